"""A seeded model of LLM-serving traffic that writes Mooncake-format traces.

What it models (each knob in ``WorkloadParams``):

- **Multi-turn chat.** A session's turn k+1 prompt is turn k's prompt + its answer +
  new user tokens, so its block chain extends the previous one. Think time between
  turns is log-normal; the number of turns geometric.
- **Shared prefixes.** Every request starts with one of a few system prompts (Zipf
  popularity); some chats add a few-shot template after it.
- **RAG.** A template + one of ``rag_num_documents`` documents (Zipf popularity) + a
  fresh question: popular documents are shared prefixes across sessions.
- **Agent tool loops.** Many short steps with short think times, each appending tool
  output to the context.
- **Scans.** One-off long documents that are read once and never again.
- **Arrivals.** Session starts follow a Poisson process whose rate has a diurnal
  (sinusoidal) swing and Markov-modulated bursts.

Blocks: a prompt is a list of content segments; its token stream is cut into
``block_size_tokens`` blocks and each block's id is assigned from a prefix tree keyed
by (parent block id, the content the block covers). So an id always follows the same
predecessor, identical prefixes share ids, and ids first appear in order 0, 1, 2 ...
like the Mooncake traces. Same params and seed give the same bytes.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

Segment = tuple[int, int]  # (content id, number of tokens)


@dataclass(frozen=True)
class WorkloadParams:
    """Every knob of the workload model. The defaults are tuned so the mixed profile has
    the shape of the Mooncake conversation trace (infinite-cache hit ratio ~0.36, LRU
    ~0.09/0.21/0.28 at 1/5/10% of distinct blocks, median reuse distance ~300
    requests) at about 3 requests/s: a workload where recency alone is not enough."""

    num_requests: int = 20_000
    seed: int = 0
    block_size_tokens: int = 512
    # Arrivals (sessions per second, before diurnal and burst modulation).
    session_rate_per_s: float = 1.5
    diurnal_amplitude: float = 0.25
    diurnal_period_s: float = 3600.0
    burst_multiplier: float = 2.0
    burst_mean_s: float = 20.0
    calm_mean_s: float = 400.0
    # Session mix: weights of each kind of session.
    mix: dict[str, float] = field(
        default_factory=lambda: {"chat": 0.5, "rag": 0.12, "agent": 0.03, "scan": 0.35}
    )
    # Shared prefixes.
    num_system_prompts: int = 12
    system_prompt_zipf: float = 1.2
    system_prompt_tokens: tuple[int, int] = (200, 900)
    num_fewshot_templates: int = 20
    fewshot_probability: float = 0.1
    fewshot_tokens: tuple[int, int] = (1000, 4000)
    # Chat.
    chat_mean_turns: float = 2.5
    chat_think_median_s: float = 240.0
    chat_think_sigma: float = 1.3
    chat_user_median_tokens: float = 300.0
    chat_first_context_median_tokens: float = 9000.0
    answer_median_tokens: float = 350.0
    # RAG.
    rag_num_documents: int = 3000
    rag_zipf: float = 1.1
    rag_document_tokens: tuple[int, int] = (2000, 12000)
    rag_mean_questions: float = 1.5
    # Agents.
    agent_mean_steps: float = 8.0
    agent_think_median_s: float = 4.0
    agent_tool_median_tokens: float = 600.0
    # Scans.
    scan_tokens: tuple[int, int] = (8000, 60000)
    # Planted pattern: when > 0, chat think time is exactly this many seconds (a
    # learnable regularity used by tests; 0 = log-normal think times).
    fixed_return_gap_s: float = 0.0
    output_tokens_max: int = 4096
    # Long context: when set, a chat's first context is uniform in these bounds
    # (tokens) instead of log-normal; a session ends before a prompt would exceed
    # max_prompt_tokens (0: no limit).
    chat_first_context_tokens: tuple[int, int] | None = None
    max_prompt_tokens: int = 0


PROFILES: dict[str, dict[str, Any]] = {
    "mixed": {},
    "chat": {"mix": {"chat": 0.85, "rag": 0.05, "agent": 0.0, "scan": 0.10}},
    "rag": {"mix": {"chat": 0.2, "rag": 0.65, "agent": 0.0, "scan": 0.15}},
    "agent": {"mix": {"chat": 0.2, "rag": 0.05, "agent": 0.65, "scan": 0.10}},
    # Long shared prefixes: system prompts and few-shot templates of 20-80 blocks (10k-
    # 40k tokens) shared by many requests, short questions after them; prompts 20k-40k
    # tokens. Reuse is of the prefix, not of the session.
    "sharedprefix": {
        "mix": {"chat": 0.25, "rag": 0.6, "agent": 0.0, "scan": 0.15},
        "num_system_prompts": 30,
        "system_prompt_zipf": 0.9,
        "system_prompt_tokens": (10_240, 40_960),
        "fewshot_probability": 0.5,
        "fewshot_tokens": (4_000, 12_000),
        "rag_num_documents": 400,
        "rag_document_tokens": (1_000, 6_000),
        "chat_first_context_median_tokens": 2_000.0,
        "session_rate_per_s": 3.0,
    },
    # A day of bursty, agent-heavy traffic: the rate follows the day (idle for hours at
    # night, amplitude > 1 clips it to zero), with bursts of 6x lasting minutes.
    "diurnal": {
        "mix": {"chat": 0.3, "rag": 0.1, "agent": 0.5, "scan": 0.1},
        "session_rate_per_s": 0.004,
        "diurnal_amplitude": 1.6,
        "diurnal_period_s": 86_400.0,
        "burst_multiplier": 6.0,
        "burst_mean_s": 300.0,
        "calm_mean_s": 3_600.0,
    },
    # Scan-heavy: most requests read a one-off long document that never returns.
    "scan": {"mix": {"chat": 0.12, "rag": 0.08, "agent": 0.0, "scan": 0.8}},
    # Sessions come back after exactly 45 s, with scans in between to push them out of
    # a recency cache: a predictor that learns the gap wins, LRU cannot.
    "planted": {
        "mix": {"chat": 0.5, "rag": 0.0, "agent": 0.0, "scan": 0.5},
        "fixed_return_gap_s": 45.0,
        "chat_mean_turns": 4.0,
        "num_system_prompts": 200,
        "system_prompt_zipf": 0.0,
    },
    # The seed's long-context setting: prompts of 32k-128k tokens, reused across the
    # turns of a conversation (the context grows by answer + user turn, ~10 minutes
    # apart) and across sessions reading the same long documents (600, Zipf 0.7).
    # About half the blocks are reused, at a median distance of a few million tokens
    # (HBM holds 1.9 M tokens of KV in the default profile, DRAM 3.9 M): reuse
    # needs the external tiers.
    "longctx": {
        "mix": {"chat": 0.5, "rag": 0.5, "agent": 0.0, "scan": 0.0},
        "session_rate_per_s": 0.1,
        "num_system_prompts": 4,
        "fewshot_probability": 0.0,
        "chat_first_context_tokens": (32_000, 100_000),
        "chat_mean_turns": 4.0,
        "chat_think_median_s": 600.0,
        "rag_num_documents": 600,
        "rag_zipf": 0.7,
        "rag_document_tokens": (32_000, 120_000),
        "rag_mean_questions": 3.0,
        "max_prompt_tokens": 131_072,
        # Long inputs, short answers (summaries, code edits): median 64 tokens.
        "answer_median_tokens": 64.0,
    },
}


def params_for(profile: str, **overrides: Any) -> WorkloadParams:
    """``WorkloadParams`` of a named profile, with overrides."""
    if profile not in PROFILES:
        raise ValueError(f"unknown workload profile {profile!r}; valid: {', '.join(PROFILES)}")
    return replace(WorkloadParams(**PROFILES[profile]), **overrides)


@dataclass
class _Request:
    ts_ms: int
    order: int  # tie-break: session start order, then turn
    segments: list[Segment]
    output_tokens: int
    session: int


class _Model:
    def __init__(self, p: WorkloadParams) -> None:
        self.p = p
        self.rng = np.random.Generator(np.random.PCG64(p.seed))
        self.next_content = 0
        self.system_prompts = [
            self._segment(self._uniform(p.system_prompt_tokens))
            for _ in range(p.num_system_prompts)
        ]
        self.fewshots = [
            self._segment(self._uniform(p.fewshot_tokens)) for _ in range(p.num_fewshot_templates)
        ]
        self.documents = [
            self._segment(self._uniform(p.rag_document_tokens)) for _ in range(p.rag_num_documents)
        ]
        self.rag_template = self._segment(400)
        self.sys_weights = _zipf_weights(p.num_system_prompts, p.system_prompt_zipf)
        self.doc_weights = _zipf_weights(p.rag_num_documents, p.rag_zipf)
        kinds = [k for k, w in p.mix.items() if w > 0]
        weights = np.array([p.mix[k] for k in kinds], dtype=float)
        self.kinds, self.kind_weights = kinds, weights / weights.sum()

    def _segment(self, tokens: float) -> Segment:
        self.next_content += 1
        return (self.next_content, max(1, int(tokens)))

    def _uniform(self, bounds: tuple[int, int]) -> int:
        return int(self.rng.integers(bounds[0], bounds[1] + 1))

    def _lognormal(self, median: float, sigma: float = 0.8) -> float:
        return float(median * math.exp(sigma * self.rng.standard_normal()))

    def _answer(self) -> int:
        return int(
            min(self.p.output_tokens_max, max(1, self._lognormal(self.p.answer_median_tokens)))
        )

    def _turns(self, mean: float) -> int:
        return int(self.rng.geometric(1.0 / max(mean, 1.0)))

    def _system(self) -> Segment:
        return self.system_prompts[
            int(self.rng.choice(len(self.system_prompts), p=self.sys_weights))
        ]

    def session(self, start_ms: int, session: int) -> Iterator[_Request]:
        kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.kind_weights))]
        p = self.p
        order = session << 16
        if kind == "scan":
            yield _Request(
                start_ms,
                order,
                [self._system(), self._segment(self._uniform(p.scan_tokens))],
                self._answer(),
                session,
            )
            return
        if kind == "rag":
            doc = self.documents[int(self.rng.choice(len(self.documents), p=self.doc_weights))]
            system = self._system()
            t = float(start_ms)
            for i in range(self._turns(p.rag_mean_questions)):
                prompt = [system, self.rag_template, doc, self._segment(self._lognormal(80))]
                yield _Request(int(t), order + i, prompt, self._answer(), session)
                t += 1000 * self._lognormal(p.chat_think_median_s, p.chat_think_sigma)
            return
        # chat and agent: the context grows turn by turn.
        context: list[Segment] = [self._system()]
        if kind == "chat":
            if self.rng.random() < p.fewshot_probability:
                context.append(self.fewshots[int(self.rng.integers(len(self.fewshots)))])
            if p.chat_first_context_tokens is not None:
                first = float(self._uniform(p.chat_first_context_tokens))
            else:
                first = self._lognormal(p.chat_first_context_median_tokens, 1.0)
            context.append(self._segment(first))
            turns, think, append = (
                self._turns(p.chat_mean_turns),
                p.chat_think_median_s,
                p.chat_user_median_tokens,
            )
        else:
            context.append(self._segment(self._lognormal(800)))
            turns, think, append = (
                self._turns(p.agent_mean_steps),
                p.agent_think_median_s,
                p.agent_tool_median_tokens,
            )
        t = float(start_ms)
        limit = p.max_prompt_tokens
        for i in range(turns):
            if limit and sum(tokens for _, tokens in context) > limit:
                return
            answer = self._answer()
            yield _Request(int(t), order + i, list(context), answer, session)
            context.append(self._segment(answer))
            context.append(self._segment(self._lognormal(append)))
            if kind == "chat" and p.fixed_return_gap_s > 0:
                gap_s = p.fixed_return_gap_s
            else:
                gap_s = self._lognormal(think, p.chat_think_sigma)
            t += 1000 * gap_s

    def session_starts(self) -> Iterator[int]:
        """Session start times (ms): Poisson per second, diurnal swing, bursts."""
        p = self.p
        second = 0
        bursting = False
        state_left = self.rng.exponential(p.calm_mean_s)
        while True:
            rate = p.session_rate_per_s * (
                1 + p.diurnal_amplitude * math.sin(2 * math.pi * second / p.diurnal_period_s)
            )
            if bursting:
                rate *= p.burst_multiplier
            for offset in np.sort(self.rng.random(int(self.rng.poisson(max(rate, 0.0))))):
                yield int((second + float(offset)) * 1000)
            second += 1
            state_left -= 1
            if state_left <= 0:
                bursting = not bursting
                state_left = self.rng.exponential(p.burst_mean_s if bursting else p.calm_mean_s)


def _zipf_weights(n: int, alpha: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** alpha
    return w / w.sum()


class _BlockTree:
    """Assigns block ids from (parent id, covered content): the prefix tree."""

    def __init__(self, block_size_tokens: int) -> None:
        self.block_size = block_size_tokens
        self.ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def chain(self, segments: list[Segment]) -> list[int]:
        out: list[int] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        room = self.block_size
        for content, tokens in segments:
            start = 0
            while start < tokens:
                take = min(room, tokens - start)
                pieces.append((content, start, start + take))
                start += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    out.append(parent)
                    pieces, room = [], self.block_size
        if pieces:
            out.append(self._id(parent, pieces))
        return out

    def _id(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(pieces))
        block = self.ids.get(key)
        if block is None:
            block = self.ids[key] = len(self.ids)
        return block


def generate(params: WorkloadParams) -> Iterator[dict[str, Any]]:
    """Yield ``params.num_requests`` Mooncake rows in arrival order."""
    model = _Model(params)
    requests: list[_Request] = []
    # Enough sessions that the first num_requests by time are all generated: keep
    # going until the next session starts after the num_requests-th request.
    session = 0
    for start_ms in model.session_starts():
        if len(requests) >= params.num_requests:
            requests.sort(key=lambda r: (r.ts_ms, r.order))
            if start_ms > requests[params.num_requests - 1].ts_ms:
                break
        requests.extend(model.session(start_ms, session))
        session += 1
    requests.sort(key=lambda r: (r.ts_ms, r.order))
    tree = _BlockTree(params.block_size_tokens)
    t0 = requests[0].ts_ms if requests else 0
    for r in requests[: params.num_requests]:
        yield {
            "timestamp": r.ts_ms - t0,
            "input_length": sum(tokens for _, tokens in r.segments),
            "output_length": r.output_tokens,
            "hash_ids": tree.chain(r.segments),
            "session_id": f"s{r.session}",
        }


def write_trace(params: WorkloadParams, out: IO[str], *, session_ids: bool = False) -> int:
    """Write the trace as Mooncake JSONL; returns the number of rows."""
    count = 0
    for row in generate(params):
        if not session_ids:
            del row["session_id"]
        out.write(json.dumps(row, separators=(", ", ": ")))
        out.write("\n")
        count += 1
    return count


def generate_to_file(
    params: WorkloadParams, path: str | Path, *, session_ids: bool = False
) -> Path:
    """Write the trace to ``path``; a name ending in ``.gz`` is gzip-compressed (with a
    zero mtime, so the same seed still gives the same bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with (
            open(path, "wb") as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
            io.TextIOWrapper(gz, encoding="utf-8") as fh,
        ):
            write_trace(params, fh, session_ids=session_ids)
        return path
    with open(path, "w", encoding="utf-8") as fh:
        write_trace(params, fh, session_ids=session_ids)
    return path


def describe(params: WorkloadParams) -> dict[str, Any]:
    return asdict(params)
