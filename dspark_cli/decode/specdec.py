"""Speculative decoding with a real target (Transformers, KV cache) and a DSpark drafter.

A round covers the R requests in flight at once: one drafter pass proposes γ tokens after every
request's anchor (the last emitted token), from the target features of the positions before it;
the scheduler picks how many drafted tokens ℓ_r each request verifies, jointly from all R
requests' confidences; one target forward over [anchor, d_1..d_ℓ] of every row (ragged: padded,
masked, per-row positions; decode/batch.py) gives the ℓ_r + 1 distributions; `verify_rounds`
accepts a prefix per row and emits a correction or bonus token; each row keeps the anchor and the
accepted tokens in the cache, and their features (captured by that same pass) extend the
drafter's context. So the SPS the scheduler assumes is the SPS this loop runs at.

Each phase is timed (`DecodeStats.phases`, seconds): prefill, draft_context (new context rows),
draft_backbone (backbone, lm_head, top-k), draft_heads (the γ Markov/confidence/sampling steps),
verify (the target forward and its lm_head), and what is outside both: schedule and accept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.draw import draw
from ..settings.eval import EvalSettings
from ..target.capture import cache_kwarg
from ..target.chat import render_prompt, stop_ids
from ..target.kv import new_cache
from .batch import TargetBatch
from .calibrate import apply_temperatures
from .prompts import Conversation
from .sampling import GREEDY_EPS, probs_from_logits, sample, verify_rounds
from .scheduler import Scheduler, expected_throughput

#: Candidates the Markov bias is applied to per slot (0 = the whole vocabulary); see
#: DSparkDrafter.draft. docs/eval.md measures the cost and the acceptance of each choice.
DEFAULT_DRAFT_TOP_K = EvalSettings.draft_top_k


@dataclass
class RoundLog:
    """One request's round: γ drafted, ℓ verified, a accepted, the raw slot confidences, and
    the conversation it belongs to (calibration cross-fits and eval bootstraps by conversation)."""

    verified: int
    accepted: int
    confidences: list[float] | None
    conversation: str = ""


@dataclass
class BatchRound:
    """One joint round of R requests: verified tokens B and what the model of Θ predicts."""

    requests: int
    batch_tokens: int
    emitted: int
    expected_tau: float | None
    theta: float


@dataclass
class DecodeStats:
    """Everything a report needs from decoding one dataset."""

    gamma: int
    rounds: list[RoundLog] = field(default_factory=list)
    batches: list[BatchRound] = field(default_factory=list)
    new_tokens: int = 0
    seconds: float = 0.0
    turns: int = 0
    answers: dict[str, list[str]] = field(default_factory=dict)  # conversation id → answers
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (module doc)


class Stopwatch:
    """Charges the time since the last lap to a phase; syncs CUDA so a phase pays its own kernels."""

    def __init__(self, device: torch.device, phases: dict[str, float]) -> None:
        self.device, self.phases = device, phases
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now


@dataclass
class _Request:
    """A request in flight: its conversation, which turn, its token ids (prompt + generated)."""

    conv: Conversation
    turn: int
    messages: list[dict[str, str]]
    ids: list[int]
    prompt_len: int
    answers: list[str] = field(default_factory=list)


class SpeculativeDecoder:
    """Decodes conversations R at a time with a drafter, a scheduler and (optionally) calibration.

    Without a drafter (drafter=None) every round is one target step for all R rows: the target
    alone, batched by the same loop, the baseline a batched speculative run is compared with.
    """

    def __init__(self, model: Any, tokenizer: Any, drafter: Any, scheduler: Scheduler, *,
                 temperature: float = 1.0, max_new_tokens: int = 256, thinking: bool = False,
                 temperatures: list[float] | None = None, seed: int = 0,
                 draft_top_k: int = DEFAULT_DRAFT_TOP_K) -> None:
        self.model, self.tokenizer, self.drafter, self.scheduler = model, tokenizer, drafter, scheduler
        self.temperature, self.max_new_tokens, self.thinking = temperature, max_new_tokens, thinking
        self.calibration = temperatures
        self.layers = list(drafter.config.target_layer_ids) if drafter is not None else [0]
        self.gamma = int(drafter.block_size) if drafter is not None else 0
        self.stop = stop_ids(tokenizer, model)
        self.seed, self.draft_top_k = seed, draft_top_k
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        if temperatures is not None and len(temperatures) != self.gamma:
            from ..errors import DsparkError

            raise DsparkError(f"calibration has {len(temperatures)} temperatures but the drafter drafts "
                              f"γ = {self.gamma} tokens.",
                              hint="calibrate this drafter with `dspark calibrate`.")

    # ---- requests ------------------------------------------------------------------------------

    def _generated(self, req: _Request) -> list[int]:
        return req.ids[req.prompt_len:]

    def _finished(self, req: _Request) -> bool:
        out = self._generated(req)
        return len(out) >= self.max_new_tokens or any(t in self.stop for t in out)

    def _answer_ids(self, req: _Request, keep_stop: bool = False) -> list[int]:
        """Generated ids up to the first stop token (included when keep_stop) or max_new_tokens."""
        out = self._generated(req)[: self.max_new_tokens]
        for i, t in enumerate(out):
            if t in self.stop:
                return out[: i + 1] if keep_stop else out[:i]
        return out

    def _answer_text(self, req: _Request) -> str:
        return self.tokenizer.decode(self._answer_ids(req), skip_special_tokens=True)

    def _join(self, conv: Conversation, turn: int, history: list[dict[str, str]],
              answers: list[str]) -> None:
        """Prefill a turn as a new last row of the target batch and the drafter context."""
        messages = [*history, {"role": "user", "content": conv.turns[turn]}]
        ids = render_prompt(self.tokenizer, messages, self.thinking)
        hidden, final = self._batch.add(ids)
        first = sample(probs_from_logits(self.lm_head(final[-1:]), self.temperature)[0], self._gen)
        self._requests.append(_Request(conv, turn, messages, [*ids, first], len(ids), answers))
        if self.drafter is not None:
            self._context.add_row()
            self.drafter.extend_context(self._context, [None] * (self._context.rows - 1)
                                        + [hidden.to(torch.bfloat16)])  # stored as the cache stores them

    def _fill_and_retire(self, pending: list[Conversation], concurrency: int, stats: DecodeStats,
                         on_turn: Callable[[int], None] | None) -> None:
        """Start conversations while there is room; retire finished turns (their next turn joins)."""
        while True:
            while pending and len(self._requests) < concurrency:
                conv = pending.pop(0)
                self._join(conv, 0, [{"role": "system", "content": conv.system}] if conv.system else [], [])
            done = [r for r in self._requests if self._finished(r)]  # a prefill can already end a turn
            if not done:
                return
            keep = [i for i, r in enumerate(self._requests) if not self._finished(r)]
            self._requests = [self._requests[i] for i in keep]
            self._batch.keep(keep)
            if self.drafter is not None:
                self._context.keep(keep)
            for req in done:
                stats.new_tokens += len(self._answer_ids(req, keep_stop=True))
                stats.turns += 1
                answer = self._answer_text(req)
                answers = [*req.answers, answer]
                if on_turn:
                    on_turn(1)
                if req.turn + 1 < len(req.conv.turns):
                    self._join(req.conv, req.turn + 1,
                               [*req.messages, {"role": "assistant", "content": answer}], answers)
                else:
                    stats.answers[req.conv.id] = answers

    # ---- the batched loop ----------------------------------------------------------------------

    def _start(self) -> None:
        """Fresh generators, an empty target batch and drafter context: every run starts alike."""
        self._gen = torch.Generator(device=self.device).manual_seed(self.seed)
        self._batch = TargetBatch(self.model, self.layers)
        self._requests: list[_Request] = []
        if self.drafter is not None:
            drafter_device = next(self.drafter.parameters()).device
            self._draft_gen = torch.Generator(device=drafter_device).manual_seed(self.seed + 1)
            self._context = self.drafter.new_context()

    @torch.inference_mode()
    def run(self, conversations: list[Conversation], concurrency: int = 1,
            on_turn: Callable[[int], None] | None = None) -> DecodeStats:
        """Decode every turn of every conversation, `concurrency` requests per round."""
        stats = DecodeStats(gamma=self.gamma)
        self._start()
        pending = list(conversations)
        watch = Stopwatch(self.device, stats.phases)
        t0 = time.perf_counter()
        while True:
            self._fill_and_retire(pending, concurrency, stats, on_turn)
            watch.lap("prefill")
            if not self._requests:
                break
            if self.drafter is None:
                self._target_step(stats, watch)
            else:
                self._round(stats, watch)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _target_step(self, stats: DecodeStats, watch: Stopwatch) -> None:
        """No drafter: one token per row from one batched target step."""
        requests = self._requests
        inputs, positions = [[r.ids[-1]] for r in requests], [len(r.ids) - 1 for r in requests]
        _hidden, final = self._batch.forward(inputs, positions)
        logits = self.lm_head(final[:, 0])  # [R, V]
        watch.lap("verify")
        if self.temperature <= GREEDY_EPS:
            tokens = logits.argmax(-1)
        else:
            tokens = draw(probs_from_logits(logits, self.temperature), self._gen)
        self._batch.commit([1] * len(requests))
        for req, token in zip(requests, tokens.tolist(), strict=True):
            req.ids.append(token)
        stats.batches.append(BatchRound(len(requests), len(requests), len(requests), None,
                                        len(requests) * self.scheduler.sps(len(requests))))
        watch.lap("accept")

    def _round(self, stats: DecodeStats, watch: Stopwatch) -> None:
        requests = self._requests
        anchors = torch.tensor([r.ids[-1] for r in requests])
        block = self.drafter.draft(self._context, anchors, self.temperature, self._draft_gen,
                                   self.draft_top_k, lap=watch.lap)
        raw = block.confidences.tolist() if block.confidences is not None else None
        calibrated = None
        if raw is not None:
            calibrated = [apply_temperatures(r, self.calibration) if self.calibration else r for r in raw]
        # Emitting ℓ + 1 tokens must not pass max_new_tokens.
        room = [max(0, self.max_new_tokens - len(self._generated(r)) - 1) for r in requests]
        lengths = self.scheduler.schedule(calibrated, room)
        drafted = block.dist.tokens.tolist()
        watch.lap("schedule")
        inputs = [[r.ids[-1], *d[:n]] for r, d, n in zip(requests, drafted, lengths, strict=True)]
        hidden, final = self._batch.forward(inputs, [len(r.ids) - 1 for r in requests])
        logits = self.lm_head(final)  # [R, q, V] where the target runs: nothing vocabulary-wide is copied
        watch.lap("verify")
        accepted, next_token = verify_rounds(block.dist, logits, torch.tensor(lengths), self.temperature,
                                             self._gen)
        accepted, next_token = accepted.tolist(), next_token.tolist()
        keep = [a + 1 for a in accepted]  # the anchor and the accepted tokens now lie before the new anchor
        self._batch.commit(keep)
        emitted = 0
        for req, d, n, a, t, conf in zip(requests, drafted, lengths, accepted, next_token,
                                         raw or [None] * len(requests), strict=True):
            req.ids.extend([*d[:a], t])
            stats.rounds.append(RoundLog(n, a, conf, req.conv.id))
            emitted += a + 1
        watch.lap("accept")
        kept = [hidden[i, :k].to(torch.bfloat16) for i, k in enumerate(keep)]  # stored as the cache does
        self.drafter.extend_context(self._context, kept)
        watch.lap("draft_context")
        batch_tokens = sum(1 + n for n in lengths)
        expected = None
        if calibrated is not None:
            expected = expected_throughput(calibrated, lengths, self.scheduler.sps)[0]
        stats.batches.append(BatchRound(len(requests), batch_tokens, emitted, expected,
                                        emitted * self.scheduler.sps(batch_tokens)))


@torch.inference_mode()
def target_only(model: Any, tokenizer: Any, conversations: list[Conversation], *, temperature: float,
                max_new_tokens: int, thinking: bool, seed: int = 0) -> DecodeStats:
    """Plain autoregressive decoding of the same prompts: the tokens/s baseline."""
    stats = DecodeStats(gamma=0)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    stop = stop_ids(tokenizer, model)
    cache_kw = cache_kwarg(model)
    t0 = time.perf_counter()
    for conv in conversations:
        messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
        answers = []
        for turn in conv.turns:
            messages.append({"role": "user", "content": turn})
            ids = torch.tensor([render_prompt(tokenizer, messages, thinking)], device=device)
            cache = new_cache(model.config)
            out_ids: list[int] = []
            while len(out_ids) < max_new_tokens:
                # logits_to_keep=1: the prompt's other rows are never sampled, and their [T, V]
                # logits would charge the baseline a full-vocabulary product the speculative
                # prefill (features only) does not pay.
                logits = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                               **{cache_kw: cache}).logits[0, -1]
                token = sample(probs_from_logits(logits, temperature), gen)
                out_ids.append(token)
                if token in stop:
                    break
                ids = torch.tensor([[token]], device=device)
            stats.new_tokens += len(out_ids)
            stats.turns += 1
            text = tokenizer.decode([t for t in out_ids if t not in stop], skip_special_tokens=True)
            answers.append(text)
            messages.append({"role": "assistant", "content": text})
        stats.answers[conv.id] = answers
    stats.seconds = time.perf_counter() - t0
    return stats


#: New tokens of the untimed first decode (`warm_up`).
WARM_UP_TOKENS = 16


def warm_up(decode: Callable[[list[Conversation], int], Any], model: Any, tokenizer: Any,
            conversations: list[Conversation], *, baseline: bool, temperature: float, thinking: bool,
            seed: int = 0) -> None:
    """An untimed short decode of the first conversation, speculative (`decode(convs, max_new)`)
    and, with `baseline`, target-only: the first decode pays one-off costs (kernel selection for
    new shapes, allocator growth; up to 1.7x on the target-only loop, docs/eval.md), and whichever
    loop ran first paid them, which biased the measured speed-up. Each timed decode seeds its own
    sampler, so what it emits is unchanged."""
    decode(conversations[:1], WARM_UP_TOKENS)
    if baseline:
        target_only(model, tokenizer, conversations[:1], temperature=temperature,
                    max_new_tokens=WARM_UP_TOKENS, thinking=thinking, seed=seed)


def merge_stats(parts: list[DecodeStats]) -> DecodeStats:
    """One DecodeStats for decodes of disjoint conversations (rounds in order, seconds summed)."""
    merged = DecodeStats(gamma=parts[0].gamma if parts else 0)
    for part in parts:
        merged.rounds.extend(part.rounds)
        merged.batches.extend(part.batches)
        merged.new_tokens += part.new_tokens
        merged.seconds += part.seconds
        merged.turns += part.turns
        merged.answers.update(part.answers)
        for phase, seconds in part.phases.items():
            merged.phases[phase] = merged.phases.get(phase, 0.0) + seconds
    return merged


def paired_decode(speculative: Callable[[list[Conversation]], DecodeStats],
                  baseline: Callable[[list[Conversation]], DecodeStats],
                  conversations: list[Conversation]) -> tuple[DecodeStats, DecodeStats]:
    """Each conversation decoded speculatively and target-only back to back, which one first
    alternating: on a shared or throttling machine the speed drifts by ±15% within a minute, and
    two loops timed one after the other each saw a different machine (single speed-ups swung
    0.79-1.32× on the same drafter, docs/eval.md). Paired, both sides see the same minutes.
    Each call seeds its own sampler, so conversation i emits the same tokens whatever its turn."""
    spec_parts, base_parts = [], []
    for i, conv in enumerate(conversations):
        order = [(speculative, spec_parts), (baseline, base_parts)]
        for decode, parts in order if i % 2 == 0 else order[::-1]:
            parts.append(decode([conv]))
    return merge_stats(spec_parts), merge_stats(base_parts)
