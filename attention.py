"""The attention kinds behind one interface to the block and the KV cache, with the rotary positions and masks they
share: CausalSelfAttention (MHA, GQA or MQA, set by its number of K/V heads) and LatentAttention (Multi-head Latent
Attention, whose cache holds one low-rank latent and one rotary key per token); the masks also cut a local layer's
keys to its window (GPTConfig.window). model.py builds them from GPTConfig.

GQA: https://arxiv.org/abs/2305.13245, MQA: https://arxiv.org/abs/1911.02150, MLA: https://arxiv.org/abs/2405.04434
"""

from typing import Protocol

import torch
import torch.nn as nn

from smallgpt.fast_paths import Linear, attention, joint_linear

NORM_EPS = 1e-5  # every RMSNorm's, as nn.LayerNorm's default (exported as Llama's rms_norm_eps)


class Cache(Protocol):
    """What attention needs of a cache: KVCache, or static_step's StaticKVView."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def latent_problems(
    kv_lora_rank: int | None,
    qk_rope_head_dim: int | None,
    q_lora_rank: int | None,
    latent_norm: bool,
    pos_encoding: str,
    n_kv_head: int,
    n_head: int,
    n_embd: int,
) -> list[str]:
    """What is wrong with GPTConfig's MLA keys, a key that would change nothing included."""
    if kv_lora_rank is None:
        given = {"qk_rope_head_dim": qk_rope_head_dim, "q_lora_rank": q_lora_rank}
        if latent_norm is not True:  # its default: anything else asks for a latent's norm
            given["latent_norm"] = latent_norm
        return [
            f"{k}={v} is an MLA key: set kv_lora_rank too"
            for k, v in given.items()
            if v is not None
        ]
    problems = []
    for key, value in (("kv_lora_rank", kv_lora_rank), ("q_lora_rank", q_lora_rank)):
        if value is not None and (type(value) is not int or value < 1):
            problems.append(f"{key}={value!r} must be a positive integer")
    rope = qk_rope_head_dim
    if type(rope) is not int or rope < 0 or (rope == 0) != (pos_encoding == "learned"):
        problems.append(
            f"qk_rope_head_dim={rope!r} must be a positive integer with pos_encoding='rope', 0 with "
            "'learned'"
        )
    if n_kv_head != n_head:
        problems.append(
            f"n_kv_head={n_kv_head} does not apply to MLA (every head has its own K and V, made from the "
            "latent): leave it out"
        )
    if problems or type(n_embd) is not int or type(n_head) is not int or n_head < 1:
        return problems
    head_dim = n_embd // n_head
    if rope > head_dim:
        problems.append(
            f"qk_rope_head_dim={rope} is wider than a head (head_dim={head_dim}): give at most "
            f"{head_dim}"
        )
    elif (
        kv_lora_rank + rope >= 2 * n_embd
    ):  # MHA caches K and V: 2 n_embd features a token and layer
        problems.append(
            f"kv_lora_rank={kv_lora_rank} with qk_rope_head_dim={rope} caches {kv_lora_rank + rope} "
            f"features a token, not fewer than the {2 * n_embd} of the K and V it replaces (2 n_embd): "
            f"give kv_lora_rank below {2 * n_embd - rope}"
        )
    return problems


def window_problems(window: int | None, pattern: str, block_size: int) -> list[str]:
    """What is wrong with GPTConfig's local-layer keys, alone and against block_size (GPTConfig checks that
    some layer is local)."""
    if isinstance(pattern, str) and pattern and set(pattern) <= {"s", "l", "S", "L"}:
        if pattern != pattern.upper():
            return [
                f"window_pattern={pattern!r}: its letters are upper case, window_pattern={pattern.upper()!r} "
                "(compare.py's variant names spell them lower case, e.g. mha-sl8)"
            ]
    else:
        return [
            f"window_pattern={pattern!r} must be letters S (a local layer) and L (a global one), e.g. 'SSSL'"
        ]
    if window is None:
        return (
            [f"window_pattern={pattern!r} has local layers (S): give their window"]
            if "S" in pattern
            else []
        )
    if type(window) is not int or window < 1:
        return [f"window={window!r} must be a positive integer (the tokens a local layer sees)"]
    if "S" not in pattern:
        return [
            f"window={window} with window_pattern={pattern!r}: no layer is local; give a pattern with S, e.g. "
            "'SSSL' (the last layer is always global)"
        ]
    if type(block_size) is int and window >= block_size:
        return [
            f"window={window} is not below block_size={block_size}, so a local layer would see what a global "
            f"one sees: give a window below {block_size}, or leave window out"
        ]
    return []


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm with this project's epsilon, computed in its weight's dtype: under autocast a bf16 input would
    miss the fused kernel (and warn)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, eps=NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


