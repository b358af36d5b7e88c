"""A GPT whose attention is MHA, GQA or MQA (set by n_kv_head), with a preallocated KV cache for decoding.

GQA: https://arxiv.org/abs/2305.13245, MQA: https://arxiv.org/abs/1911.02150, RoPE: https://arxiv.org/abs/2104.09864
"""

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

from fast_paths import Linear, attention
from generation import generate, stream

POS_ENCODINGS = ("learned", "rope")


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
    mlp_hidden: int | None = None  # the MLP's hidden width; None: 4 * n_embd (GPT-2's)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.mlp_hidden is None and type(self.n_embd) is int:
            self.mlp_hidden = 4 * self.n_embd
        sizes = ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden")
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


class StaticKVView:
    """A KVCache as GPT.decode_static uses it: K/V written at a position held in a 1-element tensor, in place into
    the cache tensors (not a view of them, which a compiled step would copy whole), and the first `length`
    positions returned, or all max_len when length is None (the step masks the unwritten ones)."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, length: int | None) -> None:
        B, G = cache.k.shape[1:3]
        self.cache, self.length, dev = cache, length, pos.device
        self.at = (torch.arange(B, device=dev)[:, None], torch.arange(G, device=dev)[None, :], pos)  # (B, G) slots

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = (torch.full((), layer, device=k.device), *self.at)
        self.cache.k.index_put_(at, k[:, :, 0])
        self.cache.v.index_put_(at, v[:, :, 0])
        k, v = self.cache.k[layer], self.cache.v[layer]
        return (k, v) if self.length is None else (k.narrow(2, 0, self.length), v.narrow(2, 0, self.length))


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
    """Boolean mask (B or 1, 1, T, start + T) for queries at positions start..start+T-1, or None when none is needed.

    None covers the two common cases: a full causal block from an empty cache and one decoded token with no padding
    (it may see everything). Otherwise the mask is explicit, because SDPA's is_causal aligns top-left.
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


Rope = tuple[torch.Tensor, torch.Tensor] | None  # the rotary cos and sin of the positions at hand, or None
Cache = KVCache | StaticKVView | None


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

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None, kv_cache: Cache) -> torch.Tensor:
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # (B, n_kv_head, Tk, head_dim)
        y = attention(q, k, v, mask, self.dropout if self.training else 0.0, cached=kv_cache is not None)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
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

    def forward(self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None, kv_cache: Cache) -> torch.Tensor:
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
            half = (config.block_size, config.head_dim // 2)
            self.register_buffer("rope_cos", torch.empty(half), persistent=False)
            self.register_buffer("rope_sin", torch.empty(half), persistent=False)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, https://arxiv.org/abs/1608.05859
        self.init_buffers()
        self.init_weights()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the buffers derived from the config: the rotary tables."""
        if self.config.pos_encoding == "rope":
            cos, sin = rope_tables(self.config)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None,
                     assign: Callable[[torch.Tensor, torch.Tensor], Any] = torch.Tensor.copy_) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, residual projections' (c_proj) std / sqrt(2 * n_layer), zero
        biases, LayerNorm weights one. Each parameter is drawn whole on CPU, from torch's global generator or, given
        a seed, from a generator seeded by (seed, its name): models of other shapes (n_kv_head, mlp_hidden) made
        with one seed share every parameter of equal shape, and a larger one starts with the smaller one's rows.
        assign(param, values) stores them; meta parameters are skipped."""
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            owner, _, kind = name.rpartition(".")
            if isinstance(self.get_submodule(owner), nn.LayerNorm):
                values = torch.full(p.shape, 1.0 if kind == "weight" else 0.0, device="cpu")
            elif kind == "bias":
                values = torch.zeros(p.shape, device="cpu")
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if owner.endswith("c_proj") else 0.02
                # (a CPU generator keeps 32 bits of its seed)
                gen = None if seed is None else torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                values = torch.empty(p.shape, device="cpu").normal_(0.0, std, generator=gen)
            assign(p, values)

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

    def decode_static(self, idx: torch.Tensor, pos: torch.Tensor, kv_cache: KVCache, length: int | None = None
                      ) -> torch.Tensor:
        """Logits (B, 1, vocab) of one token per row, idx (B, 1), at position pos (a 1-element tensor), attending over
        the whole cache under a mask (the same shapes every step and no host sync, for CUDAGraphStep), or over its
        first `length` positions (the compiled CPU step's one dynamic size)."""
        x, rope = self.embed(idx, pos)
        mask = None if length else (torch.arange(kv_cache.max_len, device=idx.device) <= pos)[None, None, None, :]
        view = StaticKVView(kv_cache, pos, length)
        for block in self.transformer.h:
            x = block(x, rope, mask, view)
        return self.lm_head(self.transformer.ln_f(x))

    def stream(self, idx: torch.Tensor, max_new_tokens: int, **options: Any) -> Iterator[torch.Tensor]:
        """Yield the next token of every row, (B,), as it is decoded: generation.stream."""
        return stream(self, idx, max_new_tokens, **options)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 **options: Any) -> torch.Tensor:
        """idx (B, T) continued by up to max_new_tokens tokens, (B, T + new): generation.generate (also top_p, eos,
        use_cache, pad, generator, cuda_graph)."""
        return generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, **options)

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str, params: list[nn.Parameter] | None = None) -> torch.optim.AdamW:
        """AdamW over params (default: all) with weight decay on matrices (embeddings included) only, fused on CUDA.
        CPU keeps the foreach kernels: the fused one is faster but moved 2 gloo ranks' weights apart from one
        process's past test_ddp's bound (docs/performance-cpu.md "Training")."""
        params = [p for p in (self.parameters() if params is None else params) if p.requires_grad]
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


