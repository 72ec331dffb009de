"""The target model, for any Transformers causal LM: one home for everything cache, train, decode
and serve need to know about it (DESIGN.md §3).

    dtypes.py    the dtype names and their torch dtypes; device resolution (local_rank aware)
    layers.py    layer ids: "auto", the shape and range checks, agreeing with a cache or drafter
    files.py     where its files are (a local folder never touches the hub), its config, sizes
    identity.py  what identifies it: config hash, stage-input fingerprint, chat-template hash
    chat.py      chat rendering (the thinking flag) and the stop-token ids
    render.py    a whole conversation → token ids and the loss mask (what the target generated)
    samples.py   responses → training samples: skip rules and features, for cache build and
                 online training alike
    capture.py   hidden-state capture (one-shot, batched, incremental), the KV-cache argument
    model.py     loading weights and tokenizer; `Target`, the loaded model with all of the above

`dtypes`, `layers` and `files` import no torch at module level: settings use them.

    from dspark_cli.target import Target
    target = Target.load("runs/smollm2", dtype="bfloat16", device="auto")
    layers = target.resolve_layers("auto")
    ids = target.render(messages, thinking=False)          # prompt ids with the generation prompt
    hidden, final = target.capture(ids, layers)             # [T, m*d], [T, d]
"""

from __future__ import annotations

from typing import Any

_LAZY = {"Target": "model", "load_target": "model"}


def __getattr__(name: str) -> Any:  # `from dspark_cli.target import Target` without importing torch early
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)