class KVCache:
    """Preallocated K and V of every layer, laid out as GPTConfig.cache_layout says: K/V heads un-repeated
    (MHA/GQA/MQA), or MLA's one head of [latent | rotary key] with no V of its own (LatentAttention). A global layer's
    are in k, v (n_global, B, heads, max_len, width), position p at slot p; a local layer's in a ring, ring_k,
    ring_v (n_local, B, heads, ring, width) of ring = min(window, max_len) slots, position p at slot p % ring, so
    that it holds the newest positions, all its window sees. `pos` counts positions written; GPT.forward advances it
    once per call, after the last layer. zeros() makes an empty one."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        ring_k: torch.Tensor,
        ring_v: torch.Tensor,
        windows: list[int | None],
    ) -> None:
        self.k, self.v, self.ring_k, self.ring_v = k, v, ring_k, ring_v
        self.max_len, self.ring = k.size(3), ring_k.size(3)
        self.where, counts = (
            [],
            [0, 0],
        )  # each layer's (local?, index in its tensors); layers so far, global and local
        for window in windows:
            local = window is not None
            self.where.append((local, counts[local]))
            counts[local] += 1
        self.pos = 0

    @classmethod
    def zeros(
        cls,
        windows: list[int | None],
        batch_size: int,
        max_len: int,
        heads: int,
        k_width: int,
        v_width: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> "KVCache":
        """An empty cache of max_len positions for layers of these windows (None: global; the local ones share one)."""
        local = [w for w in windows if w is not None]
        assert len(set(local)) <= 1, f"one window for every local layer, not {sorted(set(local))}"
        ring = min(local[0], max_len) if local else 0
        tensors = [
            torch.zeros(n, batch_size, heads, length, width, device=device, dtype=dtype)
            for n, length in ((len(windows) - len(local), max_len), (len(local), ring))
            for width in (k_width, v_width)
        ]
        return cls(*tensors, windows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.ring_k, self.ring_v))

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, heads, T, width) at pos; return the keys and values the layer attends over: a global
        layer's from 0 to pos + T; a local layer's ring in slot order (their positions: attention_mask's `ring`),
        after the write for one token, before it and then the chunk's own for a chunk (whose writes would overwrite
        keys its first queries see), only the chunk's from an empty cache."""
        local, i = self.where[layer]
        start, T = self.pos, k.size(2)
        if not local:
            self.k[i, :, :, start : start + T] = k
            self.v[i, :, :, start : start + T] = v
            return self.k[i, :, :, : start + T], self.v[
                i, :, :, : start + T
            ]  # (B, heads, start + T, width)
        ring_k, ring_v = self.ring_k[i], self.ring_v[i]  # (B, heads, ring, width)
        if T == 1:
            ring_k[:, :, start % self.ring] = k[:, :, 0]
            ring_v[:, :, start % self.ring] = v[:, :, 0]
            return (k, v) if start == 0 else (ring_k, ring_v)
        seen = (
            (k, v) if start == 0 else (torch.cat((ring_k, k), dim=2), torch.cat((ring_v, v), dim=2))
        )
        n = min(T, self.ring)  # the chunk's newest n tokens are kept
        slots = torch.arange(start + T - n, start + T, device=k.device) % self.ring
        ring_k.index_copy_(2, slots, k[:, :, T - n :])
        ring_v.index_copy_(2, slots, v[:, :, T - n :])
        return seen


Rope = tuple[torch.Tensor, torch.Tensor] | None  # the rotary cos and sin at the positions at hand
Mask = torch.Tensor | None  # bool (B or 1, 1, T, Tk), True where a query sees a key


