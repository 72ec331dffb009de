"""`dspark cache build` end to end on the tiny 36-layer Qwen3: bit-exact states, every backend,
verify catching corruption, fp8, many workers, and the reader's refusals."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from fixtures.cache_responses import response_rows, write_responses
from typer.testing import CliRunner

from dspark_cli import manifest, storage
from dspark_cli.cache import store
from dspark_cli.cache.build import build_cache, finalize_cache
from dspark_cli.cache.reader import CacheDataset, ShardLocalSampler
from dspark_cli.cache.verify import summary, verify_cache
from dspark_cli.commands import cache as cache_commands
from dspark_cli.config import load_config
from dspark_cli.errors import DsparkError
from dspark_cli.target.identity import config_hash
from dspark_cli.target.layers import auto_layers, resolve_layers
from dspark_cli.target.model import load_target
from dspark_cli.target.render import render_conversation

LAYERS = [1, 9, 17, 25, 33]


def invoke(*args: str):
    app = typer.Typer()
    cache_commands.register(app)
    return CliRunner().invoke(app, ["cache", *args])


def config(target: Path, *sets: str):
    return load_config(None, [f"target.model={target}", "target.device=cpu", "cache.min_loss_tokens=8",
                              "cache.samples_per_shard=3", *sets])


@pytest.fixture(scope="module")
def responses(tmp_path_factory) -> str:
    """7 conversations (one too short to keep) as a contract-2 responses artifact."""
    url = str(tmp_path_factory.mktemp("resp") / "responses")
    return write_responses(url, response_rows(7, short_every=4))


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory, tiny_qwen3_target, responses) -> str:
    out = str(tmp_path_factory.mktemp("cache") / "cache")
    result = invoke("build", "--responses", responses, "--output", out, "--target", str(tiny_qwen3_target),
                    "--layers", "1,9,17,25,33", "--device", "cpu", "--samples-per-shard", "3",
                    "--min-loss-tokens", "8")
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out


def test_stored_states_are_the_targets_hidden_states_bit_for_bit(local_cache, tiny_qwen3_target, responses):
    # the cache was built with target.dtype auto: float32 here (the suite pins DSPARK_CPU_BF16=0)
    model, tokenizer = load_target(str(tiny_qwen3_target), "float32", "cpu")
    ds = CacheDataset(local_cache, expect_layers=LAYERS, expect_hidden_size=32,
                      expect_target_config_hash=config_hash(model))
    from dspark_cli.data.io import read_rows

    rows = {r["id"]: r for r in read_rows(responses)}
    assert len(ds) == 6  # 7 rows, one skipped for too few loss tokens
    assert manifest.read_manifest(local_cache)["counts"]["skipped"] == {"too_few_loss_tokens": 1}
    for i in range(len(ds)):
        item = ds[i]
        row = rows[item.sample_id]
        ids, mask = render_conversation(tokenizer, row["messages"], row["thinking"], 4096)
        assert item.input_ids.tolist() == ids and item.loss_mask.int().tolist() == mask
        with torch.no_grad():
            out = model.model(torch.tensor([ids]), output_hidden_states=True)
            logits = model(torch.tensor([ids])).logits[0]
        expected = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
        assert item.hidden_states.dtype == torch.bfloat16
        assert torch.equal(item.hidden_states, expected.to(torch.bfloat16))  # bf16 storage of the forward
        loss = item.loss_mask
        # final_hidden is compact: one row per loss-mask position, nothing stored or read in between
        assert torch.equal(item.final_positions, loss.nonzero().squeeze(-1))
        assert torch.equal(item.final_hidden, out.hidden_states[-1][0][loss].to(torch.bfloat16))
        # The final state is after the last norm: the frozen lm_head gives the target's logits
        # (to bf16 storage's rounding; before the norm they would be off by the norm's scale).
        torch.testing.assert_close(model.lm_head(item.final_hidden.float()), logits[loss],
                                   atol=0.02, rtol=0.02)
        assert ds.split_of(i) == row["split"]


def test_manifest_records_what_and_how(local_cache, tiny_qwen3_target):
    extra = manifest.read_manifest(local_cache)["extra"]
    assert extra["layers"] == LAYERS and extra["hidden_size"] == 32 and extra["num_target_layers"] == 36
    assert extra["storage_dtype"] == "bf16" and extra["num_samples"] == 6 and len(extra["shards"]) == 3
    assert extra["target"] == str(tiny_qwen3_target)
    assert all(len(s["checksums"]) == 7 for s in extra["shards"])
    assert extra["bytes"] < extra["reference_bytes"]
    assert verify_cache(local_cache)["samples"] == 6
    info = summary(local_cache)
    assert info["tokens"] == extra["num_tokens"] and info["vs_reference"] < 1
    assert invoke("inspect", local_cache).exit_code == 0


def test_rerun_is_a_no_op_and_changed_config_is_refused(local_cache, tiny_qwen3_target, responses):
    cfg = config(tiny_qwen3_target)
    again = build_cache(cfg, responses, local_cache, quiet=True)
    assert again.state == "done" and again.manifest == manifest.read_manifest(local_cache)
    assert again.summary["cache"]["tokens"] == again.manifest["extra"]["num_tokens"]
    with pytest.raises(DsparkError, match="storage_dtype"):
        fp8 = config(tiny_qwen3_target, "cache.storage_dtype='fp8'")
        build_cache(fp8, responses, local_cache, quiet=True)


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_build_verify_read_on_remote_storage(backend, request, local_cache, tiny_qwen3_target, responses):
    root = request.getfixturevalue("memory_url" if backend == "memory" else "s3_bucket")
    out = storage.join(root, "cache")
    build_cache(config(tiny_qwen3_target), responses, out, quiet=True)
    verify_cache(out)
    local, remote = manifest.read_manifest(local_cache)["extra"], manifest.read_manifest(out)["extra"]
    assert [s["checksums"] for s in remote["shards"]] == [s["checksums"] for s in local["shards"]]
    ds, ref = CacheDataset(out, expect_layers=LAYERS), CacheDataset(local_cache)
    order = list(ShardLocalSampler(ds, seed=1))
    assert sorted(order) == list(range(len(ds)))
    for i in order:
        a, b = ds[i], ref[i]
        assert a.sample_id == b.sample_id and torch.equal(a.hidden_states, b.hidden_states)


def test_verify_names_the_shard_and_array_with_a_flipped_byte(local_cache, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(local_cache, copy)
    chunk = copy / "shards" / "shard-00001" / "hidden" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(DsparkError, match=r"shard-00001: array 'hidden' checksum mismatch"):
        verify_cache(str(copy))
    result = invoke("verify", str(copy))
    assert result.exit_code != 0


def test_fp8_storage_is_smaller_and_close(local_cache, tiny_qwen3_target, responses, memory_url):
    out = storage.join(memory_url, "fp8")
    build_cache(config(tiny_qwen3_target, "cache.storage_dtype='fp8'"), responses, out, quiet=True)
    verify_cache(out)
    fp8, ref = manifest.read_manifest(out)["extra"], manifest.read_manifest(local_cache)["extra"]
    assert fp8["storage_dtype"] == "fp8" and fp8["bytes"] < 0.75 * ref["bytes"]
    q, exact = CacheDataset(out), CacheDataset(local_cache)
    for i in range(len(q)):
        a, b = q[i].hidden_states.float(), exact[i].hidden_states.float()
        assert (a - b).norm() / b.norm() < 0.05
        fa, fb = q[i].final_hidden.float(), exact[i].final_hidden.float()
        assert (fa - fb).norm() / fb.norm() < 0.05
    # build and estimate count the fp8 layout's bytes with one formula
    result = invoke("estimate", "--responses", responses, "--target", str(tiny_qwen3_target), "--layers",
                    "1,9,17,25,33", "--json", "--set", "cache.min_loss_tokens=8",
                    "--set", "cache.storage_dtype='fp8'")
    assert result.exit_code == 0, result.output
    import json

    assert json.loads(result.stdout)["uncompressed_bytes"] == fp8["raw_bytes"] < ref["raw_bytes"]


def test_two_workers_fill_one_cache_and_the_last_finalizes(local_cache, tiny_qwen3_target, responses,
                                                           memory_url):
    out = storage.join(memory_url, "multi")
    cfg = config(tiny_qwen3_target)
    first = build_cache(cfg, responses, out, num_workers=2, worker_index=0, quiet=True)
    assert first.summary["shards_built"] == 2 and first.manifest is None and "cache" not in first.summary
    assert first.state == "fresh"
    with pytest.raises(DsparkError, match="shard-00001"):
        finalize_cache(out)
    assert invoke("finalize", out).exit_code != 0
    second = build_cache(cfg, responses, out, num_workers=2, worker_index=1, quiet=True)
    assert second.summary["shards_built"] == 1 and second.manifest is not None
    assert second.state == "resumed"  # the second worker found the build started
    timings = second.manifest["timings"]  # the finishing worker's wall time, not the finalize call's
    assert timings["wall_seconds"] >= timings["forward_seconds"] > 0
    assert invoke("finalize", out).exit_code == 0  # already final: a no-op
    ref = manifest.read_manifest(local_cache)["extra"]["shards"]
    assert [s["checksums"] for s in manifest.read_manifest(out)["extra"]["shards"]] == \
        [s["checksums"] for s in ref]


def test_reader_refuses_a_cache_for_another_config(local_cache):
    with pytest.raises(DsparkError, match="layers"):
        CacheDataset(local_cache, expect_layers=[1, 2, 3])
    with pytest.raises(DsparkError, match="hidden size"):
        CacheDataset(local_cache, expect_hidden_size=64)
    with pytest.raises(DsparkError, match="another target"):
        CacheDataset(local_cache, expect_target_config_hash="0" * 64)
    train, val = CacheDataset(local_cache, split="train"), CacheDataset(local_cache, split="validation")
    assert len(train) + len(val) == 6 and len(val) >= 1


def test_layer_ids_are_checked_against_the_target():
    assert auto_layers(36) == [1, 9, 17, 25, 33]
    assert auto_layers(40) == [1, 10, 19, 28, 37]
    assert auto_layers(6) == sorted(set(auto_layers(6))) and max(auto_layers(6)) < 6
    assert resolve_layers("auto", 36) == LAYERS and resolve_layers(LAYERS, 36) == LAYERS
    with pytest.raises(DsparkError, match="the target has 36 layers"):
        resolve_layers([1, 9, 36], 36)


def test_out_of_range_layer_is_one_line_error(tiny_qwen3_target, responses, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_cli.cli", "cache", "build", "--responses", responses,
         "--output", str(tmp_path / "c"), "--target", str(tiny_qwen3_target), "--layers", "1,9,40"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: --layers: id 40 is out of range; the target has 36 layers (valid ids 0..35)."]
    assert "Traceback" not in proc.stderr


def test_reader_survives_pickling_for_dataloader_workers(local_cache):
    import pickle

    ds = CacheDataset(local_cache)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[3].hidden_states, ds[3].hidden_states)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=ShardLocalSampler(ds, seed=2))
    assert sorted(item.sample_id for item in loader) == sorted(ds[i].sample_id for i in range(len(ds)))


def test_kept_samples_are_decoded_once_and_the_budget_bounds_them(local_cache, monkeypatch):
    """memory_mb: a second pass over a cache that fits decodes nothing; a budget smaller than the
    cache keeps only what fits; kept samples equal fresh reads; pickling carries none of them."""
    import pickle

    import dspark_cli.cache.reader as reader

    fresh = CacheDataset(local_cache, prefetch=0)
    reads: list[int] = []
    load = CacheDataset._load

    def counting(self, i):
        reads.append(i)
        return load(self, i)

    monkeypatch.setattr(reader.CacheDataset, "_load", counting)
    ds = CacheDataset(local_cache, prefetch=0, memory_mb=64)
    first = [ds[i] for i in range(len(ds))]
    assert sorted(reads) == list(range(len(ds))) and ds.kept_samples == len(ds)
    reads.clear()
    second = [ds[i] for i in reversed(range(len(ds)))]
    assert reads == []  # the whole cache fits: nothing is read or decoded again
    for i, item in enumerate(reversed(second)):
        assert item is first[i]
        assert torch.equal(item.hidden_states, fresh[i].hidden_states)
        assert torch.equal(item.final_hidden, fresh[i].final_hidden)
    assert pickle.loads(pickle.dumps(ds)).kept_samples == 0

    one = first[0]
    size = sum(t.numel() * t.element_size() for t in (one.input_ids, one.loss_mask, one.hidden_states,
                                                       one.final_hidden))
    small = CacheDataset(local_cache, prefetch=0, memory_mb=1)
    small.memory_bytes = size  # room for sample 0 alone
    [small[i] for i in range(len(small))]
    assert small.kept_samples == 1
    reads.clear()
    [small[i] for i in range(len(small))]
    assert sorted(reads) == list(range(1, len(small)))  # every sample but the kept one is read again
    assert CacheDataset(local_cache, prefetch=0).kept_samples == 0  # the default keeps nothing


def test_force_with_several_workers_is_refused(tiny_qwen3_target, responses, memory_url):
    with pytest.raises(DsparkError, match="--force with several workers"):
        build_cache(config(tiny_qwen3_target), responses, storage.join(memory_url, "c"), force=True,
                    num_workers=2, worker_index=0, quiet=True)


def test_estimate_matches_the_built_cache(local_cache, tiny_qwen3_target, responses):
    result = invoke("estimate", "--responses", responses, "--target", str(tiny_qwen3_target), "--layers",
                    "1,9,17,25,33", "--json", "--set", "cache.min_loss_tokens=8")
    assert result.exit_code == 0, result.output
    import json

    estimate = json.loads(result.stdout)
    extra = manifest.read_manifest(local_cache)["extra"]
    assert estimate["tokens"] == extra["num_tokens"] and estimate["loss_tokens"] == extra["num_loss_tokens"]
    assert estimate["uncompressed_bytes"] == extra["raw_bytes"]
    assert estimate["reference_bytes"] == extra["reference_bytes"]
    assert 0.7 < estimate["expected_bytes"] / extra["bytes"] < 1.3
    # what online training trades: those bytes, for a forward over each training sample per epoch
    train = [j for shard in extra["shards"] for j in range(shard["num_samples"])
             if j not in shard["validation_samples"]]
    assert estimate["online_saves_bytes"] == estimate["expected_bytes"]
    assert estimate["online_target_forwards_per_epoch"] == len(train) > 0
    assert 0 < estimate["online_target_tokens_per_epoch"] < estimate["tokens"]
    table = invoke("estimate", "--responses", responses, "--target", str(tiny_qwen3_target), "--layers",
                   "1,9,17,25,33", "--set", "cache.min_loss_tokens=8")
    assert "train --online" in table.stdout and "per sample per epoch" in table.stdout


def test_partial_shard_on_an_object_store_is_rebuilt(local_cache, tiny_qwen3_target, responses, memory_url):
    """A killed object-store write leaves objects without a marker: the rerun rebuilds that shard."""
    out = storage.join(memory_url, "partial")
    cfg = config(tiny_qwen3_target)
    build_cache(cfg, responses, out, quiet=True)
    shard = storage.join(out, "shards", "shard-00002")
    storage.remove(storage.join(shard, storage.COMMIT_MARKER))
    storage.remove(storage.join(out, manifest.MANIFEST_NAME))
    storage.write_bytes(storage.join(shard, "hidden", "c", "0", "0"), b"half an upload")
    result = build_cache(cfg, responses, out, quiet=True)
    assert result.summary["shards_built"] == 1 and result.manifest is not None
    assert result.state == "resumed"
    verify_cache(out)
    ref = manifest.read_manifest(local_cache)["extra"]["shards"]
    assert [s["checksums"] for s in manifest.read_manifest(out)["extra"]["shards"]] == \
        [s["checksums"] for s in ref]


def test_each_worker_decodes_only_the_rows_of_its_shards(local_cache, tiny_qwen3_target, memory_url,
                                                         monkeypatch):
    """Peak memory follows a worker's own rows: the Parquet footers place every row, and only the
    row groups holding the worker's shards are decoded (files of 2 rows, shards of 3: they straddle)."""
    import pyarrow.parquet as pq

    rows = response_rows(7, short_every=4)
    responses = write_responses(storage.join(memory_url, "resp2"), rows, per_file=2)
    decoded: list[int] = []
    read_row_groups = pq.ParquetFile.read_row_groups

    def counting(self, *args, **kwargs):
        table = read_row_groups(self, *args, **kwargs)
        decoded.append(table.num_rows)
        return table

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", counting)
    monkeypatch.setattr(pq.ParquetFile, "read", None)  # nothing may fall back to reading a whole file
    out, cfg = storage.join(memory_url, "rows"), config(tiny_qwen3_target)
    build_cache(cfg, responses, out, num_workers=2, worker_index=1, quiet=True)  # owns shard 1: rows 3..5
    assert sum(decoded) == 4  # files 1 and 2 (rows 2..5), not the 7 rows of the artifact
    decoded.clear()
    build_cache(cfg, responses, out, num_workers=2, worker_index=0, quiet=True)  # shards 0, 2: rows 0..2, 6
    assert sum(decoded) == 4 + 1  # files 0, 1 and 3
    ref = manifest.read_manifest(local_cache)["extra"]["shards"]
    assert [s["checksums"] for s in manifest.read_manifest(out)["extra"]["shards"]] == \
        [s["checksums"] for s in ref]  # the same cache as one worker reading one 7-row file


