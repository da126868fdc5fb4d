"""Where each block sits: the planner's view of the tiers.

``Placement`` maps block hash -> tier index (0 = fastest) and keeps, per tier, a dense
member list so that uniform sampling of a tier's residents is O(1) (the planner's
eviction sample) and add/remove are O(1) (swap-remove). It is the executor's state in
replay, and a mirror of the executor's index when serving.

Each tier also keeps its residents in the order they were last touched (``order``:
moved into the tier, or read by a request while in it, oldest first; an
``OrderedDict``, O(1) per add, remove and touch). With it the planner evicts exactly
the least recently used residents when the served policy ranks by recency (LRU, or
the guard serving LRU), instead of the sampled approximation, which trails exact LRU.

Invariant: a block is in at most one tier; ``count(t) == len(members of t) ==
len(order(t))``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

NOWHERE = -1


class Placement:
    def __init__(self, tier_names: list[str], capacities_blocks: list[int]) -> None:
        if len(tier_names) != len(capacities_blocks) or not tier_names:
            raise ValueError("need one capacity per tier, and at least one tier")
        self.tier_names = list(tier_names)
        self.capacities = [int(c) for c in capacities_blocks]
        self._tier: dict[int, int] = {}
        self._members: list[list[int]] = [[] for _ in tier_names]
        self._pos: list[dict[int, int]] = [{} for _ in tier_names]
        self._order: list[OrderedDict[int, None]] = [OrderedDict() for _ in tier_names]
        self.moved_at_ms: dict[int, int] = {}

    @property
    def num_tiers(self) -> int:
        return len(self.tier_names)

    def tier_of(self, block: int) -> int:
        return self._tier.get(block, NOWHERE)

    def tiers_of(self, blocks: list[int]) -> list[int]:
        return list(map(self._tier.get, blocks, itertools.repeat(NOWHERE)))

    def placed_below(self, blocks: Iterable[int], tier: int) -> list[int]:
        """The ``blocks`` placed in a tier slower than ``tier``, in their order (one
        pass, no list of every block's tier)."""
        tier_get = self._tier.get
        return [b for b in blocks if tier_get(b, NOWHERE) > tier]

    def count(self, tier: int) -> int:
        return len(self._members[tier])

    def overflow(self, tier: int) -> int:
        return len(self._members[tier]) - self.capacities[tier]

    def add(self, block: int, tier: int, now_ms: int = 0) -> None:
        if block in self._tier:
            raise ValueError(
                f"block {block} is already in tier {self.tier_names[self._tier[block]]}"
            )
        members = self._members[tier]
        self._pos[tier][block] = len(members)
        members.append(block)
        self._order[tier][block] = None
        self._tier[block] = tier
        self.moved_at_ms[block] = now_ms

    def add_many(self, blocks: list[int], tier: int, now_ms: int = 0) -> None:
        """``add`` of each block in order (the same member order), in bulk: O(len(blocks))
        dict and list operations done in C. ``blocks`` must be distinct and placed
        nowhere yet."""
        if not blocks:
            return
        members = self._members[tier]
        start = len(members)
        members.extend(blocks)
        self._pos[tier].update(zip(blocks, range(start, start + len(blocks)), strict=True))
        before = len(self._tier)
        self._tier.update(dict.fromkeys(blocks, tier))
        if len(self._tier) != before + len(blocks):
            # Roll back, then report the first offender the way ``add`` would.
            del members[start:]
            for b in blocks:
                self._pos[tier].pop(b, None)
            raise ValueError("add_many takes distinct blocks that are placed nowhere yet")
        self._order[tier].update(dict.fromkeys(blocks))
        self.moved_at_ms.update(dict.fromkeys(blocks, now_ms))

    def remove_many(self, blocks: list[int], tier: int) -> None:
        """Drop ``blocks``, all residents of ``tier``. Few blocks: ``remove`` each (swap-
        remove, the same member order as one by one). Many (over an eighth of the tier):
        the member list is rebuilt without them in one O(tier) pass, keeping the order of
        those that stay, instead of O(n) Python-level swaps."""
        members = self._members[tier]
        if len(blocks) * 8 <= len(members):
            for b in blocks:
                self.remove(b)
            return
        gone = set(blocks)
        kept = [b for b in members if b not in gone]
        if len(kept) + len(gone) != len(members):
            raise ValueError(f"remove_many: some blocks are not in tier {self.tier_names[tier]}")
        members[:] = kept
        self._pos[tier] = dict(zip(kept, range(len(kept)), strict=True))
        tier_of, moved, order = self._tier, self.moved_at_ms, self._order[tier]
        for b in blocks:
            del tier_of[b]
            del order[b]
            moved.pop(b, None)

    def remove(self, block: int) -> int:
        """Drop ``block`` from wherever it is; returns its former tier (or NOWHERE)."""
        tier = self._tier.pop(block, NOWHERE)
        if tier == NOWHERE:
            return tier
        members, pos = self._members[tier], self._pos[tier]
        del self._order[tier][block]
        i = pos.pop(block)
        last = members.pop()
        if last != block:
            members[i] = last
            pos[last] = i
        self.moved_at_ms.pop(block, None)
        return tier

    def move(self, block: int, tier: int, now_ms: int = 0) -> None:
        self.remove(block)
        self.add(block, tier, now_ms)

    def members(self, tier: int) -> list[int]:
        """The residents of ``tier`` (a live list: copy before mutating placement)."""
        return self._members[tier]

    def order(self, tier: int) -> OrderedDict[int, None]:
        """The residents of ``tier``, least recently touched first (a live view: the
        planner moves a block read in place to the end with ``move_to_end``; copy
        before mutating placement)."""
        return self._order[tier]

    def oldest(self, tier: int, k: int, exclude: set[int] | None = None) -> list[int]:
        """The ``k`` least recently touched residents of ``tier`` not in ``exclude``
        (fewer when the tier holds fewer). O(k + excluded ones met on the way)."""
        out: list[int] = []
        if k <= 0:
            return out
        for block in self._order[tier]:
            if exclude and block in exclude:
                continue
            out.append(block)
            if len(out) == k:
                break
        return out

    def sample(
        self, tier: int, k: int, rng: np.random.Generator, exclude: set[int] | None = None
    ) -> list[int]:
        """Up to ``k`` distinct residents of ``tier``, uniformly, without ``exclude``."""
        members = self._members[tier]
        n = len(members)
        if n == 0 or k <= 0:
            return []
        if n <= k:
            picked = list(members)
        else:
            idx = rng.integers(0, n, size=k)
            picked = list(dict.fromkeys(map(members.__getitem__, idx.tolist())))
        if exclude:
            picked = [b for b in picked if b not in exclude]
        return picked

    def __len__(self) -> int:
        return len(self._tier)
