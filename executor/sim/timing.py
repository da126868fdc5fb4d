"""The timing model: how long a transfer takes on a tier's read or write side.

A ``Channel`` is one direction of one tier (reads out of NVMe, writes into DRAM...):

- ``parallelism`` lanes, each moving one transfer at a time at the *serial* rate,
  after a fixed per-operation ``latency_ms``;
- one shared link at the *parallel* (aggregate) rate, a FIFO fluid queue: every
  transfer's bytes are booked on it in order;
- for prefetch traffic only, an admission budget: a token bucket filled at
  ``prefetch_share`` x the parallel rate holding at most ``prefetch_burst_ms`` of it.
  A prefetch that finds the bucket short is refused (a late prefetch is worthless, and
  queueing it would only delay demand reads), exactly like the real executor's
  ``TokenBucket``. So prefetch takes at most that share of the link over time.

A transfer of ``b`` bytes booked at ``t`` completes at::

    lane = max(t, earliest free lane) + latency_ms + b / serial_rate
    link = max(t, link free)          + b / parallel_rate
    done = max(lane, link)

One transfer on an idle channel takes ``latency_ms + b / serial_rate`` (the 0.98 GB/s
cold read); many at once finish at the aggregate rate (the 5.23 GB/s parallel read).
Demand and admitted prefetch share the lanes and the link in booking order: a demand
read queues behind prefetch already booked (a FIFO device queue, the pessimistic case
for prefetching). Completion times are fixed when booked (later bookings never delay
earlier ones), which keeps every booking O(log parallelism).

A move from tier A to tier B books A's read channel and B's write channel and
completes when both are done.
"""

from __future__ import annotations

import heapq

MS_PER_S = 1000.0


class Channel:
    __slots__ = (
        "latency_ms",
        "serial_bytes_per_s",
        "parallel_bytes_per_s",
        "parallelism",
        "prefetch_share",
        "_ms_per_byte_serial",
        "_ms_per_byte_parallel",
        "_ms_per_byte_budget",
        "prefetch_burst_ms",
        "_lanes",
        "_link_free_ms",
        "_budget_free_ms",
    )

    def __init__(
        self,
        *,
        serial_bytes_per_s: float,
        parallel_bytes_per_s: float,
        parallelism: int,
        latency_ms: float,
        prefetch_share: float = 1.0,
        prefetch_burst_ms: float = 1000.0,
    ) -> None:
        if not 0 < serial_bytes_per_s <= parallel_bytes_per_s:
            raise ValueError(
                f"need 0 < serial ({serial_bytes_per_s}) <= parallel ({parallel_bytes_per_s}) bytes/s"
            )
        if parallelism < 1:
            raise ValueError(f"parallelism must be >= 1, got {parallelism}")
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
        if not 0 < prefetch_share <= 1:
            raise ValueError(f"prefetch_share must be in (0, 1], got {prefetch_share}")
        self.serial_bytes_per_s = serial_bytes_per_s
        self.parallel_bytes_per_s = parallel_bytes_per_s
        self.parallelism = parallelism
        self.latency_ms = latency_ms
        if prefetch_burst_ms < 0:
            raise ValueError(f"prefetch_burst_ms must be >= 0, got {prefetch_burst_ms}")
        self.prefetch_share = prefetch_share
        self.prefetch_burst_ms = prefetch_burst_ms
        self._ms_per_byte_serial = MS_PER_S / serial_bytes_per_s
        self._ms_per_byte_parallel = MS_PER_S / parallel_bytes_per_s
        self._ms_per_byte_budget = (
            0.0 if prefetch_share >= 1 else MS_PER_S / (prefetch_share * parallel_bytes_per_s)
        )
        self.reset()

    def reset(self) -> None:
        """Forget every booking (an idle channel at time 0)."""
        self._lanes = [0.0] * self.parallelism
        self._link_free_ms = 0.0
        self._budget_free_ms = 0.0

    def admits_prefetch(self, now_ms: float, size_bytes: int) -> bool:
        """Whether the prefetch budget has room for ``size_bytes`` now (no change)."""
        if not self._ms_per_byte_budget:
            return True
        backlog = self._budget_free_ms - now_ms
        return (
            backlog + size_bytes * self._ms_per_byte_budget <= self.prefetch_burst_ms
            or backlog <= 0
        )

    def charge_prefetch(self, now_ms: float, size_bytes: int) -> None:
        """Take ``size_bytes`` from the prefetch budget (after ``admits_prefetch``)."""
        if self._ms_per_byte_budget:
            start = now_ms if now_ms > self._budget_free_ms else self._budget_free_ms
            self._budget_free_ms = start + size_bytes * self._ms_per_byte_budget

    def book(self, now_ms: float, size_bytes: int) -> float:
        """Book a transfer of ``size_bytes`` starting no earlier than ``now_ms``;
        return its completion time in ms."""
        lane_free = self._lanes[0]
        done = (
            (now_ms if now_ms > lane_free else lane_free)
            + self.latency_ms
            + size_bytes * self._ms_per_byte_serial
        )
        link = (
            now_ms if now_ms > self._link_free_ms else self._link_free_ms
        ) + size_bytes * self._ms_per_byte_parallel
        self._link_free_ms = link
        if link > done:
            done = link
        heapq.heapreplace(self._lanes, done)
        return done

    def idle_time_ms(self, size_bytes: int) -> float:
        """Time one transfer takes on an idle channel (no prefetch budget)."""
        return max(
            self.latency_ms + size_bytes * self._ms_per_byte_serial,
            size_bytes * self._ms_per_byte_parallel,
        )

    def busy_until_ms(self) -> float:
        """When the last booked transfer on the link completes."""
        return max(self._link_free_ms, max(self._lanes))


class TierChannels:
    """The read and write channels of one tier."""

    __slots__ = ("name", "read", "write")

    def __init__(self, name: str, read: Channel, write: Channel) -> None:
        self.name = name
        self.read = read
        self.write = write

    def reset(self) -> None:
        self.read.reset()
        self.write.reset()
