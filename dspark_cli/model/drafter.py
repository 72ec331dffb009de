"""The DSpark drafter, read top to bottom: norm → rotary → attention → MLP → layer → model.

A block of γ slots (`[x_anchor, MASK × (γ−1)]`, position ids anchor+k) is decoded in one parallel
pass, conditioned on the target's features of the positions before the anchor:

    ctx = RMSNorm(fc([H_l1; …; H_lm]))                        once, shared by every layer
    each layer:  Q = Wq·h,  K = [Wk·ctx; Wk·h],  V = [Wv·ctx; Wv·h]   (Qwen3: q/k norm, RoPE, GQA)
    U_k = lm_head(norm(h_k))                                  frozen target lm_head
    logits_k = U_k + W2·z_k                                   Markov bias (heads.py)

Training calls `forward` on packed blocks of many anchors (see train/blocks.py); inference calls
`draft_block`, which samples the block left to right. The embedding and lm_head are the target's,
frozen, loaded from its safetensors (model/frozen.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..target.prepack import PackedLinear, pack_weight, packed_linear
from .attention import SplitMask, attend, attend_split
from .block_sampler import SlotSampler
from .config import DrafterConfig
from .draw import DraftDist
from .heads import ConfidenceHead, MarkovHead
from .vocab_logits import vocab_logits


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables from the target's RoPE settings (any rope_type Transformers knows)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        self.impl = Qwen3RotaryEmbedding(config.hf_rope_config())

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] → cos, sin [B, T, head_dim] in x's dtype."""
        return self.impl(x, position_ids)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DraftAttention(nn.Module):
    """Queries from the block, keys/values from [context; block] (DESIGN.md §3)."""

    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x [B, T, d] → [B, Hkv, T, D] each."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, hidden: torch.Tensor, block_rope: tuple[torch.Tensor, torch.Tensor],
                ctx_kv: tuple[torch.Tensor, torch.Tensor], mask: object | None) -> torch.Tensor:
        """hidden [B, Q, d]; ctx_kv = this layer's context keys/values [B, Hkv, C, D]."""
        B, Q, _ = hidden.shape
        cos, sin = block_rope
        q = self.q_norm(self.q_proj(hidden).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [B, H, Q, D]
        k_blk, v_blk = self.kv(hidden, cos, sin)
        if isinstance(mask, SplitMask):  # training on CPU: each block's own slots, not every block's
            ctx = (ctx_kv[0].to(k_blk.dtype), ctx_kv[1].to(v_blk.dtype))
            out = attend_split(q, ctx, (k_blk, v_blk), mask)
            return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))
        k = torch.cat([ctx_kv[0].to(k_blk.dtype), k_blk], dim=2)  # [B, Hkv, C + Q, D]
        v = torch.cat([ctx_kv[1].to(v_blk.dtype), v_blk], dim=2)
        out = attend(q, k, v, mask, self.num_kv_groups)  # [B, H, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm residual block; names match Transformers' Qwen3DecoderLayer (the export relies on it)."""

    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, block_rope: tuple[torch.Tensor, torch.Tensor],
                ctx_kv: tuple[torch.Tensor, torch.Tensor], mask: object | None) -> torch.Tensor:
        residual = hidden
        hidden = residual + self.self_attn(self.input_layernorm(hidden), block_rope, ctx_kv, mask)
        residual = hidden
        return residual + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DraftBlock:
    """One sampled block: slot k proposes the token at anchor_pos + k + 1."""

    tokens: torch.Tensor  # LongTensor [γ]
    probs: torch.Tensor  # float32 [γ, V], the distribution each token was drawn from
    confidences: torch.Tensor | None  # [γ] raw sigmoid outputs, None without a confidence head


@dataclass
class DraftBatch:
    """R sampled blocks: the tokens with the distributions they were drawn from, and confidences."""

    dist: DraftDist  # tokens [R, γ] and their (top-k) draft distributions
    confidences: torch.Tensor | None  # float32 [R, γ] raw sigmoid outputs


