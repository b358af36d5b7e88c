"""The attention kinds behind one interface to the block and the KV cache, with the rotary positions
and masks they share: CausalSelfAttention (MHA, GQA or MQA, set by its number of K/V heads) and
LatentAttention (Multi-head Latent Attention, whose cache holds one low-rank latent and one rotary
key per token); the masks also cut a local layer's keys to its window (GPTConfig.window). model.py
builds them from GPTConfig.

GQA: https://arxiv.org/abs/2305.13245, MQA: https://arxiv.org/abs/1911.02150, MLA:
https://arxiv.org/abs/2405.04434"""

from typing import Protocol

import torch
import torch.nn as nn

from smallgpt.fast_paths import Linear, attention, joint_linear

NORM_EPS = 1e-5  # every RMSNorm's, as nn.LayerNorm's default (exported as Llama's rms_norm_eps)


class Cache(Protocol):
    """What attention needs of a cache: KVCache, or its fixed-shape view StaticKVCache."""

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
            f"qk_rope_head_dim={rope!r} must be a positive integer with pos_encoding='rope', "
            "0 with 'learned'"
        )
    if n_kv_head != n_head:
        problems.append(
            f"n_kv_head={n_kv_head} does not apply to MLA (every head has its own K and V, made "
            "from the latent): leave it out"
        )
    if problems or type(n_embd) is not int or type(n_head) is not int or n_head < 1:
        return problems
    head_dim = n_embd // n_head
    if rope > head_dim:
        problems.append(
            f"qk_rope_head_dim={rope} is wider than a head (head_dim={head_dim}): give at most "
            f"{head_dim}"
        )
    elif kv_lora_rank + rope >= 2 * n_embd:  # MHA caches 2 n_embd features a token and layer
        problems.append(
            f"kv_lora_rank={kv_lora_rank} with qk_rope_head_dim={rope} caches "
            f"{kv_lora_rank + rope} features a token, not fewer than the {2 * n_embd} of the K and "
            f"V it replaces (2 n_embd): give kv_lora_rank below {2 * n_embd - rope}"
        )
    return problems


def window_problems(window: int | None, pattern: str, block_size: int) -> list[str]:
    """What is wrong with GPTConfig's local-layer keys, alone and against block_size (GPTConfig
    checks that some layer is local)."""
    letters = isinstance(pattern, str) and pattern and set(pattern) <= {"s", "l", "S", "L"}
    if not letters:
        return [
            f"window_pattern={pattern!r} must be letters S (a local layer) and L (a global one), "
            "e.g. 'SSSL'"
        ]
    if pattern != pattern.upper():
        return [
            f"window_pattern={pattern!r}: its letters are upper case, "
            f"window_pattern={pattern.upper()!r} (compare.py's variant names spell them lower "
            "case, e.g. mha-sl8)"
        ]
    if window is None:
        if "S" in pattern:
            return [f"window_pattern={pattern!r} has local layers (S): give their window"]
        return []
    if type(window) is not int or window < 1:
        return [f"window={window!r} must be a positive integer (the tokens a local layer sees)"]
    if "S" not in pattern:
        return [
            f"window={window} with window_pattern={pattern!r}: no layer is local; give a pattern "
            "with S, e.g. 'SSSL' (the last layer is always global)"
        ]
    if type(block_size) is int and window >= block_size:
        return [
            f"window={window} is not below block_size={block_size}, so a local layer would see "
            f"what a global one sees: give a window below {block_size}, or leave window out"
        ]
    return []


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm with this project's epsilon, computed in its weight's dtype: under
    autocast a bf16 input would miss the fused kernel (and warn)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, eps=NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


