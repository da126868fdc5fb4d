"""Profiles: every parameter of the timing model, with its unit and its source.

A profile is a TOML file; each parameter is a table ``{ value, unit, source }`` and
the loader refuses a missing parameter, a unit other than the expected one, or an
empty source, so a number can never lose its provenance. Layout::

    [profile]                 name, description
    [model]                   num_layers, num_kv_heads, head_dim, kv_dtype_bytes,
                              tensor_parallel, block_size_tokens, prefill_tokens_per_s
    [tiers.<hbm|dram|nvme|remote>]
                              capacity_bytes, read_serial_bytes_per_s,
                              read_parallel_bytes_per_s, write_serial_bytes_per_s,
                              write_parallel_bytes_per_s, parallelism, latency_ms,
                              prefetch_share, prefetch_burst_ms

Bandwidths and capacities are for the whole node (all tensor-parallel ranks
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
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    tensor_parallel: int
    block_size_tokens: int
    prefill_tokens_per_s: float

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head, over all TP ranks."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.kv_dtype_bytes

    def block_bytes(self, block_size_tokens: int | None = None) -> int:
        """Bytes of one KV block of ``block_size_tokens`` (default: the profile's)."""
        tokens = self.block_size_tokens if block_size_tokens is None else block_size_tokens
        return self.kv_bytes_per_token * tokens

    def prefill_ms(self, num_tokens: float) -> float:
        """Time to compute the KV of ``num_tokens`` prompt tokens on the node."""
        return num_tokens * 1000.0 / self.prefill_tokens_per_s


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

    def with_tier(self, name: str, **changes: Any) -> Profile:
        """A copy with some fields of one tier changed (e.g. ``capacity_bytes``)."""
        tiers = tuple(
            dataclasses.replace(t, **changes) if t.name == name else t for t in self.tiers
        )
        self.tier(name)
        return dataclasses.replace(self, tiers=tiers)

    def with_model(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **changes))


_MODEL_UNITS = {
    "num_layers": "count",
    "num_kv_heads": "count",
    "head_dim": "count",
    "kv_dtype_bytes": "bytes",
    "tensor_parallel": "count",
    "block_size_tokens": "tokens",
    "prefill_tokens_per_s": "tokens/s",
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
        if model.prefill_tokens_per_s <= 0 or model.block_size_tokens <= 0:
            raise ProfileError("model: prefill_tokens_per_s and block_size_tokens must be > 0")
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