def test_a_cache_without_chunk_checksums_reads_unverified_and_says_so_once(local_cache, tiny_qwen3_target,
                                                                           responses, memory_url, monkeypatch,
                                                                           capsys):
    """Caches built before per-chunk checksums (store.CHUNK_CHECKSUM off writes that layout) still
    read, bit for bit the same samples, with one warning; a chunk that does not decode (the old
    Zstd traceback) is still one line naming shard and array."""
    monkeypatch.setattr(store, "CHUNK_CHECKSUM", False)
    out = storage.join(memory_url, "old-layout")
    build_cache(config(tiny_qwen3_target), responses, out, quiet=True)
    verify_cache(out)
    old, new = CacheDataset(out), CacheDataset(local_cache)
    capsys.readouterr()
    for i in range(len(new)):
        a, b = old[i], new[i]
        assert torch.equal(a.hidden_states, b.hidden_states) and torch.equal(a.final_hidden, b.final_hidden)
    said = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert said.count("without per-chunk checksums") == 1 and out in said
    chunk = storage.join(out, "shards", "shard-00000", "input_ids", "c", "0")
    data = bytearray(storage.read_bytes(chunk))
    data[0] ^= 0xFF  # the first inner chunk's zstd magic number
    storage.write_bytes(chunk, bytes(data))
    with pytest.raises(DsparkError, match=r"shard-00000: array 'input_ids' is corrupt \(a chunk does not"):
        CacheDataset(out)[0]


