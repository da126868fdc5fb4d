"""Model lifecycle of the sidecar: load, fall back to LRU, poll, hot-swap.

Primitives:

- ``ModelManager(spec, ...)``: ``spec`` is a baseline policy name (``lru``), a saved
  policy directory or a file inside one (``model.txt``), or an MLflow URI
  (``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/ID/model``).
- ``load_initial()``: never raises. When the model cannot be loaded (missing, corrupt,
  a feature version other than this kvwarm's, a policy that needs the future) it logs
  why, serves with LRU and reports ``degraded`` with the reason (``health()``).
- ``attach(sidecar)``: the sidecar whose policy it manages; also records the recent
  requests used to warm a swapped-in policy.
- ``check_for_update()``: one poll. Resolves what ``spec`` names now (the alias's
  version, or the content of a directory); when that differs from what is served,
  loads it off the loop thread and swaps it in with ``Sidecar.swap_policy`` (between
  two events: none is dropped). A new version that fails to load leaves the current
  policy in place. ``start_polling(interval_s)`` runs it in a daemon thread.

Validation: every policy, at the initial load and at every hot-swap, passes
``predictor.model_check`` before it serves: the structural check of tree models (run by
the policy's loader) and a probe batch scored under ``probe_timeout_s`` with finite,
in-range outputs. A model that fails is refused with the reason (``refused``); the
previous policy (or LRU) keeps serving.

Run-time guard: the served policy is wrapped in a ``ScoringFallback``. A score call that
raises or returns nan/inf switches it to LRU (warmed with the recent requests) and
marks the status degraded (``scoring_failed``); the loop never sees the bad scores.
``start_watchdog()`` runs a thread that marks the status degraded (``scoring_stuck``)
when one score call has run longer than ``score_timeout_s``: native scoring code
cannot be interrupted, but /healthz says so and SIGTERM still ends the process (the
CLI's forced exit).

Warm swap: a learned policy with the same feature parameters takes over the online
feature state of the one it replaces (the same ``FeatureState`` object). Otherwise
(LRU -> LightGBM after a recovery) the newcomer is fed the last ``warmup_requests``
requests before the swap, so it does not score from a cold start.

MLflow is reached only through ``training.tracking`` (the one module that imports it),
imported lazily here so that serving a file or a baseline never imports MLflow.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from features.events import BlocksAccessed
from predictor.base import MANIFEST_NAME, Policy, PolicyError, PolicyLoadError
from predictor.learned import LearnedPolicy
from predictor.model_check import DEFAULT_PROBE_TIMEOUT_S, ModelProbeError, probe_policy
from predictor.registry import available_policies, load_policy, make_policy

log = logging.getLogger(__name__)

FALLBACK_POLICY = "lru"

DegradedKind = Literal[
    "load_failed",
    "feature_version_mismatch",
    "refused",
    "unresolvable",
    "scoring_failed",
    "scoring_stuck",
]

DEFAULT_SCORE_TIMEOUT_S = 10.0
"""One score call running longer than this marks the model ``scoring_stuck``."""


@dataclass(frozen=True)
class ModelStatus:
    """What is being served and why. ``degraded`` is None when the asked-for model runs."""

    spec: str
    policy: str
    version: str
    degraded: DegradedKind | None = None
    reason: str = ""
    loaded_at_s: float = 0.0
    last_error: str = ""
    """The latest failed reload (a broken new version) while a good one keeps serving."""

    @property
    def status(self) -> str:
        return "degraded" if self.degraded else "ok"

    @property
    def name(self) -> str:
        """The registered model's name (``models:/NAME@ALIAS``), else the spec itself."""
        return registry_identity(self.spec)[0]

    @property
    def alias(self) -> str:
        """The alias followed (``models:/NAME@ALIAS``), else ``""``."""
        return registry_identity(self.spec)[1]


def registry_identity(spec: str) -> tuple[str, str]:
    """``models:/NAME@ALIAS`` -> (NAME, ALIAS); ``models:/NAME/VERSION`` -> (NAME, "");
    anything else -> (spec, "")."""
    if spec.startswith("models:/"):
        rest = spec[len("models:/") :]
        if "@" in rest:
            name, _, alias = rest.partition("@")
            return name, alias
        return rest.split("/", 1)[0], ""
    return spec, ""