def rope_tables(dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin (https://arxiv.org/abs/2104.09864) for `dim` rotated features, each (length, dim // 2)."""
    inv_freq = theta ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim // 2,)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, dim) half by half in fp32; cos, sin are (B or 1, 1, T, dim // 2). A bf16 x is made fp32
    first: products of one dtype run vectorised, mixed ones do not (docs/performance-cpu.md "Training")."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def ring_positions(end: int | torch.Tensor, ring: int, device: torch.device) -> torch.Tensor:
    """The position each slot of a ring of `ring` slots holds (KVCache: position p at slot p % ring) once positions
    below end are written: the newest such, negative where none is yet. end: an int or a 1-element tensor."""
    last = end - 1
    return last - (last - torch.arange(ring, device=device)).remainder(ring)  # (ring,)


def attention_mask(
    T: int,
    start: int,
    pad: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
    ring: int | None = None,
) -> Mask:
    """The mask (B or 1, 1, T, Tk) of queries at start..start+T-1 over the keys at 0..start+T-1, or None where none is
    needed: a causal block from an empty cache, or one token without padding (SDPA's is_causal aligns top-left), that
    no window cuts. Left padding (pad[b] slots in row b) is hidden from real queries; a pad query sees only itself,
    so no row is fully masked (which gives NaNs). window (a local layer's): a query sees only itself and the
    window - 1 slots before it. ring: the slots of a local layer's cache (KVCache), whose keys are then the ring's
    slots, for a chunk followed by its own."""
    if (
        ring is not None and start > 0
    ):  # the keys KVCache.update returns: the ring's slots (then a chunk's own)
        if (
            T == 1 and pad is None and start + 1 >= ring
        ):  # every slot written: all of them in the window
            return None
        key_pos = ring_positions(start + (T == 1), ring, device)
        if T > 1:
            key_pos = torch.cat((key_pos, torch.arange(start, start + T, device=device)))
    elif pad is None and (start == 0 or T == 1) and (window is None or start + T <= window):
        return None
    else:
        key_pos = torch.arange(start + T, device=device)
    query_pos = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
    key_pos = key_pos[None, :]  # (1, Tk)
    mask = (key_pos <= query_pos) & (key_pos >= 0)  # (T, Tk); negative: a ring slot not written yet
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    if pad is None:
        return mask[None, None]
    mask = mask & ((key_pos >= pad[:, None, None]) | (key_pos == query_pos))  # (B, T, Tk)
    return mask[:, None]


class CausalSelfAttention(nn.Module):
    """n_head query heads over n_kv_head K/V heads: MHA (equal), GQA (a divisor), MQA (one)."""

    def __init__(
        self, layer: int, n_embd: int, n_head: int, n_kv_head: int, bias: bool, dropout: float
    ) -> None:
        super().__init__()
        self.layer, self.n_head, self.n_kv_head = layer, n_head, n_kv_head
        self.head_dim = n_embd // n_head
        kv_dim = n_kv_head * self.head_dim
        self.c_q = Linear(n_embd, n_embd, bias=bias)
        self.c_k = Linear(n_embd, kv_dim, bias=bias)
        self.c_v = Linear(n_embd, kv_dim, bias=bias)
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape  # C is n_embd
        H, G, hd = self.n_head, self.n_kv_head, self.head_dim
        if (
            kv_cache is None and rope is not None
        ):  # q, k and v as one product, q and k rotated as one
            qkv = (
                joint_linear(x, self.c_q, self.c_k, self.c_v)
                .view(B, T, H + 2 * G, hd)
                .transpose(1, 2)
            )
            qk, v = qkv.split((H + G, G), dim=1)
            q, k = apply_rope(qk, *rope).split((H, G), dim=1)
        else:  # each Linear on its own: decoding's few-row products (fast_paths.Linear), and faster on CUDA without
            q = (
                self.c_q(x).view(B, T, H, hd).transpose(1, 2)
            )  # RoPE (docs/performance-cpu.md "Training")
            k = self.c_k(x).view(B, T, G, hd).transpose(1, 2)
            v = self.c_v(x).view(B, T, G, hd).transpose(1, 2)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer, k, v)  # (B, n_kv_head, Tk, head_dim)
        # q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, Tk, head_dim)
        dropout_p = self.dropout if self.training else 0.0
        y = attention(q, k, v, mask, dropout_p, cached=kv_cache is not None)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))


