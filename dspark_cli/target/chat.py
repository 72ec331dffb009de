"""Chat rendering and the stop tokens: what cache build, eval and serve must agree on exactly.

A drafter is trained on the token ids `cache build` renders and then drafts for the ids eval
and serve render; one function renders for all three, so a template quirk cannot make them
differ. No system prompt is ever injected; `thinking` becomes the template's `enable_thinking`.
"""

from __future__ import annotations

from typing import Any


def render_text(tokenizer: Any, messages: list[dict[str, Any]], *, generation: bool,
                thinking: bool | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The template's text for `messages` ("" for none), with the generation prompt when asked.

    `thinking` None leaves `enable_thinking` to `template_kwargs` or the template's default (what
    an OpenAI client gets from `dspark serve` when it sends no chat_template_kwargs).
    """
    if not messages:
        return ""
    kwargs = dict(template_kwargs or {})
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered text: the template already holds every special token."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids of the conversation plus the generation prompt, as the endpoint renders them."""
    return encode(tokenizer, render_text(tokenizer, messages, generation=True, thinking=thinking,
                                         template_kwargs=template_kwargs))


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value if v is not None}


def stop_ids(tokenizer: Any, model: Any) -> set[int]:
    """Tokens that end an answer: the tokenizer's eos plus the generation config's eos id(s).

    Instruct models often list several (Llama 3: <|eot_id|> and <|end_of_text|>); a model
    without a generation config falls back to its config's eos id(s).
    """
    generation = getattr(model, "generation_config", None)
    source = generation if generation is not None else getattr(model, "config", None)
    ids = _ids(getattr(source, "eos_token_id", None))
    ids |= _ids(getattr(tokenizer, "eos_token_id", None))
    return ids
