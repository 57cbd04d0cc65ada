"""The bench report's per-kind breakdown: a chat-docs run's chat streams have their own ITL,
which the pooled ITL of all requests hides (what a prefill/decode split is judged on)."""

from __future__ import annotations

from proxy.bench.metrics import summarize
from proxy.bench.report import format_table
from proxy.bench.results import RequestResult, RunResult


def _run(label: str, chat_itl: list[float], kinds: tuple[str, ...] = ("chat", "doc")) -> RunResult:
    run = RunResult(label, ["t"], {"name": "chat-docs"}, "m", "chat", 4, None, 4, "now", 2.0)
    for i, kind in enumerate(kinds):
        itl = chat_itl if kind == "chat" else []
        run.requests.append(
            RequestResult(i, "t", kind, ok=True, ttft=0.1 * (i + 1), e2e=1.0, itl=itl)
        )
    run.requests.append(RequestResult(9, "t", "doc", ok=False, error_kind="timeout"))
    return run


def test_each_kind_gets_its_own_latencies_in_the_summary() -> None:
    s = summarize(_run("a", [0.005, 0.005, 0.080]))
    assert set(s["by_kind"]) == {"chat", "doc"}
    chat, doc = s["by_kind"]["chat"], s["by_kind"]["doc"]
    assert (chat["requests"], chat["completed"]) == (1, 1)
    assert (doc["requests"], doc["completed"]) == (2, 1)
    assert chat["itl_s"]["n"] == 3 and chat["itl_s"]["max"] == 0.080
    assert doc["itl_s"]["n"] == 0 and doc["itl_s"]["p99"] is None  # none, not zero
    assert doc["ttft_s"]["p50"] == 0.2


def test_the_table_shows_per_kind_rows_aligned_across_runs_only_for_a_mix() -> None:
    table = format_table([_run("mixed", [0.005, 0.080]), _run("split", [0.005, 0.006])])
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in table.splitlines()}
    assert "chat: ITL p99 (ms)" in rows and "doc: TTFT p50 (ms)" in rows
    assert rows["chat: ITL p99 (ms)"].split(" | ")[1:] == ["79.2", "6.0 |"]
    assert rows["doc: ok / sent"].split(" | ")[1:] == ["1 / 2", "1 / 2 |"]
    one_kind = _run("chat only", [0.005], kinds=("chat",))
    one_kind.requests.pop()  # the failed document
    single = format_table([one_kind])
    assert "chat: ITL" not in single
