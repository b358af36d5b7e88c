"""Device-specific fast paths, each behind one name the model calls: `attention` (which kernel
computes attention) and `Linear` (few-row products split across CPU threads). Each choice was
measured; the figures are in docs/performance-cpu.md and docs/gpu.md, not here."""

from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN attention (SDPA's first choice on recent GPUs) builds a graph for each new K/V length, which
# a growing KV cache hits every step (docs/gpu.md), so attention over a cache on CUDA chooses among
# these.
CACHE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Linear splits products of up to this many rows; larger ones (training, prefill) run faster unsplit
# (docs/performance-cpu.md "Decoding").
SPLIT_MAX_ROWS = 64
# A weight larger than this (GPT-2's lm_head) streams faster from memory in the (in, out) layout, so
# Linear keeps such a copy for its split products: more memory for a faster batch-1 decode
# (docs/performance-cpu.md "Decoding").
SPLIT_COPY_BYTES = 32 * 2**20
# So does a weight with more output than input features (an MLP's first layer) at any size
# (docs/performance-cpu.md).
SPLIT_COPY_WIDE = True


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    cached: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of q (B, n_head, T, hd) over k (B, n_kv_head, Tk, hd) and v (B,
    n_kv_head, Tk, hd_v), each K/V head serving n_head / n_kv_head query heads without copies;
    scores scaled by `scale` (default hd ** -0.5). mask None means a plain causal block (Tk == T)
    or one query that sees every key; otherwise the boolean mask (B or 1, 1, T, Tk) says what
    each query sees. cached: k and v come from a KV cache (their length changes every call)."""
    # SDPA's CPU flash kernel is slower in bf16 training (docs/performance-cpu.md "Training")
    if q.is_cpu and q.dtype == torch.bfloat16 and torch.is_grad_enabled():
        return matmul_attention(q, k, v, mask, dropout_p, scale)
    B, H, T, hd = q.shape
    # and slower for one query over a bf16 cache, and for MLA's absorbed step (V narrower than K)
    # in fp32 too (docs/performance-cpu.md "Decoding", docs/compare.md "MLA")
    if (
        q.is_cpu
        and (q.dtype == torch.bfloat16 or v.size(-1) != hd)
        and T == 1
        and mask is None
        and not dropout_p
    ):
        return one_query_attention(q, k, v, scale)
    # SDPA's kernels run few blocks over a long cache, each walking every key (docs/gpu.md)
    if q.is_cuda and T == 1 and cached and not dropout_p:
        return one_query_attention(q, k, v, scale, mask)
    G = k.size(1)
    with sdpa_kernel(CACHE_SDPA_BACKENDS) if cached and q.is_cuda else nullcontext():
        if G != H and T == 1 and (mask is not None or q.is_cpu):
            # One query per head (decoding): each K/V head's queries as that head's query rows, a
            # plain multi-head call. Under a mask enable_gqa falls back to CUDA's math kernel
            # (docs/gpu.md); on CPU the flash kernel reads each K/V head once per query head, so
            # GQA/MQA would not gain their smaller cache's speed (docs/compare.md).
            y = F.scaled_dot_product_attention(
                q.view(B, G, H // G, hd), k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale
            )
            return y.reshape(
                B, H, 1, v.size(-1)
            )  # CUDA gives (B, G, H // G, hd) strided as (B, H // G, G, hd)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            dropout_p=dropout_p,
            enable_gqa=G != H,
            scale=scale,
        )


def one_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """sdpa() of one query per head, q (B, n_head, 1, hd), over the keys of k, v that mask
    (B or 1, 1, 1, Tk) lets it see (None: all): two matmuls and a softmax in fp32, each K/V
    head's queries as its rows (no copies for GQA/MQA). For bf16 on CPU, where SDPA's kernel
    is slower at a long context: eager in fp32 (torch's one-row bf16 products are slow),
    compiled with bf16 products, which inductor makes fast (docs/performance-cpu.md "Decoding");
    on CUDA in the query's dtype."""
    B, H, _, hd = q.shape
    G = k.size(1)
    wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or a float64 model's own
    dtype = q.dtype if torch.compiler.is_compiling() or q.is_cuda else wide
    scores = (q.view(B, G, H // G, hd).to(dtype) @ k.to(dtype).transpose(-1, -2)).to(wide) * (
        scale or hd**-0.5
    )
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1).to(dtype) @ v.to(dtype)).to(q.dtype).view(B, H, 1, v.size(-1))


def matmul_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None = None,
) -> torch.Tensor:
    """sdpa() as two batched matmuls and a softmax, the mask added to the scores inside the
    first (baddbmm): faster than SDPA's flash kernel for bf16 training on CPU, not in fp32
    (docs/performance-cpu.md). Each K/V head's queries are stacked as one batch entry, so GQA/MQA
    need no copies of K/V."""
    B, H, T, hd = q.shape
    G, Tk = k.size(1), k.size(2)
    rep = H // G
    if mask is None and T > 1:
        mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
    elif mask is not None and mask.size(0) == 1:
        mask = mask[0, 0]  # (T, Tk)
    bias = q.new_zeros(())
    # 0 where a query sees a key, -inf where not: (rep * T, Tk), or one per batch entry
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf")
        )
        bias = (
            bias.repeat(rep, 1)
            if mask.dim() == 2
            else bias.expand(B, G * rep, T, Tk).reshape(B * G, rep * T, Tk)
        )
    att = torch.baddbmm(
        bias,
        q.reshape(B * G, rep * T, hd),
        k.reshape(B * G, Tk, hd).transpose(1, 2),
        alpha=scale or hd**-0.5,
    ).softmax(dim=-1)  # (B * G, rep * T, Tk)
    att = F.dropout(att, dropout_p) if dropout_p else att
    return (att.type_as(v) @ v.reshape(B * G, Tk, -1)).view(B, H, T, v.size(-1))


