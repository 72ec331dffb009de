"""The vocabulary-wide loss terms with fewer FLOPs and no fresh [rows, V] tensors (train.fast_kernels).

Same maths as `loss._fused_vocab_terms` (CE and TV of p_d = softmax(lm_head·h + W2·z) against
p_t = softmax(lm_head·h_t), and their hand-written gradient), computed three ways cheaper:

- **Target rows once.** A block's slots j sit at positions anchor + j; with many anchors per
  sequence most positions belong to several blocks (512 anchors of a 1024-token sample: 3.4 rows per
  position in a chunk of sorted anchors). p_t depends only on the cached state, so it is computed
  for the chunk's distinct states and gathered.
- **Vanilla Markov bias once per token.** z = W1[x_{k−1}] depends only on the previous token, so
  W2·z, ∂/∂z and ∂/∂W2 are computed for the chunk's distinct tokens (the rows' gradients summed
  per token first, exactly what the embedding's backward would do).
- **Prepacked, reused memory.** The frozen lm_head is kept transposed and contiguous ([d, V], a
  plain NN product) in the matmul dtype, W2ᵀ likewise once per forward, and every [rows, V] buffer
  is allocated once and reused by every chunk and step: on CPU a fresh vocabulary-wide tensor
  costs page faults comparable to the product that fills it.

Rounding differs from the reference only where sums are taken in another order (tests compare
both within bf16 tolerance); train.fast_kernels = false keeps `loss._fused_vocab_terms`.
"""

from __future__ import annotations

import torch

from .teacher_norms import TeacherNorms
from .vocab_kernel import VocabKernel

_F32 = torch.float32


