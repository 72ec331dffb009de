"""The model side of `dspark serve`: load a causal LM, render chats, generate a batch of sequences.

One call of `Engine.generate` runs a padded batch (left padding, one shared KV cache) from the
prefill to the last finished sequence; finished rows are dropped from the cache as they end, so a
long answer does not make the short ones pay. `Sequence` carries one choice of one request and
reports text deltas and its finish reason through a callback.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DsparkError
from ..target.capture import cache_kwarg, stack_left_padded
from ..target.chat import render_prompt
from ..target.kv import new_cache, plain_layers
from ..target.model import Target
from ..target.prepack import packed_count
from .sampling import SamplingParams, sample

#: on_event(text_delta, finish_reason): finish_reason is None until the last call, then
#: "stop" | "length" | "error" | "cancelled".
EventFn = Callable[[str, str | None], None]


@dataclass(eq=False)
class Sequence:
    """One choice being generated: prompt ids in, tokens and text deltas out."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    on_event: EventFn
    output_ids: list[int] = field(default_factory=list)
    #: Tokens sampled, the end-of-turn token included (what usage.completion_tokens counts).
    generated: int = 0
    text: str = ""
    sent: int = 0
    finish_reason: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Running:
    """A batch mid-generation: cache row i holds rows[i]; attention covers the cached tokens."""

    rows: list[Sequence]
    cache: Any
    attention: torch.Tensor  # [rows, T] 1 where a cached position is real, 0 for padding
    next_tokens: torch.Tensor  # [rows] the token to feed next
    next_pos: torch.Tensor  # [rows] its position id

    @property
    def joinable(self) -> bool:
        """Stacking caches needs plain per-layer key/value tensors (DynamicCache of full attention)."""
        return plain_layers(self.cache)


def _merge(a: _Running | None, b: _Running | None) -> _Running | None:
    """Stack two running batches: left-pad the shorter cache (and mask) to the longer one."""
    if a is None or b is None:
        return a or b
    attention = stack_left_padded(a.cache, a.attention, b.cache, b.attention)
    return _Running(a.rows + b.rows, a.cache, attention,
                    torch.cat([a.next_tokens, b.next_tokens]), torch.cat([a.next_pos, b.next_pos]))


