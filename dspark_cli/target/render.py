"""Render a conversation with the target's own chat template and mark what the target generated.

The loss mask comes from render boundaries, not from a regex over the text: for assistant turn j
the supervised span starts where the full render stops agreeing with the render of the turns
before j plus the generation prompt (so a generation prompt such as Qwen3's empty think block is
context, not supervision), and ends after the turn's own text and the template's end-of-turn
token (the first special token that follows it). No system prompt is ever injected; the thinking
flag recorded by `data regen` is passed to the template as `enable_thinking`.
"""

from __future__ import annotations

from typing import Any

from ..errors import DsparkError
from ..target.chat import render_text


def _render(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool, generation: bool) -> str:
    return render_text(tokenizer, messages, generation=generation, thinking=thinking)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _template_messages(messages: list[dict[str, Any]], reasoning: list[str | None] | None,
                       thinking: bool) -> list[dict[str, Any]]:
    """Messages as the template wants them: reasoning passed as `reasoning_content` in thinking mode."""
    out: list[dict[str, Any]] = []
    turn = 0
    for m in messages:
        msg = {"role": m["role"], "content": m["content"] or ""}
        if m["role"] == "assistant":
            r = reasoning[turn] if reasoning and turn < len(reasoning) else None
            if thinking and r:
                msg["reasoning_content"] = r
            turn += 1
        out.append(msg)
    return out


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return ids


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool,
                    reasoning: list[str | None] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Full render text and, per assistant turn, the character span the target generated."""
    msgs = _template_messages(messages, reasoning, thinking)
    full = _render(tokenizer, msgs, thinking, generation=False)
    spans: list[tuple[int, int]] = []
    floor = 0
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, msgs[:j], thinking, generation=True)
        start = max(_common_prefix(full, prompt), floor)
        content = m["content"]
        at = full.find(content, start) if content else start
        if at < 0:
            raise DsparkError(f"assistant turn {len(spans)}: the chat template does not reproduce its text.")
        end = at + len(content)
        spans.append((start, end))
        floor = end
    return full, spans


def render_conversation(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool,
                        max_length: int | None = None, reasoning: list[str | None] | None = None
                        ) -> tuple[list[int], list[int]]:
    """Token ids of the conversation as the endpoint rendered it, and a 0/1 loss mask.

    The mask is 1 on every token the target generated in an assistant turn, including the
    end-of-turn token; truncated to `max_length` tokens.
    """
    full, spans = assistant_spans(tokenizer, messages, thinking, reasoning)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)  # = chat.encode + offsets
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
    specials = _special_ids(tokenizer)
    mask = [0] * len(ids)
    t = 0
    for start, end in spans:
        while t < len(ids) and offsets[t][1] <= start:  # tokens wholly before the span
            t += 1
        while t < len(ids) and offsets[t][0] < end:  # tokens overlapping the turn's text
            mask[t] = 1
            t += 1
        if t < len(ids) and ids[t] in specials:  # the end-of-turn token the target emitted
            mask[t] = 1
            t += 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask
