"""Who may attend to what, and the attention kernel that enforces it.

Keys are laid out `[context of sample 0; context of sample 1; …; every block slot]` and queries are
the block slots (DESIGN.md §3). A slot of the block anchored at position p of sample s sees the
context features of sample s at positions < p (strictly) and every slot of its own block
(bidirectional), nothing else. On CPU the mask is a boolean tensor for SDPA (flex attention has no
CPU backward); under CUDA the same rule is a flex-attention BlockMask. Both are built and compared
on CPU by tests/test_attention_flex.py (flex's CPU forward), so only the CUDA kernels are untested
without a GPU (`make gpu-check`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BlockLayout:
    """Per-key and per-query labels from which the mask rule is evaluated (all LongTensor)."""

    key_sample: torch.Tensor  # [K] sample of each key
    key_pos: torch.Tensor  # [K] position in its sample (context keys); unused for block keys
    key_block: torch.Tensor  # [K] block id of each block key, -1 for context keys
    query_sample: torch.Tensor  # [Q]
    query_anchor: torch.Tensor  # [Q] anchor position of the query's block
    query_block: torch.Tensor  # [Q]

    def to(self, device: torch.device | str) -> BlockLayout:
        return BlockLayout(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def allowed(layout: BlockLayout, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The rule itself, for any broadcastable query/key index tensors (shared by both backends)."""
    ctx_ok = ((layout.key_block[k] < 0) & (layout.key_sample[k] == layout.query_sample[q])
              & (layout.key_pos[k] < layout.query_anchor[q]))
    return ctx_ok | (layout.key_block[k] == layout.query_block[q])


def dense_mask(layout: BlockLayout) -> torch.Tensor:
    """Boolean [Q, K] mask, True = may attend (SDPA convention)."""
    q = torch.arange(layout.query_block.numel(), device=layout.query_block.device)
    k = torch.arange(layout.key_block.numel(), device=layout.key_block.device)
    return allowed(layout, q[:, None], k[None, :])


@dataclass
class SplitMask:
    """The dense rule of a packed step, split where it is sparse (CPU, train.fast_kernels).

    A block key is visible only to its own block's queries, so the dense [Q, C + Q] mask is
    almost all False and SDPA spends Q·(C + Q) on it. Here `context` [Q, C] says which context
    keys each query sees, and each query sees the `block` slots of its own block (queries and
    block keys come in the same consecutive blocks of `block`, as `pack` lays them out):
    Q·(C + block) instead.
    """

    context: torch.Tensor  # bool [Q, C]
    block: int


def split_mask(layout: BlockLayout) -> SplitMask | torch.Tensor:
    """`SplitMask` of a layout whose block keys and queries come in consecutive equal blocks
    (every packed step); the dense mask for any other layout."""
    n_ctx = int((layout.key_block < 0).sum())
    queries = layout.query_block.numel()
    blocks = int(layout.query_block.max()) + 1 if queries else 0
    size = queries // blocks if blocks else 0
    ids = torch.arange(blocks, device=layout.query_block.device).repeat_interleave(size)
    if (not blocks or size * blocks != queries or not torch.equal(layout.query_block, ids)
            or not torch.equal(layout.key_block[n_ctx:], ids) or bool((layout.key_block[:n_ctx] >= 0).any())):
        return dense_mask(layout)
    q = torch.arange(queries, device=ids.device)
    k = torch.arange(n_ctx, device=ids.device)
    return SplitMask(allowed(layout, q[:, None], k[None, :]), size)


