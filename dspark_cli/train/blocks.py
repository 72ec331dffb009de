"""Blocks from anchors, packed across samples by anchors (not padded to the longest context).

For an anchor p (DESIGN.md §3), draft index j = 0..γ−1 predicts the token at p + j + 1:

    anchor_first  inputs [x_p, MASK × (γ−1)]   positions p .. p+γ−1     slot j → label p+j+1
    fill_in       inputs [x_p, MASK × γ]       positions p .. p+γ       slot j+1 → label p+j+1

The Markov head's previous token for draft index j is x_{p+j} (the anchor for j = 0); the target
distribution for it is lm_head(final_hidden[p+j]). Supervision stops at the first label outside
the loss mask or the sequence (prefix mask by cumulative product).

A packed step concatenates each sample's context (only positions < its last anchor are ever
seen) and lists every block; `BlockLayout` records which keys each query may see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.attention import BlockLayout
from ..model.config import DrafterConfig
from ..sample import Sample


@dataclass
class PackedBatch:
    """One forward's worth of blocks from several samples."""

    block_input_ids: torch.Tensor  # [N, n_in]
    block_position_ids: torch.Tensor  # [N, n_in]
    context_hidden: torch.Tensor  # [C, m·d] contexts of all samples, concatenated
    context_position_ids: torch.Tensor  # [C]
    labels: torch.Tensor  # [N, γ] token at anchor + j + 1
    prev_tokens: torch.Tensor  # [N, γ] token at anchor + j (Markov x_{j-1})
    valid: torch.Tensor  # [N, γ] bool, prefix-masked supervision
    target_hidden: torch.Tensor  # [N, γ, d] final_hidden at anchor + j
    layout: BlockLayout
    num_samples: int

    @property
    def num_blocks(self) -> int:
        return self.block_input_ids.shape[0]

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        moved["layout"] = self.layout.to(device)
        return PackedBatch(**moved)


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                  gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels, prev_tokens, valid, state_positions), each [A, γ], for one sample."""
    T = input_ids.shape[0]
    j = torch.arange(gamma)
    label_pos = anchors[:, None] + j[None, :] + 1  # [A, γ]
    in_seq = label_pos < T
    clamped = label_pos.clamp(max=T - 1)
    supervised = in_seq & loss_mask.bool()[clamped]
    valid = torch.cumprod(supervised.int(), dim=1).bool()  # stop at the first unsupervised label
    state_pos = (label_pos - 1).clamp(max=T - 1)  # [A, γ] = anchor + j
    return input_ids[clamped], input_ids[state_pos], valid, state_pos


def pack(samples: list[Sample], anchors: list[torch.Tensor], config: DrafterConfig) -> PackedBatch:
    """Pack samples and their anchors into one batch of blocks."""
    gamma, n_in = config.block_size, config.block_inputs
    ctx_h, ctx_pos, key_sample, key_pos = [], [], [], []
    ids, pos, labels, prevs, valids, targets = [], [], [], [], [], []
    q_sample, q_anchor = [], []
    for s, (sample, anc) in enumerate(zip(samples, anchors, strict=True)):
        if anc.numel() == 0:
            continue
        input_ids, loss_mask = sample.input_ids.long(), sample.loss_mask
        C = int(anc.max())  # positions < the last anchor are all any block can see
        ctx_h.append(sample.hidden_states[:C])
        ctx_pos.append(torch.arange(C))
        key_sample.append(torch.full((C,), s))
        key_pos.append(torch.arange(C))
        block_ids = torch.full((anc.numel(), n_in), config.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = input_ids[anc]
        ids.append(block_ids)
        pos.append(anc[:, None] + torch.arange(n_in)[None, :])
        lab, prev, val, state_pos = block_targets(input_ids, loss_mask, anc, gamma)
        labels.append(lab)
        prevs.append(prev)
        valids.append(val)
        targets.append(sample.final_at(state_pos))  # [A, γ, d], zeros off the loss mask
        q_sample.append(torch.full((anc.numel(),), s))
        q_anchor.append(anc)
    if not ids:
        raise ValueError("no sample in this batch has an anchor")
    block_ids = torch.cat(ids)
    N = block_ids.shape[0]
    block_of_slot = torch.arange(N).repeat_interleave(n_in)  # [N·n_in]
    q_sample_t = torch.cat(q_sample).repeat_interleave(n_in)
    q_anchor_t = torch.cat(q_anchor).repeat_interleave(n_in)
    n_ctx = sum(h.shape[0] for h in ctx_h)
    layout = BlockLayout(
        key_sample=torch.cat([*key_sample, q_sample_t]),
        key_pos=torch.cat([*key_pos, torch.zeros(N * n_in, dtype=torch.long)]),
        key_block=torch.cat([torch.full((n_ctx,), -1), block_of_slot]),
        query_sample=q_sample_t, query_anchor=q_anchor_t, query_block=block_of_slot,
    )
    return PackedBatch(
        block_input_ids=block_ids, block_position_ids=torch.cat(pos),
        context_hidden=torch.cat(ctx_h), context_position_ids=torch.cat(ctx_pos),
        labels=torch.cat(labels), prev_tokens=torch.cat(prevs), valid=torch.cat(valids),
        target_hidden=torch.cat(targets), layout=layout, num_samples=len(samples),
    )
