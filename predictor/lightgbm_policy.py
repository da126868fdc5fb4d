"""LightGBM policy: gradient-boosted trees on the online features (LRB tradition).

Two objectives (``LightGBMParams.objective``):

- ``binary``: P(reused within H), trained on ``reused_within_H``; the score is that
  probability.
- ``log_time_to_next``: regression on log1p(time to next access), as LRB does, with
  censored and never-reused rows at ``max_time_to_next_ms``. The score is
  P(reused within H) under a log-normal error around the prediction (sigma = RMSE on
  the validation rows), monotone in the prediction.

Early stopping on the validation split; feature importance (gain) kept in
``training_info``. Saved as LightGBM's text model format (``model.txt``); loading
parses and validates it first (``predictor.trees.parse_lightgbm_model``: indices in
range, acyclic trees, finite values; ``PolicyLoadError`` otherwise) and only then
hands the same text to LightGBM: no pickle, and no file that could make LightGBM's
predictor read out of bounds or loop.

Inference, one call per batch, goes through the validated trees compiled to native
code (``predictor.compiled_trees``: bit-identical to LightGBM, 4-17x faster than its
predictor on kvwarm's models) when a C compiler is at hand, else through LightGBM's
C API (``LGBM_BoosterPredictForMat``, float32 rows, one thread) by ctypes: about half
the per-call cost of ``Booster.predict`` on small batches. A numpy tree walk
(``predictor.trees``) was 6-17x slower than the C API. ``kvwarm bench replay`` prints
all four side by side.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightgbm as lgb
import numpy as np
from pydantic import Field

from predictor.base import PolicyLoadError, PolicyParams
from predictor.compiled_trees import CompiledTrees, compile_ensemble
from predictor.learned import LearnedParams, LearnedPolicy, NotFittedError
from predictor.model_check import read_model_text, without_tree_sizes
from predictor.trees import TreeEnsemble, parse_lightgbm_model

log = logging.getLogger(__name__)

MODEL_FILE = "model.txt"


class LightGBMParams(LearnedParams):
    """Defaults are strongly regularised (15 leaves, >= 1000 rows a leaf, L2 10): on the
    Mooncake trace the validation loss of 63-leaf trees turns up after a few rounds
    (PR-AUC 0.57 vs 0.61 on the test part), because session-level traffic drifts."""

    objective: Literal["binary", "log_time_to_next"] = Field(
        "binary", description="What the trees fit: the reuse label, or log time to next access."
    )
    num_boost_round: int = Field(1000, ge=1, le=100_000, description="Upper bound on trees.")
    early_stopping_rounds: int = Field(
        60, ge=1, description="Stop when the validation loss has not improved for this many rounds."
    )
    learning_rate: float = Field(0.03, gt=0, le=1, description="Shrinkage per tree.")
    num_leaves: int = Field(15, ge=2, le=4096, description="Leaves per tree.")
    min_data_in_leaf: int = Field(1000, ge=1, description="Fewest training rows in a leaf.")
    feature_fraction: float = Field(
        0.7, gt=0, le=1, description="Share of features each tree sees."
    )
    bagging_fraction: float = Field(0.8, gt=0, le=1, description="Share of rows each tree sees.")
    lambda_l2: float = Field(10.0, ge=0, description="L2 penalty on leaf values.")
    max_time_to_next_ms: int = Field(
        3_600_000, ge=1, description="Regression target cap; censored rows get this value."
    )
    num_threads: int = Field(
        1,
        ge=1,
        le=256,
        description="Training threads. OpenMP spin-waits, so more threads than free cores "
        "is far slower than one; raise it on a dedicated machine.",
    )


class LightGBMPolicy(LearnedPolicy):
    """Boosted trees over ``FeatureState`` rows; see the module docstring."""

    name = "lightgbm"
    Params: ClassVar[type[PolicyParams]] = LightGBMParams
    params: LightGBMParams

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model: TreeModel | None = None
        """The trees (set by fit and load); ``booster``, ``trees``, ``compiled`` and
        ``evaluator`` read it."""
        self.sigma_log: float = 1.0

    @property
    def booster(self) -> lgb.Booster | None:
        return self.model.booster if self.model is not None else None

    @property
    def trees(self) -> TreeEnsemble | None:
        """The validated parse of the model."""
        return self.model.trees if self.model is not None else None

    @property
    def compiled(self) -> CompiledTrees | None:
        """``trees`` compiled to native code, which scores when set (else ``booster``)."""
        return self.model.compiled if self.model is not None else None

    @property
    def evaluator(self) -> str:
        """What scores: ``compiled``, or ``lightgbm`` and why not compiled."""
        return self.model.evaluator if self.model is not None else "none"

    def _lgb_params(self) -> dict[str, Any]:
        p = self.params
        common = {
            "learning_rate": p.learning_rate,
            "num_leaves": p.num_leaves,
            "min_data_in_leaf": p.min_data_in_leaf,
            "feature_fraction": p.feature_fraction,
            "bagging_fraction": p.bagging_fraction,
            "bagging_freq": 1,
            "lambda_l2": p.lambda_l2,
            "seed": p.seed,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": p.num_threads,
            "verbosity": -1,
        }
        if p.objective == "binary":
            return {**common, "objective": "binary", "metric": "binary_logloss"}
        return {**common, "objective": "regression", "metric": "l2"}

    def _target(self, y: np.ndarray, tnext: np.ndarray | None) -> np.ndarray:
        if self.params.objective == "binary":
            return np.asarray(y, dtype=np.float32)
        if tnext is None:
            raise ValueError("the log_time_to_next objective needs time_to_next_*_ms arrays")
        cap = float(self.params.max_time_to_next_ms)
        t = np.where(
            np.asarray(tnext) < 0, cap, np.minimum(np.asarray(tnext, dtype=np.float64), cap)
        )
        return np.log1p(t).astype(np.float32)

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
    ) -> LightGBMPolicy:
        names = list(self.feature_names)
        train = lgb.Dataset(
            x_train,
            self._target(y_train, time_to_next_train_ms),
            feature_name=names,
            free_raw_data=True,
        )
        valid = lgb.Dataset(
            x_valid,
            self._target(y_valid, time_to_next_valid_ms),
            reference=train,
            feature_name=names,
        )
        callbacks: list[Callable[..., Any]] = [
            lgb.early_stopping(self.params.early_stopping_rounds, verbose=False)
        ]
        if progress:
            callbacks.append(lgb.log_evaluation(period=25))
        evals: dict[str, Any] = {}
        callbacks.append(lgb.record_evaluation(evals))
        booster = lgb.train(
            self._lgb_params(),
            train,
            num_boost_round=self.params.num_boost_round,
            valid_sets=[valid],
            valid_names=["valid"],
            callbacks=callbacks,
        )
        booster.best_iteration = booster.best_iteration or booster.current_iteration()
        # Keep only the trees early stopping chose, so the saved model is what was validated.
        self.model = tree_model(booster.model_to_string(num_iteration=booster.best_iteration))
        if self.params.objective == "log_time_to_next":
            pred = np.asarray(self.model.booster.predict(x_valid), dtype=np.float64)
            resid = pred - self._target(y_valid, time_to_next_valid_ms)
            self.sigma_log = float(max(np.sqrt(np.mean(resid**2)), 1e-3))
        self.fitted = True
        self.training_info = {
            "best_iteration": int(booster.best_iteration),
            "valid_curve": next(iter(evals.get("valid", {}).values()), []),
            "feature_importance_gain": dict(
                zip(names, self.model.booster.feature_importance("gain").tolist(), strict=True)
            ),
        }
        return self

    def refit(
        self, x: np.ndarray, y: np.ndarray, *, time_to_next_ms: np.ndarray | None = None
    ) -> bool:
        """Fit again on ``x`` (the training and validation rows together, once every
        choice that needed the validation rows is made), with as many trees as early
        stopping kept: the validated settings, and the most recent rows too, which sit
        nearest the requests the model will score. ``training_info["refit"]`` records
        it; the rest of ``training_info`` (curve, importances) stays the validated fit's.
        See ``training.train.refit_on_training_span`` for what it measured."""
        if not self.fitted or self.model is None:
            raise NotFittedError(f"{self.name} policy has no model to refit")
        rounds = max(1, int(self.training_info.get("best_iteration") or 1))
        data = lgb.Dataset(
            x,
            self._target(y, time_to_next_ms),
            feature_name=list(self.feature_names),
            free_raw_data=True,
        )
        booster = lgb.train(self._lgb_params(), data, num_boost_round=rounds)
        self.model = tree_model(booster.model_to_string())
        self.training_info["refit"] = {"rows": int(x.shape[0]), "trees": rounds}
        return True

    def _predict(self, features: np.ndarray) -> np.ndarray:
        assert self.model is not None
        raw = self.model.predict(features)
        if self.params.objective == "binary":
            return raw
        # P(log T <= log1p(H)) with log T ~ N(raw, sigma^2).
        z = (math.log1p(self.params.horizon_ms) - raw) / (self.sigma_log * math.sqrt(2.0))
        return 0.5 * (1.0 + _erf(np.asarray(z)))

    def online_status(self) -> dict[str, Any]:
        return {**super().online_status(), "evaluator": self.evaluator}

    def _adopt_model(self, other: Any) -> None:
        self.model = other.model
        self.sigma_log = other.sigma_log

    def _write_model_files(self, directory: Path) -> list[str]:
        assert self.booster is not None
        self.booster.save_model(str(directory / MODEL_FILE))
        (directory / "sigma_log.txt").write_text(repr(self.sigma_log))
        return [MODEL_FILE, "sigma_log.txt"]

    def _read_model_files(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.model = read_tree_model(directory / MODEL_FILE, len(self.feature_names))
        sigma_path = directory / "sigma_log.txt"
        try:
            self.sigma_log = float(sigma_path.read_text())
        except (OSError, ValueError) as exc:
            raise PolicyLoadError(sigma_path, f"expected one float ({exc})") from exc
        if not (math.isfinite(self.sigma_log) and self.sigma_log > 0):
            raise PolicyLoadError(sigma_path, f"sigma must be finite and > 0, got {self.sigma_log}")


@dataclass(frozen=True)
class TreeModel:
    """A LightGBM text model as kvwarm scores it: LightGBM's own ``booster``, the
    validated parse ``trees`` and, where a C compiler is at hand, those trees compiled to
    native code (``compiled``; ``evaluator`` says which scores). The block model and the
    chain return model (``predictor.chain_model``) both hold one."""

    booster: lgb.Booster
    trees: TreeEnsemble
    compiled: CompiledTrees | None
    evaluator: str

    def predict(self, features: np.ndarray) -> np.ndarray:
        """The objective's output per row (float64): the compiled trees, else LightGBM's
        C API (``predict_rows``)."""
        if self.compiled is not None:
            return self.trees.transform(self.compiled.predict_raw(features))
        return predict_rows(self.booster, features)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A pickle (a replay worker's job) names the compiled library by path; the
        # worker may find it pruned from the cache by other processes' compiles.
        library = self.compiled.library if self.compiled is not None else None
        return (_unpickle_tree_model, (self.booster, self.trees, library, self.evaluator))


def _unpickle_tree_model(
    booster: lgb.Booster, trees: TreeEnsemble, library: Path | None, evaluator: str
) -> TreeModel:
    """A pickled ``TreeModel`` in this process: its compiled library loaded by path,
    or, where that file is gone (the cache keeps the ``MAX_CACHED_LIBRARIES`` most
    recently used), compiled again from ``trees`` (the same source, the same file), else
    LightGBM's predictor with the reason in ``evaluator``; never an unpickling error."""
    if library is None:
        return TreeModel(booster, trees, None, evaluator)
    try:
        return TreeModel(booster, trees, CompiledTrees(library, trees.num_features), evaluator)
    except OSError:
        log.info("compiled trees %s are gone from the cache: compiling them again", library.name)
        compiled, evaluator = _compiled(trees)
        return TreeModel(booster, trees, compiled, evaluator)


