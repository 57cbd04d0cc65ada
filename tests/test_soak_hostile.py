"""The hostile soak's backend (deploy/perf/hostile_backend.py), one request per fault through a
real proxy: each fault ends as the clean OpenAI error its FAULTS entry documents, the good
answers stay whole, and the proxy lets go of every hostile connection (trickles included)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import free_port, load_script, process, until

soak = load_script("deploy/perf/soak.py", "warmroute_soak")
hostile = load_script("deploy/perf/hostile_backend.py", "warmroute_hostile_backend")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two processes: ~5 s on 2 cores

CAP = 1 << 20  # upstream.max_response_bytes here: over_cap_json goes just past it
PROXY_ENV = {
    "WARMROUTE_TIMEOUTS__FIRST_BYTE_S": "0.5",
    "WARMROUTE_TIMEOUTS__IDLE_S": "0.5",
    "WARMROUTE_UPSTREAM__MAX_RESPONSE_BYTES": str(CAP),
    "WARMROUTE_OUTLIER__CONSECUTIVE_FAILURES": "1000000",  # one backend, failing on purpose
    "WARMROUTE_LOG_LEVEL": "error",
}
CASES = [("good", "stream"), ("good", "json")] + [
    (name, kind) for name, fault in hostile.FAULTS.items() for kind in fault.kinds
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, str]]:
    """One hostile backend (trickling a byte per 50 ms) and a proxy in front of it alone."""
    bport, pport = free_port(), free_port()
    backend = f"http://127.0.0.1:{bport}"
    argv = [*soak.hostile_args(bport, seed=7, good=0.0, cap_bytes=CAP), "--trickle-s", "0.05"]
    serve = soak.serve_args(pport, [backend], policy="round_robin", redis=None)
    with (
        pytest.MonkeyPatch.context() as mp,
        process(argv, ready=backend + "/health"),
    ):
        for k, v in PROXY_ENV.items():
            mp.setenv(k, v)
        with process(serve, ready=f"http://127.0.0.1:{pport}/ready"):
            yield {"backend": backend, "proxy": f"http://127.0.0.1:{pport}"}


async def _ask(client: Any, fault: str, kind: str) -> Any:
    client = client.with_options(default_headers={"x-hostile-fault": fault})
    if kind == "stream":
        return await soak.stream_chat(client, "hi", max_tokens=8, deadline_s=20)
    return await soak.chat_once(client, "hi", max_tokens=8, deadline_s=20)


def _wrong(fault: str, kind: str, out: Any) -> str | None:
    """What is wrong with a case's outcome, if anything."""
    if fault == "good":
        return None if out.kind == "ok" else f"{out}"
    f = hostile.FAULTS[fault]
    expected = f.expect_stream if kind == "stream" and f.expect_stream else f.expect
    if out.kind != "error" or out.cause not in expected:
        return f"{out.kind} {out.cause!r}, expected one of {expected}"
    if out.seconds > 5:  # timeouts of 0.5 s: nothing waits on a trickle
        return f"took {out.seconds:.1f} s"
    return None


async def test_each_fault_ends_as_its_documented_clean_error(fleet: dict[str, str]) -> None:
    """All cases at once (the trickles take their timeouts side by side)."""
    client = soak.client_for(fleet["proxy"], timeout_s=20)
    try:
        outs = await asyncio.gather(*(_ask(client, f, k) for f, k in CASES))
    finally:
        await client.close()
    wrong = {f"{f}/{k}": w for (f, k), o in zip(CASES, outs, strict=True) if (w := _wrong(f, k, o))}
    assert not wrong, wrong

    # the proxy let go of every hostile answer, trickles included
    stats = _settled(fleet["backend"])
    assert stats["counts"] == dict(Counter(f for f, _ in CASES)), stats


def _settled(backend: str) -> dict[str, Any]:
    """The backend's /sim/stats once nothing is running there (bounded)."""
    stats: dict[str, Any] = {}

    def idle() -> bool:
        stats.update(httpx.get(backend + "/sim/stats", timeout=5).json())
        return stats["running"] == 0

    until(idle, "the backend to have no answer left running", within_s=5)
    return stats
