"""Profiles: every parameter of the timing model, with its unit and its source.

A profile is a TOML file; each parameter is a table ``{ value, unit, source }`` and
the loader refuses a missing parameter, a unit other than the expected one, or an
empty source, so a number can never lose its provenance. Layout::

    [profile]                 name, description
    [model]                   num_layers, num_kv_heads, head_dim, kv_dtype_bytes,
                              tensor_parallel, block_size_tokens, num_attention_heads,
                              active_params, peak_flops_per_s, mfu,
                              prefill_chunk_tokens, step_overhead_ms
    [tiers.<hbm|dram|nvme|remote>]
                              capacity_bytes, read_serial_bytes_per_s,
                              read_parallel_bytes_per_s, write_serial_bytes_per_s,
                              write_parallel_bytes_per_s, parallelism, latency_ms,
                              prefetch_share, prefetch_burst_ms

A parameter whose source starts with ``assumption`` is a free parameter: a number we
chose, which a calibration may change (``Profile.assumptions``). Bandwidths and
capacities are for the whole node (all tensor-parallel ranks
together): a KV block is split across the TP ranks and its shards move in parallel.
``load_profile()`` with no argument loads the bundled default profile.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from executor.names import TIER_NAMES, TIER_RANK
from executor.sim.timing import Channel, TierChannels

DEFAULT_PROFILE = "default"


class ProfileError(ValueError):
    """A profile file is malformed; the message names the file, key and problem."""


@dataclass(frozen=True)
class ModelSpec:
    """The served model and the engine's compute (whole node, all TP ranks).

    Cost model (``prefill_flops``, ``step_ms``): the token at position ``p`` of a
    prompt costs ``2 * active_params`` FLOPs in the linear layers plus
    ``4 * num_layers * num_attention_heads * head_dim * p`` in attention (QK^T and AV
    over the ``p`` tokens before it), so a prompt of ``n`` tokens costs
    ``n * 2P + 4 L H d * n (n - 1) / 2``: superlinear in ``n``, and additive over
    chunks. Compute runs at ``peak_flops_per_s * mfu``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    tensor_parallel: int
    block_size_tokens: int
    num_attention_heads: int
    active_params: float
    peak_flops_per_s: float
    mfu: float
    prefill_chunk_tokens: int
    step_overhead_ms: float

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head, over all TP ranks."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.kv_dtype_bytes

    def block_bytes(self, block_size_tokens: int | None = None) -> int:
        """Bytes of one KV block of ``block_size_tokens`` (default: the profile's)."""
        tokens = self.block_size_tokens if block_size_tokens is None else block_size_tokens
        return self.kv_bytes_per_token * tokens

    @property
    def linear_flops_per_token(self) -> float:
        return 2.0 * self.active_params

    @property
    def attention_flops_per_position(self) -> float:
        """Attention FLOPs a token spends per earlier token it attends to."""
        return 4.0 * self.num_layers * self.num_attention_heads * self.head_dim

    @property
    def flops_per_s(self) -> float:
        """Sustained compute: peak x MFU."""
        return self.peak_flops_per_s * self.mfu

    def prefill_flops(self, start_position: float, end_position: float) -> float:
        """FLOPs to compute the KV of prompt positions ``[start, end)`` (the tokens
        before ``start`` already cached)."""
        n = end_position - start_position
        if n <= 0:
            return 0.0
        # sum of positions start .. end-1
        positions = n * (start_position + end_position - 1) / 2.0
        return n * self.linear_flops_per_token + self.attention_flops_per_position * positions

    def prefill_ms(self, num_tokens: float, start_position: float = 0.0) -> float:
        """Compute time of ``num_tokens`` prompt tokens after ``start_position``
        cached ones (no step overhead: that is the engine's, per step)."""
        flops = self.prefill_flops(start_position, start_position + num_tokens)
        return flops / self.flops_per_s * 1000.0

    def decode_flops(self, context_tokens: float) -> float:
        """FLOPs of one output token generated after ``context_tokens`` tokens."""
        return self.linear_flops_per_token + self.attention_flops_per_position * context_tokens


@dataclass(frozen=True)
class TierTiming:
    name: str
    capacity_bytes: int
    read_serial_bytes_per_s: float
    read_parallel_bytes_per_s: float
    write_serial_bytes_per_s: float
    write_parallel_bytes_per_s: float
    parallelism: int
    latency_ms: float
    prefetch_share: float
    prefetch_burst_ms: float

    def channels(self) -> TierChannels:
        """Fresh (idle) read and write channels for this tier."""

        def channel(serial: float, parallel: float) -> Channel:
            return Channel(
                serial_bytes_per_s=serial,
                parallel_bytes_per_s=parallel,
                parallelism=self.parallelism,
                latency_ms=self.latency_ms,
                prefetch_share=self.prefetch_share,
                prefetch_burst_ms=self.prefetch_burst_ms,
            )

        return TierChannels(
            self.name,
            channel(self.read_serial_bytes_per_s, self.read_parallel_bytes_per_s),
            channel(self.write_serial_bytes_per_s, self.write_parallel_bytes_per_s),
        )


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    model: ModelSpec
    tiers: tuple[TierTiming, ...]
    """Fastest first."""
    sources: dict[str, str]
    """``"model.num_layers"`` -> where the number comes from."""

    def tier(self, name: str) -> TierTiming:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"profile {self.name!r} has no tier {name!r}; it has {self.tier_names}")

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    def block_read_ms(self, block_size_tokens: int | None = None) -> tuple[float, ...]:
        """Time to read one block from each tier (fastest first), all its parallel
        channels busy: latency + block bytes / parallel read bandwidth."""
        size = self.model.block_bytes(block_size_tokens)
        return tuple(t.latency_ms + size / t.read_parallel_bytes_per_s * 1e3 for t in self.tiers)

    def with_tier(self, name: str, **changes: Any) -> Profile:
        """A copy with some fields of one tier changed (e.g. ``capacity_bytes``)."""
        tiers = tuple(
            dataclasses.replace(t, **changes) if t.name == name else t for t in self.tiers
        )
        self.tier(name)
        return dataclasses.replace(self, tiers=tiers)

    def with_model(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **changes))

    def assumptions(self) -> list[str]:
        """Keys (``"model.mfu"``) of the free parameters: numbers whose source says
        they are an assumption, the only ones a calibration may change."""
        return sorted(k for k, v in self.sources.items() if v.lower().startswith("assumption"))


