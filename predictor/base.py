"""The ``Policy`` interface: what every predictor fills in.

A policy watches the event stream and scores KV blocks: higher = more likely needed
soon (keep it in, or bring it to, a faster tier). Policies only score; the planner in
``serving`` turns scores plus tier capacities into decisions, so LRU, LightGBM, LSTM
and the oracle differ only in how they rank.

Primitives (when each is called):

- ``Policy(params)``: the constructor only stores parameters and empty state.
- ``observe(event)``: once per event, in arrival order, before any ``score`` at a
  later time. Never mutates the event. Residency events may be ignored.
- ``observe_many(events)``: the batch form; same result as calling ``observe`` in order.
- ``score(block_hashes, now_ms)``: a float32 array, one finite score per input hash,
  in input order. Unknown blocks get a score (the policy's floor), never an exception.
  Does not change the policy's state and does not mutate the input.
- ``prefetch_candidates(now_ms, limit)``: blocks (uint64, at most ``limit``, best
  first) the policy expects back soon, beyond the recent requests the loop already
  considers; called once per prefetch round. Empty by default.
- ``online_status()``: a JSON-able snapshot of what the policy decides online (the
  guard's choice and estimates), read by ``/healthz`` and the metrics from another
  thread; empty by default.
- ``save(directory)`` / ``load(directory)``: persist the parameters and any learned
  model (not the online state, which is rebuilt from the stream). A loaded policy fed
  the same events gives identical scores.
- ``handover_state()`` / ``adopt_state(state)``: at a hot swap, the outgoing policy
  hands its online state over and the incoming one takes it if it can use it as is
  (default: nothing handed over, nothing taken; the newcomer is warmed by replaying
  recent requests instead).

Each policy owns a frozen, typed ``Params`` (pydantic): every field has a default, a
constraint and a description. Declared capabilities, read by serving (never probed):
``needs_future`` marks the oracle, which only a replay may run (``Sidecar(...,
allow_future=True)``); ``fitted`` is False for a learned policy without a model.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from features.events import Event

MANIFEST_NAME = "policy.json"
"""The file in a saved policy directory that names the policy and its parameters."""

MANIFEST_FORMAT = 1
"""Version of the saved-policy layout. Bump when the manifest changes meaning."""


class PolicyError(Exception):
    """Base of predictor errors."""


class UnknownPolicyError(PolicyError, KeyError):
    """No policy of that name is registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class PolicyLoadError(PolicyError):
    """A saved policy or model file is missing, corrupt or incompatible. The message
    names the file and says why."""

    def __init__(self, path: str | Path, why: str) -> None:
        self.path = Path(path)
        self.why = why
        super().__init__(f"cannot load policy from {self.path}: {why}")


class PolicyParams(BaseModel):
    """Base of every policy's parameters: frozen, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Policy(abc.ABC):
    """Scores KV blocks by how soon they will be needed. See the module docstring."""

    name: ClassVar[str]
    """The registry name (``lru``, ``lightgbm`` ...)."""

    Params: ClassVar[type[PolicyParams]] = PolicyParams

    needs_future: ClassVar[bool] = False
    """True only for the oracle: it reads next-access annotations that no live system
    has. Serving checks this flag and refuses to run such a policy."""

    fitted: bool = True
    """False while a learned policy has no model (it cannot score); always True for
    policies that learn nothing offline."""

    outputs_probability: ClassVar[bool] = False
    """True when ``score`` is a calibrated probability of reuse within the horizon
    (learned policies); baselines return ranks only."""

    ranks_by_recency: bool = False
    """True when ``score`` ranks blocks by the recency of their last access alone (LRU):
    the planner may then evict the least recently touched residents exactly instead of
    sampling (``serving.planner``). A wrapper (the guard) answers for what it serves now."""

    def __init__(self, params: PolicyParams | None = None) -> None:
        if params is None:
            params = self.Params()
        if not isinstance(params, self.Params):
            raise TypeError(
                f"{type(self).__name__} takes {self.Params.__name__}, got {type(params).__name__}"
            )
        self.params = params

    @abc.abstractmethod
    def observe(self, event: Event) -> None:
        """Update the online state with one event (arrival order)."""

    def observe_many(self, events: Iterable[Event]) -> None:
        """Batch form of ``observe``: the same result as calling it for each event."""
        for event in events:
            self.observe(event)

    @abc.abstractmethod
    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        """float32 scores, one per hash in ``block_hashes`` (uint64), same order."""

    def prefetch_candidates(self, now_ms: int, limit: int) -> np.ndarray:
        """Blocks expected back soon (uint64, best first, at most ``limit``); called
        once per prefetch round. Policies without a view of the future return none."""
        return np.zeros(0, dtype=np.uint64)

    def online_status(self) -> dict[str, Any]:
        """What this policy decides online, for health and metrics (JSON-able; read
        from another thread, so it only reads). Nothing by default."""
        return {}

    @property
    def time_base(self) -> dict[str, Any] | None:
        """The time base a learned model was trained on (unit, clock, scale); None for
        a policy with no trained model. Serving refuses a model whose base differs."""
        return None

    # --- hot swap -----------------------------------------------------------------

    def handover_state(self) -> object | None:
        """The online state a successor may take over at a hot swap (None: nothing)."""
        return None

    def adopt_state(self, state: object | None) -> bool:
        """Take over ``state`` from the policy being replaced, if usable as is; says
        whether it did. Called once, before this policy scores its first event."""
        return False

    # --- persistence --------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write ``policy.json`` (name and parameters) plus any model files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        extra = self._save_model(directory)
        manifest = {
            "format": MANIFEST_FORMAT,
            "policy": self.name,
            "params": self.params.model_dump(mode="json"),
            **extra,
        }
        (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        return directory

    def _save_model(self, directory: Path) -> dict[str, Any]:
        """Write model files into ``directory``; return extra manifest entries."""
        return {}

    @classmethod
    def load(cls, directory: str | Path, **kwargs: Any) -> Policy:
        """Rebuild a saved policy of this class; ``kwargs`` go to the constructor."""
        manifest = read_manifest(directory)
        if manifest["policy"] != cls.name:
            raise PolicyLoadError(
                Path(directory) / MANIFEST_NAME,
                f"it holds a {manifest['policy']!r} policy, not {cls.name!r}",
            )
        params = params_from_manifest(cls, manifest, Path(directory) / MANIFEST_NAME)
        policy = cls(params, **kwargs)
        policy._load_model(Path(directory), manifest)
        return policy

    def _load_model(self, directory: Path, manifest: dict[str, Any]) -> None:
        """Read model files written by ``_save_model``. Baselines have none."""
        return None


def as_hash_array(block_hashes: Any) -> np.ndarray:
    """The uint64 view of ``block_hashes`` without copying when it already is one."""
    arr = np.asarray(block_hashes)
    if arr.dtype != np.uint64:
        arr = arr.astype(np.uint64)
    if arr.ndim != 1:
        raise ValueError(f"block_hashes must be one-dimensional, got shape {arr.shape}")
    return arr


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Parse and check ``policy.json`` in a saved policy directory."""
    path = Path(directory) / MANIFEST_NAME
    if not Path(directory).is_dir():
        raise PolicyLoadError(directory, "no such directory (expected a saved policy directory)")
    if not path.is_file():
        raise PolicyLoadError(path, "file is missing; save the policy with Policy.save(directory)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PolicyLoadError(path, f"not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or "policy" not in manifest or "params" not in manifest:
        raise PolicyLoadError(path, "not a kvwarm policy manifest (needs 'policy' and 'params')")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise PolicyLoadError(
            path, f"manifest format {manifest.get('format')!r}, this kvwarm reads {MANIFEST_FORMAT}"
        )
    return manifest


def params_from_manifest(cls: type[Policy], manifest: dict[str, Any], path: Path) -> PolicyParams:
    try:
        return cls.Params.model_validate(manifest["params"])
    except ValidationError as exc:
        raise PolicyLoadError(path, f"invalid parameters for {cls.name!r}: {exc}") from exc