def dot_layout(dtype: torch.dtype, device: torch.device) -> bool:
    """True where a matmul is fast only with both operands contiguous along the reduced dimension:
    bf16 on a CPU without native bf16 (AVX2), where PyTorch's fallback gemm runs ~10x slower on
    the other layouts (measured on 2 EPYC cores: h @ Wᵀ 5.6 GFLOP/s from W [V, d], 0.48 from a
    contiguous Wᵀ). With native bf16 (AVX512-BF16/AMX) or in fp32, oneDNN/MKL take any layout and a
    contiguous [K, N] right operand with a reused output is the fast one."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Packed:
    """A [V, k] weight in the matmul dtype: `rows` [V, k] contiguous and, for a frozen weight,
    `cols` [k, V] contiguous too, so x @ Wᵀ and G @ W each get the layout its kernel runs fastest
    on. A weight that changes every step (W2) keeps `rows` only (`transposed=False`): its
    transposing copy cost more than the layout saves (bf16 [49152, 256]: 17 ms against 1 ms)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, transposed: bool = True) -> None:
        self.rows = weight.detach().to(dtype).contiguous()
        self.cols = self.rows.t().contiguous() if transposed else None
        self.dot = dot_layout(dtype, weight.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def vocab(self) -> int:
        return self.rows.shape[0]

    def refresh(self, weight: torch.Tensor) -> Packed:
        """Copy `weight`'s new values into the same memory (no fresh allocation); returns self."""
        self.rows.copy_(weight.detach())
        if self.cols is not None:
            self.cols.copy_(self.rows.t())
        return self

    def forward_operand(self) -> torch.Tensor:
        """The right operand of x [n, k] @ Wᵀ → [n, V]."""
        return self.rows.t() if self.dot or self.cols is None else self.cols

    def backward_operand(self) -> torch.Tensor:
        """The right operand of G [n, V] @ W → [n, k]."""
        return self.cols.t() if self.dot and self.cols is not None else self.rows


class VocabWorkspace:
    """The prepacked frozen head and the reused [rows, V] buffers of one DrafterLoss."""

    def __init__(self, kernel: VocabKernel | None = None) -> None:
        #: The compiled elementwise kernel (train.compile_vocab), None: the eager passes below.
        self.kernel = kernel
        self._heads: dict[str, tuple[tuple, Packed]] = {}
        self._markov: Packed | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        #: Log-normalisers of the target's distribution by cached state (a reduced draft vocabulary).
        self.norms = TeacherNorms()

    def head(self, lm_head: torch.Tensor, dtype: torch.dtype, name: str = "head") -> Packed:
        """A frozen head packed in the matmul dtype; rebuilt only when the weight changes. `name`
        keeps several apart (a reduced draft vocabulary's rows beside the target's whole head)."""
        key = (lm_head.data_ptr(), lm_head._version, lm_head.device, dtype)
        kept = self._heads.get(name)
        if kept is None or kept[0] != key:
            self._heads.pop(name, None)  # free the old copy before making the new one
            kept = self._heads[name] = (key, Packed(lm_head, dtype))
        return kept[1]

    def markov(self, w2: torch.Tensor, dtype: torch.dtype) -> Packed:
        """W2 [V, r] in the matmul dtype, copied into the same memory every step (it is trained)."""
        packed = self._markov
        if (packed is None or packed.rows.shape != w2.shape or packed.dtype != dtype
                or packed.rows.device != w2.device):
            self._markov = packed = Packed(w2, dtype, transposed=False)
            return packed
        return packed.refresh(w2)

    def buffer(self, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
               reserve_rows: int = 0) -> torch.Tensor:
        """A [rows, cols] view of a named buffer that only ever grows (contents undefined); a new
        one holds max(rows, reserve_rows) rows, so a chunk with more distinct rows than the last
        does not allocate (and fault in) a fresh one."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * cols or buf.dtype != dtype or buf.device != device:
            self._buffers.pop(name, None)
            buf = torch.empty(max(rows, reserve_rows) * cols, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:rows * cols].view(rows, cols)

    def release(self) -> None:
        """Drop the buffers (the packed head stays): e.g. before a larger, one-off evaluation."""
        self._buffers.clear()

    def mm_into(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False,
                stage: str = "stage") -> None:
        """out (float32) = a @ b, or += with accumulate. A bf16 product is rounded to bf16 before it
        is widened, as F.linear(...).float() does, through the reused staging buffer `stage`."""
        if a.dtype == _F32:
            if accumulate:  # not addmm_, which FlopCounterMode does not count
                torch.addmm(out, a, b, out=out)
            else:
                torch.mm(a, b, out=out)
            return
        staged = self.buffer(stage, out.shape[0], out.shape[1], a.dtype, out.device)
        torch.mm(a, b, out=staged)
        if accumulate:
            out.add_(staged)
        else:
            out.copy_(staged)

    def narrow(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """t in the matmul dtype; a float32 [rows, V] tensor goes through the staging buffer."""
        if t.dtype == dtype:
            return t
        stage = self.buffer("stage", t.shape[0], t.shape[1], dtype, t.device)
        return stage.copy_(t)


def _gather_rows(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = source[index[i]]. Through gather, not index_select: on the 2-core VM index_select's
    per-row memcpy of [V] rows took 0.1 s or, erratically, 5–7 s for the same [448, 49152] copy;
    gather's vectorised loop took 0.02–0.06 s every time."""
    return torch.gather(source, 0, index[:, None].expand(out.shape), out=out)


def _softmax_(x: torch.Tensor) -> torch.Tensor:
    """Row softmax in place; returns x."""
    x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


def _draft_target_probs(ws: VocabWorkspace, target: Packed, head: Packed, draft_ids: torch.Tensor,
                        states: torch.Tensor, reserve: int) -> torch.Tensor:
    """p_t of the distinct states [S, d] on the draft's N columns → [S, N] (float32, a reused buffer).

    A state whose log-normaliser is known (`teacher_norms`) needs the N draft rows of the head
    only: exp(logits_N − lse). The others take the whole [s, V] product once, as before, and
    leave their normaliser for the next time they come.
    """
    S, device, cdt = states.shape[0], states.device, head.dtype
    norms = ws.norms.for_head(target)
    keys, checks = norms.keys(states)
    lse, known = norms.lookup(keys, checks)
    q = ws.buffer("q_draft", S, head.vocab, _F32, device, reserve_rows=reserve)
    fresh = (~known).nonzero().squeeze(-1).tolist()
    if fresh:
        rows = states[fresh].to(cdt)
        full = ws.buffer("q", len(fresh), target.vocab, _F32, device, reserve_rows=reserve)
        ws.mm_into(full, rows, target.forward_operand())
        top = full.amax(-1, keepdim=True)
        full.sub_(top).exp_()
        total = full.sum(-1, keepdim=True)
        q[fresh] = torch.index_select(full, 1, draft_ids).div_(total)
        norms.store([keys[i] for i in fresh], [checks[i] for i in fresh], (top + total.log()).squeeze(-1))
    seen = known.nonzero().squeeze(-1).tolist()
    if seen:
        part = ws.buffer("q_seen", len(seen), head.vocab, _F32, device, reserve_rows=reserve)
        ws.mm_into(part, states[seen].to(cdt), head.forward_operand())
        q[seen] = part.sub_(lse[seen, None].to(device)).exp_()
    return q


def fast_vocab_terms(ws: VocabWorkspace, head: Packed, w2: Packed | None,
                     hidden: torch.Tensor, z: torch.Tensor | None, z_index: torch.Tensor | None,
                     target_hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                     ce_coef: float, tv_coef: float, need_grad: bool,
                     grad_w2: torch.Tensor | None = None, target: Packed | None = None,
                     draft_ids: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """One chunk: (ΣwCE, ΣwTV, c* [n, γ], grads) as `loss._fused_vocab_terms` returns them.

    hidden/target_hidden [n, γ, d]; z is per row [n, γ, r] (gated/RNN heads, z_index None) or, for
    the vanilla head, the chunk's distinct features [U, r] with z_index [n·γ] naming each row's.
    grads = (∂/∂hidden [n, γ, d], ∂/∂z shaped like z). ∂/∂W2 [V, r] is added into `grad_w2`
    (float32, every chunk into the same tensor: a fresh [V, r] product per chunk cost more in page
    faults than its multiplication).

    A reduced draft vocabulary: `head` holds its N rows, `target` the whole lm_head and draft_ids
    [N] the target ids of the draft's; labels are draft ids (-1: outside, no CE). p_t is the full
    softmax's N columns, and its mass outside them counts in TV (loss._vocab_terms).
    """
    reduced = draft_ids is not None
    if ws.kernel is not None and not ws.kernel.failed and not reduced:
        out = _compiled_vocab_terms(ws, head, w2, hidden, z, z_index, target_hidden, labels, weight,
                                    ce_coef, tv_coef, need_grad, grad_w2)
        if out is not None:
            return out
    n, gamma, _ = hidden.shape
    rows, cdt, device = n * gamma, head.dtype, hidden.device
    vocab = head.vocab
    labels = labels.reshape(-1, 1)
    w = weight.reshape(-1, 1).float()
    ce_w = w
    if reduced:
        ce_w = w * (labels >= 0)
        labels = labels.clamp_min(0)
    h = hidden.reshape(rows, -1).to(cdt)
    p = ws.buffer("p", rows, vocab, _F32, device)
    ws.mm_into(p, h, head.forward_operand())
    zc = z.to(cdt) if z is not None else None
    if z is not None and z_index is None:
        ws.mm_into(p, zc.reshape(rows, -1), w2.forward_operand(), accumulate=True)
    elif z is not None:  # vanilla: W2·z once per distinct token, gathered onto the rows
        bias = ws.buffer("q", zc.shape[0], vocab, _F32, device, reserve_rows=rows)
        ws.mm_into(bias, zc, w2.forward_operand())
        p.add_(_gather_rows(bias, z_index, ws.buffer("s", rows, vocab, _F32, device)))
    picked = p.gather(-1, labels)
    top = p.amax(-1, keepdim=True)
    p.sub_(top).exp_()
    total = p.sum(-1, keepdim=True)
    p.div_(total)
    ce = (top + total.log() - picked).squeeze(-1)  # −log p[y]
    states, state_index = torch.unique(target_hidden.reshape(rows, -1), dim=0, return_inverse=True)
    outside = None
    if reduced:  # the draft's columns of p_t, and the mass it can never propose
        q = _draft_target_probs(ws, target, head, draft_ids, states, rows)
        outside = (1.0 - q.sum(-1)).clamp_min_(0.0)[state_index]
    else:
        q = ws.buffer("q", states.shape[0], vocab, _F32, device, reserve_rows=rows)
        ws.mm_into(q, states.to(cdt), head.forward_operand())
        _softmax_(q)
    diff = _gather_rows(q, state_index, ws.buffer("s", rows, vocab, _F32, device))
    torch.sub(p, diff, out=diff)  # p − q
    tv = torch.linalg.vector_norm(diff, ord=1, dim=-1)
    tv = 0.5 * (tv if outside is None else tv + outside)
    wf = w.squeeze(-1)
    ce_sum, tv_sum = (ce_w.squeeze(-1) * ce).sum(), (wf * tv).sum()
    c_star = (1.0 - tv).clamp(0.0, 1.0).view(n, gamma)
    if not need_grad:
        return ce_sum, tv_sum, c_star, None
    if tv_coef != 0.0:
        sp = diff.sign_().mul_(p)  # s·p
        m = sp.sum(-1, keepdim=True)
        grad = sp.mul_(0.5 * tv_coef * w).addcmul_(p, ce_coef * ce_w - 0.5 * tv_coef * m * w)
    else:
        grad = p.mul_(ce_coef * ce_w)
    grad.scatter_add_(-1, labels, -ce_coef * ce_w)
    g = ws.narrow(grad, cdt)
    grad_hidden = torch.mm(g, head.backward_operand()).view(n, gamma, -1).to(hidden.dtype)
    if z is None:
        return ce_sum, tv_sum, c_star, (grad_hidden, None)
    if z_index is None:
        zr = zc.reshape(rows, -1)
        grad_z = torch.mm(g, w2.backward_operand()).view(n, gamma, -1).to(z.dtype)
        ws.mm_into(grad_w2, g.t(), zr, accumulate=True, stage="stage_w2")
        return ce_sum, tv_sum, c_star, (grad_hidden, grad_z)
    # vanilla: the rows' gradients summed per distinct token (what the embedding's backward does)
    per_token = ws.buffer("q", zc.shape[0], vocab, _F32, device, reserve_rows=rows)  # p_t is spent
    per_token.zero_().index_add_(0, z_index, grad)
    gt = ws.narrow(per_token, cdt)
    ws.mm_into(grad_w2, gt.t(), zc, accumulate=True, stage="stage_w2")
    return ce_sum, tv_sum, c_star, (grad_hidden, torch.mm(gt, w2.backward_operand()).to(z.dtype))


def _compiled_vocab_terms(ws: VocabWorkspace, head: Packed, w2: Packed | None, hidden: torch.Tensor,
                          z: torch.Tensor | None, z_index: torch.Tensor | None,
                          target_hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                          ce_coef: float, tv_coef: float, need_grad: bool,
                          grad_w2: torch.Tensor | None) -> tuple | None:
    """`fast_vocab_terms` with its elementwise passes in `ws.kernel`; None if that failed to compile.

    The matmuls write the matmul dtype into reused buffers; the kernel reads them once per pass
    and writes the gradient in the matmul dtype for the backward products. A per-row Markov term
    (gated/RNN heads) is accumulated into the logits by the product itself; a vanilla one is
    computed per distinct token and indexed by the kernel. Its ∂/∂z and ∂/∂W2 are taken over the
    rows (the products then sum over each token's rows) instead of summing [rows, V] per token first.
    """
    n, gamma, _ = hidden.shape
    rows, cdt, device, vocab = n * gamma, head.dtype, hidden.device, head.vocab
    h = hidden.reshape(rows, -1).to(cdt)
    logits = ws.buffer("logits", rows, vocab, cdt, device)
    torch.mm(h, head.forward_operand(), out=logits)
    zc = z.to(cdt) if z is not None else None
    bias = z_rows = None
    if z is not None and z_index is None:
        z_rows = zc.reshape(rows, -1)
        torch.addmm(logits, z_rows, w2.forward_operand(), out=logits)
    elif z is not None:
        bias = ws.buffer("bias", zc.shape[0], vocab, cdt, device, reserve_rows=rows)
        torch.mm(zc, w2.forward_operand(), out=bias)
        z_rows = zc[z_index]
    states, state_index = torch.unique(target_hidden.reshape(rows, -1), dim=0, return_inverse=True)
    target_logits = ws.buffer("target_logits", states.shape[0], vocab, cdt, device, reserve_rows=rows)
    torch.mm(states.to(cdt), head.forward_operand(), out=target_logits)
    w = weight.reshape(-1).float()
    out = ws.kernel(logits, bias, z_index, target_logits, state_index, labels.reshape(-1), w,
                    ce_coef, tv_coef, cdt if need_grad else None)
    if out is None:
        return None
    ce, tv, grad = out
    ce_sum, tv_sum = (w * ce).sum(), (w * tv).sum()
    c_star = (1.0 - tv).clamp(0.0, 1.0).view(n, gamma)
    if not need_grad:
        return ce_sum, tv_sum, c_star, None
    grad_hidden = torch.mm(grad, head.backward_operand()).view(n, gamma, -1).to(hidden.dtype)
    if z is None:
        return ce_sum, tv_sum, c_star, (grad_hidden, None)
    grad_z_rows = torch.mm(grad, w2.backward_operand())  # [rows, r]
    ws.mm_into(grad_w2, grad.t(), z_rows, accumulate=True, stage="stage_w2")
    if z_index is None:
        return ce_sum, tv_sum, c_star, (grad_hidden, grad_z_rows.view(n, gamma, -1).to(z.dtype))
    grad_z = torch.zeros(zc.shape, dtype=_F32, device=device).index_add_(0, z_index, grad_z_rows.float())
    return ce_sum, tv_sum, c_star, (grad_hidden, grad_z.to(z.dtype))
