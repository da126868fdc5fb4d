"""Online per-block feature state: the one code path for serving and training.

Serving feeds it the live event stream; ``training.dataset`` feeds it a trace through
the same ``observe`` and reads rows with the same ``features_for``. There is no second
implementation of any feature.

Primitives:

- ``FeatureParams``: frozen, validated knobs (cap on tracked blocks, number of gaps,
  half-lives ...).
- ``FeatureState(params)``:
  - ``observe(event)``: ``BlocksAccessed`` updates the blocks of one request in a
    handful of vectorised numpy operations; ``BlockStored`` / ``BlockRemoved`` /
    ``AllBlocksCleared`` update the tier set of tracked blocks (residency of untracked
    blocks is ignored: nothing to predict).
  - ``observe_many(events)``: the same result, bit for bit (property-tested), folding
    runs of requests a chunk at a time; about twice as fast. Use it for a Kafka poll
    or a trace; use ``observe`` when rows are needed between two events.
  - ``features_for(block_hashes, now_ms)``: float32 matrix (n, len(feature_names)),
    a valid row for unknown blocks (``known=0``), never an exception.
  - ``store_scores(slots, scores, now_ms)`` / ``stored_scores(slots, now_ms,
    max_age_ms)``: a policy's prediction kept per row, so eviction reads it instead
    of re-running the model; void once the row changes (an access, a residency
    change, eviction of the row) or older than ``max_age_ms`` (the refresh rule).
  - cheap accessors for the baselines (``last_access_ms``, ``access_count``,
    ``decayed_count``, ``root_last_access_ms``), ``known``/``slot_of``,
    ``tracked_hashes``, ``num_tracked``, ``bytes_per_tracked_block``.

Storage: one row per tracked block in five flat arrays (uint64 hash, int64, int32,
float32 and uint8 columns) plus a ``dict`` hash -> row. At ``max_tracked_blocks`` the
coldest ``evict_fraction`` of the rows (oldest last access, then lowest row) is
dropped in one vectorised pass, never a block of the request being observed. Features
at time t depend only on the events observed so far, in their order: that is what
makes training rows equal to serving rows and free of leakage.

Conventions: a block read twice by one request counts once. Timestamps are expected
non-decreasing (``features.decoders`` guarantees it for traces); a query ``now_ms``
earlier than the latest observed access is answered as of that access. A single
request with more new blocks than ``max_tracked_blocks`` raises
``FeatureParamsError`` (raise the cap).
"""

from __future__ import annotations

import itertools
import math
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from features import native_rows
from features.events import AllBlocksCleared, BlockRemoved, BlocksAccessed, BlockStored, Tier
from features.feature_set import (
    DEFAULT_HALF_LIVES_S,
    DEFAULT_NUM_GAPS,
    DEFAULT_RATE_HALF_LIVES_S,
    FEATURE_NAMES,
    FEATURE_VERSION,
    MISSING,
    NO_TIER_RANK,
    ROOT_POPULARITY_HALF_LIFE_S,
    feature_names,
    request_level,
)

__all__ = [
    "FEATURE_NAMES",
    "FEATURE_VERSION",
    "FeatureParams",
    "FeatureParamsError",
    "FeatureState",
]

_LN2 = math.log(2.0)
_BLOCK_RATE_HALF_LIFE_S = 60.0

# int64 columns
_LAST, _CHILD, _EXT, _FIRST = 0, 1, 2, 3
_NUM_I64 = 4
# int32 columns; _REQORD.._ROOT are set to one value per request, so they are contiguous.
_REQORD, _REQLEN, _INTOK, _OUTTOK, _HITLEN, _TURN, _TURNGAP = 0, 1, 2, 3, 4, 5, 6
_ROOT, _COUNT, _DEPTH, _PARENT, _NCHILD = 7, 8, 9, 10, 11
_NUM_I32 = 12
_INT32_MAX = 2**31 - 1
_MAX_SCORED_MS = 2**62  # stored-score times are clamped here (int64-safe)
# Features that are a stored int32 column as it is.
_DIRECT_SRC = np.array([_COUNT, _DEPTH, _REQLEN, _INTOK, _OUTTOK, _TURN, _TURNGAP, _NCHILD])
_DIRECT_NAMES = (
    "access_count",
    "depth",
    "last_request_num_blocks",
    "last_request_input_tokens",  # -1 (MISSING) when the source did not say
    "last_request_output_tokens",
    "turn_index",
    "turn_gap_ms",  # -1 (MISSING) on a first turn
    "num_children",
)
# uint8 columns
_FLAGS, _TIERS = 0, 1
_NUM_U8 = 2
_FLAG_EVER_TAIL = 1
_CHUNK_REQUESTS = 256  # requests folded per batch by observe_many
_GROWTH = 4  # arrays grow 4x: few copies; rows not yet written cost no physical memory
_REBASE_EXPONENT = 32.0  # stored decayed counters stay below count * 2**32: float32-safe
_ROOT_DECAYED_NAME = f"root_decayed_count_hl_{ROOT_POPULARITY_HALF_LIFE_S:g}s"

# tier bitmask (bit = Tier.rank) -> fastest tier rank, NO_TIER_RANK when empty
_TIER_RANK_OF_MASK = np.array(
    [NO_TIER_RANK] + [(m & -m).bit_length() - 1 for m in range(1, 16)], dtype=np.float32
)


class FeatureParamsError(ValueError):
    """A ``FeatureParams`` field is out of range; the message says which and why."""


