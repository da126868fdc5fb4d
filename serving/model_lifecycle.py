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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from features.events import BlocksAccessed
from predictor.base import MANIFEST_NAME, Policy, PolicyError, PolicyLoadError
from predictor.registry import available_policies, load_policy, make_policy

log = logging.getLogger(__name__)

FALLBACK_POLICY = "lru"

DegradedKind = Literal["load_failed", "feature_version_mismatch", "refused", "unresolvable"]


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
        from training import tracking

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
    if "needs future" in text:
        return "refused"
    if isinstance(exc, ModelResolveError) or "could not fetch" in text:
        return "unresolvable"
    return "load_failed"


def check_time_base(policy: Policy) -> None:
    """Refuse a model whose recorded time base is not the sidecar's (event-time ms,
    unscaled): its time features would mean something else here."""
    base = getattr(policy, "time_base", None)
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
    ) -> None:
        self.spec = spec
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

    # -- reading -----------------------------------------------------------------------
    @property
    def status(self) -> ModelStatus:
        return self._status

    @property
    def policy(self) -> Policy:
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
                if getattr(policy, "fitted", True) is False:
                    raise PolicyLoadError(
                        self.spec, "a learned policy needs a trained model: pass its directory "
                        "or an MLflow URI, not the bare policy name",
                    )  # fmt: skip
            else:
                assert directory is not None
                policy = load_policy(directory)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if getattr(policy, "needs_future", False):
            raise PolicyError(f"policy {policy.name!r} needs future knowledge; serving refuses it")
        check_time_base(policy)
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
            policy = make_policy(FALLBACK_POLICY)
            self._install(policy, ModelStatus(self.spec, policy.name, "fallback", kind, str(exc)))
            return policy
        self._install(policy, ModelStatus(self.spec, policy.name, version))
        log.info("serving model %r: policy %s version %s", self.spec, policy.name, version)
        return policy

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
            if self.sidecar is not None:
                self.sidecar.swap_policy(policy)
            self.num_swaps += 1
            self._install(policy, ModelStatus(self.spec, policy.name, version))
            log.info("swapped in %s version %s (was %s %s)", policy.name, version,
                     current.policy, current.version)  # fmt: skip
            return True

    def _warm(self, new: Policy) -> None:
        old = self._policy
        old_state = getattr(old, "state", None)
        same_features = (
            old_state is not None
            and hasattr(new, "state")
            and getattr(old, "feature_params", None) == getattr(new, "feature_params", None)
            and type(old_state) is type(new.state)
        )
        if same_features:
            new.state = old_state  # type: ignore[attr-defined]  # shared: no gap at all
            return
        # Replay the recent requests; a few that arrive during the replay are missed by
        # the newcomer's features (never by the loop: no event is dropped).
        new.observe_many(list(self.recent))

    def _install(self, policy: Policy, status: ModelStatus) -> None:
        self._policy = policy
        self._status = _replace(status, loaded_at_s=time.time())

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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None


def _replace(status: ModelStatus, **changes: Any) -> ModelStatus:
    from dataclasses import replace

    return replace(status, **changes)
