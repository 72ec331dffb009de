"""The serving folder engines load (DESIGN.md §3), and loading any drafter back.

    export_drafter(drafter, "runs/x/train/export")          # config.json + model.safetensors
    drafter = load_drafter("runs/x/train/export")           # frozen rows from config's target
    drafter = load_drafter("runs/x/train/checkpoints/step-00000500", target="Qwen/Qwen3-4B")

An anchor-first drafter exports as `Qwen3DSparkModel`; a `fill_in` DFlash baseline as
`DFlashDraftModel`. Any other pairing is refused: engines would load it without complaint and
serve it with acceptance near zero. An anchor-first drafter without a Markov head (the DFlash
ablation) gets a rank-1 all-zero Markov head in the export: both engines require one (vLLM would
otherwise add uninitialised memory to the logits, SGLang refuses rank 0) and a zero head adds
exactly nothing. Our own rebuild data sits under `dspark_cli_config`, a key no engine reads
(SGLang merges a top-level `dspark_config` into its DSpark settings).
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .. import storage
from ..errors import DsparkError, reading
from ..schemas import validate
from ..target.dtypes import torch_dtype
from .config import DrafterConfig
from .drafter import DSparkDrafter
from .frozen import attach_frozen
from .heads import upgrade_legacy_markov
from .locate import CHECKPOINT_CONFIG, PRIVATE_KEY, read_config, resolve_drafter_url
from .vocab_expand import contract, expand, expanded_rank

DSPARK_ARCH = "Qwen3DSparkModel"
DFLASH_ARCH = "DFlashDraftModel"
#: Rank of the all-zero Markov head an anchor-first drafter without one is exported with.
NOOP_MARKOV_RANK = 1
NOOP_MARKOV_KEYS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
WEIGHTS = "model.safetensors"
#: The reduced vocabulary's id map in an export; `draft_token_ids` (target ids) in a checkpoint.
D2T = "d2t"
DRAFT_IDS = "draft_token_ids"


def architecture_for(config: DrafterConfig, requested: str | None = None) -> str:
    """The engine architecture for this convention; refuse pairings engines would serve wrongly."""
    expected = DSPARK_ARCH if config.sample_from_anchor else DFLASH_ARCH
    if requested is not None and requested not in (DSPARK_ARCH, DFLASH_ARCH):
        raise DsparkError(f"--architecture {requested}: unknown; engines serve {DSPARK_ARCH} or "
                          f"{DFLASH_ARCH}.",
                          hint=f"omit --architecture: this drafter exports as {expected}.")
    if requested is not None and requested != expected:
        raise DsparkError(
            f"a drafter trained with block_convention={config.block_convention} cannot be exported as "
            f"{requested}: engines would serve "
            f"it with the wrong block layout and acceptance near zero.",
            hint=f"export it as {expected}, or retrain with model.block_convention="
                 f"{'fill_in' if requested == DFLASH_ARCH else 'anchor_first'}.")
    if expected == DFLASH_ARCH and (config.markov_head_type != "none" or config.enable_confidence_head):
        raise DsparkError(
            "a fill_in drafter exports as DFlashDraftModel, which has no Markov or confidence head; "
            "serving it would silently drop them.",
            hint="train fill_in drafters with model.markov_head_type=none and "
                 "model.enable_confidence_head=false.")
    return expected


def export_config(config: DrafterConfig, architecture: str, dtype: str, d2t: bool = False) -> dict[str, Any]:
    """config.json: a Qwen3 config plus DSpark fields at top level, mirrored in dflash_config. A
    reduced draft vocabulary: vLLM's `draft_vocab_size` with d2t, else widened (vocab_expand.py)."""
    # fill_in engines count the anchor slot in block_size (z-lab/vLLM DFlash: 16 = anchor + 15).
    block_size = config.block_inputs
    rope = dict(config.rope_parameters)
    noop_markov = needs_noop_markov(config)
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_draft_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": block_size,
        "target_layer_ids": list(config.target_layer_ids),
        "num_target_layers": config.num_target_layers,
        "mask_token_id": config.mask_token_id,
        "markov_rank": (NOOP_MARKOV_RANK if noop_markov else expanded_rank(config)
                        if config.draft_vocab_size and not d2t else config.markov_rank),
        "markov_head_type": "vanilla" if noop_markov else config.markov_head_type,
        "enable_confidence_head": config.enable_confidence_head,
        "confidence_head_with_markov": config.confidence_head_with_markov,
        "sample_from_anchor": config.sample_from_anchor,
        "dflash_config": {
            "block_size": block_size,
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
        },
        # Everything load_drafter needs to rebuild the module exactly, under a key no engine reads.
        PRIVATE_KEY: config.to_dict(),
    }
    if config.draft_vocab_size and d2t:  # vLLM's reduced vocabulary: lm_head [N, d] and d2t in the weights
        out["draft_vocab_size"] = config.draft_vocab_size
    return out