@dataclass(frozen=True)
class FeatureParams:
    """Knobs of the online feature state. Changing any of them changes feature values,
    so a model records the params it was trained with alongside ``FEATURE_VERSION``."""

    max_tracked_blocks: int = 2_000_000
    """Cap on tracked blocks; at the cap the coldest are dropped (>= 16)."""
    num_gaps: int = DEFAULT_NUM_GAPS
    """K: how many of the latest inter-access gaps are kept per block (1..64)."""
    half_lives_s: tuple[float, ...] = DEFAULT_HALF_LIVES_S
    """Half-lives of the per-block decayed access counters; must include 60 s (root popularity)."""
    rate_half_lives_s: tuple[float, ...] = DEFAULT_RATE_HALF_LIVES_S
    """Half-lives of the request arrival-rate estimates."""
    evict_fraction: float = 1 / 16
    """Share of the cap dropped in one eviction pass (amortises the pass), in (0, 0.5]."""
    continuation_tail_slack: int = 2
    """A request whose longest known prefix ends within this many blocks of the tail of
    the request that last read it is counted as the next turn of that conversation
    (the previous prompt's last, partial block gets a new hash when it fills up)."""
    max_tracked_sessions: int = 200_000
    """Cap on sessions whose turn count is kept (when the source has session ids)."""
    initial_capacity: int = 1 << 16
    """Rows allocated up front; arrays grow 4x at a time up to ``max_tracked_blocks``."""

    def __post_init__(self) -> None:
        if self.max_tracked_blocks < 16:
            raise FeatureParamsError(
                f"max_tracked_blocks must be >= 16, got {self.max_tracked_blocks}"
            )
        if not 1 <= self.num_gaps <= 64:
            raise FeatureParamsError(f"num_gaps must be in 1..64, got {self.num_gaps}")
        for name in ("half_lives_s", "rate_half_lives_s"):
            values = getattr(self, name)
            if not values or any(not v > 0 for v in values):
                raise FeatureParamsError(
                    f"{name} must be a non-empty tuple of positive seconds, got {values}"
                )
        if ROOT_POPULARITY_HALF_LIFE_S not in self.half_lives_s:
            raise FeatureParamsError(
                f"half_lives_s must include {ROOT_POPULARITY_HALF_LIFE_S:g} (root popularity), "
                f"got {self.half_lives_s}"
            )
        if not 0 < self.evict_fraction <= 0.5:
            raise FeatureParamsError(
                f"evict_fraction must be in (0, 0.5], got {self.evict_fraction}"
            )
        if self.continuation_tail_slack < 0:
            raise FeatureParamsError("continuation_tail_slack must be >= 0")
        if self.max_tracked_sessions < 1 or self.initial_capacity < 1:
            raise FeatureParamsError("max_tracked_sessions and initial_capacity must be >= 1")

    @property
    def feature_names(self) -> tuple[str, ...]:
        return feature_names(self.num_gaps, self.half_lives_s, self.rate_half_lives_s)


@dataclass
class _Columns:
    """Column positions in the output matrix for one parameter set."""

    names: tuple[str, ...]
    gap0: int = field(init=False)
    dec0: int = field(init=False)
    at: dict[str, int] = field(init=False)
    direct_dst: np.ndarray = field(init=False)
    since_last_first: np.ndarray = field(init=False)
    child_ext: np.ndarray = field(init=False)
    request_level: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        at = self.at = {n: i for i, n in enumerate(self.names)}
        self.gap0 = at["gap_1_ms"]
        self.dec0 = self.gap0 + sum(n.startswith("gap_") for n in self.names)
        self.direct_dst = np.array([at[n] for n in _DIRECT_NAMES], dtype=np.intp)
        self.since_last_first = np.array(
            [at["time_since_last_access_ms"], at["age_ms"]], dtype=np.intp
        )
        self.child_ext = np.array(
            [at["time_since_child_access_ms"], at["time_since_extended_ms"]], dtype=np.intp
        )
        self.request_level = np.array([at[n] for n in request_level(self.names)], dtype=np.intp)


class _NativeLayout:
    """Where ``features.native_rows``' kernel reads and writes (see native_rows.c): one
    int64 array of the source columns, the destination columns, the tier rank of each
    tier mask and the row width, made once per state; and the addresses of the state's
    tables, looked up again only when a table is replaced (the state grew)."""

    DST, TIER_RANKS, WIDTH, SIZE = 64, 128, 136, 137

    def __init__(self, state: FeatureState) -> None:
        c, p = state._cols, state.params
        at = c.at
        src = [_LAST, _CHILD, _EXT, _FIRST, _REQORD, _REQLEN, _HITLEN, _ROOT, _COUNT]
        src += [_DEPTH, _PARENT, _FLAGS, _TIERS, p.num_gaps, len(p.half_lives_s)]
        src += [state._root_hl, len(_DIRECT_SRC), len(c.request_level), *_DIRECT_SRC]
        dst = [at["known"], c.gap0, c.dec0, *c.since_last_first]
        dst += [at["requests_since_last_access"], at["blocks_to_tail"], at["ever_tail"]]
        dst += [at["last_request_hit_fraction"], *c.child_ext]
        dst += [at["parent_time_since_last_access_ms"], at["parent_access_count"]]
        dst += [at[_ROOT_DECAYED_NAME], at["root_time_since_extended_ms"], at["tier_rank"]]
        dst += [*c.direct_dst, *c.request_level]
        self.fits = len(src) <= self.DST and len(dst) <= self.TIER_RANKS - self.DST
        """False: more columns than the kernel's layout holds; rows stay on numpy."""
        self.width = len(state.feature_names)
        self.array = np.zeros(self.SIZE, dtype=np.int64)
        if self.fits:
            self.array[: len(src)] = src
            self.array[self.DST : self.DST + len(dst)] = dst
        self.array[self.TIER_RANKS : self.WIDTH].view(np.float32)[:] = _TIER_RANK_OF_MASK
        self.array[self.WIDTH] = self.width
        self.static_args = self.array.ctypes.data
        self.constants = np.array([MISSING, NO_TIER_RANK], dtype=np.float64)
        obs = [_LAST, _CHILD, _EXT, _FIRST, _REQORD, _COUNT, _DEPTH, _PARENT, _NCHILD]
        obs += [_FLAGS, p.num_gaps, len(p.half_lives_s), _FLAG_EVER_TAIL]
        self.observe = np.array(obs, dtype=np.int64)
        """Where ``kv_observe_rows`` reads and writes."""
        self.row_bytes = 8 * _NUM_I64 + 4 * _NUM_I32 + 4 * (p.num_gaps + len(p.half_lives_s))
        self.scratch = np.zeros(0, dtype=np.uint8)
        """Gathered rows of one request (grown on demand)."""
        self._tables: tuple[np.ndarray, ...] = ()
        self._table_args: tuple[int, ...] = ()
        self._usable = False

    def usable(self, state: FeatureState) -> bool:
        """Whether the kernel can run on ``state``'s tables as they are now: each
        C-contiguous with its dtype (checked again only when a table is replaced: the
        state grew, or a checkpoint was restored into it)."""
        tables: tuple[np.ndarray, ...] = (
            state._i64,
            state._i32,
            state._u8,
            state._f32,
            state._scored,
        )
        if len(self._tables) == 5 and all(map(operator.is_, tables, self._tables)):
            return self._usable
        self._tables = tables
        dtypes: tuple[type[np.generic], ...] = (np.int64, np.int32, np.uint8, np.float32, np.int64)
        self._usable = self.fits and all(
            t.dtype == dtype and t.ndim == (1 if i == 4 else 2) and t.flags.c_contiguous
            for i, (t, dtype) in enumerate(zip(tables, dtypes, strict=True))
        )
        self._table_args = (
            tuple(v for t in tables[:4] for v in (t.ctypes.data, t.shape[1]))
            if self._usable
            else ()
        )
        return self._usable

    def table_args(self) -> tuple[int, ...]:
        """(address, row width) of the int64, int32, uint8 and float32 tables, as
        ``usable`` last saw them."""
        return self._table_args


