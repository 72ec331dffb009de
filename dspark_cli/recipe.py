"""`dspark pipeline new`: a commented pipeline config for your own target, from its tokenizer and
config alone (no weights are read).

    text, mask = new_config("runs/models/my-target")
    Path("my.toml").write_text(text)

The mask token (the drafter's `[MASK]` input, a row of the target's frozen embedding) is chosen by
rule, never guessed silently: the first spare embedding row when the embedding has more rows than
the tokenizer has tokens (Qwen3: 151669 of 151936), else a special token chat never uses — a
`reserved` one (Llama 3's `<|reserved_special_token_0|>`), or the last added special token that is
neither bos/eos/pad/unk nor written by the chat template. It is printed with its reason and checked
to be a row of the embedding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import DsparkError
from .target import files

#: Bundled with dspark, so the config finds them from anywhere (paths.py).
EVAL_SETS = ["package://dspark_cli/resources/demo_eval_gsm8k.jsonl",
             "package://dspark_cli/resources/demo_eval_humaneval.jsonl"]


@dataclass
class MaskChoice:
    token_id: int
    reason: str


def choose_mask_token(tokenizer, embedding_rows: int) -> MaskChoice:
    """The mask token id by the rule in the module docstring; DsparkError when none qualifies."""
    n_tokens = len(tokenizer)
    if embedding_rows > n_tokens:
        return MaskChoice(n_tokens, f"the first spare embedding row ({embedding_rows} rows, "
                                    f"{n_tokens} tokens): no text ever maps to it")
    template = str(getattr(tokenizer, "chat_template", "") or "")
    busy = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    added = sorted((i, str(getattr(t, "content", t))) for i, t in tokenizer.added_tokens_decoder.items()
                   if getattr(t, "special", True))
    candidates = [(i, text) for i, text in added
                  if i not in busy and text not in template and i < embedding_rows]
    reserved = [(i, text) for i, text in candidates if "reserved" in text.lower()]
    if reserved:
        i, text = reserved[0]
        return MaskChoice(i, f"{text}, a reserved special token chat never uses")
    if candidates:
        i, text = candidates[-1]
        return MaskChoice(i, f"{text}, an added special token that is not bos/eos/pad/unk and that the "
                             "chat template never writes")
    raise DsparkError("no spare embedding row and no unused special token to use as the mask token.",
                      hint="pick a token id chat never produces and set target.mask_token_id in the config.")


def _toml(value: object) -> str:
    import json

    return json.dumps(value)


def _as_written(target: str) -> str:
    """A local folder as an absolute path: the TOML's own relative paths are read from its folder,
    not from where `pipeline new` ran; a hub id as it is."""
    return os.path.abspath(target) if os.path.isdir(target) else target


def new_config(target: str, work_dir: str | None = None) -> tuple[str, MaskChoice]:
    """The TOML text of a pipeline for `target` (a folder or hub id) and the mask token chosen."""
    from .target.model import load_tokenizer

    config = files.load_config(target)
    rows = int(files.text_config(config).vocab_size)
    mask = choose_mask_token(load_tokenizer(target), rows)
    if not 0 <= mask.token_id < rows:  # the check the reason promises
        raise DsparkError(f"mask token {mask.token_id} is not a row of the {rows}-row embedding.")
    name = os.path.basename(os.path.normpath(target)) or "target"
    work_dir = work_dir or f"runs/{name}-dspark"
    lines = [
        f"# A DSpark drafter for {target}; written by `dspark pipeline new` (edit freely).",
        "# Run: dspark pipeline run THIS.toml   (dspark pipeline show THIS.toml prints every value)",
        "",
        "[pipeline]",
        f"work_dir = {_toml(work_dir)}   # every stage writes under here (a path, s3://…)",
        "",
        "[target]",
        f"model = {_toml(_as_written(target))}   # the model the drafter speeds up (folder or hub id)",
        'layers = "auto"   # 5 layers spread over the depth; cache build resolves and records them',
        f"mask_token_id = {mask.token_id}   # {mask.reason}",
        "",
        "[data]",
        '# prompts to regenerate: a hub dataset id or local JSONL/JSON/Parquet (ShareGPT, OpenAI messages)',
        'source = "package://dspark_cli/resources/demo_prompts.jsonl"',
        "",
        "[regen]",
        "serve_target = true   # `dspark serve` answers on this machine; for a GPU server, set false and",
        "endpoints = []        # list its …/v1 URLs here (vLLM, SGLang)",
        f"model = {_toml(target)}   # the name the server knows the target by",
        "",
        "[eval]",
        "# held-out prompts bundled with dspark (GSM8K, HumanEval; none among the training prompts)",
        f"datasets = {_toml(EVAL_SETS)}",
        "",
    ]
    return "\n".join(lines), mask