def tree_model(text: str, path: str | Path = "<model text>") -> TreeModel:
    """``text`` parsed and validated (``predictor.trees``) before LightGBM reads it, then
    compiled; ``PolicyLoadError`` naming ``path`` on any problem."""
    trees = parse_lightgbm_model(text, path)
    try:
        # Without tree_sizes: a wrong byte offset would abort LightGBM's parallel parse.
        booster = lgb.Booster(model_str=without_tree_sizes(text))
    except lgb.basic.LightGBMError as exc:
        raise PolicyLoadError(path, f"not a readable LightGBM text model ({exc})") from exc
    compiled, evaluator = _compiled(trees)
    return TreeModel(booster, trees, compiled, evaluator)


def read_tree_model(path: Path, num_features: int) -> TreeModel:
    """``tree_model`` of the file at ``path`` (size-bounded, UTF-8), refused unless the
    model takes ``num_features`` features."""
    model = tree_model(read_model_text(path), path)
    if model.booster.num_feature() != num_features:
        raise PolicyLoadError(
            path, f"model has {model.booster.num_feature()} features, expected {num_features}"
        )
    return model


def _compiled(trees: TreeEnsemble) -> tuple[CompiledTrees | None, str]:
    from predictor import compiled_trees

    compiled = compile_ensemble(trees)
    if compiled is not None:
        return compiled, "compiled"
    return None, f"lightgbm ({compiled_trees.last_failure})"


