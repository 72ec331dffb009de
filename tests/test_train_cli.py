"""`dspark train` on a real cache built by `dspark cache build`, through the CLI entry point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.cache_responses import response_rows, write_responses
from fixtures.cli import assert_user_error, run_dspark
from fixtures.tiny_models import mask_token_id
from safetensors.torch import load as st_load

from dspark_cli.cache.build import build_cache
from dspark_cli.cli import main
from dspark_cli.config import load_config
from dspark_cli.manifest import read_manifest
from dspark_cli.model.export import load_drafter
from dspark_cli.train.checkpoint import committed_steps

SETS = ["model.num_draft_layers=1", "model.block_size=3", "model.markov_rank=8", "train.num_anchors=6",
        "train.global_batch=2", "train.save_every=2", "train.log_every=1", "target.device=cpu"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_qwen3_target) -> str:
    root = tmp_path_factory.mktemp("train-cli")
    responses = write_responses(str(root / "responses"), response_rows(6))
    cfg = load_config(None, [f"target.model={tiny_qwen3_target}", "target.device=cpu",
                             "cache.min_loss_tokens=8", "cache.samples_per_shard=3"])
    build_cache(cfg, responses, str(root / "cache"), quiet=True)
    return str(root / "cache")


def run(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_train_from_cache_then_reload(cache, tiny_qwen3_target, tmp_path, capsys):
    out = str(tmp_path / "train")
    sets = [a for s in SETS for a in ("--set", s)]
    code = run("train", "--cache", cache, "--output", out, "--max-steps", "3",
               "--set", f"target.mask_token_id={mask_token_id(tiny_qwen3_target)}", *sets)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["steps"] == 3 and result["export"].endswith("/export")
    assert committed_steps(out) == [2, 3]
    # The target recorded in the cache is used: no --target needed, and the export reloads.
    validation = read_manifest(out)["extra"]["validation"]  # the cache's held-out split is scored
    assert validation["samples"] >= 1 and 1.0 <= validation["accepted_length"] <= 4.0
    drafter = load_drafter(out)
    assert drafter.config.target_model == str(tiny_qwen3_target)
    assert drafter.block_size == 3 and torch.isfinite(drafter.fc.weight).all()

    # Its last checkpoint drafts like the export but predates the held-out bias refit: said, once.
    shift = read_manifest(out)["extra"]["confidence_bias"]["shift"]
    assert run("export", f"{out}/checkpoints/step-00000003", str(tmp_path / "from-checkpoint")) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"before its run's held-out bias refit ({shift:+.3f})" in err and f"pass {out} for" in err
    assert run("export", out, str(tmp_path / "from-run")) == 0
    assert "bias refit" not in capsys.readouterr().err
    # The note is advice: a damaged run record never stops the export of a sound checkpoint.
    Path(out, "manifest.json").write_text("{not json")
    assert run("export", f"{out}/checkpoints/step-00000003", str(tmp_path / "damaged-run")) == 0
    assert "bias refit" not in capsys.readouterr().err


def test_missing_mask_token_is_one_line_error(cache, tmp_path, capsys):
    code = run("train", "--cache", cache, "--output", str(tmp_path / "t"), "--max-steps", "1",
               *[a for s in SETS for a in ("--set", s)])
    err = capsys.readouterr().err
    assert code == 2 and "error: target.mask_token_id is not set" in err and "Traceback" not in err


def test_out_of_vocab_mask_token_is_refused(cache, tmp_path, capsys):
    code = run("train", "--cache", cache, "--output", str(tmp_path / "t"), "--max-steps", "1",
               "--set", "target.mask_token_id=385", *[a for s in SETS for a in ("--set", s)])
    err = capsys.readouterr().err
    assert code == 2 and "not a row of the target embedding (vocab size 385)" in err


def test_explicit_layers_other_than_the_cache_are_refused(cache, tiny_qwen3_target, tmp_path, capsys):
    """The cache's layers are the truth ("auto" takes them); only explicitly different ones fail."""
    mask = f"target.mask_token_id={mask_token_id(tiny_qwen3_target)}"
    code = run("train", "--cache", cache, "--output", str(tmp_path / "t"), "--max-steps", "1",
               "--set", "target.layers=1,9,17", "--set", mask, *[a for s in SETS for a in ("--set", s)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "error: target.layers is [1, 9, 17], but the cache was built with layers [1, 9, 17, 25, 33]" in err
    assert not (tmp_path / "t").exists()  # refused before the output is claimed


def _flip_first_chunk(cache_dir: Path, shard: str, array: str) -> tuple[Path, bytes]:
    """Flip one byte inside the first inner chunk of `array` (the shard index sits at the end)."""
    obj = next(p for p in (cache_dir / "shards" / shard / array / "c").rglob("*") if p.is_file())
    original = obj.read_bytes()
    data = bytearray(original)
    data[8] ^= 0x40
    obj.write_bytes(bytes(data))
    return obj, original


@pytest.mark.parametrize("array", ["input_ids", "hidden"])
def test_a_corrupt_chunk_stops_train_with_one_line_naming_shard_and_array(cache, tiny_qwen3_target, tmp_path,
                                                                          array):
    """Before: a bad input_ids chunk died in a Zstd traceback and a bad hidden chunk trained on
    garbage. Every chunk read is checked; the installed `dspark` says which shard and array."""
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    obj, original = _flip_first_chunk(copy, "shard-00000", array)
    args = ["train", "--cache", str(copy), "--output", str(tmp_path / "train"), "--max-steps", "4",
            "--set", f"target.mask_token_id={mask_token_id(tiny_qwen3_target)}",
            *[a for s in SETS for a in ("--set", s)]]
    failed = run_dspark(*args)
    line = assert_user_error(failed, "shard-00000", f"array '{array}'", "checksum")
    assert "hint: run `dspark cache verify" in failed.stderr
    obj.write_bytes(original)  # repaired: the same command now trains, no --force needed
    done = run_dspark(*args)
    assert done.returncode == 0, (line, done.stderr)


def test_a_deleted_shard_is_missing_before_the_first_step(cache, tiny_qwen3_target, tmp_path, capsys):
    """Issue 29: found only after training had started, and called corrupt."""
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    shutil.rmtree(copy / "shards" / "shard-00001")
    mask = f"target.mask_token_id={mask_token_id(tiny_qwen3_target)}"
    code = run("train", "--cache", str(copy), "--output", str(tmp_path / "t"), "--max-steps", "2",
               "--set", mask, *[a for s in SETS for a in ("--set", s)])
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and line and "shard-00001 is missing" in line[0] and "corrupt" not in err, err
    assert not (tmp_path / "t" / "checkpoints").exists()


def test_train_with_another_target_names_the_cache_s_target(cache, tiny_qwen3_target, tiny_llama_target,
                                                            tmp_path, capsys):
    code = run("train", "--cache", cache, "--output", str(tmp_path / "t"), "--max-steps", "1",
               "--target", str(tiny_llama_target), "--set", "target.mask_token_id=384",
               *[a for s in SETS for a in ("--set", s)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"the cache was built for another target ({tiny_qwen3_target}), not {tiny_llama_target}" in err
    assert not (tmp_path / "t").exists()


def test_a_reduced_draft_vocabulary_is_counted_from_the_caches_train_split(cache, tiny_qwen3_target, tmp_path,
                                                                           capsys):
    """model.draft_vocab_size: the N most frequent response tokens of the train split (the cache's
    index arrays, counted as the samples themselves count them), kept in checkpoints, exported
    widened for both engines or, with --d2t, in vLLM's form."""
    from dspark_cli.cache.reader import CacheDataset
    from dspark_cli.train.draft_vocab import choose_draft_vocab, count_sample_tokens

    vocab = load_drafter_vocab(tiny_qwen3_target)
    train_split = CacheDataset(cache, split="train")
    by_samples = count_sample_tokens(train_split, vocab)
    by_index = train_split.split_token_counts(vocab, 10**9)
    assert all(np.array_equal(a, b) for a, b in zip(by_index, by_samples, strict=True))
    everything = count_sample_tokens(CacheDataset(cache), vocab)
    assert not np.array_equal(everything.response, by_samples.response)  # the held-out split is left out
    expected = choose_draft_vocab(by_samples, 24)
    response = by_samples.response
    assert response[expected.numpy()].min() >= np.delete(response, expected.numpy()).max()

    out = str(tmp_path / "train")
    sets = [a for s in [*SETS, "model.draft_vocab_size=24"] for a in ("--set", s)]
    args = ("train", "--cache", cache, "--output", out, "--set",
            f"target.mask_token_id={mask_token_id(tiny_qwen3_target)}", *sets)
    assert run(*args, "--max-steps", "2") == 0
    assert "draft vocabulary: the 24 most frequent" in " ".join(capsys.readouterr().err.split())
    assert torch.equal(load_drafter(f"{out}/checkpoints/step-00000002").draft_token_ids, expected)
    Path(out, "manifest.json").unlink()  # killed after its last checkpoint: the rerun resumes
    assert run(*args, "--max-steps", "2") == 0
    resumed = " ".join(capsys.readouterr().err.split())
    assert "resuming from" in resumed and "draft vocabulary" not in resumed  # the checkpoint's, not recounted
    assert run(*args, "--max-steps", "2", "--force") == 0  # a fresh run counts, whatever --force replaces
    assert torch.equal(load_drafter(f"{out}/checkpoints/step-00000002").draft_token_ids, expected)
    exported = load_drafter(out)
    assert torch.equal(exported.draft_token_ids, expected)
    assert read_manifest(out)["config"]["model"]["draft_vocab_size"] == 24
    tensors = st_load(Path(out, "export", "model.safetensors").read_bytes())  # widened: both engines
    assert tensors["markov_head.markov_w2.weight"].shape == (vocab, 8 + 1) and "d2t" not in tensors
    assert run("export", out, str(tmp_path / "vllm"), "--d2t") == 0
    tensors = st_load(Path(tmp_path, "vllm", "model.safetensors").read_bytes())
    assert torch.equal(tensors["d2t"] + torch.arange(24), expected)


def test_a_draft_vocabulary_larger_than_the_responses_fills_from_the_prompts():
    """Fewer distinct response tokens than N: every one of them, then the prompts' most frequent
    (by count, ties to the lower id), and only then ids seen nowhere."""
    from dspark_cli.train.draft_vocab import TokenCounts, choose_draft_vocab, describe

    response = np.array([0, 5, 0, 1, 0, 0, 0, 0, 0, 0])
    context = np.array([0, 0, 2, 9, 0, 7, 2, 0, 1, 0])
    counts = TokenCounts(response, context)
    assert choose_draft_vocab(counts, 2).tolist() == [1, 3]
    assert choose_draft_vocab(counts, 4).tolist() == [1, 2, 3, 5]
    assert choose_draft_vocab(counts, 5).tolist() == [1, 2, 3, 5, 6]
    assert choose_draft_vocab(counts, 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 8]
    line = describe(counts, choose_draft_vocab(counts, 5))
    assert "2 distinct ids in 6 training response tokens (100.00% of them)" in line
    assert line.endswith("the other 3 from the prompts' tokens")
    assert describe(counts, choose_draft_vocab(counts, 8)).endswith(
        "the other 6 from the prompts' tokens (4) and the lowest unseen ids (2)")


def load_drafter_vocab(target) -> int:
    from dspark_cli.target.files import load_config as load_target_config
    return load_target_config(str(target)).vocab_size


@pytest.mark.parametrize("sets,culprit", [
    (["model.draft_vocab_size=-3"], "model.draft_vocab_size"),
    (["model.draft_vocab_size=385"], "model.draft_vocab_size 385 must be smaller than the target"),
    (["model.draft_vocab_size=24", "train.fast_kernels=false"], "train.fast_kernels"),
])
def test_a_bad_draft_vocabulary_is_one_line_through_the_entry_point(cache, tiny_qwen3_target, tmp_path, sets,
                                                                    culprit):
    out = tmp_path / "t"
    mask = f"target.mask_token_id={mask_token_id(tiny_qwen3_target)}"
    failed = run_dspark("train", "--cache", cache, "--output", str(out), "--max-steps", "1",
                        *[a for s in [*SETS, mask, *sets] for a in ("--set", s)])
    assert_user_error(failed, culprit)
    assert not (out / "manifest.json").exists()
