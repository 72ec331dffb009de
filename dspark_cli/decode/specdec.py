"""Speculative decoding with a real target (Transformers, KV cache) and a DSpark drafter.

One round per active request: the anchor (last emitted token) and the target features of every
position before it go to `drafter.draft_block`; the scheduler picks how many drafted tokens ℓ each
request verifies (jointly for the R requests of a round); one target pass over
[anchor, d_1..d_ℓ] gives ℓ + 1 distributions; `sampling.verify` accepts a prefix and emits a
correction or bonus token; the KV cache is cropped to the accepted prefix and the features of the
anchor and accepted tokens (captured by that same pass) extend the drafter's context.

Batched rounds are simulated: the R verification passes run one after the other on this device,
but every scheduling decision is made jointly per round, from all R requests' confidences, which
is what the scheduler's correctness and Θ = τ·SPS(B) depend on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..target.capture import cache_kwarg, capture_step, new_cache
from ..target.chat import render_prompt, stop_ids
from .calibrate import apply_temperatures
from .prompts import Conversation
from .sampling import probs_from_logits, sample, verify
from .scheduler import Scheduler, expected_throughput
from .sps import crop_cache


@dataclass
class RoundLog:
    """One request's round: γ drafted, ℓ verified, a accepted, the raw slot confidences."""

    verified: int
    accepted: int
    confidences: list[float] | None


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


