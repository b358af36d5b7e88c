"""A GPT whose attention is MHA, GQA or MQA (set by n_kv_head), with a preallocated KV cache for decoding.

GQA: https://arxiv.org/abs/2305.13245, MQA: https://arxiv.org/abs/1911.02150, RoPE: https://arxiv.org/abs/2104.09864
"""

import math
import os
import pickle
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

POS_ENCODINGS = ("learned", "rope")
# SDPA shares K/V heads across query groups itself (no repeated K/V in memory) from torch 2.5 on.
SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
# cuDNN attention, SDPA's first choice on recent GPUs, builds a graph for each new K/V length: about 5 ms of host time
# per call when a KV cache grows by one position a step (measured on an H100, README Performance), so decoding with a
# cache on CUDA uses the other kernels.
CACHE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SPLIT_MAX_ROWS = 64  # Linear splits products of up to this many rows across threads (bench.py: faster up to ~128)
# A weight larger than this (GPT-2's lm_head) streams 2x faster from memory in the (in, out) layout, so Linear keeps
# such a copy for its split products (README Performance): more memory for a faster batch-1 decode on CPU.
SPLIT_COPY_BYTES = 32 * 2**20


@dataclass(slots=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None or n_head: MHA; 1: MQA; a divisor of n_head in between: GQA
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2
    pos_encoding: str = "learned"  # 'learned' (GPT-2 absolute positions) or 'rope' (rotary)
    rope_theta: float = 10000.0
    gelu: str = "exact"  # 'exact' or 'tanh' (the approximation OpenAI's GPT-2 was trained with)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        sizes = ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
        problems = [f"{k}={getattr(self, k)!r} must be a positive integer" for k in sizes
                    if type(getattr(self, k)) is not int or getattr(self, k) < 1]
        if not problems:
            if self.n_embd % self.n_head:
                problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
            if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
                problems.append(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head} "
                                f"(1 <= n_kv_head <= n_head; n_head: MHA, 1: MQA, a divisor in between: GQA)")
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if self.pos_encoding not in POS_ENCODINGS:
            problems.append(f"pos_encoding={self.pos_encoding!r} must be one of {', '.join(POS_ENCODINGS)}")
        elif self.pos_encoding == "rope" and not problems and self.head_dim % 2:
            problems.append(f"pos_encoding='rope' needs an even head_dim = n_embd/n_head, got head_dim={self.head_dim}")
        if self.gelu not in ("exact", "tanh"):
            problems.append(f"gelu={self.gelu!r} must be 'exact' or 'tanh'")
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            problems.append(f"rope_theta={self.rope_theta!r} must be a positive number")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def attention_kind(self) -> str:
        """'MHA' (n_kv_head == n_head), 'MQA' (n_kv_head == 1 < n_head) or 'GQA' (in between)."""
        if self.n_kv_head == self.n_head:
            return "MHA"
        return "MQA" if self.n_kv_head == 1 else "GQA"

    def kv_cache_bytes(self, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V for every layer: 2 * n_layer * batch * n_kv_head * seq_len * head_dim * element size."""
        return 2 * self.n_layer * batch_size * self.n_kv_head * seq_len * self.head_dim * dtype.itemsize


class KVCache:
    """Preallocated K/V for every layer, (n_layer, B, n_kv_head, max_len, head_dim), K/V heads stored un-repeated.

    `pos` is the number of positions written; GPT.forward advances it once per call, after the last layer.
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_head, T, head_dim) at pos; return all K, V so far, (B, n_kv_head, pos + T, head_dim)."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class StaticPosition:
    """A KVCache seen by GPT.decode_static: K/V written at a position held in a 1-element tensor and all max_len
    positions returned (the step masks the unwritten ones), so every decode step has the same shapes."""

    def __init__(self, cache: KVCache, pos: torch.Tensor) -> None:
        self.cache, self.pos = cache, pos

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.k[layer].index_copy_(2, self.pos, k)
        self.cache.v[layer].index_copy_(2, self.pos, v)
        return self.cache.k[layer], self.cache.v[layer]


class CUDAGraphStep:
    """GPT.decode_static captured once as a CUDA graph and replayed for each token: a batch-1 step of a small model is
    ~0.6 ms of GPU work behind ~4 ms of kernel launches from Python (README Performance), which the replay removes.
    Bound to one cache (its tensors' addresses); the inputs are copied into the graph's own."""

    def __init__(self, model: "GPT", kv_cache: KVCache, batch_size: int) -> None:
        device, self.cache = kv_cache.k.device, kv_cache
        self.idx = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.pos = torch.full((1,), kv_cache.pos, dtype=torch.long, device=device)  # warm-up writes the next slot
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels are chosen and workspaces allocated outside the capture
                model.decode_static(self.idx, self.pos, kv_cache)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.decode_static(self.idx, self.pos, kv_cache)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, 1, vocab) of idx (B, 1) at the cache's position, which advances by one, as in GPT.forward."""
        self.idx.copy_(idx)
        self.pos.fill_(self.cache.pos)
        self.graph.replay()
        self.cache.pos += 1
        return self.logits


