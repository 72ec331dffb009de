"""Chat-template rendering and the loss mask, hand-checked token by token on both fixture templates."""

from __future__ import annotations

import pytest
from fixtures.tiny_models import build_tokenizer

from dspark_cli.target.identity import template_hash
from dspark_cli.target.render import render_conversation

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "How can I help?"},
]

# Hand-checked: the byte-level tokens of the rendered text, and which ones the target generated.
TURN1 = ["The", "Ġa", "ns", "wer", "Ġis", "Ġ4", "2", "."]
TURN2 = ["How", "Ġc", "an", "ĠI", "Ġhe", "lp", "?"]
ASSISTANT = ["as", "s", "is", "t", "an", "t"]
SYSTEM = ["s", "y", "s", "te", "m"]
USER = ["u", "s", "er"]
BE_BRIEF = ["B", "e", "Ġb", "ri", "e", "f", "."]
QUESTION = ["Wh", "at", "Ġis", "Ġ", "12", "Ġp", "lu", "s", "Ġ", "30", "?"]
HELLO = ["He", "ll", "o", "!"]


def _pairs(tokens: list[str], flag: int) -> list[tuple[str, int]]:
    return [(t, flag) for t in tokens]


def qwen3_expected() -> list[tuple[str, int]]:
    s, e, nl = "<|im_start|>", "<|im_end|>", "Ċ"
    return (_pairs([s, *SYSTEM, nl, *BE_BRIEF, e, nl, s, *USER, nl, *QUESTION, e, nl, s, *ASSISTANT, nl], 0)
            + _pairs([*TURN1, e], 1)
            + _pairs([nl, s, *USER, nl, *HELLO, e, nl, s, *ASSISTANT, nl], 0)
            + _pairs([*TURN2, e], 1) + _pairs([nl], 0))


def llama_expected() -> list[tuple[str, int]]:
    b, h, eh, eot, nl = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "Ċ"
    return (_pairs([b, h, *SYSTEM, eh, nl, nl, *BE_BRIEF, eot, h, *USER, eh, nl, nl, *QUESTION, eot,
                    h, *ASSISTANT, eh, nl, nl], 0)
            + _pairs([*TURN1, eot], 1)
            + _pairs([h, *USER, eh, nl, nl, *HELLO, eot, h, *ASSISTANT, eh, nl, nl], 0)
            + _pairs([*TURN2, eot], 1))


@pytest.mark.parametrize("style,expected", [("qwen3", qwen3_expected), ("llama", llama_expected)])
@pytest.mark.parametrize("thinking", [False, True])
def test_loss_mask_token_by_token(style, expected, thinking):
    tok = build_tokenizer(style)
    ids, mask = render_conversation(tok, CONVERSATION, thinking=thinking)
    assert list(zip(tok.convert_ids_to_tokens(ids), mask, strict=True)) == expected()
    # The ids are exactly the template's own rendering: no injected system prompt, nothing added.
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, enable_thinking=thinking)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_truncation_cuts_ids_and_mask_together():
    tok = build_tokenizer("qwen3")
    ids, mask = render_conversation(tok, CONVERSATION, thinking=False)
    short_ids, short_mask = render_conversation(tok, CONVERSATION, thinking=False, max_length=50)
    assert short_ids == ids[:50] and short_mask == mask[:50]


# Real Qwen3 shape: the last assistant turn after the last user turn is rendered with a think block;
# in non-thinking mode the generation prompt already holds the empty one (the endpoint did not
# generate it), in thinking mode the model generated the whole block.
REAL_QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n'"
    " + message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def _supervised_text(tok, ids, mask) -> list[str]:
    spans, current = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            current.append(i)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


def test_think_block_is_context_in_non_thinking_mode_and_supervised_in_thinking_mode():
    tok = build_tokenizer("qwen3")
    tok.chat_template = REAL_QWEN3_LIKE
    ids, mask = render_conversation(tok, CONVERSATION, thinking=False)
    assert _supervised_text(tok, ids, mask) == ["The answer is 42.<|im_end|>", "How can I help?<|im_end|>"]
    ids, mask = render_conversation(tok, CONVERSATION, thinking=True, reasoning=[None, "add"])
    assert _supervised_text(tok, ids, mask) == ["The answer is 42.<|im_end|>",
                                                "<think>\nadd\n</think>\n\nHow can I help?<|im_end|>"]


def test_template_hash_follows_the_template():
    tok = build_tokenizer("qwen3")
    before = template_hash(tok)
    tok.chat_template = REAL_QWEN3_LIKE
    assert template_hash(tok) != before