class ModelStartError(RuntimeError):
    """The asked-for model cannot be loaded at start and no fallback was allowed."""


class ModelResolveError(PolicyError):
    """What a model spec names cannot be found right now (no such alias, no store)."""


class Resolver:
    """How an MLflow URI becomes a local saved policy. ``version(uri)`` is called on
    every poll and must be cheap (a registry lookup, no download); ``download(uri,
    scratch)`` is called only when that version is not the one served."""

    def version(self, uri: str) -> str:
        """The registry version ``uri`` names now ("" when the store has no registry
        version for it, e.g. ``runs:/``: the content then decides)."""
        raise NotImplementedError

    def download(self, uri: str, scratch: Path) -> Path:
        """A local saved-policy directory (inside ``scratch``) for ``uri``."""
        raise NotImplementedError


class MlflowResolver(Resolver):
    """Through ``training.tracking`` (the only mlflow importer; imported on first use)."""

    def __init__(self, tracking_uri: str | None = None) -> None:
        self.tracking_uri = tracking_uri

    def version(self, uri: str) -> str:
        # The one allowed upward import of serving (the other is the CLI command table):
        # training.tracking is the only MLflow importer, loaded lazily on first use.
        from training import tracking

        return tracking.model_version_for_uri(uri, store_uri=self.tracking_uri)

    def download(self, uri: str, scratch: Path) -> Path:
        from training import tracking  # the same allowed exception as in version()

        return tracking.resolve_policy_dir(uri, dst=scratch, store_uri=self.tracking_uri)


def mlflow_resolver(tracking_uri: str | None = None) -> Resolver:
    """A resolver through ``training.tracking``."""
    return MlflowResolver(tracking_uri)