class Rows:
    """The global layers' cache: K and V of every such layer, (layers, B, heads, max_len, width),
    position p at slot p. MLA's is one head of [latent | rotary key] and V of no width
    (LatentAttention: its values are the latent)."""

    grows = True  # its slots are the cache's length (a compiled step's dynamic size)

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k
        self.v = v

    @staticmethod
    def owns(window: int | None) -> bool:
        """Whether a layer of this window keeps its cache here: a global one."""
        return window is None

    @staticmethod
    def slots(windows: list[int | None], max_len: int) -> int:
        """The slots a layer of this kind keeps, in a cache of max_len positions."""
        return max_len

    def update(
        self, i: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer i's k, v (B, heads, T, width) at start; return its keys and values so far."""
        end = start + k.size(2)
        self.k[i, :, :, start:end] = k
        self.v[i, :, :, start:end] = v
        return self.k[i, :, :, :end], self.v[i, :, :, :end]  # (B, heads, end, width)

    def slot(self, pos: torch.Tensor) -> torch.Tensor:
        """The slot of the position held in pos (a 1-element tensor), for the static step."""
        return pos

    def read(self, i: int, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values for the static step: its first length slots, or all."""
        k = self.k[i]
        v = self.v[i]
        if length is None:
            return k, v
        return k.narrow(2, 0, length), v.narrow(2, 0, length)

    def splice(self, rows: torch.Tensor, start: int, own: "Rows", count: int) -> None:
        """Write own's first count positions (a cache of the rows alone, filled from position 0)
        at start.. in those rows of this one."""
        end = start + count
        self.k[:, rows, :, start:end] = own.k[..., :count, :]
        self.v[:, rows, :, start:end] = own.v[..., :count, :]

    def shift(self, by: int, end: int) -> None:
        """Move the positions by..end to 0..end - by (the slots no row sees are dropped)."""
        for t in (self.k, self.v):
            t[..., : end - by, :] = t[..., by:end, :].clone()


class Ring(Rows):
    """The local layers' cache: a ring of `size` slots a layer, (layers, B, heads, size, width),
    position p at slot p % size, so that it holds the newest positions, all a window sees."""

    grows = False  # its slots are the window's, whatever the cache's length

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__(k, v)
        self.size = k.size(3)

    @staticmethod
    def owns(window: int | None) -> bool:
        return window is not None

    @staticmethod
    def slots(windows: list[int | None], max_len: int) -> int:
        local = [w for w in windows if KINDS[owner(w)] is Ring]
        assert len(set(local)) <= 1, f"one window for every local layer, not {sorted(set(local))}"
        return min(local[0], max_len) if local else 0

    def update(
        self, i: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer i's k, v (B, heads, T, width) at start; return the keys and values it
        attends over, in slot order (their positions: attention_mask's `ring`): after the write
        for one token; before it, then the chunk's own, for a chunk (whose writes would overwrite
        keys its first queries see); only the chunk's from an empty cache."""
        T = k.size(2)
        ring_k = self.k[i]  # (B, heads, size, width)
        ring_v = self.v[i]
        if T == 1:
            ring_k[:, :, start % self.size] = k[:, :, 0]
            ring_v[:, :, start % self.size] = v[:, :, 0]
            if start == 0:
                return k, v
            return ring_k, ring_v
        if start == 0:
            seen = (k, v)
        else:
            seen = (torch.cat((ring_k, k), dim=2), torch.cat((ring_v, v), dim=2))
        n = min(T, self.size)  # the chunk's newest n tokens are kept
        slots = torch.arange(start + T - n, start + T, device=k.device) % self.size
        ring_k.index_copy_(2, slots, k[:, :, T - n :])
        ring_v.index_copy_(2, slots, v[:, :, T - n :])
        return seen

    def slot(self, pos: torch.Tensor) -> torch.Tensor:
        return pos % self.size

    def read(self, i: int, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]  # the whole ring: every slot written is in the window

    def splice(self, rows: torch.Tensor, start: int, own: "Ring", count: int) -> None:
        """Write the positions own's ring holds (the newest of count, filled from position 0 for
        the rows alone) at their slots in those rows of this one, where they are start.. ."""
        held = torch.arange(count - own.size, count, device=rows.device)  # own's positions
        for mine, theirs in ((self.k, own.k), (self.v, own.v)):
            rings = mine[:, rows]  # (layers, rows, heads, size, width)
            rings[:, :, :, (start + held) % self.size] = theirs[:, :, :, held % own.size]
            mine[:, rows] = rings

    def shift(self, by: int, end: int) -> None:
        """Turn the ring so that each position sits at its slot once positions move left by by."""
        for t in (self.k, self.v):
            t.copy_(t.roll(-by, dims=3))


# The kinds of cache, one per kind of layer: a layer keeps its cache in the first that owns its
# window. A new kind of layer (a fixed recurrent state) adds its class here.
KINDS = (Rows, Ring)


def owner(window: int | None) -> int:
    """The index in KINDS of the kind that keeps a layer of this window's cache."""
    return next(i for i, kind in enumerate(KINDS) if kind.owns(window))


class KVCache:
    """Preallocated K and V of every layer, laid out as GPTConfig.cache_layout says: K/V heads
    un-repeated (MHA/GQA/MQA), or MLA's one head of [latent | rotary key]. Each kind of layer keeps
    its own (`kinds`): the global layers' Rows, the local layers' Ring. `pos` counts positions
    written; GPT.forward advances it once per call, after the last layer. zeros() makes an empty
    one. Only this module reads or writes the tensors: the engine calls the methods below."""

    def __init__(self, kinds: tuple[Rows, ...], windows: list[int | None], pos: int = 0) -> None:
        self.kinds = kinds  # one of each of KINDS
        self.max_len = kinds[0].k.size(3)
        # a local layer's slots, 0 without one (its masks: attention_mask's ring)
        self.ring = next((kind.size for kind in kinds if isinstance(kind, Ring)), 0)
        self.where = []  # each layer's kind and its index among that kind's layers
        seen = [0] * len(KINDS)
        for window in windows:
            kind = owner(window)
            self.where.append((kind, seen[kind]))
            seen[kind] += 1
        self.windows = windows
        self.pos = pos

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
        """An empty cache of max_len positions for layers of these windows (None: global; the
        local ones share one)."""
        kinds = []
        owners = [owner(window) for window in windows]
        for i, kind in enumerate(KINDS):
            layers = owners.count(i)
            slots = kind.slots(windows, max_len)
            k, v = (
                torch.zeros(layers, batch_size, heads, slots, width, device=device, dtype=dtype)
                for width in (k_width, v_width)
            )
            kinds.append(kind(k, v))
        return cls(tuple(kinds), windows)

    @classmethod
    def of_tensors(cls, tensors: list[torch.Tensor], windows: list[int | None]) -> "KVCache":
        """A cache over tensors (those of tensors(), e.g. a compiled step's inputs)."""
        kinds = tuple(kind(*tensors[2 * i : 2 * i + 2]) for i, kind in enumerate(KINDS))
        return cls(kinds, windows)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache: the inputs of a compiled step (of_tensors builds it back)."""
        return [t for kind in self.kinds for t in (kind.k, kind.v)]

    def grows(self) -> list[bool]:
        """For each of tensors(): whether its slots are the cache's length."""
        return [kind.grows for kind in self.kinds for _ in (kind.k, kind.v)]

    def example(self, length: int) -> list[torch.Tensor]:
        """Tensors shaped as tensors() for a cache of `length` positions (to export a step on)."""
        tensors = self.tensors()
        for i, grows in enumerate(self.grows()):
            if grows:
                t = tensors[i]
                tensors[i] = t.new_zeros(*t.shape[:3], length, t.size(4))
        return tensors

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.kinds[0].k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kinds[0].k.dtype

    @property
    def batch_size(self) -> int:
        return self.kinds[0].k.size(1)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, heads, T, width) at pos; return the keys and values the layer attends
        over: a global layer's from 0 to pos + T, a local layer's ring (Ring.update)."""
        kind, i = self.where[layer]
        return self.kinds[kind].update(i, self.pos, k, v)

    def refill(self, rows: list[int], own: "KVCache") -> None:
        """Write own (a cache of these rows alone, its positions from 0) into these rows,
        right-aligned at pos: own's last position goes at pos - 1."""
        at = torch.tensor(rows, device=self.device)
        for mine, theirs in zip(self.kinds, own.kinds, strict=True):
            if theirs.k.size(0) and theirs.k.size(3):  # layers of the kind, and slots
                mine.splice(at, self.pos - own.pos, theirs, own.pos)

    def shift(self, by: int) -> None:
        """Move every layer's positions left by `by` (slots no row sees), making room at the end."""
        for kind in self.kinds:
            if kind.k.size(0):
                kind.shift(by, self.pos)
        self.pos -= by

    def static(self, pos: torch.Tensor, length: int | None) -> "StaticKVCache":
        """This cache as the fixed-shape one-token step reads it (StaticKVCache)."""
        return StaticKVCache(self, pos, length)


class StaticKVCache:
    """A KVCache as the fixed-shape one-token step (static_step.decode_static) uses it: K/V written
    at a position held in a 1-element tensor (a local layer's at its ring slot), in place into the
    cache's tensors (not a view of them, which a compiled step would copy whole), and read whole: a
    global layer's first `length` positions, or all max_len when length is None (the step masks
    the unwritten ones). masks: what the query at pos sees, for each window."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, length: int | None) -> None:
        self.cache = cache
        self.length = length
        self.pos = pos
        device = pos.device
        batch = torch.arange(cache.batch_size, device=device)[:, None]
        heads = torch.arange(cache.kinds[0].k.size(2), device=device)[None, :]
        self.rows = (batch, heads)  # (B, heads) slots of one position
        # what the query at pos sees (visible): a global layer's slots hold positions 0..; over
        # its first `length` slots it sees them all (no mask)
        keys = torch.arange(length or cache.max_len, device=device)
        self.masks = {None: None if length else visible(pos, keys, None)[None, None, None, :]}
        if cache.ring:  # a local layer's ring: the positions its slots hold
            window = next(w for w in cache.windows if w is not None)
            held = ring_positions(pos + 1, cache.ring, device)
            self.masks[window] = visible(pos, held, window)[None, None, None, :]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kind_index, i = self.cache.where[layer]
        kind = self.cache.kinds[kind_index]
        at = (torch.full((), i, device=k.device), *self.rows, kind.slot(self.pos))
        kind.k.index_put_(at, k[:, :, 0])
        if v.size(-1):  # MLA's cache has no V (its values are the latent, in K)
            kind.v.index_put_(at, v[:, :, 0])
        return kind.read(i, self.length)


Rope = tuple[torch.Tensor, torch.Tensor] | None  # the rotary cos and sin at the positions at hand
Mask = torch.Tensor | None  # bool (B or 1, 1, T, Tk), True where a query sees a key


def rope_tables(dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin (https://arxiv.org/abs/2104.09864) for `dim` rotated features, each
    (length, dim // 2)."""
    inv_freq = theta ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim // 2,)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, dim) half by half in fp32; cos, sin are (B or 1, 1, T, dim // 2). A
    bf16 x is made fp32 first: products of one dtype run vectorised, mixed ones do not
    (docs/performance-cpu.md "Training")."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def ring_positions(end: int | torch.Tensor, ring: int, device: torch.device) -> torch.Tensor:
    """The position each slot of a ring of `ring` slots holds (KVCache: position p at slot p %
    ring) once positions below end are written: the newest such, negative where none is yet. end:
    an int or a 1-element tensor."""
    last = end - 1
    return last - (last - torch.arange(ring, device=device)).remainder(ring)  # (ring,)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The one rule of every mask: a query sees a key at its position or before it, written
    (a ring slot not written yet holds a negative position), and within its window if it has one."""
    mask = (key_pos <= query_pos) & (key_pos >= 0)
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    return mask


def attention_mask(
    T: int,
    start: int,
    pad: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
    ring: int | None = None,
) -> Mask:
    """The mask (B or 1, 1, T, Tk) of queries at start..start+T-1 over the keys at 0..start+T-1,
    or None where none is needed: a causal block from an empty cache, or one token without
    padding (SDPA's is_causal aligns top-left), that no window cuts. Left padding (pad[b] slots
    in row b) is hidden from real queries; a pad query sees only itself, so no row is fully
    masked (which gives NaNs). window (a local layer's): a query sees only itself and the window
    - 1 slots before it. ring: the slots of a local layer's cache (KVCache), whose keys are then
    the ring's slots, for a chunk followed by its own."""
    # the keys KVCache.update returns: the ring's slots (then a chunk's own)
    if ring is not None and start > 0:
        # every slot written: all of them in the window
        if T == 1 and pad is None and start + 1 >= ring:
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
    mask = visible(query_pos, key_pos, window)  # (T, Tk)
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
        # q, k and v as one product, q and k rotated as one
        if kv_cache is None and rope is not None:
            qkv = (
                joint_linear(x, self.c_q, self.c_k, self.c_v)
                .view(B, T, H + 2 * G, hd)
                .transpose(1, 2)
            )
            qk, v = qkv.split((H + G, G), dim=1)
            q, k = apply_rope(qk, *rope).split((H, G), dim=1)
        else:
            # each Linear on its own: decoding's few-row products (fast_paths.Linear), and faster on
            # CUDA without RoPE (docs/performance-cpu.md "Training")
            q = self.c_q(x).view(B, T, H, hd).transpose(1, 2)
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
    """Multi-head Latent Attention (DeepSeek-V2, section 2.1): K and V of every head are
    up-projected (kv_b) from one latent of kv_lora_rank features a token, and positions ride on
    rope_dim extra query/key features, the rotary key shared by the heads (decoupled RoPE); the
    latent carries no position. Queries come from x directly, or through their own latent of
    q_lora_rank. Names follow DeepSeek's (q_a, q_b, kv_a, kv_b) where GPT-2's have no match.

    Training builds K and V from the latent. With a cache (decoding), the cache holds [latent |
    rotary key] as one K head and nothing as V, and kv_b's key half is folded into the query and
    its value half applied after attention (V2's appendix C): attention is MQA over that one
    head, its values the latent (the key's first kv_lora_rank features), so K and V of the heads
    are never rebuilt."""

    # Linears whose weight forward reads as a matrix: the absorbed step multiplies by kv_b's halves
    # itself and never calls kv_b while decoding, so smallgpt/quantize.py keeps these in the model's
    # dtype
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
        # the rotary key: one head, (B, 1, T, rope_dim)
        latent, k_rope = (self.kv_norm(latent), k_rope[:, None])
        if rope is not None:
            q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        dropout_p = self.dropout if self.training else 0.0
        scale = (hd + self.rope_dim) ** -0.5  # as if K held head_dim + rope_dim features a head
        if kv_cache is None:
            # K and V of every head from the latent, each (B, H, T, head_dim)
            kv = self.kv_b(latent).view(B, T, H, 2, hd)
            k, v = kv.permute(3, 0, 2, 1, 4).unbind(0)
            k = torch.cat((k, k_rope.expand(B, H, T, self.rope_dim)), dim=-1)
            q = torch.cat((q, q_rope), dim=-1)
            y = attention(q, k, v, mask, dropout_p, cached=False, scale=scale)
        else:
            # absorbed: q . (W_uk latent) = (q W_uk) . latent, then the softmax-weighted latents
            # times W_uv. The cache holds [latent | rotary key], one head, and no V.
            key = torch.cat((latent[:, None], k_rope), dim=-1)  # (B, 1, T, R + rope_dim)
            key, _ = kv_cache.update(self.layer, key, key[..., :0])  # (B, 1, Tk, R + rope_dim)
            # each head's key and value maps, (H, hd, R)
            w_uk, w_uv = self.kv_b.weight.view(H, 2, hd, R).unbind(1)
            q = torch.cat((q @ w_uk, q_rope), dim=-1)  # (B, H, T, R + rope_dim)
            latents = attention(q, key, key[..., :R], mask, dropout_p, cached=True, scale=scale)
            y = latents @ w_uv.mT  # (B, H, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))
