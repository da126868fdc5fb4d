"""``kvwarm bench seed``'s R1: the seed's own serial -> parallel read improvement,
reproduced by the timing model with nothing but the NVMe read rate changed."""

from __future__ import annotations

import pytest

from benchmarks.seed import (
    SEED_R1_TTFT_S,
    one_gpu_link,
    r1_ttft_p50_s,
    run_r1,
    serial_nvme,
)
from executor.sim.profile import load_profile


def test_r1_parallel_reads_reproduce_the_seed_within_20_percent() -> None:
    r1 = run_r1(load_profile())
    serial, parallel = r1["sim_ttft_p50_s"]
    # The prompt length is fitted on the serial figure; the parallel one is predicted.
    assert serial == pytest.approx(SEED_R1_TTFT_S[0], rel=0.05)
    assert parallel == pytest.approx(SEED_R1_TTFT_S[1], rel=0.20)
    # The gain stays below the bandwidth ratio 5.23 / 0.98: the retrieve's copy to the
    # GPU does not speed up with the reads.
    assert r1["sim_improvement"] < 5.23 / 0.98 * 0.95


def test_r1_copy_over_one_gpu_link_is_what_keeps_the_gain_below_the_bandwidth_ratio() -> None:
    profile = load_profile()
    prompt = run_r1(profile)["prompt_tokens"]
    serial = serial_nvme(profile)
    gain_one = r1_ttft_p50_s(serial, prompt) / r1_ttft_p50_s(profile, prompt)
    # TP8 over the whole node: 8 PCIe links at 400 GB/s make the copy negligible.
    gain_node = r1_ttft_p50_s(serial, prompt, one_gpu=False) / r1_ttft_p50_s(
        profile, prompt, one_gpu=False
    )
    assert gain_node > gain_one
    assert one_gpu_link(profile).tier("dram").read_parallel_bytes_per_s == pytest.approx(50e9)
