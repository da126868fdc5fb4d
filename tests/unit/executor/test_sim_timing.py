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
    assert len(profile.sources) == 7 + 4 * 9
    assert all(source for source in profile.sources.values())


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
    done = sim.schedule_transfer(1, "nvme", "dram", now_ms=10.0, kind="prefetch")
    b = sim.block_bytes
    expected = 10.0 + max(0.1 + b / 0.98e9 * 1000, 0.01 + b / 400e9 * 1000)
    assert done == pytest.approx(expected)
    assert sim.transfer_time_ms(b, "nvme", "dram") == pytest.approx(expected - 10.0)
    assert sim.where(1) == "dram" and sim.ready_at_ms(1) == done
    stats = sim.stats()
    assert stats.bytes_read["nvme"]["prefetch"] == b
    assert stats.bytes_written["dram"]["prefetch"] == b
    assert stats.num_transfers == {"demand": 0, "prefetch": 1, "demote": 0}


def test_capacity_is_never_exceeded_and_lru_demotes_cascade() -> None:
    sim = small_sim()
    for block in range(20):
        sim.place(block, "hbm", now_ms=float(block))
        for tier in sim.tier_names:
            assert sim.used_bytes(tier) <= sim.capacity_bytes(tier)
    assert sim.blocks_in("hbm") == [16, 17, 18, 19]
    assert sim.blocks_in("dram") == [12, 13, 14, 15]
    assert sim.blocks_in("nvme") == list(range(4, 12))
    assert sim.blocks_in("remote") == [0, 1, 2, 3]
    assert sim.stats().num_transfers["demote"] == 16 + 12 + 4


def test_refuse_mode_and_pins() -> None:
    sim = small_sim(on_full="refuse", capacity_blocks={"hbm": 1, "dram": 2, "nvme": 2, "remote": 2})
    assert sim.place(1, "hbm") and sim.place(2, "dram")
    assert sim.schedule_transfer(2, "dram", "hbm", now_ms=0.0) is None
    assert sim.where(2) == "dram" and sim.stats().num_refused == 1
    sim2 = small_sim(capacity_blocks={"hbm": 1, "dram": 2, "nvme": 2, "remote": 2})
    sim2.place(1, "hbm")
    sim2.pin(1)
    sim2.place(2, "dram")
    assert sim2.schedule_transfer(2, None, "hbm", now_ms=0.0) is None
    assert sim2.where(1) == "hbm" and not sim2.evict(1)


def test_load_for_request_fetches_the_prefix_and_prefills_the_rest() -> None:
    sim = small_sim(capacity_blocks={"hbm": 10, "dram": 10, "nvme": 10, "remote": 10})
    sim.place("a", "hbm")
    sim.place("b", "dram")
    sim.place("c", "nvme")
    sim.place("e", "nvme")  # after the first miss ("d"): recomputed anyway
    load = sim.load_for_request(["a", "b", "c", "d", "e"], now_ms=100.0)
    b = sim.block_bytes
    nvme_ms = 0.1 + b / 0.98e9 * 1000
    assert load.load_ready_ms == pytest.approx(100.0 + nvme_ms)
    assert load.num_hit_blocks == (1, 1, 1, 0)
    assert load.num_missing_blocks == 2 and load.num_prefill_tokens == 2 * 512
    assert load.prefill_ms == pytest.approx(2 * 512 / 20_000 * 1000)
    assert load.ready_ms == pytest.approx(load.load_ready_ms + load.prefill_ms)
    assert all(sim.where(x) == "hbm" for x in "abcde")
    # A second identical request finds everything in HBM, ready when the first left it.
    again = sim.load_for_request(["a", "b", "c", "d", "e"], now_ms=101.0)
    assert again.num_hit_blocks == (5, 0, 0, 0) and again.prefill_ms == 0.0
    assert again.ready_ms == pytest.approx(load.ready_ms)


def test_prefill_is_serialized_on_the_node_and_partial_tokens_count() -> None:
    sim = small_sim(capacity_blocks={"hbm": 10, "dram": 10, "nvme": 10, "remote": 10})
    first = sim.load_for_request([1, 2], now_ms=0.0, num_tokens=700)
    assert first.num_prefill_tokens == 700
    second = sim.load_for_request([3], now_ms=0.0)
    assert second.prefill_start_ms == pytest.approx(first.ready_ms)
    parallel = small_sim(serialize_prefill=False).load_for_request([9], now_ms=0.0)
    assert parallel.prefill_start_ms == 0.0


def test_demand_waits_for_a_prefetch_in_flight() -> None:
    sim = small_sim()
    sim.place(7, "nvme")
    arrival = sim.schedule_transfer(7, "nvme", "hbm", now_ms=0.0)
    load = sim.load_for_request([7], now_ms=1.0)
    assert load.ready_ms == pytest.approx(arrival) and load.num_hit_blocks[0] == 1


def test_decisions_apply_idempotently_and_stale_ones_are_skipped() -> None:
    sim = small_sim()
    sim.place(5, "nvme")
    promote = Decision("p1", 10, 5, "promote", "nvme", "hbm")
    first = sim.apply_one(promote)
    assert first.status == "applied" and first.completion_ms is not None
    assert sim.apply_one(promote).status == "duplicate"
    stale = sim.apply_one(Decision("p2", 11, 5, "promote", "nvme", "dram"))
    assert stale.status == "stale" and "block is in hbm" in stale.reason
    late = sim.apply_one(Decision("p3", 50, 5, "demote", None, "dram", deadline_ms=40))
    assert late.status == "expired" and late.reason == "deadline passed"
    assert sim.apply_one(Decision("e1", 60, 5, "evict")).status == "applied"
    assert sim.where(5) is None
    with pytest.raises(SimulationError, match="not cached"):
        sim.schedule_transfer(5, None, "hbm", now_ms=70.0)


def test_three_hundred_thousand_accesses_are_cheap_enough() -> None:
    # Not a timing assertion: checks that the bookkeeping stays consistent at scale.
    sim = small_sim(capacity_blocks={"hbm": 50, "dram": 200, "nvme": 1000, "remote": 5000})
    now = 0.0
    for request in range(3000):
        root = (request * 7919) % 400
        sim.load_for_request([root * 100 + i for i in range(20)], now_ms=now)
        now += 5.0
    used = sum(sim.used_bytes(t) for t in sim.tier_names)
    assert used == sum(sim.num_blocks(t) for t in sim.tier_names) * sim.block_bytes
    for tier in sim.tier_names:
        assert sim.used_bytes(tier) <= sim.capacity_bytes(tier)
    assert sim.stats().num_requests == 3000
