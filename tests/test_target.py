"""The target's one home (dspark_cli/target): loading, dtypes, devices, layer ids, capture,
rendering, stop ids and identity, as cache, train, decode and serve use them."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from fixtures.tiny_models import mask_token_id

from dspark_cli.config import load_config
from dspark_cli.errors import ConfigError, DsparkError
from dspark_cli.target import identity
from dspark_cli.target.capture import capture_layers, capture_step
from dspark_cli.target.dtypes import auto_dtype, bf16_autocast, cpu_has_fast_bf16, resolve_device, torch_dtype
from dspark_cli.target.files import load_config as load_target_config
from dspark_cli.target.files import num_layers
from dspark_cli.target.identity import config_hash
from dspark_cli.target.layers import agree_layers, auto_layers, parse_layers, resolve_layers
from dspark_cli.target.model import Target, load_target
from dspark_cli.train.trainer import autocast_for


def test_capture_matches_hidden_states_and_the_final_norm(tiny_llama_target):
    model, _ = load_target(str(tiny_llama_target), "float32", "cpu")
    assert num_layers(model) == 6 and not any(p.requires_grad for p in model.parameters())
    layers = auto_layers(6)
    ids = torch.arange(3, 40)
    hidden, final = capture_layers(model, ids, layers)
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    assert hidden.shape == (37, 32 * len(layers)) and final.shape == (37, 32)
    assert torch.equal(hidden[:, :32], out.hidden_states[layers[0] + 1][0])
    assert torch.allclose(model.lm_head(final), out.logits[0], atol=1e-5)


def test_incremental_capture_follows_the_full_forward(tiny_llama_target):
    model, _ = load_target(str(tiny_llama_target), "float32", "cpu")
    ids = torch.arange(3, 40)
    full_hidden, full_final = capture_layers(model, ids, [1, 4])
    first = capture_step(model, ids[:30], [1, 4])
    second = capture_step(model, ids[30:], [1, 4], first.past_key_values)
    assert torch.allclose(torch.cat([first.hidden, second.hidden]), full_hidden, atol=1e-4)
    assert torch.allclose(torch.cat([first.final, second.final]), full_final, atol=1e-4)


def test_config_hash_ignores_where_the_model_was_saved(tiny_llama_target, tiny_qwen3_target):
    from transformers import AutoConfig

    a = AutoConfig.from_pretrained(tiny_llama_target)
    b = AutoConfig.from_pretrained(tiny_llama_target)
    b._name_or_path = "/elsewhere"
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(AutoConfig.from_pretrained(tiny_qwen3_target))


def test_missing_target_is_a_user_error(tmp_path):
    with pytest.raises(DsparkError, match="nope.: no such folder"):
        load_target(str(tmp_path / "nope"), "float32", "cpu")
    with pytest.raises(DsparkError, match="no target model"):
        load_target("", "float32", "cpu")


# ---- one rendering and one set of stop ids for cache, eval and serve --------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "Write a short poem about the sea."},
    {"role": "assistant", "content": "The wind and the stars at night."},
]


@pytest.mark.parametrize("thinking", [True, False])
def test_cache_eval_and_serve_render_the_same_ids_and_stops(tiny_qwen3_target, thinking):
    from fixtures.drafter import drafter_config

    from dspark_cli.decode.prompts import Conversation
    from dspark_cli.decode.scheduler import Scheduler
    from dspark_cli.decode.specdec import SpeculativeDecoder
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.serve.engine import Engine
    from dspark_cli.target.render import render_conversation

    target = Target.load(str(tiny_qwen3_target), "float32", "cpu")
    engine = Engine(str(tiny_qwen3_target), dtype="float32", device="cpu")
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target, block_size=3))
    decoder = SpeculativeDecoder(target.model, target.tokenizer, drafter, Scheduler("fixed", 3),
                                 thinking=thinking)
    conv = Conversation(id="c", turns=[CONVERSATION[1]["content"], CONVERSATION[3]["content"]],
                        system=CONVERSATION[0]["content"])
    history = CONVERSATION[:3]  # eval opens turn 2 after the system prompt, turn 1 and its answer
    decoder._start()
    decoder._join(conv, 1, history, [])
    (req,) = decoder._requests
    eval_ids = req.ids[:req.prompt_len]
    serve_ids = engine.render(CONVERSATION[:4], {"enable_thinking": thinking})
    assert eval_ids == serve_ids == target.render(CONVERSATION[:4], thinking=thinking)

    cache_ids, mask = render_conversation(target.tokenizer, CONVERSATION, thinking)
    if thinking:  # no think block in the generation prompt: the cache's context is the eval prompt
        assert cache_ids[:len(eval_ids)] == eval_ids
        assert mask[len(eval_ids)] == 1 and mask[len(eval_ids) - 1] == 0
    # every supervised span ends with the end-of-turn token, which all three paths stop on
    ends = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    assert len(ends) == 2
    assert decoder.stop == engine.eos_ids == target.stop_ids
    assert {cache_ids[i] for i in ends} <= target.stop_ids


def test_stop_ids_are_the_tokenizer_eos_and_every_generation_config_eos(tiny_llama_target, tmp_path):
    import json
    import shutil

    from dspark_cli.serve.engine import Engine

    folder = tmp_path / "llama"
    shutil.copytree(tiny_llama_target, folder)
    tok = Target.load(str(folder), "float32", "cpu").tokenizer
    eot, end = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|end_of_text|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, 7]}))
    target = Target.load(str(folder), "float32", "cpu")
    assert target.tokenizer.eos_token_id == eot
    assert target.stop_ids == {eot, end, 7}
    assert Engine(str(folder), dtype="float32", device="cpu").eos_ids == target.stop_ids


# ---- dtypes, devices, identity -------------------------------------------------------------

def test_one_dtype_table_and_local_rank_devices():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype(torch.float16) is torch.float16
    with pytest.raises(DsparkError, match="must be one of bfloat16, float16, float32"):
        torch_dtype("fp64")
    with pytest.raises(ConfigError, match="target.dtype must be auto or one of"):
        load_config(None, ["target.dtype=fp64"])
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", local_rank=3) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert auto_dtype("float16", torch.device("cpu")) == "float16"


def test_auto_follows_the_cpus_bf16_support(monkeypatch):
    """'auto' (target.dtype, train.precision) is bf16 only where bf16 matmuls are native: an AVX2
    CPU runs them ~150x slower than fp32. DSPARK_CPU_BF16 overrides the detection."""
    cpu = torch.device("cpu")
    assert load_config(None, []).target.dtype == "auto"
    monkeypatch.setenv("DSPARK_CPU_BF16", "1")
    assert auto_dtype("auto", cpu) == "bfloat16" and bf16_autocast("auto", cpu)
    monkeypatch.setenv("DSPARK_CPU_BF16", "0")
    assert auto_dtype("auto", cpu) == "float32" and not bf16_autocast("auto", cpu)
    assert auto_dtype("auto", "cuda") == "bfloat16"
    assert bf16_autocast("bf16", cpu) and not bf16_autocast("fp32", cpu)
    assert isinstance(autocast_for("auto", cpu), contextlib.nullcontext)
    monkeypatch.setenv("DSPARK_CPU_BF16", "1")
    assert isinstance(autocast_for("auto", cpu), torch.autocast)
    monkeypatch.setenv("DSPARK_CPU_BF16", "yes")
    with pytest.raises(DsparkError, match="DSPARK_CPU_BF16='yes': must be 1"):
        auto_dtype("auto", cpu)
    monkeypatch.delenv("DSPARK_CPU_BF16")
    assert cpu_has_fast_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_fingerprint_is_the_config_hash_and_reads_the_old_spelling(tiny_llama_target, tmp_path):
    import hashlib
    import json
    import shutil

    target = Target.load(str(tiny_llama_target), "float32", "cpu")
    new = identity.fingerprint(str(tiny_llama_target))
    assert new == identity.PREFIX + target.config_hash == identity.PREFIX + config_hash(
        load_target_config(str(tiny_llama_target)))
    old = "config:" + hashlib.sha256((tiny_llama_target / "config.json").read_bytes()).hexdigest()
    assert identity.fingerprint(str(tiny_llama_target), previous=old) == old
    assert identity.fingerprint(str(tiny_llama_target), previous="config:" + "0" * 64) == new
    # re-saved elsewhere with another transformers version: same target, same fingerprint
    moved = tmp_path / "moved"
    shutil.copytree(tiny_llama_target, moved)
    config = json.loads((moved / "config.json").read_text())
    config["transformers_version"] = "0.0.1"
    (moved / "config.json").write_text(json.dumps(config))
    assert identity.fingerprint(str(moved)) == new


def test_a_missing_local_folder_never_reaches_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    def no_hub(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(DsparkError, match="no such folder"):
        load_target(str(tmp_path / "nope"))


# ---- layer ids ---------------------------------------------------------------------------------

def test_layers_parse_once_in_the_settings():
    assert load_config(None, []).target.layers == "auto"
    assert load_config(None, ["target.layers=auto"]).target.layers == "auto"
    assert load_config(None, ["target.layers=1,9,17"]).target.layers == [1, 9, 17]
    assert load_config(None, ["target.layers=[2, 5]"]).target.layers == [2, 5]
    for bad, message in (("[]", "is empty"), ("", "is empty"), ("1,x", "expected 'auto'"),
                         ("[5, 2]", "strictly increasing"), ("[-1, 2]", ">= 0")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"target.layers={bad}"])
    assert parse_layers("AUTO") == "auto"


def test_resolve_and_agree_layers():
    assert resolve_layers("auto", 30) == [1, 8, 14, 20, 27]
    assert resolve_layers([1, 2], 30) == [1, 2]
    with pytest.raises(DsparkError, match="the target has 30 layers"):
        resolve_layers([1, 30], 30)
    assert agree_layers("auto", [1, 8], "the cache") == [1, 8]
    assert agree_layers([1, 8], [1, 8], "the cache") == [1, 8]
    with pytest.raises(DsparkError, match=r"target.layers is \[1, 9\], but the cache was built with"):
        agree_layers([1, 9], [1, 8], "the cache")


def test_empty_layers_flag_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "cache", "build", "--responses",
                           str(tmp_path / "r"), "--output", str(tmp_path / "c"), "--target",
                           str(tmp_path / "t"), "--layers", ""], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: --layers '' is empty") and "Traceback" not in proc.stderr


def test_train_takes_the_cache_layers_unless_set_otherwise(tiny_qwen3_target):
    from dspark_cli.train.trainer import drafter_config_for

    meta = {"layers": [2, 5, 11], "hidden_size": 32, "target": str(tiny_qwen3_target)}
    sets = [f"target.mask_token_id={mask_token_id(tiny_qwen3_target)}"]
    auto = drafter_config_for(load_config(None, sets), meta)
    assert auto.target_layer_ids == [2, 5, 11]
    same = drafter_config_for(load_config(None, [*sets, "target.layers=2,5,11"]), meta)
    assert same.target_layer_ids == [2, 5, 11]
    with pytest.raises(DsparkError, match="but the cache was built with layers"):
        drafter_config_for(load_config(None, [*sets, "target.layers=1,9,17,25,33"]), meta)
    # no cache (a caller's dataset): "auto" is what `cache build` would resolve
    no_cache = drafter_config_for(load_config(None, [*sets, f"target.model={tiny_qwen3_target}"]), {})
    assert no_cache.target_layer_ids == [1, 9, 17, 25, 33]


def test_eval_and_calibrate_take_the_drafter_layers(tiny_qwen3_target, tmp_path):
    from fixtures.drafter import drafter_config

    from dspark_cli.decode.stages import drafter_block_size
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.export import export_drafter

    export_drafter(DSparkDrafter(drafter_config(tiny_qwen3_target, layers=[2, 5], block_size=3)),
                   str(tmp_path / "d"))
    assert drafter_block_size(load_config(None, []), str(tmp_path / "d")) == 3
    assert drafter_block_size(load_config(None, ["target.layers=2,5"]), str(tmp_path / "d")) == 3
    with pytest.raises(DsparkError, match="but the drafter .* was built with layers"):
        drafter_block_size(load_config(None, ["target.layers=2,6"]), str(tmp_path / "d"))



def test_an_eval_run_of_the_last_release_keeps_matching_its_target(tiny_llama_target, tmp_path):
    """Eval/calibrate/profile outputs recorded the target as 'config:<sha of config.json>'."""
    from dspark_cli import manifest
    from dspark_cli.decode.stages import _target_input

    target, out = str(tiny_llama_target), str(tmp_path / "profile")
    cfg = load_config(None, [])
    assert _target_input(cfg, target, out) == identity.fingerprint(target)  # a fresh output
    old = identity.legacy_fingerprint(target)
    assert old.startswith("config:")
    manifest.prepare_stage("profile", out, {"a": 1}, {target: old}).claim()
    assert _target_input(cfg, target, out) == old
    assert manifest.prepare_stage("profile", out, {"a": 1}, {target: _target_input(cfg, target, out)}
                                  ).state == "resume"


def test_the_pipeline_says_what_auto_resolved_to_and_warns_of_pinned_bf16(monkeypatch, capsys):
    from dspark_cli.pipeline import say_cpu_dtypes

    monkeypatch.setenv("DSPARK_CPU_BF16", "0")
    say_cpu_dtypes(load_config(None, ["target.device=cpu", "train.device=cpu"]))
    said = " ".join(capsys.readouterr().err.split())
    assert "target dtype float32, train precision fp32 (this CPU has no native bf16" in said
    assert "slower" not in said
    say_cpu_dtypes(load_config(None, ["target.device=cpu", "train.device=cpu", "target.dtype=bfloat16",
                                      "train.precision=bf16"]))
    said = " ".join(capsys.readouterr().err.split())
    assert "target.dtype and train.precision ask for bf16 on a CPU without native bf16" in said
    monkeypatch.setenv("DSPARK_CPU_BF16", "1")
    say_cpu_dtypes(load_config(None, ["target.device=cpu", "train.device=cpu", "target.dtype=bfloat16"]))
    said = " ".join(capsys.readouterr().err.split())
    assert "slower" not in said and "train precision bf16 (this CPU has native bf16" in said