def predict_rows(booster: lgb.Booster, features: np.ndarray) -> np.ndarray:
    """``booster.predict(features)`` (float64, the objective's transform applied) in one
    call of LightGBM's C API on float32 rows, one thread, skipping the Python wrapper's
    per-call checks and conversions. Falls back to ``Booster.predict`` if this
    LightGBM build does not expose its library handle."""
    x = np.ascontiguousarray(features, dtype=np.float32)
    n = x.shape[0]
    lib = getattr(lgb.basic, "_LIB", None)
    handle = getattr(booster, "_handle", None)
    if n == 0 or lib is None or handle is None:
        return np.asarray(booster.predict(x, num_threads=1), dtype=np.float64)
    out = np.empty(n, dtype=np.float64)
    out_len = ctypes.c_int64(0)
    rc = lib.LGBM_BoosterPredictForMat(
        handle,
        x.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int(0),  # C_API_DTYPE_FLOAT32
        ctypes.c_int32(n),
        ctypes.c_int32(x.shape[1]),
        ctypes.c_int(1),  # row major
        ctypes.c_int(0),  # C_API_PREDICT_NORMAL: the objective's transform applied
        ctypes.c_int(0),  # start iteration
        ctypes.c_int(-1),  # every iteration
        _PREDICT_PARAMS,
        ctypes.byref(out_len),
        out.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
    )
    if rc != 0 or out_len.value != n:
        raise lgb.basic.LightGBMError(lib.LGBM_GetLastError().decode("utf-8", "replace"))
    return out


_PREDICT_PARAMS = ctypes.c_char_p(b"num_threads=1")


def _erf(z: np.ndarray) -> np.ndarray:
    from scipy.special import erf

    return np.asarray(erf(z))