class FeatureState:
    """Per-block state of everything observed so far; see the module docstring."""

    def __init__(self, params: FeatureParams | None = None) -> None:
        self.params = params or FeatureParams()
        p = self.params
        self.feature_names = p.feature_names
        self._cols = _Columns(self.feature_names)
        self._native: _NativeLayout | None = None
        self.rows_kernel: native_rows.FeatureRowsKernel | bool = True
        """What updates and reads rows: True the process's native kernel when there is
        one (``features.native_rows.kernel()``), False numpy, or a given kernel (its
        self-test). Bit-identical either way; copies and pickles reset it to True."""
        self._k = p.num_gaps
        self._inv_hl_ms = np.array([1.0 / (h * 1000.0) for h in p.half_lives_s], dtype=np.float64)
        self._max_inv_hl_ms = float(self._inv_hl_ms.max())
        self._root_hl = p.half_lives_s.index(ROOT_POPULARITY_HALF_LIFE_S)
        cap = min(p.initial_capacity, p.max_tracked_blocks)
        self._hash = np.zeros(cap, dtype=np.uint64)
        self._i64 = np.zeros((cap, _NUM_I64), dtype=np.int64)
        self._i32 = np.zeros((cap, _NUM_I32), dtype=np.int32)
        # Columns [0, K): the latest K gaps, latest first (a shift register); then the
        # decayed counters, one per half-life.
        self._f32 = np.zeros((cap, p.num_gaps + len(p.half_lives_s)), dtype=np.float32)
        self._u8 = np.zeros((cap, _NUM_U8), dtype=np.uint8)
        # A policy's stored prediction per row (see ``store_scores``): the score and
        # the time it was computed + 1 (0 = none, or the row changed since).
        self._score = np.zeros(cap, dtype=np.float32)
        self._scored = np.zeros(cap, dtype=np.int64)
        self._index: dict[int, int] = {}
        self._free: list[int] = []
        self._high_water = 0  # rows [0, high_water) have been handed out at least once
        self._sessions: dict[str, tuple[int, int]] = {}  # session -> (turns, last ts_ms)
        self._arange = np.arange(1024, dtype=np.intp)
        self._gap_rank = np.arange(p.num_gaps)
        # Decayed counters are stored scaled by 2**((t - epoch) / half-life) so an access
        # adds one weight per request instead of decaying every block; the epoch moves
        # forward (rescaling every row) before the weights could overflow float32.
        self._dec_epoch_ms = 0
        self._weights_ts_ms: int | None = None
        self._weights = np.zeros(len(p.half_lives_s), dtype=np.float32)
        self.num_requests = 0
        self.num_accesses = 0
        self.num_evicted = 0
        self.clock_ms = 0
        """Time of the latest access event (request-level rates are valued here)."""
        self._rate_hl_s = tuple(float(h) for h in p.rate_half_lives_s)
        self._req_counts = [0.0] * len(self._rate_hl_s)
        self._block_count = 0.0
        self.last_request_slots = np.zeros(0, dtype=np.intp)
        """Rows of the blocks of the last observed request, in chain order."""

    # --- observing -----------------------------------------------------------------

    def observe_many(self, events: Iterable[object]) -> None:
        """Fold events in order; the same state as ``observe`` on each in turn, bit for bit.

        Runs of access events are folded a chunk of requests at a time in one set of
        array operations (several times faster than one by one). A chunk falls back to
        one request at a time where batching could change the result: when the cap
        would drop blocks inside it, or when the decayed counters must be rescaled.
        """
        run: list[BlocksAccessed] = []
        for event in events:
            if isinstance(event, BlocksAccessed) and event.block_hashes:
                run.append(event)
                if len(run) >= _CHUNK_REQUESTS:
                    self._observe_run(run)
                    run = []
            else:
                if run:
                    self._observe_run(run)
                    run = []
                self.observe(event)
        if run:
            self._observe_run(run)

    def _observe_run(self, run: list[BlocksAccessed]) -> None:
        start = 0
        while start < len(run):
            stop = start
            epoch, limit, inv = self._dec_epoch_ms, _REBASE_EXPONENT, self._max_inv_hl_ms
            end = min(len(run), start + _CHUNK_REQUESTS)
            # Cut it before a request that would rescale the decayed counters, or that
            # repeats a hash (both are folded one by one).
            while (
                stop < end
                and (run[stop].ts_ms - epoch) * inv <= limit
                and len(set(run[stop].block_hashes)) == len(run[stop].block_hashes)
            ):
                stop += 1
            if stop == start:
                self._observe_access(run[start])
                start += 1
                continue
            folded = self._observe_chunk(run[start:stop])
            if folded:
                start += folded
            else:  # the cap must drop blocks before the next request: one by one
                self._observe_access(run[start])
                start += 1

    def _observe_chunk(self, chunk: list[BlocksAccessed]) -> int:
        """Fold requests with no repeated hash inside one request, all in one epoch of
        the decayed counters, as one batch; returns how many were folded. Where the cap
        would have to drop blocks inside the chunk (one-by-one folding would evict
        between two of its requests), folds only the requests before that point."""
        lengths = [len(e.block_hashes) for e in chunk]
        flat: list[int] = []
        for e in chunk:
            flat.extend(e.block_hashes)
        index = self._index
        found = list(map(index.get, flat))
        taken: list[int] = []  # rows reused from the free list
        first_fresh_row = self._high_water
        if None in found:
            new_keys = list(
                dict.fromkeys([h for h, s in zip(flat, found, strict=True) if s is None])
            )
            need = len(new_keys)
            free = self._free
            cap = self._hash.shape[0]
            fresh_rows = need - len(free)
            if fresh_rows > cap - self._high_water and cap < self.params.max_tracked_blocks:
                self._grow(max(cap * _GROWTH, self._high_water + fresh_rows))
            if fresh_rows > self._hash.shape[0] - self._high_water:
                fit = self._requests_that_fit(chunk) if len(chunk) > 1 else 0
                return self._observe_chunk(chunk[:fit]) if fit else 0
            # The rows one-by-one folding would hand out, in the same order: free rows
            # from the end of the free list, then fresh rows.
            taken = free[::-1][:need]
            del free[len(free) - len(taken) :]
            num_fresh = need - len(taken)
            hw = self._high_water
            fresh = range(hw, hw + num_fresh)
            index.update(zip(new_keys, taken + list(fresh) if taken else fresh, strict=True))
            keys = np.fromiter(new_keys, dtype=np.uint64, count=need)
            if taken:
                self._hash[taken] = keys[: len(taken)]
            self._hash[hw : hw + num_fresh] = keys[len(taken) :]
            self._high_water = hw + num_fresh
            found = list(map(index.__getitem__, flat))
        num = len(flat)
        nreq = len(chunk)
        sl = np.array(found, dtype=np.intp)
        lens = np.array(lengths, dtype=np.intp)
        req_start = np.zeros(nreq, dtype=np.intp)
        np.cumsum(lens[:-1], out=req_start[1:])
        req = np.repeat(np.arange(nreq, dtype=np.intp), lens)
        pos = np.arange(num, dtype=np.intp) - req_start[req]
        n_of = lens[req]
        ts_req = np.array([e.ts_ms for e in chunk], dtype=np.int64)
        ts = ts_req[req]

        # Group accesses by row, chronological inside each group.
        order = np.argsort(sl, kind="stable")
        sl_s = sl[order]
        first_in = np.empty(num, dtype=bool)
        first_in[0] = True
        np.not_equal(sl_s[1:], sl_s[:-1], out=first_in[1:])
        group_start = np.flatnonzero(first_in)
        group_end = np.append(group_start[1:], num)
        m = group_end - group_start
        uniq = sl_s[group_start]
        gidx_s = np.cumsum(first_in) - 1
        gidx = np.empty(num, dtype=np.intp)
        gidx[order] = gidx_s
        prev_s = np.where(
            first_in, -1, np.roll(order, 1)
        )  # previous access of the row (unsorted index)
        prev = np.empty(num, dtype=np.intp)
        prev[order] = prev_s

        I_old = self._i64.take(uniq, axis=0)
        J_old = self._i32.take(uniq, axis=0)
        F_old = self._f32.take(uniq, axis=0)
        count_old = J_old[:, _COUNT]

        # New for its request: a row first handed out in this chunk, at its first access.
        is_new = sl >= first_fresh_row
        if taken:
            is_new |= np.isin(sl, taken)
        is_new &= prev < 0
        big = np.iinfo(np.intp).max
        first_new = np.minimum.reduceat(np.where(is_new, pos, big), req_start)
        hit_len = np.minimum(first_new, lens)
        last_new = np.maximum.reduceat(np.where(is_new, pos, -1), req_start)

        # Per-request scalars, in order: clock, turns, weights.
        hit_tail = np.where(hit_len >= 2, req_start + hit_len - 1, 0)
        tail_prev = prev[hit_tail]
        tail_state = J_old[gidx[hit_tail]][:, [_REQLEN, _DEPTH, _TURN]]
        tail_last_list = I_old[gidx[hit_tail], _LAST].tolist()
        turns = [1] * nreq
        turn_gaps = [-1] * nreq
        weights = np.empty((nreq, self._f32.shape[1] - self._k), dtype=np.float32)
        slack = self.params.continuation_tail_slack
        hit_list = hit_len.tolist()
        tail_prev_list = tail_prev.tolist()
        tail_state_list = tail_state.tolist()
        safe_prev = np.maximum(tail_prev, 0)
        tail_prev_req = req[safe_prev].tolist()  # request and position of that earlier read
        tail_prev_pos = pos[safe_prev].tolist()
        for r, e in enumerate(chunk):
            self._tick(e.ts_ms, lengths[r])
            weights[r] = self._weights_at(e.ts_ms)
            if e.session_id is not None:
                turns[r], turn_gaps[r] = self._session_turn(e.session_id, e.ts_ms)
            elif hit_list[r] >= 2:
                if tail_prev_list[r] >= 0:  # the hit tail was read earlier in this chunk
                    rr = tail_prev_req[r]
                    reqlen, depth, turn = lengths[rr], tail_prev_pos[r], turns[rr]
                    last_ts = chunk[rr].ts_ms
                else:
                    reqlen, depth, turn = tail_state_list[r]
                    last_ts = tail_last_list[r]
                if reqlen - 1 - depth <= slack:
                    turns[r] = turn + 1
                    turn_gaps[r] = min(e.ts_ms - last_ts, _INT32_MAX)
        reqord = self.num_requests + 1 + np.arange(nreq, dtype=np.int64)
        self.num_requests += nreq
        self.num_accesses += num

        last_acc = order[group_end - 1]  # each row's last access (unsorted index)
        prev_ts = np.where(prev >= 0, ts[np.maximum(prev, 0)], I_old[gidx, _LAST])
        gap = (ts - prev_ts).astype(np.float32)
        k = self._k
        # Rows read once in the chunk (most of them): shift in one gap, add one weight.
        F_new = np.empty_like(F_old)
        F_new[:, 1:k] = F_old[:, : k - 1]
        F_new[:, 0] = gap[last_acc]
        F_new[:, k:] = F_old[:, k:] + weights[req[last_acc]]
        multi = np.flatnonzero(m > 1)
        if multi.size:
            # The j-th latest gap is a new one for j < m, else old column j - m; the
            # decayed counters get the same float32 additions, in the same order.
            jj = np.arange(k)
            mm = m[multi]
            src = np.clip(group_end[multi, None] - 1 - jj[None, :], 0, num - 1)
            old_col = np.clip(jj[None, :] - mm[:, None], 0, k - 1)
            F_new[multi, :k] = np.where(
                jj[None, :] < mm[:, None],
                gap[order][src],
                np.take_along_axis(F_old[multi, :k], old_col, axis=1),
            )
            in_multi = (m > 1)[gidx_s]
            dec = F_old[multi, k:].copy()
            np.add.at(dec, np.searchsorted(multi, gidx_s[in_multi]), weights[req[order[in_multi]]])
            F_new[multi, k:] = dec

        I_new = I_old.copy()
        I_new[:, _LAST] = ts[last_acc]
        fresh = count_old == 0
        I_new[fresh, _FIRST] = ts[order[group_start[fresh]]]
        idx = np.arange(num, dtype=np.intp)
        for col, mask in ((_CHILD, pos < n_of - 1), (_EXT, pos < last_new[req])):
            last_hit = np.maximum.reduceat(np.where(mask[order], idx, -1), group_start)
            has = last_hit >= 0
            I_new[has, col] = ts[order[last_hit[has]]] + 1

        J_new = J_old.copy()
        consts = np.empty((nreq, _ROOT + 1), dtype=np.int32)
        consts[:, _REQORD] = reqord
        consts[:, _REQLEN] = lens
        consts[:, _INTOK] = [-1 if e.input_tokens is None else e.input_tokens for e in chunk]
        consts[:, _OUTTOK] = [-1 if e.output_tokens is None else e.output_tokens for e in chunk]
        consts[:, _HITLEN] = hit_len
        consts[:, _TURN] = turns
        consts[:, _TURNGAP] = turn_gaps
        consts[:, _ROOT] = sl[req_start]
        J_new[:, _REQORD : _ROOT + 1] = consts[req[last_acc]]
        J_new[:, _COUNT] = count_old + m
        J_new[:, _DEPTH] = pos[last_acc]
        parent = np.empty(num, dtype=np.intp)
        parent[1:] = sl[:-1]
        parent[req_start] = -1
        J_new[:, _PARENT] = parent[last_acc]
        # A new block at position > 0 is a new child of the block before it.
        child_of = parent[is_new & (pos > 0)]
        if child_of.size:
            J_new[:, _NCHILD] += np.bincount(
                np.searchsorted(uniq, child_of), minlength=uniq.shape[0]
            ).astype(np.int32)

        self._i64[uniq] = I_new
        self._i32[uniq] = J_new
        self._f32[uniq] = F_new
        self._u8[sl[req_start + lens - 1], _FLAGS] |= _FLAG_EVER_TAIL
        self._scored[uniq] = 0  # the rows changed: their stored scores are void
        self.last_request_slots = sl[req_start[-1] :]
        return nreq

    def observe(self, event: object) -> None:
        """Fold one event into the state. Unknown event types raise ``TypeError``."""
        if isinstance(event, BlocksAccessed):
            self._observe_access(event)
        elif isinstance(event, BlockStored):
            self._set_tier(event.block_hashes, event.tier, True)
        elif isinstance(event, BlockRemoved):
            self._set_tier(event.block_hashes, event.tier, False)
        elif isinstance(event, AllBlocksCleared):
            self._u8[: self._high_water, _TIERS] = 0
            self._scored[: self._high_water] = 0
        else:
            raise TypeError(
                f"FeatureState.observe takes features.events types, got {type(event).__name__}"
            )

    def _tick(self, ts_ms: int, num_blocks: int) -> None:
        """Advance the request-level counters to ``ts_ms`` and count one request."""
        if ts_ms != self.clock_ms:
            dt_s = (ts_ms - self.clock_ms) / 1000.0
            self._req_counts = [
                c * 2.0 ** (-dt_s / h)
                for c, h in zip(self._req_counts, self._rate_hl_s, strict=True)
            ]
            self._block_count *= 2.0 ** (-dt_s / _BLOCK_RATE_HALF_LIFE_S)
            self.clock_ms = ts_ms
        self._req_counts = [c + 1.0 for c in self._req_counts]
        self._block_count += num_blocks

    def _weights_at(self, ts_ms: int) -> np.ndarray:
        if ts_ms == self._weights_ts_ms:
            return self._weights
        if (ts_ms - self._dec_epoch_ms) * self._max_inv_hl_ms > _REBASE_EXPONENT:
            factor = np.exp2(-(ts_ms - self._dec_epoch_ms) * self._inv_hl_ms).astype(np.float32)
            self._f32[: self._high_water, self._k :] *= factor
            self._dec_epoch_ms = ts_ms
        self._weights = np.exp2((ts_ms - self._dec_epoch_ms) * self._inv_hl_ms).astype(np.float32)
        self._weights_ts_ms = ts_ms
        return self._weights

    def _dec_scale(self, now_ms: int) -> np.ndarray:
        """Multiplier turning stored decayed counters into their value at ``now_ms``."""
        return np.exp2(-(now_ms - self._dec_epoch_ms) * self._inv_hl_ms)

    def _session_turn(self, session_id: str, ts_ms: int) -> tuple[int, int]:
        """(turn, ms since the session's previous request or -1) of a new request."""
        prev_turn, prev_ts = self._sessions.pop(session_id, (0, 0))
        self._sessions[session_id] = (prev_turn + 1, ts_ms)
        if len(self._sessions) > self.params.max_tracked_sessions:
            del self._sessions[next(iter(self._sessions))]
        return prev_turn + 1, min(ts_ms - prev_ts, _INT32_MAX) if prev_turn else -1

    def _requests_that_fit(self, chunk: list[BlocksAccessed]) -> int:
        """How many leading requests of ``chunk`` need no more new rows than are spare."""
        spare = len(self._free) + self.params.max_tracked_blocks - self._high_water
        index = self._index
        seen: set[int] = set()
        for r, event in enumerate(chunk):
            seen.update(h for h in event.block_hashes if h not in index)
            if len(seen) > spare:
                return r
        return len(chunk)

    def _observe_access(self, event: BlocksAccessed) -> None:
        hashes = event.block_hashes
        n = len(hashes)
        t = event.ts_ms
        self._tick(t, n)
        self.num_requests += 1
        if n == 0:
            self.last_request_slots = np.zeros(0, dtype=np.intp)
            return
        self.num_accesses += n
        found = list(map(self._index.get, hashes))
        new_pos: list[int] = []
        if None in found:
            new_pos = [i for i, s in enumerate(found) if s is None]
        hit_len = new_pos[0] if new_pos else n

        # Turn of this request: the session's count when the source has sessions, else
        # one more than the conversation it continues (read before the rows change).
        turn, turn_gap = 1, -1
        if event.session_id is not None:
            turn, turn_gap = self._session_turn(event.session_id, t)
        elif hit_len >= 2:
            tail = found[hit_len - 1]
            row = self._i32[tail]
            if row[_REQLEN] - 1 - row[_DEPTH] <= self.params.continuation_tail_slack:
                turn = int(row[_TURN]) + 1
                turn_gap = min(t - int(self._i64[tail, _LAST]), _INT32_MAX)

        weights = self._weights_at(t)  # may rescale rows: before the gathers below
        if new_pos:
            self._allocate(hashes, found, new_pos)
        sl = np.array(found, dtype=np.intp)
        values = (
            self.num_requests,
            n,
            -1 if event.input_tokens is None else event.input_tokens,
            -1 if event.output_tokens is None else event.output_tokens,
            hit_len,
            turn,
            turn_gap,
        )
        fast = self._kernel()
        if fast is not None and all(-_INT32_MAX - 1 <= v <= _INT32_MAX for v in values):
            fast.observe(self, sl, t, weights, new_pos, values)
        else:
            self._observe_rows_numpy(sl, t, weights, new_pos, values)
        self.last_request_slots = sl

    def _observe_rows_numpy(
        self,
        sl: np.ndarray,
        t: int,
        weights: np.ndarray,
        new_pos: list[int],
        values: tuple[int, ...],
    ) -> None:
        """One request's update of the rows ``sl`` of its blocks (in request order) at
        ``t``: the reference definition of ``native_rows``' ``kv_observe_rows``.
        ``values``: the request's ordinal, length, tokens in and out, hit length, turn
        and turn gap; ``new_pos``: positions of blocks new to the state."""
        n = sl.shape[0]
        if n > self._arange.shape[0]:
            self._arange = np.arange(2 * n, dtype=np.intp)
        ar = self._arange[:n]
        k = self._k
        I = self._i64.take(sl, axis=0)  # noqa: E741 -- gathered rows, written back below
        J = self._i32.take(sl, axis=0)
        F = self._f32.take(sl, axis=0)
        # Shift the gaps; a new row (count 0) gets a meaningless gap 0 - its valid gaps
        # are always the first count - 1 columns, so it is never read.
        F[:, 1:k] = F[:, : k - 1]
        F[:, 0] = t - I[:, _LAST]
        F[:, k:] += weights
        I[:, _LAST] = t
        I[: n - 1, _CHILD] = t + 1
        if new_pos:
            first_new, last_new = new_pos[0], new_pos[-1]
            # A new block at position i > 0 is a new child of the block before it.
            if last_new == n - 1 and last_new - first_new + 1 == len(new_pos):  # a new suffix
                I[first_new:, _FIRST] = t
                J[max(first_new - 1, 0) : n - 1, _NCHILD] += 1
            else:
                newi = np.array(new_pos, dtype=np.intp)
                I[newi, _FIRST] = t
                J[newi[newi > 0] - 1, _NCHILD] += 1
            if last_new > 0:
                I[:last_new, _EXT] = t + 1
        J[:, _REQORD : _ROOT + 1] = (*values, sl[0])
        J[:, _COUNT] += 1
        J[:, _DEPTH] = ar
        J[0, _PARENT] = -1
        J[1:, _PARENT] = sl[:-1]
        self._i64[sl] = I
        self._i32[sl] = J
        self._f32[sl] = F
        self._u8[sl[-1], _FLAGS] |= _FLAG_EVER_TAIL
        self._scored[sl] = 0  # the rows changed: their stored scores are void

    def _allocate(
        self, hashes: tuple[int, ...], found: list[int | None], new_pos: list[int]
    ) -> None:
        """Give each new hash a row (its columns are all zero), evicting at the cap."""
        need = len(new_pos)
        cap = self._hash.shape[0]
        if len(self._free) + cap - self._high_water < need:
            if cap < self.params.max_tracked_blocks:
                self._grow(max(cap * _GROWTH, self._high_water + need))
            spare = len(self._free) + self._hash.shape[0] - self._high_water
            if spare < need:
                protect = np.array([s for s in found if s is not None], dtype=np.intp)
                self._evict(need - spare, protect)
        index = self._index
        new_hashes = [hashes[i] for i in new_pos]
        if not self._free and len(set(new_hashes)) == need:
            # Common case: fresh rows, no hash repeated within the request.
            start = self._high_water
            self._high_water = start + need
            index.update(zip(new_hashes, range(start, start + need), strict=True))
            self._hash[start : start + need] = new_hashes
            for row, i in enumerate(new_pos, start):
                found[i] = row
            return
        free = self._free
        for i, h in zip(new_pos, new_hashes, strict=True):
            slot = index.get(h)
            if slot is None:  # not a repeat of a hash new earlier in this same request
                if free:
                    slot = free.pop()
                else:
                    slot = self._high_water
                    self._high_water += 1
                index[h] = slot
                self._hash[slot] = h
            found[i] = slot

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self._hash, self._i64, self._i32, self._f32, self._u8, self._score, self._scored)

    def _grow(self, rows: int) -> None:
        rows = min(rows, self.params.max_tracked_blocks)
        old = self._hash.shape[0]
        if rows <= old:
            return
        grown = []
        for a in self._arrays():
            out = np.zeros((rows, *a.shape[1:]), dtype=a.dtype)
            out[:old] = a
            grown.append(out)
        self._hash, self._i64, self._i32, self._f32, self._u8, self._score, self._scored = grown

    def _evict(self, at_least: int, protect: np.ndarray) -> None:
        """Drop the coldest rows (oldest last access), never those in ``protect``."""
        hw = self._high_water
        key = self._i64[:hw, _LAST].copy()
        # Free rows hold nothing and protected rows must stay: neither is a candidate.
        spared = np.unique(np.concatenate([protect, np.array(self._free, dtype=np.intp)]))
        key[spared] = np.iinfo(np.int64).max
        evictable = hw - spared.size
        if evictable < at_least:
            raise FeatureParamsError(
                f"one request has more blocks than max_tracked_blocks "
                f"({self.params.max_tracked_blocks}) can hold; raise max_tracked_blocks"
            )
        m = min(
            max(at_least, math.ceil(self.params.max_tracked_blocks * self.params.evict_fraction)),
            evictable,
        )
        # The m coldest, by (last access, row), so the choice never depends on
        # argpartition's internal order.
        cold = np.argpartition(key, m - 1)[:m] if m < hw else np.arange(hw)
        cold = cold[np.lexsort((cold, key[cold]))][:m]
        for h in self._hash[cold].tolist():
            del self._index[h]
        for col in (_PARENT, _ROOT):
            ref = self._i32[:hw, col]
            ref[np.isin(ref, cold)] = -1
        for a in self._arrays():
            a[cold] = 0
        # pop() takes from the end: the coldest row is reused first.
        self._free.extend(cold[::-1].tolist())
        self.num_evicted += m

    def _set_tier(self, block_hashes: tuple[int, ...], tier: Tier, present: bool) -> None:
        slots = [s for s in map(self._index.get, block_hashes) if s is not None]
        if not slots:
            return
        bit = 1 << tier.rank
        self._scored[slots] = 0  # tier_rank changes: stored scores are void
        if present:
            self._u8[slots, _TIERS] |= np.uint8(bit)
        else:
            self._u8[slots, _TIERS] &= np.uint8(~bit & 0xFF)

    # --- lookups -------------------------------------------------------------------

    def slot_of(self, block_hashes: np.ndarray | Iterable[int]) -> np.ndarray:
        """Row of each hash, -1 for untracked (intp)."""
        values = (
            block_hashes.tolist() if isinstance(block_hashes, np.ndarray) else list(block_hashes)
        )
        return np.fromiter(
            map(self._index.get, values, itertools.repeat(-1)), dtype=np.intp, count=len(values)
        )

    def known(self, block_hashes: np.ndarray | Iterable[int]) -> np.ndarray:
        """True for tracked hashes."""
        return self.slot_of(block_hashes) >= 0

    @property
    def num_tracked(self) -> int:
        return len(self._index)

    def tracked_slots(self) -> np.ndarray:
        """Rows of every tracked block, ascending."""
        hw = self._high_water
        if not self._free:
            return np.arange(hw, dtype=np.intp)
        used = np.ones(hw, dtype=bool)
        used[np.array(self._free, dtype=np.intp)] = False
        return np.flatnonzero(used)

    def tracked_hashes(self) -> np.ndarray:
        """Hashes of every tracked block (uint64), in row order."""
        return self._hash[self.tracked_slots()]

    def hashes_of_slots(self, slots: np.ndarray) -> np.ndarray:
        """Hashes (uint64) held in these rows (e.g. ``last_request_slots``)."""
        return self._hash[slots]

    # --- stored scores ----------------------------------------------------------------

    def stored_scores(
        self, slots: np.ndarray, now_ms: int, max_age_ms: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(stored score per row, whether it may be used at ``now_ms``).

        Refresh rule: a stored score is usable while its row has not changed since it
        was stored (any access to the block voids it) and it is at most ``max_age_ms``
        old. Untracked rows (-1) are never usable. Scores are written by
        ``store_scores``; the state itself never computes one."""
        sl = np.asarray(slots, dtype=np.intp)
        known = sl >= 0
        safe = np.where(known, sl, 0)
        scored = self._scored[safe]
        usable = known & (scored > 0) & (now_ms + 1 - scored <= max_age_ms)
        return self._score[safe], usable

    def store_scores(self, slots: np.ndarray, scores: np.ndarray, now_ms: int) -> None:
        """Keep ``scores`` (computed at ``now_ms``) for these rows; -1 rows are skipped."""
        sl = np.asarray(slots, dtype=np.intp)
        keep = sl >= 0
        self._score[sl[keep]] = np.asarray(scores, dtype=np.float32)[keep]
        self._scored[sl[keep]] = min(now_ms, _MAX_SCORED_MS) + 1

    def forget_scores(self) -> None:
        """Void every stored score (the model that computed them was replaced)."""
        self._scored[: self._high_water] = 0

    # --- cheap accessors for baseline policies -------------------------------------

    def last_access_ms(self, block_hashes: np.ndarray | Iterable[int]) -> np.ndarray:
        """Last access time (int64), -1 for untracked: what LRU ranks by."""
        sl = self.slot_of(block_hashes)
        return np.where(sl >= 0, self._i64[sl, _LAST], -1)

    def access_count(self, block_hashes: np.ndarray | Iterable[int]) -> np.ndarray:
        """Access count (int64), 0 for untracked: what LFU ranks by."""
        sl = self.slot_of(block_hashes)
        return np.where(sl >= 0, self._i32[sl, _COUNT], 0).astype(np.int64)

    def decayed_count(
        self, block_hashes: np.ndarray | Iterable[int], now_ms: int, half_life_s: float = 60.0
    ) -> np.ndarray:
        """Decayed access count at ``now_ms`` (float64), 0 for untracked."""
        if half_life_s not in self.params.half_lives_s:
            raise FeatureParamsError(
                f"half_life_s {half_life_s} is not one of {self.params.half_lives_s}"
            )
        col = self.params.half_lives_s.index(half_life_s)
        sl = self.slot_of(block_hashes)
        value = self._f32[sl, self._k + col] * self._dec_scale(now_ms)[col]
        return np.where(sl >= 0, value, 0.0)

    def root_last_access_ms(self, block_hashes: np.ndarray | Iterable[int]) -> np.ndarray:
        """Last access of each block's prefix root (int64), -1 when untracked: what a
        prefix-aware LRU ranks by."""
        sl = self.slot_of(block_hashes)
        root = np.where(sl >= 0, self._i32[sl, _ROOT], -1)
        return np.where(root >= 0, self._i64[root, _LAST], -1)

    # --- features --------------------------------------------------------------------

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles leave the native layout behind: it holds the addresses of
        this state's tables, which a copy does not share."""
        state = self.__dict__.copy()
        state["_native"] = None
        state["rows_kernel"] = True  # a kernel is a loaded library: not copied
        return state

    def features_for(self, block_hashes: np.ndarray | Iterable[int], now_ms: int) -> np.ndarray:
        """Feature rows (float32, one per hash, ``feature_names`` order) at ``now_ms``."""
        return self.features_for_slots(self.slot_of(block_hashes), now_ms)

    def features_for_slots(self, slots: np.ndarray, now_ms: int) -> np.ndarray:
        """Same as ``features_for`` for rows already looked up (-1 = unknown).

        Computed by the native kernel (``features.native_rows``, see ``rows_kernel``)
        when it is available, else by numpy (``_rows_numpy``, the reference): the same
        rows bit for bit."""
        # The state cannot look back in time: an instant before the latest access is
        # answered as of that access (keeps every value finite).
        now_ms = max(now_ms, self.clock_ms)
        fast = self._kernel()
        if fast is None:
            return self._rows_numpy(slots, now_ms)
        sl = np.ascontiguousarray(slots, dtype=np.int64)
        return fast.rows(self, sl, now_ms, self._dec_scale(now_ms), self._request_rates(now_ms))

    def _kernel(self) -> native_rows.FeatureRowsKernel | None:
        chosen = self.rows_kernel
        fast = native_rows.kernel() if chosen is True else (chosen or None)
        return fast if fast is not None and self._native_layout().usable(self) else None

    def _native_layout(self) -> _NativeLayout:
        """Column positions for the native kernel (made once per state)."""
        if self._native is None:
            self._native = _NativeLayout(self)
        return self._native

    def _rows_numpy(self, slots: np.ndarray, now_ms: int) -> np.ndarray:
        """``features_for_slots`` in numpy (the reference definition)."""
        now_ms = max(now_ms, self.clock_ms)
        c = self._cols
        at = c.at
        k = self._k
        sl = np.asarray(slots, dtype=np.intp)
        n = sl.shape[0]
        out = np.empty((n, len(self.feature_names)), dtype=np.float32)
        known = sl >= 0
        all_known = bool(known.all())
        if not all_known:
            sl = np.where(known, sl, 0)
        I = self._i64.take(sl, axis=0)  # noqa: E741
        J = self._i32.take(sl, axis=0)
        U = self._u8.take(sl, axis=0)
        cnt = J[:, _COUNT]
        out[:, at["known"]] = 1.0
        F = self._f32.take(sl, axis=0)
        # A block read c times has c - 1 gaps; the rest of the shift register is noise.
        valid = self._gap_rank[None, :] < (cnt[:, None] - 1)
        out[:, c.gap0 : c.gap0 + k] = np.where(valid, F[:, :k], MISSING)
        scale = self._dec_scale(now_ms)
        out[:, c.dec0 : c.dec0 + scale.shape[0]] = F[:, k:] * scale
        # Stored int32 columns copied as they are, in one operation.
        out[:, c.direct_dst] = J[:, _DIRECT_SRC]
        out[:, c.since_last_first] = now_ms - I[:, [_LAST, _FIRST]]
        out[:, at["requests_since_last_access"]] = self.num_requests - J[:, _REQORD]
        reqlen = J[:, _REQLEN]
        out[:, at["blocks_to_tail"]] = reqlen - 1 - J[:, _DEPTH]
        out[:, at["ever_tail"]] = U[:, _FLAGS] & _FLAG_EVER_TAIL
        out[:, at["last_request_hit_fraction"]] = J[:, _HITLEN] / np.maximum(reqlen, 1)
        # _CHILD and _EXT hold ts + 1, so a zeroed row means "never".
        child_ext = I[:, _CHILD : _EXT + 1]
        out[:, c.child_ext] = np.where(child_ext > 0, now_ms + 1 - child_ext, MISSING)
        # Parent and prefix root, gathered together (-1 = none or dropped by the cap).
        links = J[:, [_PARENT, _ROOT]]
        has = links >= 0
        safe = np.where(has, links, 0)
        parent, root = safe[:, 0], safe[:, 1]
        has_parent, has_root = has[:, 0], has[:, 1]
        out[:, at["parent_time_since_last_access_ms"]] = np.where(
            has_parent, now_ms - self._i64[parent, _LAST], MISSING
        )
        out[:, at["parent_access_count"]] = np.where(has_parent, self._i32[parent, _COUNT], MISSING)
        rext = self._i64[root, _EXT]
        root_dec = self._f32[root, k + self._root_hl] * scale[self._root_hl]
        out[:, at[_ROOT_DECAYED_NAME]] = np.where(has_root, root_dec, MISSING)
        out[:, at["root_time_since_extended_ms"]] = np.where(
            has_root & (rext > 0), now_ms + 1 - rext, MISSING
        )
        out[:, at["tier_rank"]] = _TIER_RANK_OF_MASK[U[:, _TIERS] & 15]
        if not all_known:
            unknown = ~known
            out[unknown] = MISSING
            out[unknown, at["known"]] = 0.0
            out[unknown, at["tier_rank"]] = NO_TIER_RANK
        out[:, self._cols.request_level] = self._request_rates(now_ms)
        return out

    def _request_rates(self, now_ms: int) -> list[float]:
        """Arrival rates at ``now_ms``, in ``request_level(feature_names)`` order."""
        dt_s = (now_ms - self.clock_ms) / 1000.0
        rates = [
            count * 2.0 ** (-dt_s / hl) * _LN2 / hl
            for hl, count in zip(self._rate_hl_s, self._req_counts, strict=True)
        ]
        blocks = self._block_count * 2.0 ** (-dt_s / _BLOCK_RATE_HALF_LIFE_S)
        rates.append(blocks * _LN2 / _BLOCK_RATE_HALF_LIFE_S)
        return rates

    # --- memory ----------------------------------------------------------------------

    def bytes_per_tracked_block(self) -> float:
        """Bytes one tracked block costs: its array row, plus its dict entry and the key
        and value int objects (measured on up to 1,000 entries). Spare rows allocated
        ahead of need are not counted (arrays grow 4x at a time up to the cap)."""
        row = sum(a.itemsize * (a.shape[1] if a.ndim == 2 else 1) for a in self._arrays())
        n = len(self._index)
        if n == 0:
            return float(row)
        table = sys.getsizeof(self._index) / n
        sample = list(self._index.items())[:1000]
        # Ints up to 256 are cached singletons: they cost nothing per entry.
        objs = sum(
            (sys.getsizeof(h) if h > 256 else 0) + (sys.getsizeof(s) if s > 256 else 0)
            for h, s in sample
        )
        return float(row + table + objs / len(sample))

    def allocated_bytes(self) -> int:
        """Bytes held by the arrays (every allocated row) and the index dict's table."""
        return sum(a.nbytes for a in self._arrays()) + sys.getsizeof(self._index)
