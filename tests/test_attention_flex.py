"""The CUDA training path's attention rule, exercised on CPU: flex attention has a CPU forward
(eager, and compiled through Inductor) though no CPU backward, so the BlockMask that training builds
under CUDA (`flex_block_mask`) is compared here with the SDPA boolean mask that CPU training uses,
on real training layouts: the tiny target's samples, anchors drawn by the trainer's own code
(`train.data.load_batch`) from their real loss masks, several samples packed into one batch."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafter import drafter_config, make_samples

from dspark_cli.model import attention
from dspark_cli.model.attention import dense_mask, flex_block_mask
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.frozen import attach_frozen
from dspark_cli.train.data import load_batch

flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention


@pytest.fixture(scope="module")
def setup(tiny_qwen3_target):
    samples = make_samples(tiny_qwen3_target, n=4)
    config = drafter_config(tiny_qwen3_target)
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    attach_frozen(drafter, str(tiny_qwen3_target))
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)
    # Two training micro-batches: all four samples with 6 anchors each, and two with every anchor.
    batches = [load_batch(samples, [0, 1, 2, 3], epoch=0, num_anchors=6, seed=0, config=config),
               load_batch(samples, [1, 3], epoch=1, num_anchors=512, seed=3, config=config)]
    return drafter.eval(), batches


def _qkv(layout: attention.BlockLayout, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    gen = torch.Generator().manual_seed(layout.key_block.numel())
    q = torch.randn(1, heads, layout.query_block.numel(), dim, generator=gen)
    k = torch.randn(1, kv_heads, layout.key_block.numel(), dim, generator=gen)
    v = torch.randn(1, kv_heads, layout.key_block.numel(), dim, generator=gen)
    return q, k, v


def test_training_layouts_are_real(setup):
    """The layouts hold several samples, context keys and blocks of every sample (not a toy case)."""
    _drafter, batches = setup
    for batch in batches:
        layout = batch.layout
        assert layout.query_sample.unique().numel() >= 2
        assert (layout.key_block < 0).any() and (layout.key_block >= 0).any()
        mask = dense_mask(layout)
        assert mask.any(1).all() and not mask.all()  # every query sees something, none sees all


def test_flex_block_mask_forward_equals_sdpa_eager(setup):
    _drafter, batches = setup
    for batch in batches:
        q, k, v = _qkv(batch.layout)
        sdpa = attention.attend(q, k, v, dense_mask(batch.layout), num_kv_groups=2)
        flex = flex_attention(q, k, v, block_mask=flex_block_mask(batch.layout), enable_gqa=True)
        torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


def test_block_mask_skips_only_fully_masked_tiles(setup):
    """The BlockMask's sparsity agrees with the dense rule: a tile it drops holds no allowed pair."""
    _drafter, batches = setup
    layout = batches[1].layout
    block = flex_block_mask(layout)
    dense = dense_mask(layout)
    tiles = block.to_dense()[0, 0].bool()  # [Q tiles, K tiles]: tiles flex computes
    size_q, size_k = block.BLOCK_SIZE
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            tile = dense[i * size_q:(i + 1) * size_q, j * size_k:(j + 1) * size_k]
            assert bool(tiles[i, j]) == bool(tile.any()), (i, j)


def test_drafter_forward_with_block_mask_equals_sdpa(setup, monkeypatch):
    """The drafter's own attention entry point (`attend`'s BlockMask branch: one dtype, GQA) with the
    training BlockMask equals its SDPA path. The kernel is eager flex here: training compiles it
    with dynamic shapes, which Inductor's CPU backend cannot build for this mask (torch 2.13:
    CppCompileError); the static compile is the slow test below, the dynamic one `make gpu-check`."""
    drafter, batches = setup
    monkeypatch.setattr(attention, "_flex_compiled", flex_attention)
    for batch in batches:
        args = (batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                batch.context_position_ids)
        with torch.no_grad():
            sdpa = drafter(*args, dense_mask(batch.layout))
            flex = drafter(*args, flex_block_mask(batch.layout))
        torch.testing.assert_close(flex, sdpa, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_flex_forward_equals_sdpa(setup):
    """flex attention compiled by Inductor for the CPU (static shapes; ~20 s of compiling, hence
    slow) on the training BlockMask equals SDPA with the boolean mask."""
    _drafter, batches = setup
    compiled = torch.compile(flex_attention, dynamic=False)
    for batch in batches:
        q, k, v = _qkv(batch.layout)
        sdpa = attention.attend(q, k, v, dense_mask(batch.layout), num_kv_groups=2)
        flex = compiled(q, k, v, block_mask=flex_block_mask(batch.layout), enable_gqa=True)
        torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)
