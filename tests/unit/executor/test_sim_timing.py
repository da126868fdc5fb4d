"""The simulated side: the timing model's formula, capacities, shared bandwidth,
request loading, decisions and the profile file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from executor.decision import Decision
from executor.sim import Channel, ProfileError, SimulatedExecutor, load_profile
from executor.sim.executor import SimulationError
from executor.sim.profile import parse_profile

MB = 1_000_000


def nvme_channel(share: float = 1.0) -> Channel:
    # The seed's figures: 0.98 GB/s for one stream, 5.23 GB/s with parallel reads.
    return Channel(
        serial_bytes_per_s=0.98e9,
        parallel_bytes_per_s=5.23e9,
        parallelism=8,
        latency_ms=0.1,
        prefetch_share=share,
    )


def test_one_transfer_on_an_idle_channel_is_latency_plus_size_over_serial_rate() -> None:
    channel = nvme_channel()
    done = channel.book(1000.0, 100 * MB)
    assert done == pytest.approx(1000.0 + 0.1 + 100 * MB / 0.98e9 * 1000)


def test_many_transfers_finish_at_the_aggregate_rate() -> None:
    channel = nvme_channel()
    n, size = 64, 100 * MB
    last = max(channel.book(0.0, size) for _ in range(n))
    # 8 lanes x 0.98 GB/s exceed 5.23 GB/s, so the shared link binds: N*b/parallel.
    assert last == pytest.approx(n * size / 5.23e9 * 1000)
    assert n * size / (last / 1000) == pytest.approx(5.23e9)


def test_lane_bound_channel_runs_in_waves_of_parallelism() -> None:
    channel = Channel(
        serial_bytes_per_s=1e9, parallel_bytes_per_s=100e9, parallelism=4, latency_ms=2.0
    )
    size = 10 * MB
    done = [channel.book(0.0, size) for _ in range(10)]
    per_op = 2.0 + size / 1e9 * 1000
    assert max(done) == pytest.approx(math.ceil(10 / 4) * per_op)
    assert sorted(done)[:4] == pytest.approx([per_op] * 4)


def test_prefetch_budget_refuses_beyond_its_share_and_demand_queues_behind_prefetch() -> None:
    channel = nvme_channel(share=0.5)
    size = 100 * MB
    per_prefetch_ms = size / (0.5 * 5.23e9) * 1000  # budget time one prefetch costs
    admitted = 0
    for _ in range(100):
        if channel.admits_prefetch(0.0, size):
            channel.charge_prefetch(0.0, size)
            channel.book(0.0, size)
            admitted += 1
    assert admitted == math.floor(channel.prefetch_burst_ms / per_prefetch_ms)
    # Demand shares the link: it waits behind the prefetch bytes already booked.
    demand = channel.book(0.0, size)
    assert demand == pytest.approx((admitted + 1) * size / 5.23e9 * 1000)
    assert demand > nvme_channel().book(0.0, size)
    # The budget refills at share x rate: later, one more prefetch fits.
    later = admitted * per_prefetch_ms - channel.prefetch_burst_ms + per_prefetch_ms
    assert not channel.admits_prefetch(later - 1.0, size)
    assert channel.admits_prefetch(later + 1e-6, size)


def test_default_profile_derives_kv_bytes_and_cites_every_number() -> None:
    profile = load_profile()
    assert profile.model.kv_bytes_per_token == 62 * 8 * 128 * 2 * 2 == 253_952
    assert profile.model.block_bytes() == 253_952 * 512
    nvme = profile.tier("nvme")
    assert (nvme.read_serial_bytes_per_s, nvme.read_parallel_bytes_per_s) == (0.98e9, 5.23e9)
    assert profile.tier_names == ("hbm", "dram", "nvme", "remote")
    assert len(profile.sources) == 12 + 4 * 9
    assert all(source for source in profile.sources.values())
    # The calibration's free parameters are declared as assumptions; measured ones not.
    assumptions = profile.assumptions()
    assert {"model.mfu", "model.step_overhead_ms"} <= set(assumptions)
    assert "tiers.nvme.read_parallel_bytes_per_s" not in assumptions
    assert "model.num_layers" not in assumptions


def _profile_dict() -> dict:
    import tomllib

    text = (Path(__file__).resolve().parents[3] / "executor/profiles/default.toml").read_text()
    return tomllib.loads(text)


def test_profile_refuses_missing_source_wrong_unit_and_unknown_keys() -> None:
    data = _profile_dict()
    data["tiers"]["nvme"]["latency_ms"]["source"] = " "
    with pytest.raises(ProfileError, match="tiers.nvme.latency_ms: say where"):
        parse_profile(data)
    data = _profile_dict()
    data["tiers"]["dram"]["read_serial_bytes_per_s"]["unit"] = "GB/s"
    with pytest.raises(ProfileError, match="unit must be 'bytes/s'"):
        parse_profile(data)
    data = _profile_dict()
    data["model"]["num_layerz"] = data["model"]["num_layers"]
    with pytest.raises(ProfileError, match="unknown parameter"):
        parse_profile(data)
    data = _profile_dict()
    del data["model"]["head_dim"]
    with pytest.raises(ProfileError, match="model.head_dim: missing"):
        parse_profile(data)


def small_sim(**kwargs) -> SimulatedExecutor:
    caps = kwargs.pop("capacity_blocks", {"hbm": 4, "dram": 4, "nvme": 8, "remote": 100})
    return SimulatedExecutor(capacity_blocks=caps, **kwargs)


def test_transfer_time_matches_formula_and_moves_the_block() -> None:
    sim = small_sim()
    assert sim.place(1, "nvme", now_ms=0.0)
    done = sim.schedule_transfer(1, "nvme", "dram", now_ms=10.0)
    b = sim.block_bytes
    expected = 10.0 + max(0.1 + b / 0.98e9 * 1000, 0.01 + b / 400e9 * 1000)
    assert done == pytest.approx(expected)
    assert sim.transfer_time_ms(b, "nvme", "dram") == pytest.approx(expected - 10.0)
    assert sim.locate(1) == "dram" and sim.ready_at_ms(1) == done
    stats = sim.stats()
    assert stats.bytes_read["nvme"]["promote"] == b
    assert stats.bytes_written["dram"]["promote"] == b
    assert stats.num_transfers == {"promote": 1, "demote": 0, "stream": 0}


def test_a_full_tier_refuses_and_nothing_is_evicted_on_its_own() -> None:
    sim = small_sim(capacity_blocks={"hbm": 1, "dram": 2, "nvme": 2, "remote": 2})
    assert sim.place(1, "hbm") and sim.place(2, "dram")
    assert not sim.place(3, "hbm")  # full: refused, block 1 stays
    assert sim.schedule_transfer(2, "dram", "hbm", now_ms=0.0) is None
    assert sim.locate(1) == "hbm" and sim.locate(2) == "dram" and sim.locate(3) is None
    out = sim.apply_one(Decision("p", 0, 2, "promote", "dram", "hbm"))
    assert out.status == "refused_full" and out.reason == "no room in hbm"
    assert sim.stats().num_refused == 3
    for tier in sim.tier_names:
        assert sim.used_bytes(tier) <= sim.capacity_bytes(tier)


def test_a_batch_swaps_blocks_between_two_full_tiers() -> None:
    sim = small_sim(capacity_blocks={"hbm": 1, "dram": 1, "nvme": 2, "remote": 2})
    sim.place(1, "hbm")
    sim.place(2, "dram")
    demote = Decision("d", 5, 1, "demote", "hbm", "dram")
    promote = Decision("p", 5, 2, "promote", "dram", "hbm")
    # One at a time neither fits; as one round (the planner's), both do.
    assert [o.status for o in sim.apply_batch([demote, promote])] == ["applied", "applied"]
    assert (sim.locate(1), sim.locate(2)) == ("dram", "hbm")
    # A round that would overfill refuses its latest move into the full tier.
    sim.place(3, "nvme")
    outs = sim.apply_batch([Decision("p3", 6, 3, "promote", "nvme", "hbm")])
    assert outs[0].status == "refused_full" and outs[0].reason == "no room in hbm"
    assert sim.locate(3) == "nvme"


def test_stores_join_the_round_and_computing_blocks_are_no_hit_until_computed() -> None:
    sim = small_sim(capacity_blocks={"hbm": 2, "dram": 2, "nvme": 2, "remote": 2})
    sim.place(1, "hbm")
    sim.place(2, "hbm")
    # The engine computed block 3 into a full HBM; the planner demotes 1 in the round.
    outs = sim.apply_batch(
        [Decision("d1", 0, 1, "demote", "hbm", "dram")], stores=[(3, "hbm", 0.0)]
    )
    assert outs[0].status == "applied" and sim.last_store_statuses == ["applied"]
    assert sim.locate(3) == "hbm" and sim.ready_at_ms(3) == math.inf
    assert sim.cached_prefix([2, 3]) == (1, [0])  # 3 is being computed: a miss
    sim.mark_computed([3], 40.0)
    assert sim.cached_prefix([2, 3, 9]) == (2, [0, 0])
    assert sim.prefix_ready_ms([2, 3], 10.0) == 40.0


def test_prefix_ready_streams_blocks_left_below_hbm() -> None:
    sim = small_sim()
    sim.place(7, "nvme", now_ms=0.0)
    ready = sim.prefix_ready_ms([7], 100.0)
    assert ready == pytest.approx(100.0 + 0.1 + sim.block_bytes / 0.98e9 * 1000)
    assert sim.locate(7) == "nvme" and sim.stats().num_transfers["stream"] == 1


def test_prefetch_budget_is_charged_once_by_the_planner_side() -> None:
    sim = small_sim(capacity_blocks={"hbm": 100, "dram": 100, "nvme": 100, "remote": 100})
    admitted = 0
    while sim.admit_prefetch("nvme", "hbm", 0.0):
        admitted += 1
    # 75% of 5.23 GB/s for at most 1 s of budget, in blocks of 124 MiB.
    assert admitted == math.floor(1000 / (sim.block_bytes / (0.75 * 5.23e9) * 1000))
    assert sim.stats().num_over_budget == 1
    # Applying a promote does not charge the budget again (it was admitted above).
    sim.place(1, "nvme")
    assert sim.apply_one(Decision("p", 0, 1, "promote", "nvme", "hbm")).status == "applied"


def test_decisions_apply_idempotently_and_stale_ones_are_skipped() -> None:
    sim = small_sim()
    sim.place(5, "nvme")
    promote = Decision("p1", 10, 5, "promote", "nvme", "hbm")
    first = sim.apply_one(promote)
    assert first.status == "applied" and first.completion_ms is not None
    assert sim.apply_one(promote).reason == "duplicate decision id"
    stale = sim.apply_one(Decision("p2", 11, 5, "promote", "nvme", "dram"))
    assert stale.status == "stale" and "block is in hbm" in stale.reason
    late = sim.apply_one(Decision("p3", 50, 5, "demote", None, "dram", deadline_ms=40))
    assert late.reason == "deadline passed"
    assert sim.apply_one(Decision("e1", 60, 5, "evict")).status == "applied"
    assert sim.locate(5) is None
    with pytest.raises(SimulationError, match="not cached"):
        sim.schedule_transfer(5, None, "hbm", now_ms=70.0)


# -- the prefill model and the engine ------------------------------------------------


def test_prefill_cost_is_additive_over_chunks_and_superlinear() -> None:
    model = load_profile().model
    n = 100_000
    whole = model.prefill_flops(0, n)
    chunks = sum(model.prefill_flops(s, min(n, s + 8192)) for s in range(0, n, 8192))
    assert chunks == pytest.approx(whole, rel=1e-12)
    assert model.prefill_ms(n) == pytest.approx(
        sum(model.prefill_ms(min(8192, n - s), s) for s in range(0, n, 8192)), rel=1e-12
    )
    # Superlinear: doubling the prompt more than doubles its cost, and a block near the
    # end of a long prompt costs more than one at its start.
    for k in (1_000, 10_000, 50_000):
        assert model.prefill_ms(2 * k) > 2 * model.prefill_ms(k)
    assert model.prefill_ms(512, 100_000) > 3 * model.prefill_ms(512, 0)


def test_prefill_cost_matches_a_hand_computed_value() -> None:
    # The bundled config with MFU pinned at 0.35 (the profile's value is calibrated).
    model = load_profile().with_model(mfu=0.35).model
    # 1,000 tokens: 1,000 x 2 x 35e9 linear + 4 x 62 x 96 x 128 x (0 + ... + 999)
    linear = 1000 * 2 * 35e9
    attention = 4 * 62 * 96 * 128 * (999 * 1000 / 2)
    assert linear == 7.0e13 and attention == pytest.approx(1.5221882880e12)
    flops_per_s = 8 * 989e12 * 0.35
    assert model.prefill_flops(0, 1000) == pytest.approx(linear + attention)
    assert model.prefill_ms(1000) == pytest.approx((linear + attention) / flops_per_s * 1000)
    assert model.prefill_ms(1000) == pytest.approx(25.828, abs=1e-3)


def _engine(**kwargs):
    from executor.sim.engine import Engine

    profile = load_profile()
    return Engine(
        profile.model,
        hbm_read_bytes_per_s=profile.tier("hbm").read_parallel_bytes_per_s,
        **kwargs,
    )


def test_engine_batches_chunks_of_several_requests_and_counts_decode_as_busy() -> None:
    from executor.sim.engine import EngineRequest

    done: list[EngineRequest] = []
    engine = _engine(on_finish=done.append)
    model = engine.model
    a = EngineRequest("a", 0.0, prompt_tokens=3000, output_tokens=1)
    b = EngineRequest("b", 0.0, prompt_tokens=3000, output_tokens=1)
    engine.submit(a)
    engine.submit(b)
    engine.step()
    # One step (budget 8192) computes both prompts: their first tokens come together.
    assert (
        a.first_token_ms
        == b.first_token_ms
        == pytest.approx(model.step_overhead_ms + 2 * model.prefill_ms(3000))
    )
    assert len(done) == 2 and engine.num_steps == 1
    # Decode: each output token after the first is one more step in the busy time.
    c = EngineRequest("c", engine.now_ms, prompt_tokens=100, output_tokens=51)
    engine.submit(c)
    busy_before = engine.busy_ms
    while engine.next_start_ms() is not None:
        engine.step()
    assert c.generated == 51 and engine.num_steps == 1 + 51
    assert engine.busy_ms - busy_before > 51 * model.step_overhead_ms
    assert (
        c.finish_ms == engine.now_ms == pytest.approx(busy_before + (engine.busy_ms - busy_before))
    )


def test_engine_decode_stretch_equals_step_by_step() -> None:
    from executor.sim.engine import EngineRequest

    def run(stretch: bool) -> list[float]:
        engine = _engine()
        reqs = [EngineRequest(i, 0.0, 2000 + 500 * i, 40 + 7 * i) for i in range(4)]
        for r in reqs:
            engine.submit(r)
        while engine.next_start_ms() is not None:
            # A horizon just ahead forces single decode steps.
            engine.step(horizon_ms=float("inf") if stretch else engine.now_ms + 1e-9)
        return [r.finish_ms for r in reqs]

    assert run(True) == pytest.approx(run(False), rel=1e-9)


def test_engine_waits_for_a_loading_prefix_without_blocking_the_queue() -> None:
    from executor.sim.engine import EngineRequest

    engine = _engine()
    loading = EngineRequest("l", 0.0, 4000, 1, cached_tokens=3000, load_ready_ms=500.0)
    ready = EngineRequest("r", 0.0, 1000, 1)
    engine.submit(loading)
    engine.submit(ready)
    engine.step()
    assert ready.first_token_ms > 0 and loading.first_token_ms < 0
    while engine.next_start_ms() is not None:
        engine.step()
    # Only the 1,000 uncached tokens are computed, after the load, at their positions.
    assert loading.first_token_ms == pytest.approx(
        500.0 + engine.model.step_overhead_ms + engine.model.prefill_ms(1000, 3000)
    )


def test_with_blocking_loads_the_step_waits_for_the_load_and_the_batch_with_it() -> None:
    """A connector that loads in the forward pass (LMCache without async loading):
    the step computing the loading request starts when its KV is in HBM, and the ready
    request scheduled in the same step waits too; the wait is a stall, not busy time."""
    from executor.sim.engine import EngineRequest

    engine = _engine(blocking_loads=True)
    loading = EngineRequest("l", 0.0, 4000, 1, cached_tokens=3000, load_ready_ms=500.0)
    ready = EngineRequest("r", 0.0, 1000, 1)
    engine.submit(loading)
    engine.submit(ready)
    engine.step()
    model = engine.model
    both = 500.0 + model.step_overhead_ms + model.prefill_ms(1000, 3000) + model.prefill_ms(1000)
    assert loading.first_token_ms == ready.first_token_ms == pytest.approx(both)
    assert engine.stalled_ms == pytest.approx(500.0)
    assert engine.busy_ms == pytest.approx(both - 500.0)


def test_a_write_back_backlog_never_delays_a_read() -> None:
    sim = small_sim(capacity_blocks={"hbm": 50, "dram": 50, "nvme": 50, "remote": 50})
    for block in range(40):
        sim.place(block, "dram", now_ms=0.0)
    # 40 write-backs to NVMe at 3.1 GB/s take ~1.7 s to land...
    outs = sim.apply_batch([Decision(f"d{b}", 0, b, "demote", "dram", "nvme") for b in range(40)])
    assert max(o.completion_ms for o in outs) > 1500
    # ...but reading the last one back right away does not wait for them.
    ready = sim.prefix_ready_ms([39], 1.0)
    assert ready == pytest.approx(1.0 + 0.1 + sim.block_bytes / 0.98e9 * 1000)