class SplitWeight(NamedTuple):
    """Linear's weight and bias cut into one slice of output features per thread, made once per
    weight."""

    # what they were made from: thread count, the weight's (and bias's) memory, its version if
    # copied
    key: tuple
    weight: (
        torch.Tensor
    )  # (parts, in, out // parts), a view of the weight, or an (in, out) copy padded with zeros
    bias: (
        torch.Tensor
    )  # (parts, 1, out // parts), zeros for a Linear without bias (baddbmm compiles to MKL's
    # product where a one-row bmm would become inductor's slower reduction)
    rest: (
        tuple[torch.Tensor, torch.Tensor | None] | None
    )  # weight and bias of the last out % parts features
    source: (
        torch.Tensor
    )  # holds the weight's memory, so no other tensor can reuse its address and match the key


class Linear(nn.Linear):
    """nn.Linear whose products with few rows (decoding) in fp32 on CPU without autograd split
    the output features into one slice per thread, computed as one batched matmul: MKL runs such
    a thin product on one core, which cannot stream the weights from memory at full speed
    (docs/performance-cpu.md). split_max_rows = 0 turns it off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split_max_rows = SPLIT_MAX_ROWS
        self.split: SplitWeight | None = None

    def split_weight(self, parts: int) -> SplitWeight:
        """The weight split into `parts`: views of it, or an (in, out) copy of one over
        SPLIT_COPY_BYTES or with more output than input features (remade when the weight changes
        in place; weights made under inference_mode have no version to tell that by), padded with
        zero features to a multiple of parts, so nothing is left over."""
        w, b = self.weight, self.bias
        copy = w.nbytes > SPLIT_COPY_BYTES or (
            SPLIT_COPY_WIDE and self.out_features > self.in_features
        )
        version = w._version if copy and not w.is_inference() else None
        key = (parts, w.data_ptr(), version, None if b is None else b.data_ptr())
        if self.split is None or self.split.key != key:
            self.split = None  # the old copy goes before the new one is made
            # (parts, in, out / parts rounded up), zero features at the end: no odd ones left over
            if copy:
                m = -(-self.out_features // parts)
                ws, bs = w.new_zeros(parts, self.in_features, m), w.new_zeros(parts, 1, m)
                for p, chunk in enumerate(w.detach().split(m)):
                    ws[p, :, : chunk.size(0)] = chunk.T
                for p, chunk in enumerate(() if b is None else b.detach().split(m)):
                    bs[p, 0, : chunk.size(0)] = chunk
                rest = None
            else:  # views: the features past a multiple of parts are multiplied on their own
                n = self.out_features // parts * parts
                ws = w[:n].view(parts, n // parts, -1).transpose(1, 2)  # (parts, in, n // parts)
                bs = w.new_zeros(parts, 1, n // parts) if b is None else b[:n].view(parts, 1, -1)
                rest = (w[n:], None if b is None else b[n:]) if n < self.out_features else None
            self.split = SplitWeight(key, ws, bs, rest, w.detach())
        return self.split

    def splits_into(self, parts: int) -> bool:
        """Whether the product is shared by `parts` threads: two or more, each with at least one
        output feature (a Gated DeltaNet's one-a-head products may have fewer than the threads)."""
        return 2 <= parts <= self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.is_grad_enabled()
            or not x.is_cpu
            or x.dtype != torch.float32
            or self.weight.dtype != torch.float32
            or x.numel() > self.split_max_rows * self.in_features
            or torch.is_autocast_enabled("cpu")
        ):
            return super().forward(x)
        # the split made before compiling (prepare_splits): a graph cannot check it
        if torch.compiler.is_compiling():
            split = self.split
        else:
            parts = torch.get_num_threads()
            split = self.split_weight(parts) if self.splits_into(parts) else None
        if split is None:
            return super().forward(x)
        rows, parts = x.numel() // self.in_features, split.weight.size(0)
        xs = x.reshape(1, rows, -1).expand(parts, -1, -1)  # (parts, rows, in_features)
        y = torch.baddbmm(split.bias, xs, split.weight)
        y = y.transpose(0, 1).reshape(
            rows, -1
        )  # (rows, parts * (out // parts)), or the padded copy's features
        if split.rest is not None:
            y = torch.cat((y, F.linear(x.reshape(rows, -1), *split.rest)), dim=1)
        elif y.size(1) > self.out_features:
            y = y[:, : self.out_features]
        return y.view(*x.shape[:-1], self.out_features)


def joint_linear(x: torch.Tensor, *layers: nn.Linear) -> torch.Tensor:
    """x through several Linear layers as one product, their outputs side by side: one cast of x
    under autocast and one product forward and backward instead of one each
    (docs/performance-cpu.md "Training"). Layers of another kind (quantize.Int8Linear) each make
    their own product."""
    if not all(isinstance(layer, nn.Linear) for layer in layers):
        return torch.cat([layer(x) for layer in layers], dim=-1)
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    return F.linear(x, torch.cat([layer.weight for layer in layers]), bias)


def prepare_splits(model: nn.Module) -> None:
    """Make (or check) every Linear's split weight for the current thread count, or drop it where
    none applies, as a compiled step will use them: compiled code cannot check them, so call this
    again after weights change."""
    parts = torch.get_num_threads()
    for m in model.modules():
        if isinstance(m, Linear):
            m.split = (
                m.split_weight(parts)
                if m.splits_into(parts) and m.split_max_rows and m.weight.dtype == torch.float32
                else None
            )
