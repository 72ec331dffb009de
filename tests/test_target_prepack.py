"""Prepacked target linears (target/prepack.py): the same numbers as the plain model, through the
decoder's own batched forward, and left plain wherever packing does not apply."""

from __future__ import annotations

import torch

from dspark_cli.decode.batch import TargetBatch
from dspark_cli.settings.target import TargetSettings
from dspark_cli.target.model import Target, load_target
from dspark_cli.target.prepack import PackedLinear, packed_count, prepack_linears


def test_packed_target_matches_plain_through_the_decoders_forward(tiny_llama_target):
    plain, _ = load_target(str(tiny_llama_target), "float32", "cpu")
    packed, _ = load_target(str(tiny_llama_target), "float32", "cpu", prepack=True)
    assert packed_count(plain) == 0
    linears = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert linears > 0 and packed_count(packed) == linears
    assert list(packed.state_dict()) == list(plain.state_dict())  # parameters stay where they were

    results = []
    for model in (plain, packed):
        batch = TargetBatch(model, [1, 3])
        with torch.inference_mode():
            batch.add([5, 6, 7, 8, 9])
            batch.add([10, 11, 12])
            # ragged verification (rows of 4 and 1 tokens: M ≥ 2 and the M = 1 padding path),
            # then a one-token step per row, as the target-only loop runs it
            hidden, final = batch.forward([[13, 14, 15, 16], [17]], [5, 3])
            batch.commit([2, 1])
            _, step = batch.forward([[20], [21]], [7, 4])
            logits = model.get_output_embeddings()(final)
        results.append((hidden, final, step, logits))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_gradients_take_the_plain_path_and_one_row_the_packed_one(tiny_llama_target):
    model, _ = load_target(str(tiny_llama_target), "float32", "cpu", prepack=True)
    layer = next(m for m in model.modules() if isinstance(m, PackedLinear))
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer(x).sum().backward()  # the packed kernel has no backward: this only works on the plain path
    expected = layer.weight.sum(0).expand(3, -1)
    torch.testing.assert_close(x.grad, expected)
    one = torch.randn(1, 1, layer.in_features)
    with torch.inference_mode():  # one row (the target-only baseline's step) runs packed as well
        torch.testing.assert_close(layer(one), torch.nn.functional.linear(one, layer.weight, layer.bias))
    layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(layer.weight), None)
    with torch.inference_mode():
        assert layer(one).abs().max() == (layer.bias.abs().max() if layer.bias is not None else 0)


def test_bf16_packed_only_where_onednn_has_native_bf16(tiny_llama_target):
    plain, _ = load_target(str(tiny_llama_target), "bfloat16", "cpu")
    packed, _ = load_target(str(tiny_llama_target), "bfloat16", "cpu", prepack=True)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2: refused or a slow fallback there
        assert packed_count(packed) == 0
        return
    assert packed_count(packed) == sum(type(m) is torch.nn.Linear for m in plain.modules()) > 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.inference_mode():
        for rows in (ids, ids[:, :1]):  # a multi-token step and a one-row one
            a, b = plain(rows).logits.float(), packed(rows).logits.float()
            torch.testing.assert_close(b, a, rtol=0.02, atol=0.02)  # bf16: rounding order differs


def test_left_plain_where_packing_does_not_apply(tiny_llama_target):
    model, _ = load_target(str(tiny_llama_target), "float32", "cpu")
    assert prepack_linears(model, memory=1024) == 0  # the copy would not fit in half the memory
    assert packed_count(model) == 0
    settings = TargetSettings(model=str(tiny_llama_target), dtype="float32", device="cpu", prepack=False)
    assert packed_count(Target.from_settings(settings).model) == 0
    settings.prepack = True
    assert packed_count(Target.from_settings(settings).model) > 0