def rope_tables(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, each (block_size, head_dim // 2)."""
    inv_freq = config.rope_theta ** (-torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
    angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x (B, heads, T, head_dim) by angles whose cos/sin are (B or 1, 1, T, head_dim // 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def attention_mask(T: int, start: int, pad: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, T, start + T) for queries at positions start..start+T-1, or None when SDPA needs none.

    None covers the two common cases: a full causal block from an empty cache (is_causal=True) and one decoded token
    with no padding (it may see everything). Otherwise the mask is explicit, because is_causal aligns top-left.
    Left-padding slots (pad[b] per row) are hidden from every real query; a pad query sees itself only, so no row
    is fully masked (which would make NaNs).
    """
    if pad is None and (start == 0 or T == 1):
        return None
    q = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
    k = torch.arange(start + T, device=device)[None, :]  # (1, Tk)
    mask = k <= q
    if pad is not None:
        mask = mask & ((k >= pad[:, None, None]) | (k == q))  # (B, T, Tk)
        return mask[:, None]
    return mask[None, None]


class Linear(nn.Linear):
    """nn.Linear whose products with few rows (decoding) in fp32 on CPU without autograd split the output features
    into one slice per thread, computed as one batched matmul: MKL runs such a thin product on one core, which
    cannot stream the weights from memory at full speed (about 1.9x faster with 2 threads, see README Performance)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split: tuple | None = None  # (key, weight and bias per thread, the rows left over, weight); split_views

    def split_views(self, parts: int) -> tuple:
        """weight as (parts, in, out // parts) and bias as (parts, 1, out // parts), plus the last out % parts
        features' weight and bias; made once per weight tensor and thread count. They are views of the weight, but a
        weight over SPLIT_COPY_BYTES is copied into the (in, out) layout, remade when the weight changes in place."""
        w, b = self.weight, self.bias
        copy = w.nbytes > SPLIT_COPY_BYTES
        key = (parts, w.data_ptr(), w._version if copy else None, None if b is None else b.data_ptr())
        if self.split is None or self.split[0] != key:
            n = self.out_features // parts * parts
            ws = w[:n].view(parts, n // parts, -1).transpose(1, 2)  # (parts, in, n // parts)
            views = (ws.contiguous() if copy else ws, None if b is None else b[:n].view(parts, 1, -1))
            rest = (w[n:], None if b is None else b[n:]) if n < self.out_features else None
            self.split = None  # the old copy goes before the new one is made
            self.split = (key, views, rest, w.detach())  # holding w's memory: no other tensor reuses its address
        return self.split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_compiling() or torch.is_grad_enabled() or not x.is_cpu or x.dtype != torch.float32
                or self.weight.dtype != torch.float32 or x.numel() > SPLIT_MAX_ROWS * self.in_features
                or torch.is_autocast_enabled("cpu") or (parts := torch.get_num_threads()) < 2):
            return super().forward(x)
        _, (ws, bs), rest, _ = self.split_views(parts)
        rows = x.numel() // self.in_features
        xs = x.reshape(1, rows, -1).expand(ws.size(0), -1, -1)  # (parts, rows, in_features)
        y = torch.bmm(xs, ws) if bs is None else torch.baddbmm(bs, xs, ws)  # (parts, rows, out // parts)
        y = y.transpose(0, 1).reshape(rows, -1)
        if rest is not None:
            y = torch.cat((y, F.linear(x.reshape(rows, -1), *rest)), dim=1)
        return y.view(*x.shape[:-1], self.out_features)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_head, self.n_kv_head, self.head_dim = layer, config.n_head, config.n_kv_head, config.head_dim
        kv_dim = config.n_kv_head * config.head_dim
        self.c_q = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_k = Linear(config.n_embd, kv_dim, bias=config.bias)
        self.c_v = Linear(config.n_embd, kv_dim, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None,
                kv_cache: KVCache | None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # (B, n_kv_head, pos + T, head_dim)
        with sdpa_kernel(CACHE_SDPA_BACKENDS) if kv_cache is not None and q.is_cuda else nullcontext():
            y = sdpa(q, k, v, mask, is_causal=mask is None and T > 1 and k.size(2) == T,
                     dropout_p=self.dropout if self.training else 0.0)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
         dropout_p: float) -> torch.Tensor:
    """Attention of q (B, n_head, T, hd) over k, v (B, n_kv_head, Tk, hd); each K/V head serves n_head/n_kv_head
    query heads. SDPA, except for bf16 training on CPU (matmul_attention); where SDPA cannot share K/V heads itself
    (torch < 2.5), they are repeated here instead."""
    if q.is_cpu and q.dtype == torch.bfloat16 and torch.is_grad_enabled():
        return matmul_attention(q, k, v, mask, is_causal, dropout_p)
    gqa = k.size(1) != q.size(1)
    if gqa and q.size(2) == 1 and mask is not None:
        # One query per head (decoding under a mask, e.g. CUDAGraphStep): each K/V head's queries become that head's
        # query rows, a plain multi-head call. With enable_gqa and a mask, CUDA falls back to the math kernel: 11 ms
        # against 3.8 ms for MHA per batch-16 step at context 4096 on an H100, measured before this branch.
        B, H, _, hd = q.shape
        y = F.scaled_dot_product_attention(q.view(B, k.size(1), H // k.size(1), hd), k, v, attn_mask=mask,
                                           dropout_p=dropout_p)
        return y.view(B, H, 1, hd)
    if gqa and not SDPA_HAS_GQA:
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, n_head, Tk, hd)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                          enable_gqa=gqa)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                     dropout_p: float) -> torch.Tensor:
    """sdpa() as two batched matmuls and a softmax, the mask added to the scores inside the first (baddbmm). For
    training in bf16 on CPU, SDPA's flash kernel is the slower one: 30-34 ms against 17-20 ms forward and backward at
    B=8, 6 heads, T=256 (README Performance); not in fp32. Each K/V head's queries are stacked as one batch entry,
    so GQA/MQA need no copies of K/V."""
    B, H, T, hd = q.shape
    G, Tk = k.size(1), k.size(2)
    rep = H // G
    if is_causal:
        mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
    elif mask is not None and mask.size(0) == 1:
        mask = mask[0, 0]  # (T, Tk)
    bias = q.new_zeros(())
    if mask is not None:  # 0 where a query sees a key, -inf where not: (rep * T, Tk), or one per batch entry
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        bias = bias.repeat(rep, 1) if mask.dim() == 2 else bias.expand(B, G * rep, T, Tk).reshape(B * G, rep * T, Tk)
    att = torch.baddbmm(bias, q.reshape(B * G, rep * T, hd), k.reshape(B * G, Tk, hd).transpose(1, 2),
                        alpha=hd**-0.5).softmax(dim=-1)  # (B * G, rep * T, Tk)
    att = F.dropout(att, dropout_p) if dropout_p else att
    return (att.type_as(v) @ v.reshape(B * G, Tk, hd)).view(B, H, T, hd)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = "tanh" if config.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None,
                kv_cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, mask, kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        if config.pos_encoding == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:  # derived from the config, so kept out of the state_dict
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, https://arxiv.org/abs/1608.05859
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; non_embedding leaves out the token (= tied lm_head) and position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel()
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
        return n

    def attention_params_per_layer(self) -> int:
        return sum(p.numel() for p in self.transformer.h[0].attn.parameters())

    def make_kv_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for up to max_len (default block_size) positions, on the model's device and dtype."""
        w = self.transformer.wte.weight
        return KVCache(self.config, batch_size, max_len or self.config.block_size, w.device, dtype or w.dtype)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and the loss for targets; with no targets, logits of the last position only (B, 1, V).

        idx (B, T) continues what kv_cache holds (if any). pad (B,) counts left-padding tokens at the start of each
        row's sequence (the cache's slots included): they are masked out and each row's positions start after them.
        """
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        if kv_cache is not None and start + T > kv_cache.max_len:
            raise ValueError(f"KV cache holds {kv_cache.max_len} positions, {start + T} needed")
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        if pad is not None:
            pos = (pos[None, :] - pad[:, None]).clamp(min=0)  # (B, T)
        x, rope = self.embed(idx, pos)
        x = self.transformer.drop(x)
        mask = attention_mask(T, start, pad, idx.device)
        for block in self.transformer.h:
            x = block(x, rope, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def embed(self, idx: torch.Tensor, pos: torch.Tensor
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Embeddings (B, T, n_embd) of idx (B, T) at positions pos ((T,) or (B, T)): token plus learned position
        embeddings, or the token embeddings and the rotary cos/sin for those positions, each (B or 1, 1, T, hd // 2)."""
        x = self.transformer.wte(idx)
        if self.config.pos_encoding == "learned":
            return x + self.transformer.wpe(pos), None
        T = idx.size(1)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T or B, T, head_dim // 2)
        return x, (cos.view(-1, 1, T, cos.size(-1)), sin.view(-1, 1, T, sin.size(-1)))

    def decode_static(self, idx: torch.Tensor, pos: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """Logits (B, 1, vocab) of one token per row, idx (B, 1), at position pos (a 1-element tensor), attending over
        the whole cache under a mask: the same shapes every step, and no host sync, for CUDAGraphStep."""
        x, rope = self.embed(idx, pos)
        mask = (torch.arange(kv_cache.max_len, device=idx.device) <= pos)[None, None, None, :]
        slot = StaticPosition(kv_cache, pos)
        for block in self.transformer.h:
            x = block(x, rope, mask, slot)
        return self.lm_head(self.transformer.ln_f(x))

    @torch.inference_mode()
    def stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, eos: int | None = None, use_cache: bool = True,
               pad: torch.Tensor | None = None, generator: torch.Generator | None = None, cuda_graph: bool = True
               ) -> Iterator[torch.Tensor]:
        """Yield the next token of every row, (B,), up to max_new_tokens times; see generate()."""
        B, T0 = idx.shape
        bs = self.config.block_size
        tokens = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)
        tokens[:, :T0] = idx
        start = max(0, T0 - bs)  # the window the model sees is tokens[:, start:n]
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        kv_cache, graph = None, None
        for n in range(T0, T0 + max_new_tokens):
            refill = n - start > bs  # the window is full: slide it, keeping the last half, and prefill again
            if refill:
                start = n - max(1, bs // 2)
            window_pad = None if pad is None else (pad - start).clamp(min=0)
            if not use_cache:
                logits, _ = self(tokens[:, start:n], pad=window_pad)
            elif kv_cache is None or refill:  # a refill reuses the cache (of block_size positions by then)
                if kv_cache is None:
                    kv_cache = self.make_kv_cache(B, min(bs, T0 + max_new_tokens - 1 - start))
                kv_cache.pos = 0
                logits, _ = self(tokens[:, start:n], kv_cache=kv_cache, pad=window_pad)
            elif cuda_graph and idx.is_cuda and pad is None:
                graph = graph or CUDAGraphStep(self, kv_cache, B)
                logits = graph(tokens[:, n - 1:n])
            else:
                logits, _ = self(tokens[:, n - 1:n], kv_cache=kv_cache, pad=window_pad)
            nxt = sample_logits(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
            if eos is not None:
                nxt = torch.where(done, eos, nxt)
                done |= nxt == eos
            tokens[:, n] = nxt
            yield nxt
            if eos is not None and bool(done.all()):
                return

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos: int | None = None, use_cache: bool = True,
                 pad: torch.Tensor | None = None, generator: torch.Generator | None = None, cuda_graph: bool = True
                 ) -> torch.Tensor:
        """Continue idx (B, T) by up to max_new_tokens tokens; returns (B, T + new tokens).

        The cache is prefilled once and then fed one token per step; use_cache=False recomputes the whole window
        every step (same tokens, slower). Rows of unequal length are left-padded, pad (B,) counting each row's pad
        tokens (see left_pad). temperature 0 is greedy. A row that emits eos keeps emitting eos; generation stops
        when every row has. When the context reaches block_size the window slides: the newest block_size // 2 tokens
        are kept and prefilled again, so past block_size a prefill happens every block_size // 2 tokens. On CUDA
        (without padding) each one-token step replays a CUDA graph of decode_static unless cuda_graph=False.
        """
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, eos, use_cache, pad, generator,
                               cuda_graph))
        return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices (embeddings included) only, fused on CUDA. (On CPU the fused kernel
        is 3x faster, 7 vs 22 ms a step for the 6x384 model, but it moved 2 gloo ranks' weights apart from one
        process's by twice test_ddp's bound, so CPU keeps the foreach kernels.)"""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token: 6 per weight of every matmul (the smaller K/V projections
        of GQA/MQA included, lm_head included) plus 12 * n_layer * n_embd * seq_len for the attention scores and
        weighted sum (causal masking not subtracted, as in the PaLM paper's appendix B)."""
        cfg = self.config
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul + 12 * cfg.n_layer * cfg.n_embd * (seq_len or cfg.block_size)

    def estimate_mfu(self, tokens_per_iter: int, dt: float, peak_flops: float, seq_len: int | None = None) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over peak_flops (the device's dense peak)."""
        return self.flops_per_token(seq_len) * tokens_per_iter / dt / peak_flops


def sample_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from logits (B, V): temperature 0 is argmax; top_k and top_p (nucleus) restrict the
    candidates to the k most likely, and to the fewest whose probability sums to at least top_p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: list[list[int]], pad_token: int = 0, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists of unequal length into idx (B, max_len) and pad (B,), the pad count of each row."""
    width = max(len(p) for p in prompts)
    idx = torch.tensor([[pad_token] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long, device=device)
    return idx, pad


def save_checkpoint(path: str | Path, model: GPT, **state: Any) -> None:
    """Write {'model', 'model_config', **state} atomically: to a temp file in the same folder, fsynced, then renamed
    over the old checkpoint, so a crash mid-write leaves the previous one intact. state holds plain data only."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "model_config": asdict(model.config), **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint written by save_checkpoint, loaded with weights_only=True (it cannot run code)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: train one first (python train.py ...) or fix out_dir")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"refusing to load {path}: it holds objects other than tensors and plain data, which "
                         f"could run code ({str(e).splitlines()[0]})") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"checkpoint {path} is corrupt or truncated ({str(e).splitlines()[0]})") from e
    if not isinstance(ckpt, dict) or not {"model", "model_config"} <= ckpt.keys():
        raise ValueError(f"{path} is not a checkpoint written by this project (no 'model' and 'model_config')")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any]) -> GPT:
    """The GPT a checkpoint describes, with its weights."""
    try:
        model = GPT(GPTConfig(**ckpt["model_config"]))
    except TypeError as e:
        raise ValueError(f"checkpoint's model_config does not fit GPTConfig ({e})") from e
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise ValueError(f"checkpoint weights do not match its model_config ({str(e).splitlines()[0]})") from e
    return model