class LatentAttention(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2, section 2.1): K and V of every head are up-projected (kv_b) from one
    latent of kv_lora_rank features a token, and positions ride on rope_dim extra query/key features, the rotary key
    shared by the heads (decoupled RoPE); the latent carries no position. Queries come from x directly, or through
    their own latent of q_lora_rank. Names follow DeepSeek's (q_a, q_b, kv_a, kv_b) where GPT-2's have no match.

    Training builds K and V from the latent. With a cache (decoding), the cache holds [latent | rotary key] as one
    K head and nothing as V, and kv_b's key half is folded into the query and its value half applied after attention
    (V2's appendix C): attention is MQA over that one head, its values the latent (the key's first kv_lora_rank
    features), so K and V of the heads are never rebuilt."""

    # Linears whose weight forward reads as a matrix: the absorbed step multiplies by kv_b's halves
    # itself and never calls kv_b while decoding, so smallgpt/quantize.py keeps these in the model's dtype
    matrices: tuple[str, ...] = ("kv_b",)

    def __init__(
        self,
        layer: int,
        n_embd: int,
        n_head: int,
        kv_lora_rank: int,
        rope_dim: int,
        q_lora_rank: int | None,
        latent_norm: bool,
        bias: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, n_head, n_embd // n_head
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        q_dim = n_head * (
            self.head_dim + rope_dim
        )  # each head: head_dim features for the latent's keys, rope_dim
        if q_lora_rank is None:
            self.c_q = Linear(n_embd, q_dim, bias=bias)
        else:
            self.q_a = Linear(n_embd, q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(q_lora_rank)
            self.q_b = Linear(q_lora_rank, q_dim, bias=False)
        self.kv_a = Linear(n_embd, kv_lora_rank + rope_dim, bias=bias)  # [latent | rotary key]
        self.kv_norm = RMSNorm(kv_lora_rank) if latent_norm else nn.Identity()
        self.kv_b = Linear(
            kv_lora_rank, 2 * n_embd, bias=False
        )  # each head's [k | v], head_dim each
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape
        H, hd, R = self.n_head, self.head_dim, self.kv_lora_rank
        q = self.c_q(x) if self.q_lora_rank is None else self.q_b(self.q_norm(self.q_a(x)))
        q = q.view(B, T, H, hd + self.rope_dim).transpose(1, 2)  # (B, H, T, head_dim + rope_dim)
        q, q_rope = q.split((hd, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a(x).split(
            (R, self.rope_dim), dim=-1
        )  # (B, T, R), (B, T, rope_dim)
        latent, k_rope = (
            self.kv_norm(latent),
            k_rope[:, None],
        )  # the rotary key: one head, (B, 1, T, rope_dim)
        if rope is not None:
            q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        dropout_p = self.dropout if self.training else 0.0
        scale = (hd + self.rope_dim) ** -0.5  # as if K held head_dim + rope_dim features a head
        if kv_cache is None:  # K and V of every head from the latent
            k, v = (
                self.kv_b(latent).view(B, T, H, 2, hd).permute(3, 0, 2, 1, 4).unbind(0)
            )  # (B, H, T, head_dim)
            k = torch.cat((k, k_rope.expand(B, H, T, self.rope_dim)), dim=-1)
            y = attention(
                torch.cat((q, q_rope), dim=-1), k, v, mask, dropout_p, cached=False, scale=scale
            )
        else:  # absorbed: q . (W_uk latent) = (q W_uk) . latent, and softmax-weighted latents times W_uv
            key = torch.cat((latent[:, None], k_rope), dim=-1)  # (B, 1, T, R + rope_dim)
            key, _ = kv_cache.update(
                self.layer, key, key[..., :0]
            )  # (B, 1, Tk, R + rope_dim), V: nothing
            w_uk, w_uv = self.kv_b.weight.view(H, 2, hd, R).unbind(
                1
            )  # each head's key and value maps, (H, hd, R)
            q = torch.cat((q @ w_uk, q_rope), dim=-1)  # (B, H, T, R + rope_dim)
            y = (
                attention(q, key, key[..., :R], mask, dropout_p, cached=True, scale=scale) @ w_uv.mT
            )  # (B,H,T,hd)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))
