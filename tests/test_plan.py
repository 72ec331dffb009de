"""`dspark plan`: its FLOPs are FlopCounterMode's count of a real step, its traced activations are
what a real step saves, and the command plans the reference configs offline."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dspark_cli.model.attention import dense_mask
from dspark_cli.model.config import DrafterConfig
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.plan import memory
from dspark_cli.plan.batches import synthetic_micro_batch
from dspark_cli.plan.flops import flop_counter, micro_batch_flops
from dspark_cli.train.loss import DrafterLoss, LossWeights

HEADLESS = dict(markov_head_type="none", enable_confidence_head=False, confidence_head_with_markov=False)
KINDS = {"vanilla": {}, "conf-h": dict(confidence_head_with_markov=False),
         "gated": dict(markov_head_type="gated"), "rnn": dict(markov_head_type="rnn"), "headless": HEADLESS,
         "fill_in": dict(block_convention="fill_in", **HEADLESS)}
SAMPLES = [(180, 120), (95, 40)]  # two samples of a micro-batch: (tokens, answer tokens)


def tiny(**model) -> DrafterConfig:
    return DrafterConfig(hidden_size=48, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=700, target_layer_ids=[0, 2, 3], mask_token_id=699,
                         num_draft_layers=2, block_size=5, markov_rank=24, **model)


def real_step(c: DrafterConfig, chunk: int = 16):
    torch.manual_seed(0)
    drafter = DSparkDrafter(c)
    batch = synthetic_micro_batch(c, SAMPLES, num_anchors=48)
    batch.context_hidden.normal_()
    batch.target_hidden.normal_()
    # the plan counts the full vocabulary-wide work: fast_kernels' savings depend on the data
    return drafter, batch, DrafterLoss(drafter, LossWeights(), chunk, fast_kernels=False)


@pytest.mark.parametrize("kind", KINDS)
def test_plan_flops_are_flop_counter_modes_count_of_a_real_step(kind):
    c = tiny(**KINDS[kind])
    _, batch, loss_module = real_step(c)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = loss_module(batch, dense_mask(batch.layout))
        loss.backward()
    predicted = micro_batch_flops(c, batch.context_hidden.shape[0], batch.num_blocks)
    assert predicted.counted("cpu") == counter.get_total_flops()
    assert predicted.attention > 0 and predicted.total > predicted.counted("cpu")  # SDPA: uncounted on CPU


@pytest.mark.parametrize("kind", ["vanilla", "fill_in"])
def test_plan_flops_total_is_the_count_with_cpus_fused_attention_counted(kind):
    c = tiny(**KINDS[kind])
    _, batch, loss_module = real_step(c)
    with flop_counter() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = loss_module(batch, dense_mask(batch.layout))
        loss.backward()
    predicted = micro_batch_flops(c, batch.context_hidden.shape[0], batch.num_blocks)
    assert counter.get_total_flops() == predicted.total > predicted.counted("cpu")


@pytest.mark.parametrize("kind", ["vanilla", "headless"])
def test_traced_activations_are_what_a_real_step_saves(kind):
    c = tiny(**KINDS[kind])
    drafter, batch, loss_module = real_step(c)
    own = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_module(batch, dense_mask(batch.layout))
    traced = memory.traced_activation_bytes(c, SAMPLES, num_anchors=48, chunk_blocks=16, bf16=True)
    assert traced == sum(saved.values()) > 0


def test_parameter_counts_match_the_drafter():
    c = tiny()
    drafter = DSparkDrafter(c)
    counts = memory.parameter_counts(c)
    assert counts.trainable == sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert counts.frozen == 2 * c.vocab_size * c.hidden_size


def test_plan_of_the_reference_configs_offline_and_what_to_change():
    from fixtures.cli import run_dspark

    proc = run_dspark("plan", "pipelines/qwen3-4b.toml", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["target"]["origin"] == "built-in table"
    assert 4.0e9 < plan["target"]["parameters"] < 4.05e9  # Qwen3-4B: 4.02B with its tied embedding
    cache, online = plan["sources"]["cache"], plan["sources"]["online"]
    assert cache["fits"] and online["peak_gib"] > cache["peak_gib"] + 7  # + the 8 GB bf16 target
    assert online["flops_per_step"] > cache["flops_per_step"]
    assert plan["advice"] == []
    tight = run_dspark("plan", "pipelines/qwen3-14b.toml", "--gpu-memory", "24")
    assert tight.returncode == 0, tight.stderr
    text = " ".join((tight.stdout + tight.stderr).split())
    assert "DOES NOT FIT" in text and "--set train.num_anchors=256" in text
    assert "More GPUs do not lower it" in text


def test_an_unknown_target_offline_is_one_line(tmp_path):
    from fixtures.cli import assert_user_error, run_dspark

    toml = tmp_path / "x.toml"
    toml.write_text('[target]\nmodel = "someone/unknown-7b"\nmask_token_id = 5\nlayers = [1, 2]\n')
    assert_user_error(run_dspark("plan", str(toml), env={"HF_HUB_OFFLINE": "1"}), "someone/unknown-7b")


def test_the_online_target_is_counted_in_its_own_dtype():
    from dspark_cli.config import load_config
    from dspark_cli.plan.report import Cluster, Data, make_plan

    data, cluster = Data(1000, 256, 192, "stated"), Cluster(1, 80.0, 300.0, "cpu")
    peaks, parameters = {}, 0
    for dtype in ("bfloat16", "float32"):
        cfg = load_config("pipelines/qwen3-4b.toml", [f"target.dtype='{dtype}'"])
        plan = make_plan(cfg, data, cluster)
        peaks[dtype], parameters = plan.sources["online"].memory.online_target, plan.target["parameters"]
    assert peaks["float32"] - peaks["bfloat16"] >= 2 * parameters > 8e9  # 4 bytes a weight, not 2


def test_on_cpu_a_checkpoints_serialised_moments_count_and_not_on_a_gpu():
    """train/checkpoint.py serialises the AdamW moments (8 bytes a trainable weight) in host memory
    before writing them: on CPU that is the device's memory (make rehearse measured it as the peak)."""
    from dspark_cli.config import load_config
    from dspark_cli.plan.report import Cluster, Data, make_plan

    cfg = load_config("pipelines/qwen3-4b.toml", [])
    data = Data(1000, 112, 34, "stated")
    cpu = make_plan(cfg, data, Cluster(1, 80.0, 300.0, "cpu"))
    gpu = make_plan(cfg, data, Cluster(1, 80.0, 300.0, "cuda"))
    trainable = cpu.parameters["trainable"]
    m = cpu.sources["cache"].memory
    assert m.checkpoint == 8 * trainable and gpu.sources["cache"].memory.checkpoint == 0
    assert gpu.sources["cache"].memory.kept == 0 and cpu.sources["online"].memory.kept == 0
    # the reader keeps the whole split when it fits train.cache_memory_mb (host memory: CPU only)
    d, train = cpu.target["hidden_size"], int(100 * (1 - cfg.data.val_fraction))
    few = make_plan(cfg, Data(100, 112, 34, "stated"), Cluster(1, 80.0, 300.0, "cpu"))
    assert few.sources["cache"].memory.kept == train * (112 * (8 + 1 + 5 * d * 2) + 34 * d * 2)  # fits
    assert m.kept == cfg.train.cache_memory_mb * 2**20  # 950 samples of 2.9 MB: the budget bounds it
    static = m.runtime + m.frozen + m.batches + m.kept
    assert m.peak == static + m.states + m.checkpoint  # short samples: the checkpoint is the peak
