"""MLflow tracking and the model registry: the only module of kvwarm that imports mlflow.

Primitives:

- ``tracking_uri()``: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///mlflow.db`` in
  the working directory with artifacts in ``./mlartifacts`` (both git-ignored): the
  store a plain ``mlflow ui`` opens there. ``ui_command()`` is the command to browse it.
- ``model_version_for_uri(uri)``: the registry version an alias names now (one lookup,
  no download), for the sidecar's poll.
- ``tracked_run(experiment, run_name)``: a context manager giving a ``TrackedRun`` with
  ``log_params``, ``log_metrics``, ``log_figure`` (PNG), ``log_dict`` and
  ``log_policy`` (the saved policy as an MLflow pyfunc model with a signature,
  optionally registered under a name with an alias such as ``champion``).
- ``load_policy_uri(uri)``: a policy from a local directory, ``models:/NAME@ALIAS``,
  ``models:/NAME/VERSION`` or ``runs:/RUN_ID/model``. It downloads the model's files and
  reads them with ``predictor.load_policy`` (LightGBM text, torch ``weights_only``):
  nothing is unpickled.

The logged pyfunc model is a "model from code" (a three-line script that builds
``PolicyPyfuncModel``), so MLflow's own ``mlflow.pyfunc.load_model`` does not unpickle
either. Its input is the feature matrix (named columns, float32) and its output the
policy's probability of reuse within the horizon.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.models import infer_signature
from mlflow.pyfunc import PythonModel

from predictor import Policy, PolicyLoadError, load_policy

DEFAULT_STORE_DB = Path("mlflow.db")
"""The default local store, relative to the working directory (the project folder when
run from the repo root); ``mlflow ui`` opens ``sqlite:///mlflow.db`` by default."""

DEFAULT_ARTIFACTS_DIR = Path("mlartifacts")
"""Artifacts of the default store (``mlflow server``'s own default folder name)."""

MODEL_ARTIFACT_PATH = "model"
POLICY_ARTIFACT_KEY = "policy"

_MODEL_CODE = """\
# Written by kvwarm (training.tracking): builds the pyfunc wrapper of a saved policy.
import mlflow.models

from training.tracking import PolicyPyfuncModel

mlflow.models.set_model(PolicyPyfuncModel())
"""


class TrackingError(RuntimeError):
    """A tracking or registry operation failed; the message says what to check."""


def tracking_uri() -> str:
    """The tracking URI in force: ``MLFLOW_TRACKING_URI`` or the local default."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{DEFAULT_STORE_DB.resolve()}"


def masked_uri(uri: str) -> str:
    """``uri`` with any ``user:password@`` replaced by ``***@`` (safe to print)."""
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", uri)


def ui_command(uri: str) -> str:
    """The command that browses ``uri``'s runs (relative to the working directory when
    the store is under it, so it can be copied as printed)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        with suppress(ValueError):
            db = db.resolve().relative_to(Path.cwd().resolve())
        return f"mlflow ui --backend-store-uri sqlite:///{db}"
    return f"open {masked_uri(uri)} in a browser"


def _artifact_root_for(uri: str) -> str | None:
    """Artifacts of a local SQLite store go next to its database file, not into
    whatever directory the process happens to run in."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        return (db.parent / DEFAULT_ARTIFACTS_DIR).resolve().as_uri()
    return None


def _require_local_store(uri: str) -> None:
    """A lookup never creates a store: a local SQLite file that does not exist means
    nothing was ever logged there."""
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        raise TrackingError(
            f"no MLflow store at {uri}; train and register a model first "
            "(kvwarm train ... --register NAME --alias champion) or set MLFLOW_TRACKING_URI"
        )


def configure(uri: str | None = None) -> str:
    """Point MLflow at ``uri`` (default: ``tracking_uri()``), creating a local store's
    folder. Returns the URI."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def _experiment_id(name: str, uri: str) -> str:
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    return str(client.create_experiment(name, artifact_location=_artifact_root_for(uri)))


class PolicyPyfuncModel(PythonModel):
    """MLflow pyfunc face of a saved learned policy: features in, probability out."""

    def load_context(self, context: Any) -> None:
        self.policy = load_policy(context.artifacts[POLICY_ARTIFACT_KEY])

    def predict(self, context: Any, model_input: pd.DataFrame, params: Any = None) -> np.ndarray:
        features = np.asarray(model_input, dtype=np.float32)
        return np.asarray(self.policy.predict_features(features), dtype=np.float32)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class LoggedPolicy:
    model_uri: str
    registered_name: str | None = None
    version: str | None = None
    alias: str | None = None

    @property
    def registry_uri(self) -> str | None:
        """``models:/NAME@ALIAS`` (or ``/VERSION``) when registered."""
        if self.registered_name is None:
            return None
        if self.alias:
            return f"models:/{self.registered_name}@{self.alias}"
        return f"models:/{self.registered_name}/{self.version}"


