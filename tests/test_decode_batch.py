"""The batched target: ragged rows (joins, right-padded rounds, masked holes, leaves) give every
row what a forward over that row's own kept tokens alone gives."""

from __future__ import annotations

import pytest
import torch

from dspark_cli.decode.batch import TargetBatch
from dspark_cli.decode.sps import row_lengths
from dspark_cli.target.capture import capture_layers
from dspark_cli.target.model import load_target

LAYERS = [1, 9, 17]


@pytest.fixture(scope="module")
def model(tiny_qwen3_target):
    return load_target(str(tiny_qwen3_target), dtype="float32", device="cpu")[0]


def test_ragged_rounds_match_each_sequence_alone(model):
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 384, (n,), generator=gen).tolist()

    seqs = [ids(5), ids(11), ids(8)]  # every position already cached, per row
    batch = TargetBatch(model, LAYERS)
    for s in seqs:
        batch.add(s)
    # Three rounds of different lengths per row, each keeping a different prefix (holes in rows 0, 2).
    for inputs_len, keep in [([3, 1, 5], [1, 1, 4]), ([2, 4, 1], [2, 3, 1]), ([6, 2, 2], [6, 2, 1])]:
        inputs = [ids(n) for n in inputs_len]
        hidden, final = batch.forward(inputs, [len(s) for s in seqs])
        for r, (s, new) in enumerate(zip(seqs, inputs, strict=True)):
            want_h, want_f = capture_layers(model, s + new, LAYERS)
            q = len(new)
            torch.testing.assert_close(hidden[r, :q], want_h[-q:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(final[r, :q], want_f[-q:], atol=1e-4, rtol=1e-4)
        batch.commit(keep)
        seqs = [s + new[:k] for s, new, k in zip(seqs, inputs, keep, strict=True)]
        assert batch.attention.sum(1).tolist() == [len(s) for s in seqs]
    # Row 1 (the longest) leaves: the others keep their rows, the dead left columns go.
    width = batch.attention.shape[1]
    batch.keep([2, 0])
    seqs = [seqs[2], seqs[0]]
    assert batch.rows == 2 and batch.attention.shape[1] < width
    hidden, final = batch.forward([[7], [9, 3]], [len(s) for s in seqs])
    for r, new in enumerate([[7], [9, 3]]):
        want_h, want_f = capture_layers(model, seqs[r] + new, LAYERS)
        torch.testing.assert_close(final[r, : len(new)], want_f[-len(new):], atol=1e-4, rtol=1e-4)


def test_profile_rows_split_batch_tokens_like_the_decoder():
    assert row_lengths(1, 8) == [1]
    assert row_lengths(8, 8) == [8]
    assert row_lengths(20, 8) == [7, 7, 6]
    assert sum(row_lengths(129, 8)) == 129 and len(row_lengths(129, 8)) == 17


def test_target_alone_batched_by_the_decoder_loop_equals_plain_decoding(model, tiny_qwen3_target):
    """drafter=None: one batched target step per round for R rows (the Figure 8 baseline) gives
    the plain one-at-a-time greedy text, multi-turn conversations included."""
    from dspark_cli.decode.prompts import Conversation
    from dspark_cli.decode.scheduler import Scheduler
    from dspark_cli.decode.specdec import SpeculativeDecoder, target_only
    from dspark_cli.target.model import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_qwen3_target))
    convs = [Conversation("a", ["What is 12 plus 30?", "And plus 2?"]), Conversation("b", ["Hello!"]),
             Conversation("c", ["Write a short poem about the sea."], system="Be brief.")]
    base = target_only(model, tokenizer, convs, temperature=0.0, max_new_tokens=12, thinking=False)
    batched = SpeculativeDecoder(model, tokenizer, None, Scheduler("fixed", 1), temperature=0.0,
                                 max_new_tokens=12).run(convs, 3)
    assert batched.answers == base.answers and batched.new_tokens == base.new_tokens
    assert max(b.requests for b in batched.batches) == 3
