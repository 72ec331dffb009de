"""Sampling filters and the engine's stop logic, in-process (no server)."""

from __future__ import annotations

import torch

from dspark_cli.serve.engine import Engine, Sequence, _held_back
from dspark_cli.serve.sampling import SamplingParams, _sorted_filtered_probs, sample

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))  # [1, 4]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What `sample` draws filtered rows from, scattered back over the vocabulary → [B, V]."""
    probs, order = _sorted_filtered_probs(logits, params)
    return torch.zeros_like(logits).scatter_(-1, order, probs)


def test_top_k_keeps_the_k_best():
    probs = filtered_probs(LOGITS, [SamplingParams(top_k=2)])
    assert torch.allclose(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = filtered_probs(LOGITS, [SamplingParams(top_p=0.7)])  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    assert torch.allclose(filtered_probs(LOGITS, [SamplingParams(top_p=1.0)]), LOGITS.exp())


def test_min_p_is_relative_to_the_best_token():
    probs = filtered_probs(LOGITS, [SamplingParams(min_p=0.4)])  # keep p >= 0.2
    assert torch.allclose(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_rows_use_their_own_params_and_generators():
    logits = LOGITS.repeat(3, 1)  # [3, 4]
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=1.0)]
    counts = torch.zeros(4)
    for seed in range(400):
        gens = [torch.Generator().manual_seed(seed) for _ in range(3)]
        tokens = sample(logits, params, gens)
        assert tokens[0] == 0 and tokens[1] == 0
        counts[tokens[2]] += 1
    freq = counts / counts.sum()
    assert (freq - LOGITS.exp()[0]).abs().max() < 0.07  # unfiltered T=1 follows the distribution


def test_unfiltered_and_filtered_rows_in_one_batch_follow_their_own_distributions():
    """Rows that filter nothing skip the sort (the fast path); a filtered row beside them still
    draws from its filtered distribution, and the temperature applies to both."""
    logits = LOGITS.repeat(2, 1)  # [2, 4]
    params = [SamplingParams(temperature=2.0), SamplingParams(temperature=2.0, top_p=0.6)]
    assert not params[0].filters(4) and params[1].filters(4)
    counts = torch.zeros(2, 4)
    for seed in range(600):
        tokens = sample(logits, params, [torch.Generator().manual_seed(seed) for _ in range(2)])
        counts[0, tokens[0]] += 1
        counts[1, tokens[1]] += 1
    freq = counts / counts.sum(dim=1, keepdim=True)
    hot = (LOGITS[0] / 2.0).softmax(dim=-1)  # ≈ [0.35, 0.25, 0.19, 0.16]: T = 2 flattens
    assert (freq[0] - hot).abs().max() < 0.06
    kept = hot[:2] / hot[:2].sum()  # top-p 0.6 over the T = 2 distribution keeps the best two
    assert (freq[1, :2] - kept).abs().max() < 0.06 and freq[1, 2:].sum() == 0


def test_filters_says_whether_anything_is_removed():
    assert not SamplingParams(top_k=-1).filters(4) and not SamplingParams(top_k=4).filters(4)
    assert SamplingParams(top_k=3).filters(4) and SamplingParams(min_p=0.1).filters(4)


def test_same_seed_same_draw_regardless_of_batch_mates():
    p = SamplingParams(temperature=1.0)
    alone = sample(LOGITS, [p], [torch.Generator().manual_seed(5)])
    mates = sample(LOGITS.repeat(2, 1), [SamplingParams(top_k=1), p],
                   [torch.Generator().manual_seed(1), torch.Generator().manual_seed(5)])
    assert alone[0] == mates[1]


def test_held_back_covers_partial_stop_strings_and_bytes():
    assert _held_back("hello wor", ("world",)) == 3
    assert _held_back("hello", ("xyz",)) == 0
    assert _held_back("ab\ufffd", ()) == 1


def test_eos_finishes_with_stop_and_is_not_in_the_text(tiny_qwen3_target):
    engine = Engine(str(tiny_qwen3_target))
    events: list[tuple[str, str | None]] = []
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=5), torch.Generator(),
                   lambda d, r: events.append((d, r)))
    word = engine.tokenizer.encode("fox")[0]
    engine._advance(seq, word)
    engine._advance(seq, engine.tokenizer.eos_token_id)
    assert seq.finish_reason == "stop" and seq.text == engine.tokenizer.decode([word])
    assert seq.generated == 2 and events[-1][1] == "stop"


