"""The in-place growing KV cache (target/kv.py) against Transformers' own DynamicCache."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from dspark_cli.decode.sps import crop_cache
from dspark_cli.target.capture import cache_kwarg
from dspark_cli.target.kv import GrowingLayer, append_in_place, new_cache


def _logits(model, cache, ids, positions, attention):
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
                **{cache_kwarg(model): cache})
    return out.logits


def test_decoding_matches_dynamic_cache_through_crop_and_row_selection(tiny_llama_target):
    """Prefill, steps of 1 and 3 tokens, a crop (speculative rejection), dropping a row (a finished
    request): logits equal DynamicCache's bit for bit, and steps write into the same buffer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_target, dtype=torch.float32).eval()
    ours, theirs = new_cache(model.config), DynamicCache(config=model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in ours.layers)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9))
    attention = torch.ones(2, 9, dtype=torch.long)
    positions = torch.arange(9)[None].expand(2, -1)
    buffers = []
    with torch.inference_mode():
        for step, width in enumerate([9, 1, 3, 1, 1, 3]):
            if step:
                ids = torch.randint(0, vocab, (attention.shape[0], width))
                start = int(attention.shape[1])
                positions = torch.arange(start, start + width)[None].expand(attention.shape[0], -1)
                attention = torch.cat([attention, torch.ones(attention.shape[0], width, dtype=torch.long)], 1)
            a = _logits(model, ours, ids, positions, attention)
            b = _logits(model, theirs, ids, positions, attention)
            assert torch.equal(a, b), step
            buffers.append(ours.layers[0]._key_buffer.data_ptr())
            if step == 2:  # two of the three drafted tokens rejected
                crop_cache(ours, ours.get_seq_length() - 2)
                crop_cache(theirs, theirs.get_seq_length() - 2)
                attention = attention[:, :-2]
            if step == 4:  # row 0 finished
                keep = torch.tensor([1])
                ours.batch_select_indices(keep)
                theirs.batch_select_indices(keep)
                attention = attention[keep]
    assert buffers[1] == buffers[2] == buffers[3] == buffers[4]  # grown in place, cropped in place
    assert buffers[5] != buffers[4]  # a selected row is a new tensor: copied into a new buffer once
    assert torch.equal(ours.layers[0].keys, theirs.layers[0].keys)


def test_append_writes_in_place_until_full_then_doubles():
    new = torch.randn(1, 2, 3, 4)
    view, buffer = append_in_place(torch.tensor([]), None, new)
    assert torch.equal(view, new) and buffer.shape[2] == 3 + 64
    first = buffer.data_ptr()
    for _ in range(21):
        view, buffer = append_in_place(view, buffer, torch.randn(1, 2, 3, 4))
    assert buffer.data_ptr() == first and view.shape[2] == 66
    grown, buffer = append_in_place(view, buffer, torch.randn(1, 2, 3, 4))
    assert buffer.data_ptr() != first and buffer.shape[2] >= 2 * 66 and torch.equal(grown[:, :, :66], view)
    replaced = grown[:, :, 5:].clone()  # someone else's tensor (a trimmed or stacked cache)
    again, other = append_in_place(replaced, buffer, new)
    assert other.data_ptr() != buffer.data_ptr() and torch.equal(again, torch.cat([replaced, new], 2))
