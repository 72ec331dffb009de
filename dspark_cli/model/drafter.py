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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .config import DrafterConfig
from .draw import draw
from .heads import ConfidenceHead, MarkovHead


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


class DSparkDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.fc = nn.Linear(config.num_context_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(config, i) for i in range(config.num_draft_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.rotary = Rotary(config)
        self.markov_head = MarkovHead(config) if config.markov_head_type != "none" else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        self._init_weights()
        for p in (self.embed_tokens.weight, self.lm_head.weight):
            p.requires_grad_(False)  # the target's, frozen
        self.reset_cache()

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

    def reset_cache(self) -> None:
        """Forget the cached context keys/values (call between unrelated sequences)."""
        self._cache_rows: torch.Tensor | None = None  # [n, m·d] the features the cache was built from
        self._cache_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._cache_len = 0

    def _cached_context_kv(self, ctx_hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V for rows 0..N-1, computing only the rows not seen before.

        The cache is reused for exactly the prefix of rows that equals what it was built from, so a
        rollback (rejected tokens) keeps the accepted prefix and another sequence that merely starts
        with the same chat-template tokens never reads stale keys.
        """
        N = ctx_hidden.shape[0]
        keep = min(N, self._cache_len)
        if keep and not torch.equal(self._cache_rows[:keep], ctx_hidden[:keep]):
            self.reset_cache()
            keep = 0
        if self._cache_len > keep:  # rolled back: keep the matching prefix
            self._cache_kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self._cache_kv]
            self._cache_rows = self._cache_rows[:keep]
            self._cache_len = keep
        if self._cache_len < N:
            new = ctx_hidden[self._cache_len:N]
            ctx = self.fuse_context(new).unsqueeze(0)  # [1, n_new, d]
            pos = torch.arange(self._cache_len, N, device=ctx.device).unsqueeze(0)
            fresh = self.context_kv(ctx, pos)
            if self._cache_kv is None:
                self._cache_kv = fresh
            else:
                self._cache_kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                  for (k0, v0), (k1, v1) in zip(self._cache_kv, fresh, strict=True)]
            self._cache_len = N
            self._cache_rows = ctx_hidden[:N].clone()
        return self._cache_kv

    @torch.no_grad()
    def draft_block(self, ctx_hidden: torch.Tensor, anchor_token: int, anchor_pos: int,
                    temperature: float = 1.0, generator: torch.Generator | None = None) -> DraftBlock:
        """Propose γ tokens after the anchor, left to right with the Markov bias.

        ctx_hidden [N, m·d] holds the target features of positions 0..anchor_pos-1. temperature 0
        is greedy (probs one-hot at the argmax).
        """
        device = self.fc.weight.device
        ctx_hidden = ctx_hidden.to(device)
        if ctx_hidden.shape[0] == 0:
            empty = torch.zeros(1, self.config.num_key_value_heads, 0, self.config.head_dim, device=device,
                                dtype=self.fc.weight.dtype)
            ctx_kv = [(empty, empty) for _ in range(len(self.layers))]
        else:
            ctx_kv = self._cached_context_kv(ctx_hidden)
        ids = self.block_inputs(torch.tensor([anchor_token], device=device))  # [1, n_in]
        pos = anchor_pos + torch.arange(self.config.block_inputs, device=device).unsqueeze(0)
        hidden = self.draft_slots(self.backbone(ids, pos, ctx_kv, None))[0]  # [γ, d]
        base_logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()  # [γ, V]
        tokens, probs, confs = [], [], []
        prev = torch.tensor([anchor_token], device=device)
        state = None
        for k in range(self.block_size):
            logits = base_logits[k]
            prev_embed = None
            if self.markov_head is not None:
                z, state = self.markov_head.step(prev, hidden[k:k + 1], state)
                logits = logits + self.markov_head.bias(z)[0].float()
                prev_embed = self.markov_head.embed_prev(prev)
            if self.confidence_head is not None:
                confs.append(torch.sigmoid(self.confidence_head(hidden[k:k + 1], prev_embed)).float()[0])
            if temperature <= 0:
                token = logits.argmax()
                p = F.one_hot(token, logits.shape[-1]).float()
            else:
                p = torch.softmax(logits / temperature, dim=-1)
                token = draw(p, generator)
            tokens.append(token)
            probs.append(p)
            prev = token.view(1)
        return DraftBlock(tokens=torch.stack(tokens).long(), probs=torch.stack(probs).float(),
                          confidences=torch.stack(confs) if confs else None)

    # ---- weights -----------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight except the frozen target embedding and lm_head."""
        return {k: v for k, v in self.state_dict().items()
                if not k.startswith(("embed_tokens.", "lm_head.", "rotary."))}