def test_the_arrays_an_open_reads_whole_are_one_chunk_and_older_shards_read_the_same(
        local_cache, tiny_qwen3_target, responses, memory_url, monkeypatch):
    """Opening a shard reads its ids, mask and offsets whole: one inner chunk each, the states in
    CHUNK_TOKENS rows; a cache written in the earlier layout (every array in 64-row chunks) reads
    the same samples."""
    from dspark_cli.cache.build import CHUNK_TOKENS

    group, _ = store.shard_arrays(storage.join(local_cache, "shards", "shard-00000"))
    for name in store.INDEX_ARRAYS:
        assert group[name].chunks == group[name].shape, name
    assert group["input_ids"].shape[0] > CHUNK_TOKENS  # the case this layout exists for
    assert group["hidden"].chunks[0] == CHUNK_TOKENS
    monkeypatch.setattr(store, "WHOLE_INDEX", False)
    out = storage.join(memory_url, "chunked-ids")
    build_cache(config(tiny_qwen3_target), responses, out, quiet=True)
    old, _ = store.shard_arrays(storage.join(out, "shards", "shard-00000"))
    assert old["input_ids"].chunks[0] == CHUNK_TOKENS
    a, b = CacheDataset(out), CacheDataset(local_cache)
    for i in range(len(b)):
        x, y = a[i], b[i]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(x.hidden_states, y.hidden_states) and torch.equal(x.final_hidden, y.final_hidden)