def from_hf_gpt2(name_or_path: str) -> GPT:
    """OpenAI's GPT-2 through Hugging Face transformers: a hub name ('gpt2', 'gpt2-medium', 'gpt2-large',
    'gpt2-xl') or a local folder written by save_pretrained. Its fused c_attn is split into c_q, c_k, c_v and its
    Conv1D weights, stored (in, out), are transposed to Linear's (out, in)."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    try:
        hf = GPT2LMHeadModel.from_pretrained(name_or_path)
    except OSError as e:  # what transformers raises for no network, no cache or a bad folder
        raise RuntimeError(f"cannot load GPT-2 weights {name_or_path!r} ({str(e).splitlines()[0]}): with no network, "
                           f"fill the Hugging Face cache once online, or pass a folder saved by save_pretrained") from e
    c = hf.config
    model = GPT(GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head,
                          n_embd=c.n_embd, bias=True, gelu="tanh" if c.activation_function == "gelu_new" else "exact"))
    state = {}
    for name, t in hf.state_dict().items():
        if ".attn.c_attn." in name:
            for part, piece in zip(("c_q", "c_k", "c_v"), t.split(c.n_embd, dim=-1), strict=True):
                state[name.replace("c_attn", part)] = piece.t() if name.endswith("weight") else piece
        else:
            state[name] = t.t() if name.endswith(("c_proj.weight", "c_fc.weight")) else t
    model.load_state_dict(state)
    return model


def convert_kv_heads(model: GPT, n_kv_head: int) -> GPT:
    """A copy of model whose K/V heads are pooled into n_kv_head groups: each new K (and V) head is the mean of the
    heads of its group, query and output projections unchanged (GQA paper, https://arxiv.org/abs/2305.13245 s2.1)."""
    old = model.config.n_kv_head
    config = replace(model.config, n_kv_head=n_kv_head)  # checks that n_kv_head divides n_head
    if old % n_kv_head:
        raise ValueError(f"cannot pool the model's {old} K/V heads into n_kv_head={n_kv_head} groups: "
                         f"n_kv_head must divide {old}")
    state = model.state_dict()
    for name, t in state.items():
        if name.endswith(("attn.c_k.weight", "attn.c_k.bias", "attn.c_v.weight", "attn.c_v.bias")):
            # (old * head_dim, ...) -> (n_kv_head, old / n_kv_head, head_dim, ...) -> mean over each group
            grouped = t.view(n_kv_head, old // n_kv_head, config.head_dim, *t.shape[1:])
            state[name] = grouped.mean(dim=1).reshape(n_kv_head * config.head_dim, *t.shape[1:])
    converted = GPT(config).to(next(model.parameters()).device)
    converted.load_state_dict(state)
    return converted