class TrackedRun:
    """The active MLflow run of a training job."""

    def __init__(self, run: Any, uri: str) -> None:
        self.run_id: str = run.info.run_id
        self.experiment_id: str = run.info.experiment_id
        self.tracking_uri = uri

    def log_params(self, params: Mapping[str, Any]) -> None:
        mlflow.log_params({k: _param_value(v) for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and np.isfinite(v)}
        mlflow.log_metrics(clean, step=step)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as a PNG artifact (``artifact_file`` ends in ``.png``)."""
        mlflow.log_figure(figure, artifact_file)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        mlflow.log_dict(dict(data), artifact_file)

    def log_policy(
        self,
        policy: Policy,
        example_features: np.ndarray,
        feature_names: list[str],
        *,
        registered_name: str | None = None,
        alias: str | None = None,
    ) -> LoggedPolicy:
        """Log ``policy`` as a pyfunc model with a feature signature; register it under
        ``registered_name`` and point ``alias`` at the new version when given."""
        if alias and not registered_name:
            raise TrackingError("an alias needs a registered model name (--register NAME)")
        example = pd.DataFrame(
            np.asarray(example_features, dtype=np.float32), columns=feature_names
        )
        predicted = policy.predict_features(example.to_numpy())  # type: ignore[attr-defined]
        signature = infer_signature(example, np.asarray(predicted, dtype=np.float32))
        with tempfile.TemporaryDirectory() as tmp:
            policy_dir = policy.save(Path(tmp) / POLICY_ARTIFACT_KEY)
            code = Path(tmp) / "kvwarm_policy_model.py"
            code.write_text(_MODEL_CODE)
            info = mlflow.pyfunc.log_model(
                name=MODEL_ARTIFACT_PATH,
                python_model=str(code),
                artifacts={POLICY_ARTIFACT_KEY: str(policy_dir)},
                signature=signature,
                input_example=example.iloc[:5],
                # Listed, not inferred: inference imports the model in a subprocess
                # (tens of seconds) and cannot see kvwarm's own lazy imports.
                pip_requirements=_pip_requirements(policy),
                registered_model_name=registered_name,
            )
        version = str(info.registered_model_version) if registered_name else None
        if alias and registered_name:
            set_alias(registered_name, alias, version or "")
        return LoggedPolicy(info.model_uri, registered_name, version, alias)


_MODEL_DEPENDENCIES = {"lightgbm": ("lightgbm", "scipy"), "lstm": ("torch",)}


def _pip_requirements(policy: Policy) -> list[str]:
    """Pinned distributions a loaded kvwarm policy model imports (plus kvwarm itself,
    which must be installed from this repository)."""
    from importlib.metadata import PackageNotFoundError, version

    names = (
        "mlflow",
        "numpy",
        "pandas",
        "pydantic",
        "msgspec",
        *_MODEL_DEPENDENCIES.get(policy.name, ()),
    )
    out = []
    for name in names:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def _param_value(value: Any) -> str:
    text = (
        value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    )
    return text[:6000]  # MLflow's limit on a param value


@contextmanager
def tracked_run(
    experiment: str, run_name: str | None = None, uri: str | None = None
) -> Iterator[TrackedRun]:
    """Start a run in ``experiment`` (created if needed) on the configured store."""
    uri = configure(uri)
    experiment_id = _experiment_id(experiment, uri)
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name) as run:
        yield TrackedRun(run, uri)


def set_alias(name: str, alias: str, version: str) -> None:
    mlflow.MlflowClient().set_registered_model_alias(name, alias, version)


def resolve_policy_dir(
    uri: str, dst: str | Path | None = None, store_uri: str | None = None
) -> Path:
    """A local directory holding ``policy.json`` for a path or an MLflow model URI
    (resolved against ``store_uri``, default ``tracking_uri()``)."""
    if "://" not in uri and not uri.startswith(("models:", "runs:")):
        return Path(uri)
    try:
        _require_local_store(store_uri or tracking_uri())
    except TrackingError as exc:
        raise PolicyLoadError(uri, str(exc)) from None
    configure(store_uri)
    # No progress bar in a service's log on every download.
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    if dst is None:
        dst = tempfile.mkdtemp(prefix="kvwarm-model-")
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except Exception as exc:  # MLflow raises several types for a missing model or alias
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PolicyLoadError(
            uri,
            f"MLflow could not fetch it from {masked_uri(store_uri or tracking_uri())} ({first})",
        ) from None
    for candidate in (
        local / "artifacts" / POLICY_ARTIFACT_KEY,
        local / POLICY_ARTIFACT_KEY,
        local,
    ):
        if (candidate / "policy.json").is_file():
            return candidate
    raise PolicyLoadError(
        uri, "the MLflow model holds no kvwarm policy (artifacts/policy/policy.json)"
    )


def load_policy_uri(uri: str, *, store_uri: str | None = None, **kwargs: Any) -> Policy:
    """Load a policy from a directory or an MLflow model URI (``models:/NAME@ALIAS``).
    A model fetched from MLflow is read into memory from a scratch directory that is
    removed afterwards (nothing is left behind in the temporary directory)."""
    if "://" not in uri and not uri.startswith(("models:", "runs:")):
        return load_policy(Path(uri), **kwargs)
    with tempfile.TemporaryDirectory(prefix="kvwarm-model-") as scratch:
        return load_policy(resolve_policy_dir(uri, dst=scratch, store_uri=store_uri), **kwargs)


def model_version_for_uri(uri: str, *, store_uri: str | None = None) -> str:
    """The registry version ``models:/NAME@ALIAS`` (or ``models:/NAME/VERSION``) names
    now, from one registry lookup (``MlflowClient.get_model_version_by_alias``), nothing
    downloaded; ``""`` for other URIs (``runs:/``). Called by the sidecar on every poll."""
    if not uri.startswith("models:/"):
        return ""
    rest = uri[len("models:/") :]
    try:
        _require_local_store(store_uri or tracking_uri())
    except TrackingError as exc:
        raise PolicyLoadError(uri, str(exc)) from None
    configure(store_uri)
    try:
        if "@" in rest:
            name, _, alias = rest.partition("@")
            return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
        name, _, version = rest.partition("/")
        return str(mlflow.MlflowClient().get_model_version(name, version).version)
    except Exception as exc:  # MLflow raises several types for a missing model or alias
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PolicyLoadError(
            uri,
            f"not in the MLflow registry at {masked_uri(store_uri or tracking_uri())} ({first})",
        ) from None
