"""``kvwarm bench seed``: the seed's published figures beside the simulation of the
same setting.

The seed (a vendor report on KV-cache prewarming for a 480B MoE at TP8) measured:

- R1: cold reads through LMCache at concurrency 16; read bandwidth 0.98 -> 5.23 GB/s
  (serial -> parallel reads) took TTFT from 37.97 s to 9.30 s.
- R2: long-context load at TP8 with no external cache, TTFT p50 10.17-35.73 s over
  three concurrency levels (35.73 s at concurrency 8); with tiered prewarming
  7.53-26.35 s (-26 to -32%).
- R2/R3: throughput +29% at concurrency 8 and +40% at concurrency 16.

The report does not say which concurrency the 10.17 s belongs to, nor the TTFT at
16, so those cells are empty (``null`` in ``--json``).

Simulation of the same setting (the bundled profile: Qwen3-Coder-480B-A35B at TP8 on
8 x H200, HBM / DRAM / NVMe / remote; the ``longctx`` workload, prompts of 32k-128k
tokens reused across turns and documents), closed loop at each concurrency, every
run through the serving path (sidecar -> planner -> decisions -> simulated executor)
into the one simulation:

- R1: 64 distinct prompts whose every block starts in NVMe (cold), LRU, loads at
  scheduling, concurrency 16; NVMe read serial (1 lane at 0.98 GB/s) vs the
  profile's parallel reads (5.23 GB/s aggregate); nothing else changes. R1 went
  through LMCache, whose retrieve runs in the forward pass unless its (opt-in) async
  loading is on, so the engine's step waits for the loads of the requests it computes
  (``TieredSetup.blocking_loads``; R2/R3 keep asynchronous loading, as kvwarm's
  prefetch does). A synchronous retrieve reads a request's chunks into host memory,
  then copies them to the GPU, and the connector retrieves a step's requests one
  after another, so each request's copy adds to the reads (``executor.sim.run``). R1
  ran on one GPU: the copy goes over one PCIe link, the profile's per-GPU 50 GB/s
  (``one_gpu_link``). The copy is why the serial -> parallel gain is below the
  bandwidth ratio (5.34x). The report does not give R1's prompt length: it is set
  (to 512 tokens) so that the serial figure is nearest the seed's, and the parallel
  one is the model's prediction.
- R2/R3: ``no_cache`` (HBM only, the engine's own prefix cache), ``lru_prewarm``
  (tiered LRU, loads at arrival), ``kvwarm`` (learned LightGBM behind the online
  guard, as served; loads at arrival and speculative prefetch behind the prefetch
  gate) and ``oracle`` (future knowledge, the upper reference).

Free parameters: only the profile's assumptions (``Profile.assumptions``); the
bundled values of ``model.mfu`` and ``model.step_overhead_ms`` were calibrated with
this command (``--mfu`` / ``--step-overhead-ms`` override them to explore).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from executor.sim.profile import Profile, load_profile
from features.events import BlocksAccessed

SEED_R1_READ_GB_PER_S = (0.98, 5.23)
SEED_R1_TTFT_S = (37.97, 9.30)
SEED_R1_CONCURRENCY = 16
SEED_R2: dict[int, dict[str, float | None]] = {
    8: {"ttft_p50_s": 35.73, "ttft_p50_s_prewarm": 26.35, "throughput_gain": 0.29},
    16: {"ttft_p50_s": None, "ttft_p50_s_prewarm": None, "throughput_gain": 0.40},
}


@dataclass(frozen=True)
class SeedSetting:
    num_requests: int = 480
    seed: int = 0
    train_fraction: float = 0.5
    concurrencies: tuple[int, ...] = (8, 16)
    learned: str = "lightgbm"


def _workload(setting: SeedSetting) -> tuple[list[BlocksAccessed], list[BlocksAccessed]]:
    import tempfile
    from pathlib import Path

    from features.decoders import read_trace
    from features.generator import generate_to_file, params_for
    from training.replay import split_events, spread_ties

    with tempfile.TemporaryDirectory() as tmp:
        path = generate_to_file(
            params_for("longctx", num_requests=setting.num_requests, seed=setting.seed),
            Path(tmp) / "longctx.jsonl",
        )
        events = spread_ties(list(read_trace(path)))
    return split_events(events, setting.train_fraction)


def _warm(name: str, train: Sequence[BlocksAccessed], **kwargs: Any) -> Any:
    from predictor.registry import make_policy

    policy = make_policy(name, **kwargs)
    policy.observe_many(train)
    return policy


def serial_nvme(profile: Profile) -> Profile:
    """The same profile with NVMe reads issued one at a time: 0.98 GB/s."""
    nvme = profile.tier("nvme")
    return profile.with_tier(
        "nvme", read_parallel_bytes_per_s=nvme.read_serial_bytes_per_s, parallelism=1
    )


def one_gpu_link(profile: Profile) -> Profile:
    """R1 ran on one GPU: the host-to-GPU copy of a retrieve goes over one PCIe link,
    the profile's per-GPU share of the DRAM tier's read rate (its source: ~50 GB/s
    pinned host-to-device per GPU)."""
    dram = profile.tier("dram")
    gpus = profile.model.tensor_parallel
    return profile.with_tier(
        "dram",
        read_serial_bytes_per_s=dram.read_serial_bytes_per_s / gpus,
        read_parallel_bytes_per_s=dram.read_parallel_bytes_per_s / gpus,
        parallelism=1,
    )


R1_REQUESTS = 64
R1_OUTPUT_TOKENS = 128


def r1_events(prompt_tokens: int, num_requests: int = R1_REQUESTS) -> list[BlocksAccessed]:
    """Distinct prompts of ``prompt_tokens`` (no reuse between them: every read is a
    cold read)."""
    per = -(-prompt_tokens // 512)
    return [
        BlocksAccessed(
            ts_ms=i,
            request_id=f"r1-{i}",
            block_hashes=tuple(range(i * per, (i + 1) * per)),
            block_size_tokens=512,
            input_tokens=prompt_tokens,
            output_tokens=R1_OUTPUT_TOKENS,
        )
        for i in range(num_requests)
    ]


def r1_ttft_p50_s(profile: Profile, prompt_tokens: int, *, one_gpu: bool = True) -> float:
    """TTFT p50 (s) of cold NVMe reads at concurrency 16: every block starts in NVMe,
    LRU, loads when the engine schedules the request and the step waits for them (as
    LMCache does without async loading). ``one_gpu``: copies to the GPU over one PCIe
    link, as R1 ran (False: the profile's whole node, 8 links)."""
    from training.tiered import TieredSetup, replay_tiered

    events = r1_events(prompt_tokens)
    setup = TieredSetup(
        profile=one_gpu_link(profile) if one_gpu else profile,
        hbm_capacity_blocks=_hbm_blocks(profile),
        concurrency=SEED_R1_CONCURRENCY,
        blocking_loads=True,  # through LMCache: loads in the forward pass
    )
    r = replay_tiered(
        _warm("lru", []),
        events,
        setup,
        prewarm=False,
        speculative=False,
        label="cold",
        preload={"nvme": [b for e in events for b in e.block_hashes]},
    )
    return r.ttft_percentiles()["p50"] / 1000


def r1_prompt_tokens(profile: Profile) -> tuple[int, float]:
    """The report does not give R1's prompt length: the one (to 512 tokens) whose
    serial-read TTFT p50 is nearest the seed's 37.97 s, with that TTFT (s). A workload
    parameter, not a profile one; the parallel figure is then a prediction."""
    target = SEED_R1_TTFT_S[0]
    serial = serial_nvme(profile)
    ttft: dict[int, float] = {}  # blocks -> serial TTFT p50 (s), each simulated once

    def serial_s(blocks: int) -> float:
        if blocks not in ttft:
            ttft[blocks] = r1_ttft_p50_s(serial, blocks * 512)
        return ttft[blocks]

    lo, hi = 1, 256  # blocks
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if serial_s(mid) < target:
            lo = mid
        else:
            hi = mid
    best = lo if target - serial_s(lo) < serial_s(hi) - target else hi
    return best * 512, ttft[best]


def run_r1(profile: Profile) -> dict[str, Any]:
    """Cold NVMe reads at concurrency 16, serial vs parallel; TTFT p50 in seconds."""
    prompt, serial_s = r1_prompt_tokens(profile)
    sim = [serial_s, r1_ttft_p50_s(profile, prompt)]
    return {
        "concurrency": SEED_R1_CONCURRENCY,
        "prompt_tokens": prompt,
        "seed_read_gb_per_s": list(SEED_R1_READ_GB_PER_S),
        "seed_ttft_s": list(SEED_R1_TTFT_S),
        "sim_ttft_p50_s": sim,
        "sim_improvement": sim[0] / sim[1],
        "seed_improvement": SEED_R1_TTFT_S[0] / SEED_R1_TTFT_S[1],
    }


def _hbm_blocks(profile: Profile) -> int:
    return profile.tier("hbm").capacity_bytes // profile.model.block_bytes()


def run_r2(
    profile: Profile,
    train: Sequence[BlocksAccessed],
    test: Sequence[BlocksAccessed],
    concurrency: int,
    learned: str,
    say: Any,
) -> dict[str, Any]:
    """One concurrency: no cache, tiered LRU with prewarm, kvwarm learned, oracle."""
    from predictor.guard import guarded
    from predictor.oracle import FutureAccesses
    from training.replay import rescale_time
    from training.tiered import TieredSetup, replay_tiered
    from training.train import fit_policy_on_events

    setup = TieredSetup(
        profile=profile, hbm_capacity_blocks=_hbm_blocks(profile), concurrency=concurrency
    )
    no_cache = replay_tiered(
        _warm("lru", train), test, setup, speculative=False, external=False, label="no_cache"
    )
    # Align the trace's clock with the closed loop's pace, so that what the learned
    # policy and the oracle know about time (gaps, horizons) matches the replay's.
    span = test[-1].ts_ms - test[0].ts_ms
    scale = no_cache.makespan_ms / span if span > 0 else 1.0
    events = rescale_time(list(train) + list(test), scale)
    train_s, test_s = events[: len(train)], events[len(train) :]
    say(f"concurrency {concurrency}: time scale {scale:.3f}; training {learned}")
    model = fit_policy_on_events(learned, train_s, quick=True, horizon_ms=int(60_000 * scale))
    # As ``serve`` serves it: behind the online guard (model / LRU / LFU / LRU-2 ghosts).
    served = guarded(model, _hbm_blocks(profile))
    served.observe_many(train_s)
    future = FutureAccesses.from_events(events)
    oracle = _warm("oracle", train_s, future=future)
    results = {
        "no_cache": no_cache,
        "lru_prewarm": replay_tiered(
            _warm("lru", train_s), test_s, setup, speculative=False, label="lru_prewarm"
        ),
        "kvwarm": replay_tiered(served, test_s, setup, label="kvwarm"),
        "oracle": replay_tiered(oracle, test_s, setup, label="oracle"),
    }
    base = no_cache
    row: dict[str, Any] = {"concurrency": concurrency}
    seed = SEED_R2.get(concurrency, {})
    row["seed_ttft_p50_s"] = seed.get("ttft_p50_s")
    row["seed_ttft_p50_s_prewarm"] = seed.get("ttft_p50_s_prewarm")
    row["seed_throughput_gain"] = seed.get("throughput_gain")
    for name, r in results.items():
        row[f"sim_ttft_p50_s_{name}"] = r.ttft_percentiles()["p50"] / 1000
        row[f"sim_throughput_rps_{name}"] = r.throughput_rps
        if name != "no_cache":
            row[f"sim_ttft_p50_change_{name}"] = (
                r.ttft_percentiles()["p50"] / base.ttft_percentiles()["p50"] - 1
            )
            row[f"sim_throughput_gain_{name}"] = r.throughput_rps / base.throughput_rps - 1
        row[f"sim_hbm_hit_{name}"] = r.hit_ratio("hbm")
        row[f"sim_placement_mismatches_{name}"] = r.placement_mismatches
    return row


def run_seed(setting: SeedSetting, profile: Profile, say: Any = lambda _m: None) -> dict[str, Any]:
    train, test = _workload(setting)
    say(f"longctx: {len(train)} training, {len(test)} replayed requests")
    t0 = time.perf_counter()
    r1 = run_r1(profile)
    say(f"R1 done in {time.perf_counter() - t0:.0f} s")
    r2 = []
    for c in setting.concurrencies:
        r2.append(run_r2(profile, train, test, c, setting.learned, say))
        say(f"R2 concurrency {c} done in {time.perf_counter() - t0:.0f} s")
    return {
        "r1": r1,
        "r2": r2,
        "profile": profile.name,
        "calibrated": {
            k: _model_value(profile, k) for k in ("model.mfu", "model.step_overhead_ms")
        },
        "assumptions": profile.assumptions(),
        "workload": {
            "profile": "longctx",
            "num_requests": setting.num_requests,
            "seed": setting.seed,
            "replayed_requests": len(test),
            "prompt_tokens_p50": float(
                np.median([e.input_tokens or 0 for e in test]) if test else 0.0
            ),
        },
    }


def _model_value(profile: Profile, key: str) -> float:
    return float(getattr(profile.model, key.split(".", 1)[1]))


def format_seed(data: dict[str, Any]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:+.0f}%"

    r1 = data["r1"]
    lines = [
        f"profile {data['profile']}; calibrated {data['calibrated']}",
        "R1 cold NVMe reads, concurrency 16: TTFT p50 (s), serial 0.98 GB/s -> parallel 5.23 GB/s",
        f"  seed  {s(r1['seed_ttft_s'][0]):>7} -> {s(r1['seed_ttft_s'][1]):>7}"
        f"  ({r1['seed_improvement']:.2f}x)",
        f"  sim   {s(r1['sim_ttft_p50_s'][0]):>7} -> {s(r1['sim_ttft_p50_s'][1]):>7}"
        f"  ({r1['sim_improvement']:.2f}x; prompts of {r1['prompt_tokens']:,} tokens, set so"
        " the serial figure matches)",
        "",
        "R2/R3 long context, closed loop: TTFT p50 (s) and throughput vs no external cache",
        f"{'conc':>4} {'':>5} {'no cache':>9} {'LRU+pw':>9} {'kvwarm':>9} {'oracle':>9}"
        f" {'thr LRU+pw':>10} {'thr kvwarm':>10} {'thr oracle':>10}",
    ]
    for row in data["r2"]:
        c = row["concurrency"]
        seed_change = None
        if row["seed_ttft_p50_s"] and row["seed_ttft_p50_s_prewarm"]:
            seed_change = row["seed_ttft_p50_s_prewarm"] / row["seed_ttft_p50_s"] - 1
        lines.append(
            f"{c:>4} {'seed':>5} {s(row['seed_ttft_p50_s']):>9} {s(row['seed_ttft_p50_s_prewarm']):>9}"
            f" {'':>9} {'':>9} {pct(row['seed_throughput_gain']):>10}"
            + (f"   (TTFT {pct(seed_change)})" if seed_change is not None else "")
        )
        lines.append(
            f"{c:>4} {'sim':>5} {s(row['sim_ttft_p50_s_no_cache']):>9}"
            f" {s(row['sim_ttft_p50_s_lru_prewarm']):>9} {s(row['sim_ttft_p50_s_kvwarm']):>9}"
            f" {s(row['sim_ttft_p50_s_oracle']):>9}"
            f" {pct(row['sim_throughput_gain_lru_prewarm']):>10}"
            f" {pct(row['sim_throughput_gain_kvwarm']):>10}"
            f" {pct(row['sim_throughput_gain_oracle']):>10}"
        )
        lines.append(
            f"{'':>4} {'chg':>5} {'':>9} {pct(row['sim_ttft_p50_change_lru_prewarm']):>9}"
            f" {pct(row['sim_ttft_p50_change_kvwarm']):>9} {pct(row['sim_ttft_p50_change_oracle']):>9}"
        )
    return "\n".join(lines)


@click.command("seed")
@click.option(
    "--requests",
    "num_requests",
    type=click.IntRange(50, 20_000),
    default=480,
    show_default=True,
    help="Requests of the longctx workload (half train, half replay).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--profile", "profile_path", default=None, help="Profile TOML (default: bundled).")
@click.option(
    "--mfu",
    type=click.FloatRange(0.01, 1.0),
    default=None,
    help="Override model.mfu (an assumption) to explore the calibration.",
)
@click.option(
    "--step-overhead-ms",
    type=click.FloatRange(0.0, 1000.0),
    default=None,
    help="Override model.step_overhead_ms (an assumption).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_seed(
    num_requests: int,
    seed: int,
    profile_path: str | None,
    mfu: float | None,
    step_overhead_ms: float | None,
    as_json: bool,
) -> None:
    """The seed's R1 and R2/R3 rows beside the simulation of the same setting."""
    profile = load_profile(profile_path)
    changes = {
        k: v for k, v in (("mfu", mfu), ("step_overhead_ms", step_overhead_ms)) if v is not None
    }
    if changes:
        profile = profile.with_model(**changes)

    def say(message: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {message}", err=True)

    data = run_seed(SeedSetting(num_requests=num_requests, seed=seed), profile, say)
    click.echo(json.dumps(data, indent=2) if as_json else format_seed(data))
