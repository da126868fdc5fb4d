"""LSTM policy (torch, CPU): a sequence model over each block's recent access gaps.

Input per block = one ``FeatureState`` row, read two ways:

- the sequence: the last K inter-access gaps (``gap_1_ms`` .. ``gap_K_ms``), oldest
  first, each step ``(log1p(gap_s), missing)``, through a one-layer LSTM;
- the context: every other feature (recency, decayed counts, depth, prefix-root and
  session signals, request rate), both as ``sign(x) log1p(|x|)`` and raw, standardised
  with the training rows' mean and std (clipped at 8 sigma), through a small MLP.

The two are concatenated into a logit of P(reused within H). Training: Adam on
binary cross-entropy, shuffled minibatches from a seeded generator, early stopping on
the validation loss, a fixed thread count and deterministic algorithms, so the same
seed gives the same weights. Saved with ``torch.save(state_dict)``, loaded with
``torch.load(weights_only=True)``: tensors only, no pickle of code.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field
from torch import nn

from predictor.base import PolicyLoadError, PolicyParams
from predictor.learned import LearnedParams, LearnedPolicy
from predictor.model_check import check_lstm_weights

WEIGHTS_FILE = "weights.pt"


_MAX_BATCH_ROWS = 65_536
"""Rows per forward pass (bounds the memory of one scoring call)."""


class LSTMParams(LearnedParams):
    hidden_size: int = Field(32, ge=1, le=1024, description="LSTM hidden units.")
    context_size: int = Field(64, ge=1, le=4096, description="Hidden units of the context MLP.")
    max_epochs: int = Field(8, ge=1, le=1000, description="Upper bound on passes over the rows.")
    patience_epochs: int = Field(
        2, ge=1, description="Early stop after this many epochs without a better validation loss."
    )
    batch_size: int = Field(1024, ge=1, description="Rows per optimiser step.")
    learning_rate: float = Field(3e-3, gt=0, le=1, description="Adam step size.")
    max_train_rows: int = Field(
        400_000,
        ge=1,
        description="Train on a seeded sample of at most this many rows (bounds time).",
    )
    num_threads: int = Field(
        1,
        ge=1,
        le=256,
        description="torch threads (1: small batches are dominated by thread sync).",
    )


class _Net(nn.Module):
    context_mean: torch.Tensor
    context_std: torch.Tensor

    def __init__(self, num_gaps: int, num_context: int, hidden: int, context_hidden: int) -> None:
        super().__init__()
        self.num_gaps = num_gaps
        self.register_buffer("context_mean", torch.zeros(2 * num_context))
        self.register_buffer("context_std", torch.ones(2 * num_context))
        self.lstm = nn.LSTM(input_size=2, hidden_size=hidden, batch_first=True)
        self.context = nn.Sequential(nn.Linear(2 * num_context, context_hidden), nn.ReLU())
        self.head = nn.Sequential(
            nn.Linear(hidden + context_hidden, context_hidden),
            nn.ReLU(),
            nn.Linear(context_hidden, 1),
        )

    def forward(self, seq: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(seq)
        ctx = self.context(((context - self.context_mean) / self.context_std).clamp(-8.0, 8.0))
        return self.head(torch.cat([h[-1], ctx], dim=1)).squeeze(1)


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LSTMPolicy(LearnedPolicy):
    """LSTM over per-block gap histories plus an MLP over the other features."""

    name = "lstm"
    Params: ClassVar[type[PolicyParams]] = LSTMParams
    params: LSTMParams

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        names = list(self.feature_names)
        self._gap_cols = np.array(
            [i for i, n in enumerate(names) if n.startswith("gap_")], dtype=np.intp
        )
        self._ctx_cols = np.array(
            [i for i, n in enumerate(names) if not n.startswith("gap_")], dtype=np.intp
        )
        self.net = self._new_net()

    def _new_net(self) -> _Net:
        # Seeded initial weights without touching the process-wide torch RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.params.seed)
            return _Net(
                len(self._gap_cols),
                len(self._ctx_cols),
                self.params.hidden_size,
                self.params.context_size,
            )

    def _inputs(self, features: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        gaps = features[:, self._gap_cols][:, ::-1]  # oldest first
        missing = gaps < 0
        steps = np.stack(
            [np.where(missing, 0.0, np.log1p(np.maximum(gaps, 0) / 1000.0)), missing], axis=2
        )
        raw = features[:, self._ctx_cols].astype(np.float64)
        # Both scales: the log view separates orders of magnitude, the raw view keeps a
        # narrow band (a session's return gap) wide enough for ReLUs to cut out.
        ctx = np.concatenate([np.sign(raw) * np.log1p(np.abs(raw)), raw], axis=1)
        return torch.from_numpy(steps.astype(np.float32)), torch.from_numpy(ctx.astype(np.float32))

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
    ) -> LSTMPolicy:
        p = self.params
        rng = np.random.default_rng(p.seed)
        if x_train.shape[0] > p.max_train_rows:
            keep = np.sort(rng.choice(x_train.shape[0], p.max_train_rows, replace=False))
            x_train, y_train = x_train[keep], y_train[keep]
        with _torch_threads(p.num_threads), _deterministic():
            self.net = self._new_net()
            seq, ctx = self._inputs(np.asarray(x_train, dtype=np.float32))
            vseq, vctx = self._inputs(np.asarray(x_valid, dtype=np.float32))
            y = torch.from_numpy(np.asarray(y_train, dtype=np.float32))
            vy = torch.from_numpy(np.asarray(y_valid, dtype=np.float32))
            self.net.context_mean.copy_(ctx.mean(0))
            self.net.context_std.copy_(ctx.std(0).clamp_min(1e-3))
            # Start the output at the base rate so early epochs do not fight a bad bias.
            rate = float(y.mean().clamp(1e-4, 1 - 1e-4))
            with torch.no_grad():
                out_layer = self.net.head[-1]
                assert isinstance(out_layer, nn.Linear)
                out_layer.bias.fill_(math.log(rate / (1 - rate)))
            opt = torch.optim.Adam(self.net.parameters(), lr=p.learning_rate)
            loss_fn = nn.BCEWithLogitsLoss()
            gen = torch.Generator().manual_seed(p.seed)
            best = (math.inf, copy.deepcopy(self.net.state_dict()), 0)
            curve: list[float] = []
            bad = 0
            for epoch in range(p.max_epochs):
                self.net.train()
                order = torch.randperm(seq.shape[0], generator=gen)
                for start in range(0, seq.shape[0], p.batch_size):
                    idx = order[start : start + p.batch_size]
                    opt.zero_grad()
                    loss = loss_fn(self.net(seq[idx], ctx[idx]), y[idx])
                    loss.backward()
                    opt.step()
                vloss = self._loss(vseq, vctx, vy)
                curve.append(vloss)
                if progress:
                    print(
                        f"  lstm epoch {epoch + 1}/{p.max_epochs}: valid log loss {vloss:.5f}",
                        flush=True,
                    )
                if vloss < best[0] - 1e-6:
                    best, bad = (vloss, copy.deepcopy(self.net.state_dict()), epoch + 1), 0
                else:
                    bad += 1
                    if bad >= p.patience_epochs:
                        break
            self.net.load_state_dict(best[1])
            self.net.eval()
        self.fitted = True
        self.training_info = {
            "best_epoch": best[2],
            "valid_curve": curve,
            "train_rows": int(seq.shape[0]),
        }
        return self

    def _loss(self, seq: torch.Tensor, ctx: torch.Tensor, y: torch.Tensor) -> float:
        self.net.eval()
        total = 0.0
        with torch.no_grad():
            for start in range(0, seq.shape[0], 65536):
                sl = slice(start, start + 65536)
                total += float(
                    nn.functional.binary_cross_entropy_with_logits(
                        self.net(seq[sl], ctx[sl]), y[sl], reduction="sum"
                    )
                )
        return total / max(seq.shape[0], 1)

    def _predict(self, features: np.ndarray) -> np.ndarray:
        """One batch per call, in inference mode, at a few fixed shapes: the rows are
        padded up to the next power of two (at least 16, at most 65,536 per chunk), so
        the network sees a handful of batch sizes whatever the request sizes. Rows are
        independent (eval mode), so padding changes no score."""
        n = features.shape[0]
        out = np.empty(n, dtype=np.float32)
        if n == 0:
            return out
        self.net.eval()
        with _torch_threads(self.params.num_threads), torch.inference_mode():
            for start in range(0, n, _MAX_BATCH_ROWS):
                chunk = features[start : start + _MAX_BATCH_ROWS]
                rows = chunk.shape[0]
                padded_rows = min(_MAX_BATCH_ROWS, max(16, 1 << (rows - 1).bit_length()))
                if padded_rows != rows:
                    pad = np.zeros((padded_rows - rows, chunk.shape[1]), dtype=chunk.dtype)
                    chunk = np.concatenate([chunk, pad])
                seq, ctx = self._inputs(chunk)
                out[start : start + rows] = torch.sigmoid(self.net(seq, ctx)).numpy()[:rows]
        return out

    def _adopt_model(self, other: Any) -> None:
        self.net.load_state_dict(other.net.state_dict())
        self.net.eval()

    def _write_model_files(self, directory: Path) -> list[str]:
        torch.save(self.net.state_dict(), directory / WEIGHTS_FILE)
        return [WEIGHTS_FILE]

    def _read_model_files(self, directory: Path, manifest: dict[str, Any]) -> None:
        path = directory / WEIGHTS_FILE
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a truncated or foreign file
            raise PolicyLoadError(
                path, f"not a readable torch state_dict ({type(exc).__name__}: {exc})"
            ) from exc
        if not isinstance(state, dict):
            raise PolicyLoadError(path, f"expected a state_dict, got {type(state).__name__}")
        try:
            self.net.load_state_dict(state)
        except RuntimeError as exc:
            raise PolicyLoadError(path, f"weights do not fit these LSTM params ({exc})") from exc
        check_lstm_weights(self.net.state_dict(), path)
        self.net.eval()


@contextmanager
def _deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