class Engine:
    """A Transformers causal LM + tokenizer with batched, cached generation."""

    def __init__(self, model_path: str, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, trust_remote_code: bool = False,
                 prepack: bool = True) -> None:
        target = Target.load(model_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                             prepack=prepack)
        self.model, self.tokenizer, self.device = target.model, target.tokenizer, target.device
        if not getattr(self.tokenizer, "chat_template", None):
            raise DsparkError(f"the tokenizer of {model_path} has no chat template.")
        config = self.model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 4096)
        if max_model_len:
            self.context_length = min(self.context_length, max_model_len)
        self.eos_ids = target.stop_ids
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        self.dtype = str(target.dtype).removeprefix("torch.")
        self.prepacked = packed_count(self.model)
        self._cache_arg = cache_kwarg(self.model)
        head = self.model.get_output_embeddings()
        if head is not None:
            head.register_forward_pre_hook(_contiguous_input)

    def render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        """Prompt token ids exactly as the chat template renders the conversation."""
        return render_prompt(self.tokenizer, messages, template_kwargs=template_kwargs)

    @torch.inference_mode()
    def generate(self, batch: list[Sequence], on_forward: Callable[[int], None] = lambda b: None,
                 take_new: Callable[[int], list[Sequence]] | None = None) -> None:
        """Run every sequence of `batch` to its end (callbacks report the text as it grows).

        With `take_new(rows_running)`, sequences queued meanwhile join the running batch between
        two decoding steps: they are prefilled on their own, then their KV cache is left-padded
        and stacked under the running one (continuous batching).
        """
        state = self._prefill(batch, on_forward)
        while state is not None:
            joining = take_new(len(state.rows)) if take_new and state.joinable else []
            if joining:
                state = _merge(state, self._prefill(joining, on_forward))
                if state is None:
                    continue
            on_forward(len(state.rows))
            state.attention = torch.cat([state.attention, torch.ones((len(state.rows), 1),
                                                                     dtype=torch.long)], dim=1)
            out = self._forward(state.next_tokens[:, None], state.attention,  # [rows, 1]
                                state.next_pos[:, None], state.cache)
            state = self._sample_and_prune(state, out.logits[:, -1, :].cpu(), state.next_pos + 1)

    def _prefill(self, batch: list[Sequence], on_forward: Callable[[int], None]) -> _Running | None:
        """Prefill the prompts in groups of similar length (`length_groups`), then stack the groups'
        caches into one running batch: one forward padded to the longest of 32 demo prompts
        (86-321 tokens) ran 2.4x the real tokens and took 8-10 s."""
        state = None
        for group in length_groups(batch):
            state = _merge(state, self._prefill_padded(group, on_forward))
        return state

    def _prefill_padded(self, batch: list[Sequence], on_forward: Callable[[int], None]) -> _Running | None:
        """Forward the (left-padded) prompts, sample each sequence's first token."""
        B = len(batch)
        L = max(len(s.prompt_ids) for s in batch)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)  # [B, L], left padded
        attention = torch.zeros((B, L), dtype=torch.long)  # [B, L]
        for row, seq in enumerate(batch):
            input_ids[row, L - len(seq.prompt_ids):] = torch.tensor(seq.prompt_ids)
            attention[row, L - len(seq.prompt_ids):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        cache = new_cache()
        on_forward(B)
        out = self._forward(input_ids, attention, positions, cache)
        state = _Running(list(batch), cache, attention, torch.zeros(B, dtype=torch.long),
                         torch.zeros(B, dtype=torch.long))
        return self._sample_and_prune(state, out.logits[:, -1, :].cpu(), positions[:, -1] + 1)

    def _forward(self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                 cache: Any) -> Any:
        return self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                          position_ids=positions.to(self.device), use_cache=True, logits_to_keep=1,
                          **{self._cache_arg: cache})

    def _sample_and_prune(self, state: _Running, logits: torch.Tensor,
                          next_pos: torch.Tensor) -> _Running | None:
        """Sample a token per row (logits [rows, V]), report it, drop finished rows from the cache."""
        tokens = sample(logits, [s.params for s in state.rows], [s.generator for s in state.rows])
        for seq, token in zip(state.rows, tokens.tolist(), strict=True):
            self._advance(seq, token)
        keep = [i for i, s in enumerate(state.rows) if not s.done]
        if not keep:
            return None
        if len(keep) < len(state.rows):
            index = torch.tensor(keep)
            state.cache.batch_select_indices(index.to(self.device))
            state.attention, next_pos, tokens = state.attention[index], next_pos[index], tokens[index]
            state.rows = [state.rows[i] for i in keep]
            _trim_left_padding(state)
        state.next_tokens, state.next_pos = tokens, next_pos
        return state

    def _advance(self, seq: Sequence, token: int) -> None:
        """Append one sampled token, detokenise, check the stop conditions, report the delta."""
        if seq.cancelled.is_set():
            seq.finish_reason = "cancelled"
            seq.on_event("", "cancelled")
            return
        reason = None
        seq.generated += 1
        if token in self.eos_ids:
            reason = "stop"
        else:
            seq.output_ids.append(token)
            seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            for stop in seq.params.stop:
                cut = seq.text.find(stop, max(0, seq.sent - len(stop)))
                if cut >= 0:
                    seq.text, reason = seq.text[:cut], "stop"
                    break
            if reason is None and (len(seq.output_ids) >= seq.params.max_tokens
                                   or len(seq.prompt_ids) + len(seq.output_ids) >= self.context_length):
                reason = "length"
        end = len(seq.text)
        if reason is None:  # hold back a partial UTF-8 char and what could start a stop string
            end -= _held_back(seq.text, seq.params.stop)
        delta = seq.text[seq.sent:end] if end > seq.sent else ""
        seq.sent = max(seq.sent, end)
        seq.finish_reason = reason
        if delta or reason:
            seq.on_event(delta, reason)


def _contiguous_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The lm_head's input made contiguous: with `logits_to_keep=1` a prefill hands it the strided
    slice `hidden[:, -1:, :]`, which `F.linear` runs as a bmm over a copy of the weight per row
    (25 rows x 576 x 49,152: 1.16 s, against 6 ms contiguous; a third of the demo's regen)."""
    return (args[0].contiguous(), *args[1:])


#: A prefill group's padded tokens may exceed its real ones by this factor.
PADDING_SLACK = 1.25


def length_groups(batch: list[Sequence], slack: float = PADDING_SLACK) -> list[list[Sequence]]:
    """Sequences sorted by prompt length, cut into runs whose left-padded size (rows × longest)
    stays within `slack` × their real tokens: few forwards, little compute spent on padding."""
    groups: list[list[Sequence]] = []
    real = 0
    for seq in sorted(batch, key=lambda s: len(s.prompt_ids)):
        n = len(seq.prompt_ids)
        if groups and (len(groups[-1]) + 1) * n <= slack * (real + n):
            groups[-1].append(seq)
            real += n
        else:
            groups.append([seq])
            real = n
    return groups


def _trim_left_padding(state: _Running) -> None:
    """Drop cache columns that are padding for every row left (a long row just finished).

    Without this, a batch that never empties (clients keep sending) grows its padded width with
    every join and every step pays attention and cache copies over dead columns.
    """
    if not state.joinable:
        return
    real = state.attention.any(dim=0)  # [T]
    lead = int(real.long().argmax()) if bool(real.any()) else 0
    if lead == 0:
        return
    state.attention = state.attention[:, lead:]
    for layer in state.cache.layers:
        layer.keys = layer.keys[:, :, lead:, :]
        layer.values = layer.values[:, :, lead:, :]


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may still change or turn into a stop string."""
    hold = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold

