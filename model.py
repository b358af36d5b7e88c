"""A GPT whose attention is MHA, GQA or MQA (set by n_kv_head), with a preallocated KV cache.

GQA: https://arxiv.org/abs/2305.13245, MQA: https://arxiv.org/abs/1911.02150"""

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

from fast_paths import Linear, attention

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
        problems: list[str] = []
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                     "mlp_hidden"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not problems:  # the sizes are integers, so their ratios can be checked
            if self.n_embd % self.n_head:
                problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
            if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
                problems.append(f"n_head={self.n_head} must be divisible by "
                                f"n_kv_head={self.n_kv_head} (1 <= n_kv_head <= n_head; "
                                "n_head: MHA, 1: MQA, a divisor in between: GQA)")
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if self.pos_encoding not in POS_ENCODINGS:
            choices = ", ".join(POS_ENCODINGS)
            problems.append(f"pos_encoding={self.pos_encoding!r} must be one of {choices}")
        elif self.pos_encoding == "rope" and not problems and self.head_dim % 2:
            problems.append("pos_encoding='rope' needs an even head_dim = n_embd/n_head, "
                            f"got head_dim={self.head_dim}")
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

    def kv_cache_bytes(self, batch_size: int, seq_len: int,
                       dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V in every layer for batch_size sequences of seq_len positions."""
        per_layer = 2 * batch_size * self.n_kv_head * seq_len * self.head_dim * dtype.itemsize
        return self.n_layer * per_layer


class KVCache:
    """Preallocated K and V, (n_layer, B, n_kv_head, max_len, head_dim), K/V heads un-repeated.
    `pos` counts positions written; GPT.forward advances it once per call, after the last layer."""

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_head, T, head_dim) at pos; return K and V from 0 to pos + T."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, n_kv_head, end, head_dim)


def rope_tables(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin (https://arxiv.org/abs/2104.09864), each (block_size, head_dim // 2)."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
    inv_freq = config.rope_theta ** -exponents  # (head_dim // 2,)
    angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, head_dim) half by half; cos, sin are (B or 1, 1, T, head_dim // 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


Rope = tuple[torch.Tensor, torch.Tensor] | None  # the rotary cos and sin at the positions at hand
Mask = torch.Tensor | None  # bool (B or 1, 1, T, Tk), True where a query sees a key
Cache = KVCache | None  # or any object with KVCache.update (static_step's StaticKVView)


def attention_mask(T: int, start: int, pad: torch.Tensor | None, device: torch.device) -> Mask:
    """The mask (B or 1, 1, T, start + T) of queries at start..start+T-1, or None where none is
    needed: a causal block from an empty cache, or one token without padding (SDPA's is_causal
    aligns top-left). Left padding (pad[b] slots in row b) is hidden from real queries; a pad query
    sees only itself, so no row is fully masked (which gives NaNs)."""
    if pad is None and (start == 0 or T == 1):
        return None
    query_pos = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
    key_pos = torch.arange(start + T, device=device)[None, :]  # (1, Tk)
    mask = key_pos <= query_pos  # (T, Tk)
    if pad is None:
        return mask[None, None]
    mask = mask & ((key_pos >= pad[:, None, None]) | (key_pos == query_pos))  # (B, T, Tk)
    return mask[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_head * config.head_dim
        self.c_q = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_k = Linear(config.n_embd, kv_dim, bias=config.bias)
        self.c_v = Linear(config.n_embd, kv_dim, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache) -> torch.Tensor:
        B, T, C = x.shape  # C is n_embd
        # q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim)
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # (B, n_kv_head, Tk, head_dim)
        dropout_p = self.dropout if self.training else 0.0
        y = attention(q, k, v, mask, dropout_p, cached=kv_cache is not None)
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

    def forward(self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache) -> torch.Tensor:
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
            table_shape = (config.block_size, config.head_dim // 2)
            self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
            self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, https://arxiv.org/abs/1608.05859
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
                     assign: Callable[[torch.Tensor, torch.Tensor], Any] = torch.Tensor.copy_
                     ) -> None:
        """GPT-2's initialisation: weights N(0, 0.02) (c_proj's std / sqrt(2 * n_layer)), zero
        biases, LayerNorm weights one, stored by assign(param, values); meta parameters skipped.
        Given a seed, each is drawn whole on CPU from a generator seeded by (seed, its name): models
        of other shapes share every equal-shaped one; a larger one starts with a smaller's rows."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            owner, _, kind = name.rpartition(".")
            if isinstance(self.get_submodule(owner), nn.LayerNorm):
                values = torch.full(p.shape, 1.0 if kind == "weight" else 0.0, device="cpu")
            elif kind == "bias":
                values = torch.zeros(p.shape, device="cpu")
            else:
                std = residual_std if owner.endswith("c_proj") else 0.02
                generator = None
                if seed is not None:  # crc32: a CPU generator keeps 32 bits of its seed
                    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                values = torch.empty(p.shape, device="cpu").normal_(0.0, std, generator=generator)
            assign(p, values)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; non_embedding leaves out token (= lm_head) and position embeddings."""
        count = sum(p.numel() for p in self.parameters())
        if non_embedding:
            count -= self.transformer.wte.weight.numel()
            if "wpe" in self.transformer:
                count -= self.transformer.wpe.weight.numel()
        return count

    def attention_params_per_layer(self) -> int:
        return sum(p.numel() for p in self.transformer.h[0].attn.parameters())

    def make_kv_cache(self, batch_size: int, max_len: int | None = None,
                      dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache of max_len (default block_size) positions, on the weights' device."""
        weight = self.transformer.wte.weight
        length = max_len or self.config.block_size
        return KVCache(self.config, batch_size, length, weight.device, dtype or weight.dtype)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, pad: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size) and the loss, or without targets the last position's logits.

        idx (B, T) continues kv_cache (if any). pad (B,) counts each row's left-padding tokens (the
        cache's too): they are masked out and the row's positions start after them."""
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.pos
        end = start + T
        block_size = self.config.block_size
        if end > block_size:
            raise ValueError(f"sequence of {end} tokens is longer than block_size={block_size}")
        if kv_cache is not None and end > kv_cache.max_len:
            raise ValueError(f"KV cache holds {kv_cache.max_len} positions, {end} needed")
        pos = torch.arange(start, end, device=idx.device)  # (T,)
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
        if targets is None:  # generation needs only the next token's logits
            return self.lm_head(x[:, -1:, :]), None  # (B, 1, vocab_size)
        logits = self.lm_head(x)
        flat_logits = logits.view(-1, logits.size(-1))  # (B * T, vocab_size)
        loss = F.cross_entropy(flat_logits, targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """Embeddings (B, T, n_embd) of idx (B, T) at positions pos, (T,) or (B, T), and the rotary
        cos and sin there, each (B or 1, 1, T, head_dim // 2), or None for learned positions."""
        x = self.transformer.wte(idx)
        if self.config.pos_encoding == "learned":
            return x + self.transformer.wpe(pos), None
        T = idx.size(1)
        half_dim = self.config.head_dim // 2
        cos = self.rope_cos[pos].view(-1, 1, T, half_dim)  # (B or 1, 1, T, head_dim // 2)
        sin = self.rope_sin[pos].view(-1, 1, T, half_dim)
        return x, (cos, sin)

    def configure_optimizers(self, weight_decay: float, learning_rate: float,
                             betas: tuple[float, float], device_type: str,
                             params: list[nn.Parameter] | None = None) -> torch.optim.AdamW:
        """AdamW over params (default: all), decaying matrices (embeddings included) only."""
        if params is None:
            params = list(self.parameters())
        trainable = [p for p in params if p.requires_grad]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # foreach on CPU: fused drifts gloo ranks apart (docs/performance-cpu.md "Training")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, as in the PaLM paper's appendix B: 6 per
        matmul weight (lm_head and K/V projections included) plus 12 * n_layer * n_embd * seq_len
        for attention scores and weighted sums (causal masking not subtracted)."""
        config = self.config
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention_flops = 12 * config.n_layer * config.n_embd * (seq_len or config.block_size)
        return 6 * matmul_weights + attention_flops

    def estimate_mfu(self, tokens_per_iter: int, dt: float, peak_flops: float,
                     seq_len: int | None = None) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak_flops."""
        return self.flops_per_token(seq_len) * tokens_per_iter / dt / peak_flops