def attend_split(query: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor],
                 block_kv: tuple[torch.Tensor, torch.Tensor], mask: SplitMask) -> torch.Tensor:
    """`attend` under a SplitMask: one softmax over [visible context keys; own block's keys].

    query [B, H, Q, D]; ctx_kv [B, Hkv, C, D]; block_kv [B, Hkv, Q, D] (the queries' own slots).
    Query head h reads kv head h // (H / Hkv), as repeat_interleave does. Returns [B, H, Q, D].
    """
    B, H, Q, D = query.shape
    kv_heads, n = ctx_kv[0].shape[1], mask.block
    g, N, C = H // kv_heads, Q // n, ctx_kv[0].shape[2]
    q = query.reshape(B, kv_heads, g * Q, D) * D ** -0.5
    s_ctx = torch.matmul(q, ctx_kv[0].transpose(-1, -2)).view(B, H, Q, C)
    s_ctx = s_ctx.masked_fill(~mask.context, float("-inf"))
    k_blk = block_kv[0].reshape(B, kv_heads, 1, N, n, D)
    s_blk = torch.matmul(q.view(B, kv_heads, g, N, n, D), k_blk.transpose(-1, -2))  # [B, Hkv, g, N, n, n]
    probs = torch.softmax(torch.cat([s_ctx, s_blk.reshape(B, H, Q, n).to(s_ctx.dtype)], dim=-1), dim=-1)
    p_ctx, p_blk = probs.split([C, n], dim=-1)
    v_ctx, v_blk = ctx_kv[1], block_kv[1]
    out = torch.matmul(p_ctx.to(v_ctx.dtype).reshape(B, kv_heads, g * Q, C), v_ctx).view(B, H, Q, D)
    p_blk = p_blk.to(v_blk.dtype).reshape(B, kv_heads, g, N, n, n)
    out_blk = torch.matmul(p_blk, v_blk.reshape(B, kv_heads, 1, N, n, D)).reshape(B, H, Q, D)
    return out + out_blk.to(out.dtype)


def flex_block_mask(layout: BlockLayout):
    """The same rule as a flex-attention BlockMask (sparse: skips fully masked tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(layout, q_idx, kv_idx)

    return create_block_mask(mask_mod, None, None, layout.query_block.numel(), layout.key_block.numel(),
                             device=layout.query_block.device)


def step_mask(layout: BlockLayout, flex: bool, split: bool) -> object:
    """The mask a training step passes to the drafter: a flex BlockMask (CUDA), a SplitMask
    (train.fast_kernels) or the dense boolean mask."""
    if flex:
        return flex_block_mask(layout)
    return split_mask(layout) if split else dense_mask(layout)


_flex_compiled = None


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: object | None,
           num_kv_groups: int) -> torch.Tensor:
    """Scaled dot-product attention with GQA. query [B, H, Q, D], key/value [B, Hkv, K, D].

    `mask` is None (every query sees every key), a boolean [Q, K] tensor (SDPA), or a flex
    BlockMask (CUDA). Returns [B, H, Q, D].
    """
    global _flex_compiled
    if mask is not None and not isinstance(mask, torch.Tensor):  # flex BlockMask
        from torch.nn.attention.flex_attention import flex_attention

        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=True)
        # flex is not an autocast op: give it one dtype (q/k norms return float32 under autocast).
        dev = query.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else query.dtype
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return _flex_compiled(query, key, value, block_mask=mask, enable_gqa=num_kv_groups > 1)
    if num_kv_groups > 1 and query.device.type == "cpu":
        # On CPU enable_gqa reads each kv head for its query group in place: the same values and
        # gradients as repeating key/value to H heads, without copying the context every call.
        # The attention of a draft layer over 300 context positions (2-core EPYC, median of runs):
        # R = 1 0.13-0.15 -> 0.10-0.13 ms, R = 8 1.0-1.1 -> 0.6-0.8 ms (fp32 and bf16): a small
        # part of a 5-6 ms draft. CUDA keeps the copy: a mask with enable_gqa sends it to the math kernel.
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    if num_kv_groups > 1:
        key = key.repeat_interleave(num_kv_groups, dim=1)  # [B, H, K, D]
        value = value.repeat_interleave(num_kv_groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


def use_flex(device: torch.device | str) -> bool:
    """Flex attention only under CUDA: on CPU it has no backward."""
    return torch.device(device).type == "cuda"