_MODEL_UNITS = {
    "num_layers": "count",
    "num_kv_heads": "count",
    "head_dim": "count",
    "kv_dtype_bytes": "bytes",
    "tensor_parallel": "count",
    "block_size_tokens": "tokens",
    "num_attention_heads": "count",
    "active_params": "count",
    "peak_flops_per_s": "FLOP/s",
    "mfu": "fraction",
    "prefill_chunk_tokens": "tokens",
    "step_overhead_ms": "ms",
}
_TIER_UNITS = {
    "capacity_bytes": "bytes",
    "read_serial_bytes_per_s": "bytes/s",
    "read_parallel_bytes_per_s": "bytes/s",
    "write_serial_bytes_per_s": "bytes/s",
    "write_parallel_bytes_per_s": "bytes/s",
    "parallelism": "count",
    "latency_ms": "ms",
    "prefetch_share": "fraction",
    "prefetch_burst_ms": "ms",
}
_INT_FIELDS = {
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "kv_dtype_bytes",
    "tensor_parallel",
    "block_size_tokens",
    "num_attention_heads",
    "prefill_chunk_tokens",
    "capacity_bytes",
    "parallelism",
}


def _section(
    where: str, table: Any, units: dict[str, str], sources: dict[str, str]
) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ProfileError(f"{where}: expected a table")
    unknown = sorted(set(table) - set(units))
    if unknown:
        raise ProfileError(f"{where}.{unknown[0]}: unknown parameter; known: {', '.join(units)}")
    values: dict[str, Any] = {}
    for key, unit in units.items():
        entry = table.get(key)
        path = f"{where}.{key}"
        if not isinstance(entry, dict):
            raise ProfileError(
                f"{path}: missing; write it as {{ value = ..., unit = {unit!r}, source = ... }}"
            )
        if entry.get("unit") != unit:
            raise ProfileError(f"{path}: unit must be {unit!r}, got {entry.get('unit')!r}")
        source = entry.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ProfileError(f"{path}: say where the number comes from in 'source'")
        value = entry.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ProfileError(f"{path}: value must be a number >= 0, got {value!r}")
        if key in _INT_FIELDS:
            if float(value) != int(value):
                raise ProfileError(f"{path}: value must be a whole number, got {value!r}")
            value = int(value)
        values[key] = value
        sources[path] = source.strip()
    return values


def parse_profile(data: dict[str, Any], origin: str = "<profile>") -> Profile:
    sources: dict[str, str] = {}
    try:
        head = data.get("profile", {})
        model = ModelSpec(**_section("model", data.get("model"), _MODEL_UNITS, sources))
        tier_tables = data.get("tiers")
        if not isinstance(tier_tables, dict) or not tier_tables:
            raise ProfileError("tiers: expected at least one [tiers.<name>] table")
        for name in tier_tables:
            if name not in TIER_RANK:
                raise ProfileError(f"tiers.{name}: unknown tier; use {', '.join(TIER_NAMES)}")
        tiers = tuple(
            TierTiming(
                name=name, **_section(f"tiers.{name}", tier_tables[name], _TIER_UNITS, sources)
            )
            for name in sorted(tier_tables, key=TIER_RANK.__getitem__)
        )
        for tier in tiers:
            tier.channels()  # validates rates, parallelism, share
            if tier.capacity_bytes <= 0:
                raise ProfileError(f"tiers.{tier.name}.capacity_bytes: must be > 0")
        if not 0 < model.mfu <= 1:
            raise ProfileError(f"model.mfu: must be in (0, 1], got {model.mfu}")
        if min(model.peak_flops_per_s, model.block_size_tokens, model.prefill_chunk_tokens) <= 0:
            raise ProfileError(
                "model: peak_flops_per_s, block_size_tokens and prefill_chunk_tokens must be > 0"
            )
    except ProfileError as exc:
        raise ProfileError(f"{origin}: {exc}") from None
    except ValueError as exc:
        raise ProfileError(f"{origin}: {exc}") from None
    return Profile(
        name=str(head.get("name", origin)),
        description=str(head.get("description", "")),
        model=model,
        tiers=tiers,
        sources=sources,
    )


def load_profile(path: str | Path | None = None) -> Profile:
    """Load a profile file; ``None`` or ``"default"`` loads the bundled default."""
    if path is None or str(path) == DEFAULT_PROFILE:
        text = resources.files("executor").joinpath("profiles/default.toml").read_text("utf-8")
        origin = "executor/profiles/default.toml"
    else:
        text = Path(path).read_text("utf-8")
        origin = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{origin}: not valid TOML: {exc}") from None
    return parse_profile(data, origin)
