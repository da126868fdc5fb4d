"""``Engine``: one serving engine (one TP8 node) as continuous batching with chunked
prefill, on simulated time.

Each step takes up to ``prefill_chunk_tokens`` tokens: one decode token for every
running request first, then prefill chunks of waiting requests in arrival order
(FCFS), several requests' chunks in one step when the budget allows. A request
whose cached prefix is still being loaded into HBM is skipped (asynchronous KV
loading, as vLLM's connectors do) and does not hold back the ones behind it.

Step time (``ModelSpec``): ``step_overhead_ms`` + FLOPs of every token in the step
(prefill positions and decode contexts, attention included) / (peak x MFU) + the KV
bytes the decode tokens read / HBM bandwidth. A request's first token comes at the
end of the step that computes its last prompt chunk; it then decodes one token per
step until ``output_tokens``. Busy time counts prefill and decode, so throughput
counts what users get.

Decode-only stretches (nothing to prefill until ``horizon_ms``) advance several
steps at once with the exact sum of their times (contexts grow by one token a
step), so long decodes cost O(1) each, not O(output tokens).

Callbacks, all optional: ``on_schedule(request, now_ms) -> (load_ready_ms,
cached_tokens)`` is called when a request first gets prefill budget, as an engine looks
its prompt up in its prefix cache and its KV connector when it first schedules the
request (vLLM's scheduler): for a request whose ``load_ready_ms`` is None (the "no
prewarm" case) its loads start only then; one whose loads started at arrival (prewarm)
may find more of its prefix cached by now (blocks earlier requests computed while it
queued) or less (blocks evicted since). Without ``on_schedule``, a request's loads
start when it is first scheduled (None) or as submitted. ``on_first_token`` and
``on_finish`` receive the request when those happen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from executor.sim.profile import ModelSpec


@dataclass(slots=True)
class EngineRequest:
    """One request inside the engine (positions and counts in tokens)."""

    key: Any
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV is reused (loaded), not computed."""
    load_ready_ms: float | None = 0.0
    """When the cached prefix is in HBM; None until the engine schedules it."""
    next_position: int = -1
    generated: int = 0
    first_token_ms: float = -1.0
    finish_ms: float = -1.0
    queued_ms: float = 0.0
    """Time from arrival until its first prefill chunk was computed."""
    scheduled: bool = False
    """It has had prefill budget once (``on_schedule`` ran for it)."""
    extra: dict[str, Any] = field(default_factory=dict)


ScheduleFn = Callable[[EngineRequest, float], tuple[float, int]]
"""(request, now_ms) -> (load_ready_ms, cached_tokens) when its loads start."""
NotifyFn = Callable[[EngineRequest], None]


