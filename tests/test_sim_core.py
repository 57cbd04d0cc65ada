"""The simulated engine's physics on its pure core: simulated time only, no wall clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sim import SimConfig
from proxy.sim.engine import Scheduler, Seq, make_seq, prefill_seconds, step_duration
from proxy.sim.kvcache import BlockPool, block_hashes
from proxy.sim.tokens import count_tokens, render_chat, tokenize

# docs/physics.md's ceiling table: memory bandwidth (GB/s) per device, 8B model in 16-bit = 16 GB.
CEILING_TABLE_BANDWIDTH = {
    "cpu-ddr5": 90,
    "a10g": 600,
    "l40s": 864,
    "rtx4090": 1008,
    "a100": 2039,
    "h100": 3350,
}


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def single_stream(cfg: SimConfig, prompt_len: int, out: int) -> list[float]:
    """Simulated durations of every step of one request alone on the engine."""
    s = Scheduler(cfg)
    s.add(make_seq(cfg, "a", prompt(prompt_len), out, ignore_eos=True))
    return [p.duration for p in s.run_until_idle()]


@pytest.mark.parametrize("device", CEILING_TABLE_BANDWIDTH)
def test_single_stream_decode_matches_the_bandwidth_ceiling(device: str) -> None:
    cfg = SimConfig.from_preset(device, "8b", "bf16")
    ceiling = CEILING_TABLE_BANDWIDTH[device] / 16.0
    assert cfg.decode_ceiling_tok_s == pytest.approx(ceiling, rel=1e-9)
    steps = single_stream(cfg, 100, 101)
    rate = 100 / sum(steps[1:])  # tokens after the first, over decode time
    assert rate == pytest.approx(ceiling, rel=0.03)
    assert rate <= ceiling  # a real server is below the ceiling, never above


def test_h100_single_stream_is_about_209_tokens_per_second() -> None:
    steps = single_stream(SimConfig.from_preset("h100"), 50, 201)
    assert 200 < 200 / sum(steps[1:]) < 209.4


def test_eight_bit_weights_roughly_double_the_ceiling() -> None:
    bf16 = SimConfig.from_preset("l40s", "8b", "bf16")
    int8 = SimConfig.from_preset("l40s", "8b", "int8")
    assert int8.decode_ceiling_tok_s == pytest.approx(2 * bf16.decode_ceiling_tok_s)
    r16 = 100 / sum(single_stream(bf16, 100, 101)[1:])
    r8 = 100 / sum(single_stream(int8, 100, 101)[1:])
    assert 1.9 < r8 / r16 <= 2.0


def test_kv_bytes_per_token_follow_the_model_layout() -> None:
    cfg = SimConfig.from_preset("h100", "8b")
    assert cfg.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert SimConfig.from_preset("h100", "8b", kv_cache_dtype="fp8").kv_bytes_per_token == 65536


def test_kv_pool_is_what_the_weights_leave_of_device_memory() -> None:
    cfg = SimConfig.from_preset("h100", "8b")
    expected = 80e9 * 0.9 - 16e9 - 1024**3
    assert cfg.kv_pool_tokens * cfg.kv_bytes_per_token == pytest.approx(expected, rel=0.001)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        SimConfig.from_preset("a10g", "70b")
    assert SimConfig.from_preset("h100", "70b", tensor_parallel_size=2).num_kv_blocks > 0


def test_doubling_the_prompt_at_least_doubles_prefill_while_decode_barely_moves() -> None:
    cfg = SimConfig.from_preset("a10g", "8b")
    for n in (500, 1000, 4000):
        assert prefill_seconds(cfg, 2 * n) >= 2 * prefill_seconds(cfg, n)
        itl_n = step_duration(cfg, [(1, n)])[0]
        itl_2n = step_duration(cfg, [(1, 2 * n)])[0]
        assert 1.0 < itl_2n / itl_n < 1.05


def test_quadratic_attention_term_dominates_very_long_prompts() -> None:
    cfg = SimConfig.from_preset("h100", "8b")
    short = prefill_seconds(cfg, 1000) / 1000
    long = prefill_seconds(cfg, 64000) / 64000
    assert long > 1.5 * short  # per-token prefill cost grows with context


def test_warm_prefix_skips_prefill_and_reports_cached_tokens() -> None:
    cfg = SimConfig.from_preset("a10g", "8b")
    s = Scheduler(cfg)
    system = prompt(1000)
    first = make_seq(cfg, "a", [*system, *prompt(40, 50_000)], 4, ignore_eos=True)
    s.add(first)
    s.run_until_idle()
    assert first.num_cached == 0
    second = make_seq(cfg, "b", [*system, *prompt(40, 60_000)], 4, ignore_eos=True)
    start = s.now
    s.add(second)
    s.run_until_idle()
    assert second.num_cached == 1000 // 16 * 16
    assert first.first_token_at is not None and second.first_token_at is not None
    assert second.first_token_at - start < 0.2 * first.first_token_at
    assert s.prefix_hits == 992 and s.prefix_queries == 2080


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    cfg = SimConfig.from_preset("h100", "8b")
    s = Scheduler(cfg)
    for sid in ("a", "b"):
        s.add(make_seq(cfg, sid, prompt(64), 2, ignore_eos=True))
        s.run_until_idle()
    assert s.prefix_hits == 48  # 64 tokens: the 4th block holds the token that must run


def test_lru_evicts_the_least_recently_used_prefix_first() -> None:
    cfg = SimConfig.from_preset("h100", "8b", kv_blocks=14)
    s = Scheduler(cfg)

    def run(sid: str, ids: list[int]) -> Seq:
        seq = make_seq(cfg, sid, ids, 1, ignore_eos=True)
        s.add(seq)
        s.run_until_idle()
        return seq

    a, b = prompt(96, 0), prompt(96, 10_000)  # 6 blocks each
    run("a1", a)
    run("b1", b)
    run("a2", a)  # a is now more recently used than b
    run("c", prompt(96, 20_000))  # needs room: evicts from b
    assert run("a3", a).num_cached == 80
    assert run("b2", b).num_cached < 80
    assert s.pool.evictions > 0


def test_full_kv_pool_makes_requests_wait() -> None:
    cfg = SimConfig.from_preset("h100", "8b", kv_blocks=64)  # 1024 tokens
    s = Scheduler(cfg)
    for i in range(4):
        s.add(make_seq(cfg, f"r{i}", prompt(400, i * 1000), 50, ignore_eos=True))
    s.step()
    assert len(s.running) == 2 and len(s.waiting) == 2
    assert s.pool.usage > 0.75
    s.run_until_idle()
    assert not s.waiting and not s.running and s.pool.usage == 0.0


def test_chunked_prefill_caps_the_gap_a_long_prompt_puts_into_running_streams() -> None:
    def worst_gap(budget: int) -> tuple[float, float]:
        cfg = SimConfig.from_preset("h100", "8b", max_num_batched_tokens=budget)
        s = Scheduler(cfg)
        streaming = make_seq(cfg, "stream", prompt(100), 400, ignore_eos=True)
        s.add(streaming)
        for _ in range(5):
            s.step()
        s.add(make_seq(cfg, "doc", prompt(16_000, 50_000), 1, ignore_eos=True))
        gaps = []
        while streaming.state != "finished":
            plan, _ = s.step()
            assert plan is not None
            gaps.append(plan.duration)
        return max(gaps), min(gaps)

    big_max, decode = worst_gap(16_384)
    small_max, _ = worst_gap(2048)
    assert big_max > 50 * decode  # the whole prompt in one step: a long pause mid-stream
    assert small_max < big_max / 4  # chunks spread it over many short steps


def test_batching_raises_throughput_and_step_time() -> None:
    cfg = SimConfig.from_preset("h100", "8b")
    results = []
    for batch in (1, 8, 64):
        s = Scheduler(cfg)
        for i in range(batch):
            s.add(make_seq(cfg, f"r{i}", prompt(500, i * 1000), 100, ignore_eos=True))
        plans = [p for p in s.run_until_idle() if p.prefill_tokens == 0]
        steps = sorted(p.duration for p in plans)
        tokens_per_s = sum(p.decode_tokens for p in plans) / sum(steps)
        results.append((tokens_per_s, steps[int(len(steps) * 0.99)]))
    (t1, itl1), (t8, itl8), (t64, itl64) = results
    assert t1 < t8 < t64 and t64 > 20 * t1
    assert itl1 < itl8 < itl64


def test_preemption_under_kv_pressure_still_finishes_every_request() -> None:
    cfg = SimConfig.from_preset("h100", "8b", kv_blocks=40)
    s = Scheduler(cfg)
    seqs = [make_seq(cfg, f"r{i}", prompt(150, i * 1000), 200, ignore_eos=True) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    s.run_until_idle()
    assert s.preemptions > 0
    assert all(q.finish_reason == "length" and q.num_output == 200 for q in seqs)
    assert s.pool.num_free == 40


def test_abort_frees_kv_at_once() -> None:
    cfg = SimConfig.from_preset("h100", "8b", kv_blocks=100)
    s = Scheduler(cfg)
    s.add(make_seq(cfg, "a", prompt(500), 100, ignore_eos=True))
    s.add(make_seq(cfg, "b", prompt(500, 5000), 100, ignore_eos=True))
    s.step()
    assert s.pool.num_free < 100
    assert s.abort("a") is not None and s.abort("b") is not None
    assert s.pool.num_free == 100 and not s.has_work
    assert s.abort("a") is None


def test_stop_strings_eos_and_ignore_eos() -> None:
    cfg = SimConfig.from_preset("h100", "8b", min_output_tokens=5, max_output_tokens=5)
    s = Scheduler(cfg)
    natural = make_seq(cfg, "a", prompt(10), 100)
    forced = make_seq(cfg, "b", prompt(10), 20, ignore_eos=True)
    s.add(natural)
    s.add(forced)
    s.run_until_idle()
    assert (natural.finish_reason, natural.num_output) == ("stop", 5)
    assert (forced.finish_reason, forced.num_output) == ("length", 20)
    word = forced.text.split()[3].strip(".")
    stopped = make_seq(cfg, "c", prompt(10), 20, ignore_eos=True, stop=[word])
    s.add(stopped)
    s.run_until_idle()
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert word not in stopped.text and forced.text.startswith(stopped.text)


def test_outputs_are_deterministic_per_prompt_and_seed() -> None:
    cfg = SimConfig.from_preset("h100", "8b")

    def text(seed: int | None, index: int = 0) -> str:
        s = Scheduler(cfg)
        seq = make_seq(cfg, "a", prompt(30), 12, seed=seed, index=index, ignore_eos=True)
        s.add(seq)
        s.run_until_idle()
        return seq.text

    assert text(1) == text(1) != text(2)
    assert text(None, 0) != text(None, 1)


def test_tokens_are_about_four_characters_and_share_prefixes() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    a = render_chat([system, {"role": "user", "content": "first question"}])
    b = render_chat([system, {"role": "user", "content": "another one"}])
    ta, tb = tokenize(a), tokenize(b)
    assert len(ta) == count_tokens(a) == -(-len(a) // 4)
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    assert shared >= len("<|im_start|>system\n" + system["content"]) // 4


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 1000), min_size=0, max_size=80),
    st.lists(st.integers(0, 1000), min_size=0, max_size=40),
    st.lists(st.integers(0, 1000), min_size=0, max_size=40),
)
def test_chained_hashes_match_exactly_the_shared_whole_blocks(
    common: list[int], tail_a: list[int], tail_b: list[int]
) -> None:
    a, b = common + tail_a, common + tail_b
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == len(a) // 16
    shared = 0
    while (
        shared * 16 + 16 <= min(len(a), len(b)) and a[: shared * 16 + 16] == b[: shared * 16 + 16]
    ):
        shared += 1
    assert ha[:shared] == hb[:shared]
    if len(ha) > shared and len(hb) > shared:
        assert ha[shared] != hb[shared]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "abort"]), st.integers(0, 7), st.integers(1, 300)
        ),
        max_size=60,
    )
)
def test_block_accounting_survives_any_interleaving(ops: list[tuple[str, int, int]]) -> None:
    cfg = SimConfig.from_preset("h100", "8b", kv_blocks=48, max_num_batched_tokens=256)
    s = Scheduler(cfg)
    live: set[str] = set()
    for n, (op, key, size) in enumerate(ops):
        sid = f"r{key}"
        if op == "add" and sid not in live:
            s.add(make_seq(cfg, sid, prompt(size, key * 7), 1 + size % 40, ignore_eos=True))
            live.add(sid)
        elif op == "abort":
            s.abort(sid)
            live.discard(sid)
        else:
            s.step()
        live = {x for x in live if x in s.seqs}
        referenced = {b for seq in s.running for b in seq.blocks}
        assert s.pool.num_free + len(referenced) == cfg.num_kv_blocks, n
        assert all(s.pool.ref[b] > 0 for b in referenced)
    s.run_until_idle()
    assert s.pool.num_free == cfg.num_kv_blocks and not s.has_work


def test_block_pool_revives_free_cached_blocks_before_allocating() -> None:
    pool = BlockPool(4)
    [b0] = pool.allocate(1)
    pool.commit(b0, 123)
    pool.release([b0])
    assert pool.num_free == 4 and pool.longest_hit([123]) == [b0]
    assert pool.can_allocate(3, [b0]) and not pool.can_allocate(4, [b0])
    pool.touch([b0])
    assert pool.num_free == 3 and pool.usage == 0.25
    pool.release([b0])
    pool.allocate(4)  # evicts the cached block too
    assert pool.longest_hit([123]) == [] and pool.evictions == 1