class DraftContext:
    """Per-request context keys/values, preallocated [rows, Hkv, capacity, D] per layer.

    Row r holds positions 0..lengths[r]-1 of request r (the target features before its anchor);
    rows are appended to, never recomputed, and capacity grows by doubling, so a round costs the
    new positions only. The decoder keeps its request order and this one in step.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 256) -> None:
        shape = (0, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def add_row(self) -> None:
        """A new, empty request at the end."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
        self.lengths.append(0)

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished requests leave)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.keys[0].device)
        self.keys = [t.index_select(0, index) for t in self.keys]
        self.values = [t.index_select(0, index) for t in self.values]
        self.lengths = [self.lengths[r] for r in rows]

    def write(self, row: int, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append keys/values [Hkv, n, D] per layer at the end of `row`."""
        start = self.lengths[row]
        n = layer_kv[0][0].shape[1]
        if start + n > self.keys[0].shape[2]:
            grow = max(start + n, 2 * self.keys[0].shape[2]) - self.keys[0].shape[2]
            for store in (self.keys, self.values):
                for i, t in enumerate(store):
                    store[i] = torch.cat([t, t.new_zeros((t.shape[0], t.shape[1], grow, t.shape[3]))], dim=2)
        for i, (k, v) in enumerate(layer_kv):
            self.keys[i][row, :, start:start + n] = k
            self.values[i][row, :, start:start + n] = v
        self.lengths[row] = start + n

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views [rows, Hkv, max length, D] per layer (shorter rows are masked by `mask`)."""
        width = max(self.lengths, default=0)
        return [(k[:, :, :width], v[:, :, :width]) for k, v in zip(self.keys, self.values, strict=True)]

    def mask(self, block: int) -> torch.Tensor | None:
        """Boolean [rows, 1, block, width + block]: a row's own context and the whole block."""
        width = max(self.lengths, default=0)
        if all(n == width for n in self.lengths):
            return None  # nothing padded: every query sees every key
        device = self.keys[0].device
        ctx_ok = torch.arange(width, device=device)[None] < torch.tensor(self.lengths, device=device)[:, None]
        ok = torch.cat([ctx_ok, ctx_ok.new_ones((self.rows, block))], dim=1)  # [rows, width + block]
        return ok[:, None, None, :].expand(self.rows, 1, block, width + block)


class DSparkDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.fc = nn.Linear(config.num_context_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(config, i) for i in range(config.num_draft_layers))
        if config.tie_k_norm:  # one module: every layer's name in the state dict holds the same weight
            for layer in self.layers[1:]:
                layer.self_attn.k_norm = self.layers[0].self_attn.k_norm
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.rotary = Rotary(config)
        self.markov_head = MarkovHead(config) if config.markov_head_type != "none" else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        #: A reduced draft vocabulary: the target ids of draft ids 0..N-1 (ascending; the trainer
        #: picks them, train/draft_vocab.py). None: draft ids are target ids.
        self.draft_token_ids: torch.Tensor | None
        self.register_buffer("draft_token_ids", torch.arange(config.draft_vocab_size)
                             if config.draft_vocab_size else None)
        self._draft_head: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None
        self._sampler = SlotSampler(compiled=False)
        self._init_weights()
        for p in (self.embed_tokens.weight, self.lm_head.weight):
            p.requires_grad_(False)  # the target's, frozen

    def _init_weights(self) -> None:
        for module in self.layers.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.normal_(self.fc.weight, std=0.02)

    @property
    def block_size(self) -> int:
        """γ: draft tokens per block."""
        return self.config.block_size

    # ---- shared by training and inference ----------------------------------------------------

    def fuse_context(self, context_hidden: torch.Tensor) -> torch.Tensor:
        """[..., C, m·d] concatenated target layers → [..., C, d] context features."""
        w = self.fc.weight
        return self.hidden_norm(self.fc(context_hidden.to(w.dtype)))

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer keys/values of the context features ctx [B, C, d] at positions [B, C]."""
        rope = self.rotary(ctx, ctx_pos)
        return [layer.self_attn.kv(ctx, *rope) for layer in self.layers]

    def backbone(self, block_input_ids: torch.Tensor, block_position_ids: torch.Tensor,
                 ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: object | None) -> torch.Tensor:
        """Block ids/positions [B, Q] → normed slot states [B, Q, d]."""
        hidden = self.embed_tokens(block_input_ids).to(self.fc.weight.dtype)
        block_rope = self.rotary(hidden, block_position_ids)
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            hidden = layer(hidden, block_rope, kv, mask)
        return self.norm(hidden)

    def draft_head(self) -> torch.Tensor:
        """The lm_head rows the drafter proposes from: [N, d] for a reduced draft vocabulary (kept
        until the weight or the ids change), else the whole frozen [V, d] lm_head."""
        weight, ids = self.lm_head.weight, self.draft_token_ids
        if ids is None:
            return weight
        key = (weight.data_ptr(), weight._version, weight.dtype, ids.data_ptr(), ids._version)
        if self._draft_head is None or self._draft_head[0] != key:
            self._draft_head = (key, weight.detach()[ids].contiguous(), None)
        return self._draft_head[1]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft states [M, d] → logits [M, N] over the draft vocabulary.

        A prepacked drafter (frozen, CPU: `prepack_linears`, as eval loads it) multiplies by a
        packed copy of the draft head: the γ-row product then streams the weight once instead of
        MKL's repack of it (2-core AVX2 VM, 7 rows of the demo's [8192, 576]: 2.7 → 0.8 ms).
        """
        head = self.draft_head()
        hidden = hidden.to(head.dtype)
        if isinstance(self.lm_head, PackedLinear) and not torch.is_grad_enabled():
            return packed_linear(hidden, self._packed_draft_head(head))
        return vocab_logits(hidden, head)

    def _packed_draft_head(self, head: torch.Tensor) -> torch.Tensor:
        """The packed copy of `draft_head()` (its own packed weight without a reduced vocabulary)."""
        if self.draft_token_ids is None:
            return self.lm_head.packed_weight
        key, weight, packed = self._draft_head
        if packed is None:
            packed = pack_weight(weight)
            self._draft_head = (key, weight, packed)
        return packed

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids → target token ids (the same ids without a reduced vocabulary)."""
        return draft_ids if self.draft_token_ids is None else self.draft_token_ids[draft_ids]

    def draft_slots(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., n_in, d] per input slot → [..., γ, d] per draft token (fill_in drops the anchor slot)."""
        return hidden[..., 1:, :] if self.config.block_convention == "fill_in" else hidden

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Anchor ids [N] → block input ids [N, n_in]: the anchor, then mask tokens."""
        n_in = self.config.block_inputs
        ids = anchor_tokens.new_full((anchor_tokens.shape[0], n_in), self.config.mask_token_id)
        ids[:, 0] = anchor_tokens
        return ids

    # ---- training ----------------------------------------------------------------------------

    def forward(self, block_input_ids: torch.Tensor, block_position_ids: torch.Tensor,
                context_hidden: torch.Tensor, context_position_ids: torch.Tensor,
                mask: object | None) -> torch.Tensor:
        """Packed blocks of one step → draft states [N, γ, d].

        block_input_ids/position_ids [N, n_in]; context_hidden [C, m·d] (several samples' contexts
        concatenated); context_position_ids [C]; mask: boolean [N·n_in, C + N·n_in] or a BlockMask.
        """
        N, n_in = block_input_ids.shape
        ctx = self.fuse_context(context_hidden).unsqueeze(0)  # [1, C, d]
        ctx_kv = self.context_kv(ctx, context_position_ids.unsqueeze(0))
        hidden = self.backbone(block_input_ids.reshape(1, N * n_in), block_position_ids.reshape(1, N * n_in),
                               ctx_kv, mask)  # [1, N·n_in, d]
        return self.draft_slots(hidden.view(N, n_in, -1))  # [N, γ, d]

    # ---- inference ---------------------------------------------------------------------------

    def new_context(self) -> DraftContext:
        """An empty per-request context store for `extend_context` / `draft`."""
        c = self.config
        return DraftContext(len(self.layers), c.num_key_value_heads, c.head_dim, self.fc.weight.dtype,
                            self.fc.weight.device)

    @torch.no_grad()
    def extend_context(self, context: DraftContext, features: list[torch.Tensor | None]) -> None:
        """Append target features [n_r, m·d] (positions lengths[r]..) to row r, all rows in one pass."""
        device = self.fc.weight.device
        rows = [(r, f) for r, f in enumerate(features) if f is not None and f.shape[0] > 0]
        if not rows:
            return
        new = torch.cat([f.to(device) for _r, f in rows])  # [N, m·d]
        pos = torch.cat([torch.arange(context.lengths[r], context.lengths[r] + f.shape[0], device=device)
                         for r, f in rows])
        fresh = self.context_kv(self.fuse_context(new).unsqueeze(0), pos.unsqueeze(0))  # [1, Hkv, N, D]
        start = 0
        for r, f in rows:
            end = start + f.shape[0]
            context.write(r, [(k[0, :, start:end], v[0, :, start:end]) for k, v in fresh])
            start = end

    @torch.no_grad()
    def draft(self, context: DraftContext, anchor_tokens: torch.Tensor, temperature: float = 1.0,
              generator: torch.Generator | None = None, top_k: int = 0,
              lap: Callable[[str], None] | None = None, markov_candidates: bool = True) -> DraftBatch:
        """Propose γ tokens after each row's anchor (anchor_tokens [R]), left to right.

        One backbone pass for every row, then γ sequential head steps on all rows at once
        (`block_sampler.sample_block`, whose doc says how top_k > 0 picks each slot's candidates;
        eager unless `compile_sampler(True)`). temperature 0 is greedy. `lap(phase)` is called
        after the backbone and after the head loop (timing); markov_candidates=False keeps the base
        top k alone (what bench_draft_candidates compares).
        """
        device = self.fc.weight.device
        R, n_in = anchor_tokens.shape[0], self.config.block_inputs
        anchor_tokens = anchor_tokens.to(device)
        ids = self.block_inputs(anchor_tokens)  # [R, n_in]
        pos = (torch.tensor(context.lengths, device=device)[:, None]
               + torch.arange(n_in, device=device)[None])  # anchor_pos = context length
        hidden = self.backbone(ids, pos, context.layer_kv(), context.mask(n_in))
        hidden = self.draft_slots(hidden)  # [R, γ, d]
        # On 2-D rows: fill_in's slice is a strided [R, γ, d] that makes the Linear a batched matmul
        # copying the whole [V, d] weight per call (bf16 CPU: a 107 ms draft instead of 12 ms).
        gamma_slots = hidden.shape[1]
        base = self.draft_logits(hidden.reshape(R * gamma_slots, -1))
        full_base = base.view(R, gamma_slots, -1)  # [R, γ, V], V the draft vocabulary (support: draft ids)
        vocab = full_base.shape[-1]
        truncated = 0 < top_k < vocab
        if truncated:
            base, support = full_base.topk(top_k, dim=-1)  # [R, γ, K]
        else:
            base, support = full_base, torch.arange(vocab, device=device).expand(full_base.shape)
        base = base.float()
        # The vanilla bias depends on the previous token alone: its own top k join each slot's
        # candidates once that token is drawn (Markov.favoured_after).
        favoured = (markov_candidates and truncated and self.markov_head is not None
                    and self.markov_head.kind == "vanilla")
        if lap:
            lap("draft_backbone")
        # One uniform per slot and row, drawn slot by slot as γ calls of `draw` would draw them.
        gen_device = generator.device if generator is not None else torch.device("cpu")
        uniforms = torch.rand((self.block_size, R), generator=generator, device=gen_device).T.to(device)
        out = self._sampler(base, support, full_base, anchor_tokens, hidden, uniforms, temperature,
                            self.markov_head, self.confidence_head,
                            self.markov_head.favoured_table(top_k) if favoured else None,
                            self.draft_token_ids, truncated)
        if lap:
            lap("draft_heads")
        return DraftBatch(DraftDist(out.tokens, out.support, out.probs, out.index), out.confidences)

    def compile_sampler(self, compiled: bool) -> None:
        """Draw blocks with the compiled slot loop (target.compile_draft) or the eager one."""
        self._sampler = SlotSampler(compiled)

    def draft_block(self, ctx_hidden: torch.Tensor, anchor_token: int, anchor_pos: int,
                    temperature: float = 1.0, generator: torch.Generator | None = None,
                    top_k: int = 0) -> DraftBlock:
        """One sequence, no state kept: ctx_hidden [anchor_pos, m·d] are the features before the anchor."""
        if ctx_hidden.shape[0] != anchor_pos:
            raise ValueError(f"ctx_hidden has {ctx_hidden.shape[0]} rows; the anchor at {anchor_pos} needs "
                             f"one per position before it.")
        context = self.new_context()
        context.add_row()
        self.extend_context(context, [ctx_hidden])
        out = self.draft(context, torch.tensor([anchor_token]), temperature, generator, top_k)
        d = out.dist
        probs = d.dense_row(torch.zeros(self.block_size, dtype=torch.long),
                            torch.arange(self.block_size), self.config.vocab_size)
        return DraftBlock(d.tokens[0], probs, out.confidences[0] if out.confidences is not None else None)

    # ---- weights -----------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight except the frozen target embedding and lm_head. A tied weight (tie_k_norm) is
        listed under every layer's name, as engines load it; copies after the first, since
        safetensors refuses tensors that share memory."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for k, v in self.state_dict().items():
            if k.startswith(("embed_tokens.", "lm_head.", "rotary.")):
                continue
            out[k] = v.clone() if v.data_ptr() in seen else v
            seen.add(v.data_ptr())
        return out