def test_sequences_joining_a_running_batch_generate_as_if_alone(tiny_qwen3_target):
    """Continuous batching: a prompt that joins mid-generation (its cache left-padded and stacked
    under the running one) gives the same greedy tokens as when decoded alone."""
    engine = Engine(str(tiny_qwen3_target), dtype="float32")
    prompts = [engine.render([{"role": "user", "content": c}], {"enable_thinking": False})
               for c in ("What is 12 plus 30?", "Write a short poem about the sea, the wind and the stars.",
                         "hi")]

    def seq(ids: list[int], max_tokens: int = 12) -> Sequence:
        return Sequence(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), torch.Generator(),
                        lambda d, r: None)

    alone = []
    for ids in prompts:
        s = seq(ids)
        engine.generate([s])
        alone.append(s.output_ids)
    first, late = seq(prompts[0]), [seq(prompts[1]), seq(prompts[2])]
    calls = []

    def take_new(running: int) -> list[Sequence]:
        calls.append(running)
        return late if len(calls) == 4 else []  # join after three decoding steps

    engine.generate([first], take_new=take_new)
    assert [first.output_ids, late[0].output_ids, late[1].output_ids] == alone
    assert calls[4] == 3  # the running batch grew to three rows


def test_finished_long_prompt_frees_its_padding_columns(tiny_qwen3_target):
    """When the row with the longest history finishes, the columns that were padding for every
    other row leave the KV cache (the batch would otherwise keep paying for them each step), and
    the remaining rows still decode exactly as when alone."""
    engine = Engine(str(tiny_qwen3_target), dtype="float32")
    short = engine.render([{"role": "user", "content": "hi"}], {"enable_thinking": False})
    long = engine.render([{"role": "user", "content": "Write a long poem about the sea, the wind, the stars, "
                                                      "the harbour lights and the boats coming home."}],
                         {"enable_thinking": False})

    def seq(ids: list[int], max_tokens: int) -> Sequence:
        return Sequence(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), torch.Generator(),
                        lambda d, r: None)

    alone = seq(short, 10)
    engine.generate([alone])
    widths: list[int] = []
    forward = engine._forward

    def recording_forward(input_ids, attention, positions, cache):
        if input_ids.shape[1] == 1:  # decode steps only: prefill runs one forward per length group
            widths.append(attention.shape[1])
        return forward(input_ids, attention, positions, cache)

    engine._forward = recording_forward
    together = [seq(long, 2), seq(short, 10)]
    engine.generate(together)
    assert together[1].output_ids == alone.output_ids
    assert len(long) > len(short) + 5
    # step 1 decodes both rows over the long prompt's width; once the long row is gone, the width
    # is the short row's own history (prompt + tokens so far), not the long prompt's.
    assert widths[0] == len(long) + 1
    assert widths[1] == len(short) + 2


def test_prefill_hands_the_lm_head_a_contiguous_last_position(tiny_qwen3_target):
    """`logits_to_keep=1` slices the prefill's last position as a strided view, which `F.linear`
    turns into a bmm over a per-row copy of the vocabulary-wide weight (1.2 s for 25 SmolLM2 rows):
    the engine's pre-hook makes the lm_head's input contiguous, and the samples do not change."""
    engine = Engine(str(tiny_qwen3_target), dtype="float32")
    prompts = [engine.render([{"role": "user", "content": text}], {"enable_thinking": False})
               for text in ("tell me about the sea", "tell me about the wind")]  # one prefill group
    seen: list[bool] = []
    engine.model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].is_contiguous()))
    seqs = [Sequence(p, SamplingParams(temperature=0.0, max_tokens=3), torch.Generator(), lambda d, r: None)
            for p in prompts]
    engine.generate(seqs)
    assert seen and all(seen)
    alone = Sequence(prompts[1], SamplingParams(temperature=0.0, max_tokens=3), torch.Generator(),
                     lambda d, r: None)
    engine.generate([alone])
    assert alone.output_ids == seqs[1].output_ids
