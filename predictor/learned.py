"""Shared machinery of learned policies (LightGBM, LSTM): online features in, model out.

A learned policy owns a ``features.state.FeatureState`` (the one feature code path,
shared with ``training.dataset``): ``observe`` feeds it, ``score`` asks it for feature
rows of the requested blocks and runs the model on them. Training happens offline
(``training.train``) through ``fit`` on feature matrices built by the same state.

Saved layout: ``policy.json`` (name, params, feature version, feature names and
feature params) plus the model's own files, and, when a chain return model was fitted
beside the block model, ``chain_model.txt`` with its entry ``chain`` (params, file) in
the manifest. A directory without that entry loads with no chain model (models saved
before it existed keep working). Loading refuses a model whose feature version or
feature names differ from this kvwarm's: its columns would mean other things.

This module imports neither LightGBM nor torch; subclasses do, lazily by registry.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from features import native_rows
from features.events import Event
from features.state import FEATURE_VERSION, FeatureParams, FeatureState
from predictor.base import (
    MANIFEST_NAME,
    Policy,
    PolicyError,
    PolicyLoadError,
    PolicyParams,
    as_hash_array,
)
from predictor.chain_model import CHAIN_MODEL_FILE, ChainPolicy, ChainTracker


class NotFittedError(PolicyError):
    """A learned policy was asked to score before it was fitted or loaded."""


class LearnedParams(PolicyParams):
    horizon_ms: int = Field(
        120_000, ge=1, description="H: the model predicts reuse within (t, t + H]."
    )
    seed: int = Field(0, ge=0, description="Seed of every random choice in training.")
    score_max_age_ms: int = Field(
        0,
        ge=0,
        description="Score once, keep the score: a block's prediction is stored in the "
        "feature state and reused while the block is not accessed again and the score is "
        "at most this old (event time); 0 recomputes every score (exact, slowest). "
        "Shared trace, 5%, single tier: 10 s halves the model rows per access "
        "(12.5 -> 6.4) at an unchanged hit ratio (+0.0004); 60 s: 2.3 rows, -0.003. "
        "The chain model's predictions of prefetch rounds are reused the same way (while "
        "the chain is not continued). Off (0) by default: evaluation compares scores with "
        "the model on the same rows; serving sets its own (SidecarSettings).",
    )


def feature_params_to_dict(params: FeatureParams) -> dict[str, Any]:
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()
    }


def feature_params_from_dict(data: dict[str, Any]) -> FeatureParams:
    fields = {f.name for f in dataclasses.fields(FeatureParams)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"unknown feature params {sorted(unknown)}")
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return FeatureParams(**kwargs)


DEFAULT_TIME_BASE: dict[str, Any] = {"unit": "ms", "clock": "event", "time_scale": 1.0}
"""What a model trained by ``kvwarm train`` saw: event-time milliseconds, unscaled."""


@dataclasses.dataclass(frozen=True)
class LearnedHandover:
    """What a learned policy hands its successor at a hot swap (``adopt_state``)."""

    state: FeatureState
    chain_tracker: ChainTracker | None


class LearnedPolicy(Policy):
    """Base of policies that score ``model(features_for(blocks, now_ms))``."""

    Params: ClassVar[type[PolicyParams]] = LearnedParams
    params: LearnedParams
    outputs_probability = True

    def __init__(
        self, params: PolicyParams | None = None, feature_params: FeatureParams | None = None
    ) -> None:
        super().__init__(params)
        self.feature_params = feature_params or FeatureParams()
        self.state = FeatureState(self.feature_params)
        self.feature_names: tuple[str, ...] = self.state.feature_names
        self.fitted = False
        self.training_info: dict[str, Any] = {}
        """What ``fit`` learned besides the model: best iteration, importances ..."""
        self._chain: ChainPolicy | None = None

    @property
    def chain(self) -> ChainPolicy | None:
        """The per-chain return model (``predictor.chain_model``), when one was fitted
        beside the block model: it follows conversations online and names the blocks of
        the chains most likely back soon as prefetch candidates; with a ``blend``, its
        return probabilities are folded into every block score too. Without a blend it
        keeps no block -> chain map (set here: nothing reads it, and it is most of the
        tracker's cost)."""
        return self._chain

    @chain.setter
    def chain(self, chain: ChainPolicy | None) -> None:
        if chain is not None:
            chain.tracker.keep_block_map(chain.blend is not None)
        self._chain = chain

    # --- online ---------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        self.state.observe(event)
        if self.chain is not None:
            self.chain.observe(event)

    def observe_many(self, events: Iterable[Event]) -> None:
        # FeatureState batches requests; the result is bit-identical to one by one.
        if self.chain is not None:
            events = list(events)
            self.chain.observe_many(events)
        self.state.observe_many(events)

    def online_status(self) -> dict[str, Any]:
        """``feature_rows``: what computes this process's feature rows and updates
        (``native``, or ``numpy (<why>)``: see ``features.native_rows``)."""
        return {"feature_rows": native_rows.status()}

    def prefetch_candidates(self, now_ms: int, limit: int) -> np.ndarray:
        """Blocks of the chains the chain model expects back soonest (none without one).
        The chain predictions follow ``score_max_age_ms`` as block scores do."""
        if self.chain is None:
            return super().prefetch_candidates(now_ms, limit)
        return self.chain.prefetch_candidates(now_ms, limit, self.params.score_max_age_ms)

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        """Stored scores where the refresh rule allows (``score_max_age_ms``), the rest
        computed in one model call and stored: a block is scored once per access
        (when first asked after it), not once per eviction sample that holds it."""
        hashes = as_hash_array(block_hashes)
        if hashes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        max_age_ms = self.params.score_max_age_ms
        state = self.state
        if max_age_ms == 0:
            return self._blended(hashes, state.features_for(hashes, now_ms), now_ms)
        slots = state.slot_of(hashes)
        stored, usable = state.stored_scores(slots, now_ms, max_age_ms)
        if usable.all():
            return stored
        out = stored.copy()
        need = np.flatnonzero(~usable)
        fresh = self._blended(hashes[need], state.features_for_slots(slots[need], now_ms), now_ms)
        out[need] = fresh
        state.store_scores(slots[need], fresh, now_ms)
        return out

    def _blended(self, hashes: np.ndarray, features: np.ndarray, now_ms: int) -> np.ndarray:
        """The model's scores of these rows, folded with the chain model's return
        probabilities of the same blocks when the chain model has a blend."""
        scores = self.predict_features(features)
        chain = self.chain
        if chain is None or chain.blend is None:
            return scores
        returns, has_chain = chain.block_scores(hashes, now_ms)
        return chain.blend.apply(scores, returns, has_chain)

    def refit(
        self, x: np.ndarray, y: np.ndarray, *, time_to_next_ms: np.ndarray | None = None
    ) -> bool:
        """Fit again on the training and validation rows together with the validated
        settings (``training.train.refit_on_training_span``); False where the model does
        not (the LSTM keeps its validated fit: a refit for its validated epochs was
        measured and not kept, see ``training.train.refit_on_training_span``)."""
        return False

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        """Probability of reuse within the horizon per feature row (float32)."""
        if not self.fitted:
            raise NotFittedError(
                f"{self.name} policy has no model: fit it (kvwarm train) or load a saved one"
            )
        features = np.asarray(features, dtype=np.float32)
        if features.ndim != 2 or features.shape[1] != len(self.feature_names):
            raise ValueError(
                f"expected features of shape (n, {len(self.feature_names)}), got {features.shape}"
            )
        return np.asarray(self._predict(features), dtype=np.float32)

    @property
    def chain_tracker(self) -> ChainTracker | None:
        """The chain model's online state (None without a chain model): what
        ``serving.checkpoint`` captures beside ``state``. Assigning None to a policy that
        has a chain model (a snapshot taken without one) empties its tracker and keeps
        the model; a tracker is restored in place by the checkpoint module."""
        return self.chain.tracker if self.chain is not None else None

    @chain_tracker.setter
    def chain_tracker(self, tracker: ChainTracker | None) -> None:
        if self.chain is None:
            if tracker is not None:
                raise ValueError("a chain tracker given to a policy without a chain model")
            return
        if tracker is None:
            tracker = ChainTracker(
                max_chains=self.chain.params.max_chains,
                index_blocks=self.chain.blend is not None,
            )
        self.chain.tracker = tracker

    # --- model ----------------------------------------------------------------------

    @abc.abstractmethod
    def _predict(self, features: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    def fit(
        self,
        x_train: np.ndarray,
        y_train: np.ndarray,
        x_valid: np.ndarray,
        y_valid: np.ndarray,
        *,
        time_to_next_train_ms: np.ndarray | None = None,
        time_to_next_valid_ms: np.ndarray | None = None,
        progress: bool = False,
    ) -> LearnedPolicy:
        """Train on feature rows with ``reused_within_H`` labels (bool); validation rows
        drive early stopping. Returns ``self``."""

    def handover_state(self) -> object | None:
        return LearnedHandover(self.state, self.chain_tracker)

    def adopt_state(self, state: object | None) -> bool:
        """Share the outgoing policy's ``FeatureState`` when it computes the same
        features (same ``FeatureParams``): no gap in history at all. Its chain tracker
        too, when both have a chain model keeping as many chains (the tracker is
        stream state only; the chain model reads it the same way; its block -> chain map
        is kept or dropped as the new chain model's blend needs)."""
        chain_tracker = None
        if isinstance(state, LearnedHandover):
            chain_tracker = state.chain_tracker
            state = state.state
        if not isinstance(state, FeatureState) or type(state) is not type(self.state):
            return False
        if state.params != self.feature_params:
            return False
        state.forget_scores()  # stored by the outgoing model (score_max_age_ms > 0)
        self.state = state
        chain = self.chain
        if (
            chain is not None
            and chain_tracker is not None
            and chain_tracker.max_chains == chain.params.max_chains
        ):
            # A blend reads the block -> chain map: it fills from the next request on
            # when the outgoing model kept none.
            chain_tracker.keep_block_map(chain.blend is not None)
            chain.tracker = chain_tracker
        return True

    def set_score_max_age(self, max_age_ms: int) -> None:
        """Reuse stored scores (and chain predictions) for at most ``max_age_ms``
        (``LearnedParams.score_max_age_ms``; 0: recompute every score)."""
        self.params = self.params.model_copy(update={"score_max_age_ms": max_age_ms})

    def fresh_copy(self) -> LearnedPolicy:
        """Same params and model, empty online state (what ``load`` would give)."""
        clone = type(self)(self.params, self.feature_params)
        clone._adopt_model(self)
        clone.fitted = self.fitted
        clone.training_info = dict(self.training_info)
        clone.chain = self.chain.fresh_copy() if self.chain is not None else None
        return clone

    @abc.abstractmethod
    def _adopt_model(self, other: LearnedPolicy) -> None: ...

    def model_size_bytes(self) -> int:
        """Bytes of the saved model files (what serving loads)."""
        return int(self.training_info.get("model_size_bytes", 0))

    # --- persistence ----------------------------------------------------------------

    def _save_model(self, directory: Path) -> dict[str, Any]:
        if not self.fitted:
            raise NotFittedError(f"cannot save an unfitted {self.name} policy")
        files = self._write_model_files(directory)
        extra: dict[str, Any] = {}
        if self.chain is not None:
            extra["chain"] = self.chain.save_model(directory)
            files = [*files, extra["chain"]["file"]]
        else:
            (directory / CHAIN_MODEL_FILE).unlink(missing_ok=True)  # a stale one
        self.training_info["model_size_bytes"] = sum((directory / f).stat().st_size for f in files)
        return {
            "feature_version": FEATURE_VERSION,
            "feature_names": list(self.feature_names),
            "feature_params": feature_params_to_dict(self.feature_params),
            "time_base": self.time_base,
            "files": files,
            **extra,
        }

    @property
    def time_base(self) -> dict[str, Any]:
        """The time the model was trained on: ``unit`` (ms), ``clock`` (``event``: the
        events' own timestamps) and ``time_scale`` (1.0 unless a replay stretched the
        trace). Saved in the manifest; serving checks it when it loads the model."""
        return dict(self.training_info.get("time_base") or DEFAULT_TIME_BASE)

    @classmethod
    def load(cls, directory: str | Path, **kwargs: Any) -> Policy:
        from predictor.base import params_from_manifest, read_manifest

        directory = Path(directory)
        manifest = read_manifest(directory)
        where = directory / MANIFEST_NAME
        if manifest["policy"] != cls.name:
            raise PolicyLoadError(
                where, f"it holds a {manifest['policy']!r} policy, not {cls.name!r}"
            )
        if manifest.get("feature_version") != FEATURE_VERSION:
            raise PolicyLoadError(
                where,
                f"model was trained on feature version {manifest.get('feature_version')!r}, "
                f"this kvwarm computes version {FEATURE_VERSION}; retrain it (kvwarm train)",
            )
        try:
            feature_params = feature_params_from_dict(manifest.get("feature_params", {}))
        except (TypeError, ValueError) as exc:
            raise PolicyLoadError(where, f"invalid feature_params: {exc}") from exc
        params = params_from_manifest(cls, manifest, where)
        policy = cls(params, feature_params, **kwargs)
        if list(policy.feature_names) != manifest.get("feature_names"):
            raise PolicyLoadError(
                where, "feature names differ from this kvwarm's; retrain the model"
            )
        for name in manifest.get("files", []):
            if not (directory / name).is_file():
                raise PolicyLoadError(directory / name, "model file is missing")
        policy._read_model_files(directory, manifest)
        if manifest.get("chain") is not None:
            policy.chain = ChainPolicy.load_model(directory, manifest["chain"], where)
        policy.fitted = True
        if "time_base" in manifest:
            if not isinstance(manifest["time_base"], dict):
                raise PolicyLoadError(where, "time_base must be a table")
            policy.training_info["time_base"] = dict(manifest["time_base"])
        policy.training_info["model_size_bytes"] = sum(
            (directory / f).stat().st_size for f in manifest.get("files", [])
        )
        return policy

    @abc.abstractmethod
    def _write_model_files(self, directory: Path) -> list[str]:
        """Write the model; return the file names (relative to ``directory``)."""

    @abc.abstractmethod
    def _read_model_files(self, directory: Path, manifest: dict[str, Any]) -> None:
        """Read the model; raise ``PolicyLoadError`` naming the file on any problem."""