def reduced_vocab_tensors(drafter: DSparkDrafter) -> dict[str, torch.Tensor]:
    """A reduced draft vocabulary as vLLM (and EAGLE-3's d2t convention) reads it: its own
    `lm_head.weight` [N, d] (the target's rows) and `d2t` [N], the offset of each draft id's target
    id (target = draft + d2t[draft])."""
    ids = drafter.draft_token_ids
    return {"lm_head.weight": drafter.draft_head(), D2T: ids - torch.arange(ids.shape[0], device=ids.device)}


def needs_noop_markov(config: DrafterConfig) -> bool:
    """Anchor-first without a Markov head: engines need one, so the export carries a zero head."""
    return config.sample_from_anchor and config.markov_head_type == "none"


def noop_markov_tensors(config: DrafterConfig) -> dict[str, torch.Tensor]:
    """W1 [V, 1] and W2 [V, 1], all zeros: the bias W2·W1[x] is exactly 0 for every token."""
    zeros = torch.zeros(config.vocab_size, NOOP_MARKOV_RANK)
    return {NOOP_MARKOV_KEYS[0]: zeros, NOOP_MARKOV_KEYS[1]: zeros.clone()}


def export_drafter(drafter: DSparkDrafter, out_url: str, include_embeddings: bool = False,
                   architecture: str | None = None, dtype: str = "bfloat16", d2t: bool = False,
                   ) -> dict[str, Any]:
    """Write config.json + model.safetensors to out_url (weights first, config last). A reduced draft
    vocabulary goes out widened to the target's (both engines) or, with d2t, in vLLM's own form."""
    check_export_output(out_url)
    if d2t and drafter.draft_token_ids is None:
        raise DsparkError("--d2t: this drafter proposes from the target's whole vocabulary; d2t is the map "
                          "of a reduced one.", hint="train with model.draft_vocab_size = N, or omit --d2t.")
    torch_dt = torch_dtype(dtype, "export dtype")
    arch = architecture_for(drafter.config, architecture)
    config = export_config(drafter.config, arch, dtype, d2t)
    validate(config, "drafter_export_config", where=storage.join(out_url, "config.json"))
    tensors = drafter.trainable_state_dict()
    if needs_noop_markov(drafter.config):
        tensors.update(noop_markov_tensors(drafter.config))
    if include_embeddings:
        tensors["embed_tokens.weight"] = drafter.embed_tokens.weight
        tensors["lm_head.weight"] = drafter.lm_head.weight
    if drafter.draft_token_ids is not None:
        ids = tensors.pop(DRAFT_IDS)
        if d2t:
            tensors.update(reduced_vocab_tensors(drafter))
        else:
            tensors = expand(tensors, drafter.config, ids)
    tensors = {k: v.detach().to("cpu", torch_dt if v.is_floating_point() else v.dtype).contiguous()
               for k, v in tensors.items()}
    storage.write_bytes(storage.join(out_url, WEIGHTS), st_save(tensors, metadata={"format": "pt"}))
    storage.write_json(storage.join(out_url, "config.json"), config)
    return config