class Engine:
    def __init__(
        self,
        model: ModelSpec,
        *,
        hbm_read_bytes_per_s: float,
        on_schedule: ScheduleFn | None = None,
        on_first_token: NotifyFn | None = None,
        on_finish: NotifyFn | None = None,
        blocking_loads: bool = False,
    ) -> None:
        """``blocking_loads``: a step that schedules a request whose prefix is still
        loading waits for the load (the forward pass waits for its KV, as a connector
        that loads synchronously does, e.g. LMCache's retrieve before the layers run);
        every request in the batch waits with it. Default: asynchronous loading (the
        request is skipped until its KV is in HBM)."""
        self.model = model
        self.blocking_loads = blocking_loads
        self.stalled_ms = 0.0
        self.now_ms = 0.0
        self.busy_ms = 0.0
        self.num_steps = 0
        self.waiting: list[EngineRequest] = []
        self.decoding: list[EngineRequest] = []
        self.on_schedule = on_schedule
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        fps = model.flops_per_s
        self._ms_per_flop = 1000.0 / fps
        self._kv_ms_per_token = model.kv_bytes_per_token * 1000.0 / hbm_read_bytes_per_s
        # decode token at context c costs a + b * c ms (compute plus KV read)
        self._decode_a_ms = model.linear_flops_per_token * self._ms_per_flop
        self._decode_b_ms = (
            model.attention_flops_per_position * self._ms_per_flop + self._kv_ms_per_token
        )

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.decoding)

    def submit(self, request: EngineRequest) -> None:
        """A request arrived (at ``request.arrival_ms``, not before ``now_ms``). At
        least its last prompt token is computed (it yields the first output token),
        as in vLLM, so ``cached_tokens`` is capped at ``prompt_tokens - 1``."""
        if request.prompt_tokens < 1 or request.output_tokens < 1:
            raise ValueError(
                f"request {request.key!r}: prompt and output need >= 1 token, got "
                f"{request.prompt_tokens} and {request.output_tokens}"
            )
        request.cached_tokens = min(request.cached_tokens, request.prompt_tokens - 1)
        request.next_position = request.cached_tokens
        self.waiting.append(request)

    def prefill_step_ms(self, chunks: list[tuple[int, int]], contexts: list[int]) -> float:
        """Time of one step computing prefill ``chunks`` ([start, end) positions) and
        one decode token after each of ``contexts``."""
        model = self.model
        flops = sum(model.prefill_flops(s, e) for s, e in chunks)
        ms = self.model.step_overhead_ms + flops * self._ms_per_flop
        for c in contexts:
            ms += self._decode_a_ms + self._decode_b_ms * c
        return ms

    def next_start_ms(self) -> float | None:
        """When the next step can start: now when any request can make progress, the
        earliest load completion when only loading requests wait, None when idle."""
        if self.decoding:
            return self.now_ms
        earliest: float | None = None
        for r in self.waiting:
            # Not before it arrived (an idle engine's clock lags the arrivals).
            ready = (
                r.arrival_ms
                if r.load_ready_ms is None or self.blocking_loads
                else (r.load_ready_ms)
            )
            if ready <= self.now_ms:
                return self.now_ms
            if earliest is None or ready < earliest:
                earliest = ready
        return earliest

    def step(self, horizon_ms: float = float("inf")) -> None:
        """Run one step (or a stretch of decode-only steps ending before
        ``horizon_ms``, the next external event). Call only when ``next_start_ms``
        is not None."""
        start = self.next_start_ms()
        if start is None:
            return
        self.now_ms = t = start
        budget = self.model.prefill_chunk_tokens - len(self.decoding)
        chunks: list[tuple[EngineRequest, int, int]] = []
        for r in self.waiting:
            if budget <= 0:
                break
            if r.arrival_ms > t:
                continue
            if not r.scheduled:
                r.scheduled = True
                if self.on_schedule is not None:
                    r.load_ready_ms, cached = self.on_schedule(r, t)
                    r.cached_tokens = min(cached, r.prompt_tokens - 1)
                    r.next_position = r.cached_tokens
                elif r.load_ready_ms is None:
                    r.load_ready_ms = t
            assert r.load_ready_ms is not None
            if r.load_ready_ms > t and not self.blocking_loads:
                continue
            n = min(budget, r.prompt_tokens - r.next_position)
            chunks.append((r, r.next_position, r.next_position + n))
            budget -= n
        if not chunks and self.decoding:
            self._decode_stretch(horizon_ms)
            return
        if self.blocking_loads and chunks:
            # The forward pass waits for the KV of every request it computes.
            loaded = max(r.load_ready_ms or t for r, _, _ in chunks)
            if loaded > t:
                self.stalled_ms += loaded - t
                t = loaded
        contexts = [r.prompt_tokens + r.generated for r in self.decoding]
        ms = self.prefill_step_ms([(s, e) for _, s, e in chunks], contexts)
        end = t + ms
        self.busy_ms += ms
        self.num_steps += 1
        self.now_ms = end
        finished: list[EngineRequest] = []
        for r in self.decoding:
            r.generated += 1
            if r.generated >= r.output_tokens:
                r.finish_ms = end
                finished.append(r)
        if finished:
            done = set(map(id, finished))
            self.decoding = [r for r in self.decoding if id(r) not in done]
        prefilled: list[EngineRequest] = []
        for r, s, e in chunks:
            if s == r.cached_tokens and r.queued_ms == 0.0:
                r.queued_ms = t - r.arrival_ms
            r.next_position = e
            if e >= r.prompt_tokens:
                prefilled.append(r)
        if prefilled:
            gone = set(map(id, prefilled))
            self.waiting = [r for r in self.waiting if id(r) not in gone]
            for r in prefilled:
                r.first_token_ms = end
                r.generated = 1
                if self.on_first_token is not None:
                    self.on_first_token(r)
                if r.generated >= r.output_tokens:
                    r.finish_ms = end
                    finished.append(r)
                else:
                    self.decoding.append(r)
        if self.on_finish is not None:
            for r in finished:
                self.on_finish(r)

    def _decode_stretch(self, horizon_ms: float) -> None:
        """k decode-only steps at once: step j (0-based) takes
        ``overhead + B a + b (S + B j)`` for B running requests of total context S."""
        running = self.decoding
        B = len(running)
        S = sum(r.prompt_tokens + r.generated for r in running)
        a = self.model.step_overhead_ms + B * self._decode_a_ms
        b = self._decode_b_ms
        first_ms = a + b * S
        k = min(r.output_tokens - r.generated for r in running)
        for r in self.waiting:
            if r.load_ready_ms is not None and r.load_ready_ms < horizon_ms:
                horizon_ms = r.load_ready_ms
        if horizon_ms < float("inf"):
            fits = int((horizon_ms - self.now_ms) // first_ms)
            k = max(1, min(k, fits))
        ms = k * a + b * (k * S + B * k * (k - 1) / 2.0)
        end = self.now_ms + ms
        self.busy_ms += ms
        self.num_steps += k
        self.now_ms = end
        finished = []
        for r in running:
            r.generated += k
            if r.generated >= r.output_tokens:
                r.finish_ms = end
                finished.append(r)
        if finished:
            self.decoding = [r for r in running if r.generated < r.output_tokens]
            if self.on_finish is not None:
                for r in finished:
                    self.on_finish(r)


def busy_ms_uncached(
    model: ModelSpec,
    *,
    hbm_read_bytes_per_s: float,
    requests: Sequence[tuple[float, int, int]],
) -> float:
    """Engine busy time (prefill and decode) to serve ``requests`` (arrival ms, prompt
    tokens, output tokens), open loop, with nothing cached: the work a trace offers at
    its time scale. Decode steps are batched over whatever is decoding, so this depends
    on the arrival times, not only on the token counts."""
    engine = Engine(model, hbm_read_bytes_per_s=hbm_read_bytes_per_s)
    for key, (arrival_ms, prompt, output) in enumerate(sorted(requests)):
        while (ready := engine.next_start_ms()) is not None and ready < arrival_ms:
            engine.step(horizon_ms=arrival_ms)
        engine.submit(
            EngineRequest(
                key=key,
                arrival_ms=arrival_ms,
                prompt_tokens=prompt,
                output_tokens=output,
                load_ready_ms=arrival_ms,  # nothing to load; not startable before it arrives
            )
        )
    while engine.next_start_ms() is not None:
        engine.step()
    return engine.busy_ms