def content_version(directory: Path) -> str:
    """A version label from the bytes of a saved policy (manifest + model files)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(path.read_bytes())
    return "sha-" + digest.hexdigest()[:12]


def is_mlflow_uri(spec: str) -> bool:
    return spec.startswith(("models:", "runs:")) or "://" in spec


def _classify(exc: BaseException) -> DegradedKind:
    text = str(exc)
    if "feature version" in text or "feature names differ" in text:
        return "feature_version_mismatch"
    if "needs future" in text or isinstance(exc, ModelProbeError):
        return "refused"
    if isinstance(exc, ModelResolveError) or "could not fetch" in text:
        return "unresolvable"
    return "load_failed"


def check_time_base(policy: Policy) -> None:
    """Refuse a model whose recorded time base is not the sidecar's (event-time ms,
    unscaled): its time features would mean something else here."""
    base = policy.time_base
    if base is None:
        return  # a baseline: no model, no time base
    if base.get("unit") != "ms" or base.get("clock") != "event":
        raise PolicyError(
            f"model was trained on time base {base}, the sidecar computes features in "
            "event-time ms; retrain it with kvwarm train"
        )
    scale = float(base.get("time_scale", 1.0))
    if abs(scale - 1.0) > 1e-9:
        raise PolicyError(
            f"model was trained on a trace stretched x{scale:.3g} (a replay's model); its "
            "horizon and time features do not match live event time; retrain it with "
            "kvwarm train"
        )


class ModelManager:
    """Owns which policy the sidecar scores with. Thread-safe: the poller and the HTTP
    thread read ``status``; only ``_install`` writes it."""

    def __init__(
        self,
        spec: str,
        *,
        resolver: Resolver | None = None,
        tracking_uri: str | None = None,
        warmup_requests: int = 4_096,
        scratch_dir: str | Path | None = None,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        score_timeout_s: float = DEFAULT_SCORE_TIMEOUT_S,
        score_max_age_ms: int | None = None,
    ) -> None:
        """``score_max_age_ms``: set on every learned policy loaded (its
        ``LearnedParams.score_max_age_ms``: how long a stored block score or chain
        prediction is reused); None keeps what the saved model says."""
        self.spec = spec
        self.score_max_age_ms = score_max_age_ms
        self.probe_timeout_s = probe_timeout_s
        self.score_timeout_s = score_timeout_s
        self.resolver = resolver or mlflow_resolver(tracking_uri)
        self.sidecar: Any = None
        self.recent: deque[BlocksAccessed] = deque(maxlen=max(1, warmup_requests))
        self.warmup_requests = warmup_requests
        self.num_swaps = 0
        self.num_failed_reloads = 0
        self._scratch = Path(scratch_dir) if scratch_dir else None
        self._status = ModelStatus(spec, FALLBACK_POLICY, "none", "load_failed", "not loaded yet")
        self._policy: Policy | None = None
        self._last_version = ""
        self._broken_versions: set[str] = set()
        """Versions that failed to load: not downloaded-and-parsed again every poll."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None

    # -- reading -----------------------------------------------------------------------
    @property
    def status(self) -> ModelStatus:
        return self._status

    @property
    def policy(self) -> Policy:
        """The served policy (a ``ScoringFallback`` around the loaded one)."""
        assert self._policy is not None, "call load_initial() first"
        return self._policy

    def model_info(self) -> tuple[str, str]:
        """(policy name, version) for decisions; cheap, called per batch of moves."""
        s = self._status
        return s.policy, s.version

    # -- loading -----------------------------------------------------------------------
    def _resolve(
        self, scratch: Path, skip: frozenset[str] = frozenset()
    ) -> tuple[str, Path | None, str]:
        """-> (kind, directory or None, version label). Raises on failure. An MLflow
        version in ``skip`` is not downloaded (directory None)."""
        spec = self.spec
        if spec in available_policies() and not Path(spec).exists():
            return "builtin", None, "builtin"
        if is_mlflow_uri(spec):
            version = self.resolver.version(spec)
            if version and version in skip:
                return "mlflow", None, version  # unchanged: nothing downloaded
            directory = self.resolver.download(spec, scratch)
            return "mlflow", directory, version or content_version(directory)
        path = Path(spec)
        if path.is_file():
            path = path.parent  # model.txt or policy.json inside a saved policy
        if not path.is_dir():
            raise PolicyLoadError(path, "no such file or directory (expected a saved policy)")
        if not (path / MANIFEST_NAME).is_file():
            raise PolicyLoadError(path / MANIFEST_NAME, "missing; not a saved kvwarm policy")
        return "path", path, content_version(path)

    def _load(self, skip_versions: frozenset[str] = frozenset()) -> tuple[Policy | None, str]:
        """Load what ``spec`` names now; ``(None, version)`` when that version is one of
        ``skip_versions`` (already served, or known broken): nothing is parsed then."""
        self._last_version = ""
        # MLflow downloads land in a scratch dir dropped once the model is in memory.
        scratch = Path(tempfile.mkdtemp(prefix="kvwarm-model-", dir=self._scratch))
        try:
            kind, directory, version = self._resolve(scratch, skip_versions)
            self._last_version = version
            if version in skip_versions:
                return None, version
            if kind == "builtin":
                policy = make_policy(self.spec)
                if not policy.fitted:
                    raise PolicyLoadError(
                        self.spec, "a learned policy needs a trained model: pass its directory "
                        "or an MLflow URI, not the bare policy name",
                    )  # fmt: skip
            else:
                assert directory is not None
                policy = load_policy(directory)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if policy.needs_future:
            raise PolicyError(f"policy {policy.name!r} needs future knowledge; serving refuses it")
        if self.score_max_age_ms is not None and isinstance(policy, LearnedPolicy):
            policy.set_score_max_age(self.score_max_age_ms)
        check_time_base(policy)
        probe_policy(policy, self.probe_timeout_s, where=self.spec)
        return policy, version

    def load_initial(self, *, fallback: bool = True) -> Policy:
        """The policy to start with: the asked-for model, or LRU (degraded) if it fails.
        With ``fallback=False`` a model that cannot be loaded raises ``ModelStartError``
        instead (what ``kvwarm serve`` does unless told ``--fallback lru``)."""
        try:
            policy, version = self._load()
            assert policy is not None
        except Exception as exc:
            kind = _classify(exc)
            if not fallback:
                hint = (
                    f"valid names: {', '.join(available_policies())}; "
                    if not is_mlflow_uri(self.spec) and not Path(self.spec).exists()
                    else ""
                )
                raise ModelStartError(
                    f"model {self.spec!r} cannot be loaded ({kind}): "
                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; "
                    f"{hint}pass --fallback lru to serve LRU meanwhile"
                ) from exc
            if isinstance(exc, PolicyLoadError) and self._last_version:
                self._broken_versions.add(self._last_version)
            log.error(
                "model %r could not be loaded (%s): %s; serving with %s until a good version "
                "appears",
                self.spec,
                kind,
                exc,
                FALLBACK_POLICY,
            )
            lru = make_policy(FALLBACK_POLICY)
            status = ModelStatus(self.spec, lru.name, "fallback", kind, str(exc))
            return self._install(lru, status)
        log.info("serving model %r: policy %s version %s", self.spec, policy.name, version)
        return self._install(policy, ModelStatus(self.spec, policy.name, version))

    def attach(self, sidecar: Any) -> None:
        """Manage ``sidecar``'s policy; record requests for warming swapped-in policies."""
        self.sidecar = sidecar
        if self.warmup_requests > 0:
            recent = self.recent

            def remember(event: BlocksAccessed | None, moves: Any, now_ms: int) -> None:
                if event is not None:
                    recent.append(event)

            sidecar.hooks.append(remember)

    def check_for_update(self) -> bool:
        """One poll: swap in what ``spec`` names now if it changed. True if swapped."""
        with self._lock:
            current = self._status
            if current.degraded is None and current.version == "builtin":
                return False  # a baseline never changes
            skip = set(self._broken_versions)
            if current.degraded is None:
                skip.add(current.version)
            try:
                policy, version = self._load(frozenset(skip))
            except Exception as exc:
                if isinstance(exc, PolicyLoadError) and self._last_version:
                    self._broken_versions.add(self._last_version)
                if current.degraded is None:
                    # A good model keeps serving; the broken version is only reported.
                    self.num_failed_reloads += 1
                    self._status = _replace(current, last_error=str(exc))
                    log.warning("new version of %r failed to load, keeping %s: %s",
                                self.spec, current.version, exc)  # fmt: skip
                else:
                    self._status = _replace(current, degraded=_classify(exc), reason=str(exc))
                return False
            if policy is None:
                return False  # unchanged, or a version already known to be broken
            self._warm(policy)
            guarded = self._install(policy, ModelStatus(self.spec, policy.name, version))
            if self.sidecar is not None:
                self.sidecar.swap_policy(guarded)
            self.num_swaps += 1
            log.info("swapped in %s version %s (was %s %s)", policy.name, version,
                     current.policy, current.version)  # fmt: skip
            return True

    def _warm(self, new: Policy) -> None:
        old = self._policy
        if new.adopt_state(old.handover_state() if old is not None else None):
            return  # shared: no gap at all
        # Replay the recent requests; a few that arrive during the replay are missed by
        # the newcomer's features (never by the loop: no event is dropped).
        new.observe_many(list(self.recent))

    def _install(self, policy: Policy, status: ModelStatus) -> ScoringFallback:
        guarded = ScoringFallback(policy, self._scoring_failed)
        self._policy = guarded
        self._status = _replace(status, loaded_at_s=time.time())
        return guarded

    def _scoring_failed(self, guard: ScoringFallback, why: str) -> Policy:
        """Called by the guard (on the loop thread) when its policy's scores are unusable:
        returns the LRU that takes over, warmed with the recent requests."""
        fallback = make_policy(FALLBACK_POLICY)
        fallback.observe_many(list(self.recent))
        if guard is self._policy:
            current = self._status
            if current.version not in ("builtin", "fallback"):
                self._broken_versions.add(current.version)
            self._status = _replace(
                current, policy=fallback.name, degraded="scoring_failed", reason=why
            )
        log.error("model %r: %s; serving with %s", self.spec, why, FALLBACK_POLICY)
        return fallback

    # -- watchdog ----------------------------------------------------------------------
    def start_watchdog(self, interval_s: float = 0.5) -> None:
        """Check every ``interval_s`` that no score call has run past ``score_timeout_s``;
        if one has, report ``scoring_stuck`` (health degraded) until it returns."""
        if self._watchdog is not None or self.score_timeout_s <= 0:
            return

        def watch() -> None:
            while not self._stop.wait(interval_s):
                guard = self._policy
                if not isinstance(guard, ScoringFallback):
                    continue
                since = guard.scoring_since_s
                current = self._status
                if since is not None and time.monotonic() - since > self.score_timeout_s:
                    if current.degraded != "scoring_stuck":
                        why = (
                            f"one score call has run more than {self.score_timeout_s:g} s "
                            f"(policy {current.policy} {current.version})"
                        )
                        log.error("model %r: %s", self.spec, why)
                        self._status = _replace(
                            current, degraded="scoring_stuck", reason=why, last_error=why
                        )
                elif since is None and current.degraded == "scoring_stuck":
                    self._status = _replace(current, degraded=None, reason="")

        self._watchdog = threading.Thread(target=watch, name="kvwarm-score-watchdog", daemon=True)
        self._watchdog.start()

    # -- polling -----------------------------------------------------------------------
    def start_polling(self, interval_s: float) -> None:
        """Poll every ``interval_s`` in a daemon thread (no-op for 0 or a baseline)."""
        if interval_s <= 0 or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check_for_update()
                except Exception:  # the poller must never die silently
                    log.exception("model poll failed")

        self._thread = threading.Thread(target=loop, name="kvwarm-model-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the poller and the watchdog (waits at most a few seconds for each)."""
        self._stop.set()
        for thread in (self._thread, self._watchdog):
            if thread is not None:
                thread.join(timeout=5)
        self._thread = self._watchdog = None


class ScoringFallback(Policy):
    """The served policy behind the scoring fallback (not the online guard of
    ``predictor.guard``); every other attribute is the active policy's.

    ``score`` records when the call started (the watchdog reads ``scoring_since_s``) and
    checks the result: an exception or a nan/inf score makes ``on_failure`` hand over a
    fallback policy, which scores this call and every later one. Checking costs one
    ``np.isfinite`` over the scores; nothing is moved to another thread on the hot path.
    """

    def __init__(
        self, policy: Policy, on_failure: Callable[[ScoringFallback, str], Policy]
    ) -> None:
        # Policy.__init__ is not called: the guard has no params of its own.
        self.inner = policy
        self.active = policy
        self.on_failure = on_failure
        self.scoring_since_s: float | None = None
        self.num_failures = 0

    def __getattr__(self, attr: str) -> Any:
        # Only reached for attributes the guard itself lacks (state, feature_params ...).
        if attr in ("inner", "active"):
            raise AttributeError(attr)
        return getattr(self.active, attr)

    @property  # type: ignore[override]
    def name(self) -> str:  # type: ignore[override]
        return self.active.name

    @property  # type: ignore[override]
    def outputs_probability(self) -> bool:  # type: ignore[override]
        return self.active.outputs_probability

    @property  # type: ignore[override]
    def ranks_by_recency(self) -> bool:  # type: ignore[override]
        return self.active.ranks_by_recency

    @property  # type: ignore[override]
    def time_base(self) -> dict[str, Any] | None:  # type: ignore[override]
        return self.active.time_base

    # Declared Policy capabilities reach the active policy (the base class defines them,
    # so ``__getattr__`` would never see them).
    def handover_state(self) -> object | None:
        return self.active.handover_state()

    def adopt_state(self, state: object | None) -> bool:
        return self.active.adopt_state(state)

    def prefetch_candidates(self, now_ms: int, limit: int) -> np.ndarray:
        return self.active.prefetch_candidates(now_ms, limit)

    def online_status(self) -> dict[str, Any]:
        return self.active.online_status()

    def observe(self, event: Any) -> None:
        self.active.observe(event)

    def observe_many(self, events: Any) -> None:
        self.active.observe_many(events)

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        self.scoring_since_s = time.monotonic()
        try:
            scores = self.active.score(block_hashes, now_ms)
            if np.isfinite(scores).all():
                return scores
            why = f"{int((~np.isfinite(scores)).sum())} of {len(scores)} scores were nan or inf"
        except Exception as exc:
            if self.active is not self.inner:
                raise  # the fallback itself failed: a bug, not a bad model
            why = f"scoring raised {type(exc).__name__}: {exc}"
        finally:
            self.scoring_since_s = None
        if self.active is not self.inner:
            raise PolicyError(f"fallback policy {self.active.name} returned non-finite scores")
        self.num_failures += 1
        self.active = self.on_failure(self, why)
        return self.active.score(block_hashes, now_ms)


def _replace(status: ModelStatus, **changes: Any) -> ModelStatus:
    from dataclasses import replace

    return replace(status, **changes)