def check_export_output(out_url: str) -> None:
    """Refuse an output that is a file, a folder whose config.json/weights are not a drafter export
    (a target model folder, say): writing there would overwrite files export did not make, or any
    other non-empty folder: the serving folder would mix with the user's files."""
    storage.check_output(out_url)
    config_url = storage.join(out_url, "config.json")
    if not storage.exists(config_url) and not storage.exists(storage.join(out_url, WEIGHTS)):
        names = [n for n in storage.listdir(out_url) if not n.startswith(storage.TMP_PREFIX)]
        if names:  # someone's folder: the stages refuse it too (manifest._refuse_foreign_folder)
            shown = ", ".join(names[:3]) + (" …" if len(names) > 3 else "")
            raise DsparkError(f"{out_url}: folder is not empty ({shown}) and holds no drafter export.",
                              hint="pass a new or empty folder as OUT.")
        return
    try:
        archs = storage.read_json(config_url).get("architectures") or []
    except (DsparkError, AttributeError):
        archs = []
    if not {DSPARK_ARCH, DFLASH_ARCH} & set(archs):
        raise DsparkError(f"{out_url}: holds a config.json or {WEIGHTS} that is not a drafter export; "
                          "export would overwrite them.", hint="pass a new folder as OUT.")


def save_weights(drafter: DSparkDrafter, dir_url: str) -> None:
    """Trainable weights (float32) + drafter_config.json: the model part of a checkpoint."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.trainable_state_dict().items()}
    storage.write_bytes(storage.join(dir_url, WEIGHTS), st_save(tensors))
    storage.write_text(storage.join(dir_url, CHECKPOINT_CONFIG), drafter.config.to_json())


def load_drafter(path: str, target: str | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DSparkDrafter:
    """Rebuild a drafter from a checkpoint dir, an export folder or a train artifact root.

    The frozen embedding / lm_head come from the folder when it holds them (--include-embeddings),
    else from `target` (default: the target path recorded at training time).
    """
    url = resolve_drafter_url(path)
    config = read_config(url)
    with reading(storage.join(url, WEIGHTS)):
        tensors = st_load(storage.read_bytes(storage.join(url, WEIGHTS)))
    tensors = upgrade_legacy_markov(tensors, config.markov_head_type, f"{url}/{WEIGHTS}")
    if needs_noop_markov(config):
        tensors = {k: v for k, v in tensors.items() if k not in NOOP_MARKOV_KEYS}
    if config.draft_vocab_size and D2T in tensors:  # vLLM's form: its lm_head holds the draft rows only
        d2t = tensors.pop(D2T)
        tensors[DRAFT_IDS] = d2t + torch.arange(d2t.shape[0], dtype=d2t.dtype)
        tensors.pop("lm_head.weight", None)
    elif config.draft_vocab_size and DRAFT_IDS not in tensors:  # widened to the target's vocabulary
        tensors, tensors[DRAFT_IDS] = contract(tensors, config, f"{url}/{WEIGHTS}")
    drafter = DSparkDrafter(config)
    expected = set(drafter.trainable_state_dict())
    frozen_in_file = {"embed_tokens.weight", "lm_head.weight"} <= set(tensors)
    missing = sorted(expected - set(tensors))
    unknown = sorted(set(tensors) - expected - {"embed_tokens.weight", "lm_head.weight"})
    if missing or unknown:
        raise DsparkError(f"{url}/{WEIGHTS}: weights do not match the drafter config "
                          f"(missing {missing[:3]}, unexpected {unknown[:3]}).")
    state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    drafter.load_state_dict(state, strict=False)
    if not frozen_in_file:
        source = target or config.target_model
        if not source:
            raise DsparkError(f"{url}: holds no embedding/lm_head and no target is known.",
                              hint="pass the target model path (--target).")
        attach_frozen(drafter, source)
    return drafter.to(device=device, dtype=dtype).eval()