class TargetState:
    """One sequence on the target: token ids, KV cache (everything before the anchor), features."""

    def __init__(self, model: Any, layers: list[int], prompt_ids: list[int], temperature: float,
                 generator: torch.Generator) -> None:
        self.model, self.layers, self.temperature, self.gen = model, layers, temperature, generator
        self.lm_head = model.get_output_embeddings()
        cap = capture_step(model, prompt_ids, layers)
        self.cache = cap.past_key_values
        self.features = cap.hidden.to(torch.bfloat16)  # [n, m*d]: positions 0..n-1, stored as in the cache
        first = sample(self._probs(cap.final[-1:])[0], generator)
        self.ids = [*prompt_ids, first]

    @property
    def anchor_pos(self) -> int:
        return len(self.ids) - 1

    def _probs(self, final: torch.Tensor) -> torch.Tensor:
        """Final normed states [t, d] → float32 target distributions [t, V] on the CPU."""
        return probs_from_logits(self.lm_head(final).float().cpu(), self.temperature)

    def verify_pass(self, drafted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed [anchor, drafted…]; return target probs [ℓ+1, V] and their features [ℓ+1, m*d]."""
        cap = capture_step(self.model, [self.ids[-1], *drafted], self.layers, self.cache)
        return self._probs(cap.final), cap.hidden.to(torch.bfloat16)

    def commit(self, accepted: list[int], next_token: int, hidden: torch.Tensor) -> None:
        """Keep the anchor + accepted tokens in the cache and features; append the new tokens."""
        keep = len(accepted) + 1  # anchor and accepted drafted tokens now lie before the new anchor
        crop_cache(self.cache, self.anchor_pos + keep)
        self.features = torch.cat([self.features, hidden[:keep]], dim=0)
        self.ids.extend([*accepted, next_token])


@dataclass
class _Slot:
    """A request in flight: its conversation, which turn, and the target state of that turn."""

    conv: Conversation
    turn: int
    messages: list[dict[str, str]]
    state: TargetState
    prompt_len: int
    answers: list[str] = field(default_factory=list)


class SpeculativeDecoder:
    """Decodes conversations R at a time with a drafter, a scheduler and (optionally) calibration."""

    def __init__(self, model: Any, tokenizer: Any, drafter: Any, scheduler: Scheduler, *,
                 temperature: float = 1.0, max_new_tokens: int = 256, thinking: bool = False,
                 temperatures: list[float] | None = None, seed: int = 0) -> None:
        self.model, self.tokenizer, self.drafter, self.scheduler = model, tokenizer, drafter, scheduler
        self.temperature, self.max_new_tokens, self.thinking = temperature, max_new_tokens, thinking
        self.calibration = temperatures
        self.layers = list(drafter.config.target_layer_ids)
        self.gamma = int(drafter.block_size)
        self.stop = stop_ids(tokenizer, model)
        self.seed = seed
        self._drafting: TargetState | None = None
        if temperatures is not None and len(temperatures) != self.gamma:
            from ..errors import DsparkError

            raise DsparkError(f"calibration has {len(temperatures)} temperatures but the drafter drafts "
                              f"γ = {self.gamma} tokens.",
                              hint="calibrate this drafter with `dspark calibrate`.")

    # ---- one conversation turn -----------------------------------------------------------------

    def _open(self, conv: Conversation, turn: int, messages: list[dict[str, str]], gen: torch.Generator,
              answers: list[str]) -> _Slot:
        messages = [*messages, {"role": "user", "content": conv.turns[turn]}]
        ids = render_prompt(self.tokenizer, messages, self.thinking)
        return _Slot(conv, turn, messages, TargetState(self.model, self.layers, ids, self.temperature, gen),
                     len(ids), answers)

    def _generated(self, slot: _Slot) -> list[int]:
        return slot.state.ids[slot.prompt_len:]

    def _finished(self, slot: _Slot) -> bool:
        out = self._generated(slot)
        return len(out) >= self.max_new_tokens or any(t in self.stop for t in out)

    def _answer_ids(self, slot: _Slot, keep_stop: bool = False) -> list[int]:
        """Generated ids up to the first stop token (included when keep_stop) or max_new_tokens."""
        out = self._generated(slot)[: self.max_new_tokens]
        for i, t in enumerate(out):
            if t in self.stop:
                return out[: i + 1] if keep_stop else out[:i]
        return out

    def _answer_text(self, slot: _Slot) -> str:
        return self.tokenizer.decode(self._answer_ids(slot), skip_special_tokens=True)

    # ---- the batched loop ----------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, conversations: list[Conversation], concurrency: int = 1,
            on_turn: Callable[[int], None] | None = None) -> DecodeStats:
        """Decode every turn of every conversation, `concurrency` requests per round."""
        stats = DecodeStats(gamma=self.gamma)
        gen = torch.Generator().manual_seed(self.seed)
        draft_gen = torch.Generator(device=next(self.drafter.parameters()).device).manual_seed(self.seed + 1)
        pending = list(conversations)
        slots: list[_Slot] = []
        t0 = time.perf_counter()
        while pending or slots:
            while pending and len(slots) < concurrency:
                conv = pending.pop(0)
                system = [{"role": "system", "content": conv.system}] if conv.system else []
                slots.append(self._open(conv, 0, system, gen, []))
            self._round(slots, stats, gen, draft_gen)
            for slot in [s for s in slots if self._finished(s)]:
                slots.remove(slot)
                stats.new_tokens += len(self._answer_ids(slot, keep_stop=True))
                stats.turns += 1
                answer = self._answer_text(slot)
                answers = [*slot.answers, answer]
                if on_turn:
                    on_turn(1)
                if slot.turn + 1 < len(slot.conv.turns):
                    history = [*slot.messages, {"role": "assistant", "content": answer}]
                    slots.append(self._open(slot.conv, slot.turn + 1, history, gen, answers))
                else:
                    stats.answers[slot.conv.id] = answers
        stats.seconds = time.perf_counter() - t0
        return stats

    def _round(self, slots: list[_Slot], stats: DecodeStats, gen: torch.Generator,
               draft_gen: torch.Generator) -> None:
        active = [s for s in slots if not self._finished(s)]  # a prefill can already end a turn
        if not active:
            return
        blocks = []
        for slot in active:
            st = slot.state
            if self._drafting is not st:
                # The drafter caches one sequence's fused context; a different sequence (another
                # request, or the next turn) must not reuse it, even when its first token matches.
                self.drafter.reset_cache()
                self._drafting = st
            blocks.append(self.drafter.draft_block(st.features, st.ids[-1], st.anchor_pos,
                                                   temperature=self.temperature, generator=draft_gen))
        raw = [b.confidences.float().cpu().tolist() if b.confidences is not None else None for b in blocks]
        calibrated = None
        if all(r is not None for r in raw):
            calibrated = [apply_temperatures(r, self.calibration) if self.calibration else r for r in raw]
        # Emitting ℓ + 1 tokens must not pass max_new_tokens.
        room = [max(0, self.max_new_tokens - len(self._generated(s)) - 1) for s in active]
        lengths = self.scheduler.schedule(calibrated, room)
        emitted = 0
        for slot, block, n, conf in zip(active, blocks, lengths, raw, strict=True):
            drafted = block.tokens[:n].cpu()
            target_probs, hidden = slot.state.verify_pass(drafted.tolist())
            verdict = verify(block.tokens.cpu(), block.probs.cpu(), target_probs, n, gen,
                             greedy=self.temperature <= 0)
            slot.state.commit(drafted[: verdict.accepted].tolist(), verdict.next_token, hidden)
            stats.rounds.append(RoundLog(n, verdict.accepted, conf))
            emitted += verdict.accepted + 1
        batch_tokens = sum(1 + n for n in lengths)
        expected = None
        if calibrated is not None:
            expected = expected_throughput(calibrated, lengths, self.scheduler.sps)[0]
        stats.batches.append(BatchRound(len(active), batch_tokens, emitted, expected,
                                        emitted * self.scheduler.sps(batch_tokens)))


@torch.inference_mode()
def target_only(model: Any, tokenizer: Any, conversations: list[Conversation], *, temperature: float,
                max_new_tokens: int, thinking: bool, seed: int = 0) -> DecodeStats:
    """Plain autoregressive decoding of the same prompts: the tokens/s baseline."""
    stats = DecodeStats(gamma=0)
    gen = torch.Generator().manual_seed(seed)
    stop = stop_ids(tokenizer, model)
    device = next(model.parameters()).device
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
                logits = model(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[0, -1]
                token = sample(probs_from_logits(logits.float().cpu(), temperature), gen)
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
