"""A model given to the replay (``--model``) that was trained on another time scale
than the replay's stretched trace is flagged: its time features see gaps off by the
ratio, so its figures understate it. The replay says so and records it."""

from __future__ import annotations

from benchmarks.traces import generated_events
from training.report import ComparisonConfig, run_comparison, time_base_warning
from training.train import fit_policy_on_events


class _Model:
    def __init__(self, time_scale: float) -> None:
        self.time_base = {"unit": "ms", "clock": "event", "time_scale": time_scale}


def test_time_base_warning_names_both_scales_and_the_way_out():
    assert time_base_warning("lightgbm", _Model(15.0), 15.1) is None  # within 1%
    assert time_base_warning("lru", object(), 15.0) is None  # no time base: nothing to say
    warning = time_base_warning("lightgbm", _Model(1.0), 15.3)
    assert warning is not None
    assert "x1" in warning and "x15.3" in warning and "leave out --model" in warning


def test_replay_flags_a_given_model_trained_on_unstretched_time():
    events = generated_events(600, seed=4)
    model = fit_policy_on_events("lightgbm", events[:300], quick=True)  # time scale 1
    said: list[str] = []
    config = ComparisonConfig(
        policies=("lru", "lightgbm"),
        capacities=(0.05,),
        modes=("single",),
        peers=False,
        guard=False,
    )
    report = run_comparison(events, config, trained={"lightgbm": model}, progress=said.append)
    scale = report.config["time_scale"]
    assert abs(scale - 1.0) > 0.01, "the replay did not stretch this trace; pick another"
    warnings = [m for m in said if m.startswith("warning: lightgbm was trained on time")]
    assert len(warnings) == 1
    assert report.training["lightgbm"]["time_base_warning"] in warnings[0]
    assert report.single and "lightgbm" in report.single[0]["policies"]
