"""The attention kinds behind one interface to the block and the KV cache, with the rotary positions
and masks they share: CausalSelfAttention (MHA, GQA or MQA, set by its number of K/V heads, with
Qwen3.5's options: an output gate, q/k norms, a rotary fraction) and LatentAttention (Multi-head
Latent Attention, whose cache holds one low-rank latent and one rotary key per token); the masks
also cut a local layer's keys to its window (GPTConfig.window). The cache of every kind of layer
lives here too (KVCache and its kinds: Rows, Ring, and the recurrent layers' Recurrent, which
gated_deltanet.py's layer reads and writes). model.py builds them from GPTConfig.

GQA: https://arxiv.org/abs/2305.13245, MQA: https://arxiv.org/abs/1911.02150, MLA:
https://arxiv.org/abs/2405.04434"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from smallgpt.fast_paths import Linear, attention, joint_linear

NORM_EPS = 1e-5  # every RMSNorm's, as nn.LayerNorm's default (exported as Llama's rms_norm_eps)
RECURRENT = "D"  # a recurrent layer's entry in GPTConfig.layer_windows (it has no window)
Window = int | str | None  # a layer's: None global, an int local, RECURRENT recurrent
Device = torch.device | str


class Cache(Protocol):
    """What a layer needs of a cache: KVCache, or its fixed-shape view StaticKVCache. An attention
    layer writes and reads its keys and values (update), a recurrent one its state (recurrent,
    remember)."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def remember(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None: ...


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


def window_problems(
    window: int | None, pattern: str, block_size: int, key: str = "window_pattern"
) -> list[str]:
    """What is wrong with GPTConfig's local-layer keys, alone and against block_size (GPTConfig
    checks that some layer is local). key: the pattern's name, window_pattern or layer_pattern
    (whose letters may name recurrent layers too, D)."""
    allowed = {"S", "L", "D"} if key == "layer_pattern" else {"S", "L"}
    letters = isinstance(pattern, str) and pattern and set(pattern.upper()) <= allowed
    if not letters:
        if key == "layer_pattern":
            return [
                f"layer_pattern={pattern!r} must be letters L (global attention), S (local "
                "attention, its window) and D (Gated DeltaNet), e.g. 'DDDL'"
            ]
        return [
            f"window_pattern={pattern!r} must be letters S (a local layer) and L (a global one), "
            "e.g. 'SSSL'"
        ]
    if pattern != pattern.upper():
        return [
            f"{key}={pattern!r}: its letters are upper case, "
            f"{key}={pattern.upper()!r} (compare.py's variant names spell them lower "
            "case, e.g. mha-sl8)"
        ]
    if window is None:
        if "S" in pattern:
            return [f"{key}={pattern!r} has local layers (S): give their window"]
        return []
    if type(window) is not int or window < 1:
        return [f"window={window!r} must be a positive integer (the tokens a local layer sees)"]
    if "S" not in pattern:
        return [
            f"window={window} with {key}={pattern!r}: no layer is local; give a pattern "
            "with S, e.g. 'SSSL' (the last layer is always global)"
        ]
    if type(block_size) is int and window >= block_size:
        return [
            f"window={window} is not below block_size={block_size}, so a local layer would see "
            f"what a global one sees: give a window below {block_size}, or leave window out"
        ]
    return []


def pattern_problems(
    window: int | None, window_pattern: str, layer_pattern: str | None, block_size: int
) -> list[str]:
    """What is wrong with the keys that name each layer's kind: window_pattern (S and L), or
    layer_pattern (S, L and D), not both."""
    if layer_pattern is None:
        return window_problems(window, window_pattern, block_size)
    if window_pattern != "L":
        return [
            f"layer_pattern={layer_pattern!r} and window_pattern={window_pattern!r}: give one "
            "(layer_pattern spells window_pattern's S and L too)"
        ]
    return window_problems(window, layer_pattern, block_size, key="layer_pattern")


def gate_problems(attn_gate: str, qk_norm: bool, rope_fraction: float, mla: bool) -> list[str]:
    """What is wrong with the keys of Qwen3.5's attention: its output gate, q/k norms and rotary
    fraction (GPTConfig checks the fraction's rotated width)."""
    problems = []
    if attn_gate not in ("none", "head", "element"):
        problems.append(f"attn_gate={attn_gate!r} must be one of none, head, element")
    if type(qk_norm) is not bool:
        problems.append(f"qk_norm={qk_norm!r} must be True or False")
    elif qk_norm and mla:
        problems.append(
            "qk_norm=True does not apply to MLA (its latent has its own norm, latent_norm): "
            "leave it out"
        )
    if not (isinstance(rope_fraction, int | float) and 0 < rope_fraction <= 1):
        problems.append(f"rope_fraction={rope_fraction!r} must be a number in (0, 1]")
    elif rope_fraction != 1 and mla:
        problems.append(
            f"rope_fraction={rope_fraction} does not apply to MLA (its rotary width is "
            "qk_rope_head_dim): leave it out"
        )
    return problems


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

    @classmethod
    def zeros(
        cls, layers: int, batch_size: int, shape: "CacheShape", device: Device, dtype: torch.dtype
    ) -> "Rows":
        """An empty cache of this kind for `layers` layers (shape: the layers' sizes)."""
        slots = cls.slots(shape.windows, shape.max_len)
        k, v = (
            torch.zeros(layers, batch_size, shape.heads, slots, width, device=device, dtype=dtype)
            for width in (shape.k_width, shape.v_width)
        )
        return cls(k, v)

    @staticmethod
    def owns(window: Window) -> bool:
        """Whether a layer of this window keeps its cache here: a global one."""
        return window is None

    @staticmethod
    def slots(windows: list[Window], max_len: int) -> int:
        """The slots a layer of this kind keeps, in a cache of max_len positions."""
        return max_len

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    @property
    def layers(self) -> int:
        return self.k.size(0)

    def reset(self, rows: torch.Tensor) -> None:
        """Forget what these rows held: nothing to do, the mask hides slots before a row's pad."""

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
    def owns(window: Window) -> bool:
        return isinstance(window, int)

    @staticmethod
    def slots(windows: list[Window], max_len: int) -> int:
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


class Recurrent:
    """The recurrent layers' cache (GatedDeltaNet): each layer's last kernel - 1 inputs of its
    convolution, (layers, B, channels, kernel - 1), and its state S, (layers, B, heads, d_k, d_v),
    in fp32 (a running sum over every token): bytes that do not grow with the context. It holds
    no positions: a prefill from an empty cache starts from zeros, a refill takes the rows' own
    state (recomputed from the tokens they keep) and a shift leaves it as it is."""

    grows = False

    def __init__(self, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.conv = conv
        self.state = state

    @classmethod
    def zeros(
        cls, layers: int, batch_size: int, shape: "CacheShape", device: Device, dtype: torch.dtype
    ) -> "Recurrent":
        s = shape.state
        conv = torch.zeros(layers, batch_size, s.channels, s.kernel - 1, device=device, dtype=dtype)
        size = (layers, batch_size, s.heads, s.key_width, s.value_width)
        return cls(conv, torch.zeros(size, device=device, dtype=torch.float32))

    @staticmethod
    def owns(window: Window) -> bool:
        return window == RECURRENT

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.state

    @property
    def layers(self) -> int:
        return self.conv.size(0)

    def read(self, i: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's convolution inputs and state before position start: zeros at 0 (whatever
        an earlier sequence left)."""
        if start == 0:
            return torch.zeros_like(self.conv[i]), torch.zeros_like(self.state[i])
        return self.conv[i], self.state[i]

    def write(self, i: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.conv[i] = conv
        self.state[i] = state

    def splice(self, rows: torch.Tensor, start: int, own: "Recurrent", count: int) -> None:
        """These rows take own's state: what the rows' own tokens left (the positions mean
        nothing to a state)."""
        self.conv[:, rows] = own.conv
        self.state[:, rows] = own.state

    def shift(self, by: int, end: int) -> None:
        """Nothing moves: the positions dropped are slots no row sees, never in a state."""

    def reset(self, rows: torch.Tensor) -> None:
        """These rows start again from nothing (a row whose context slid to a single token)."""
        self.conv[:, rows] = 0
        self.state[:, rows] = 0


# The kinds of cache, one per kind of layer: a layer keeps its cache in the first that owns its
# window (None: global, an int: local, RECURRENT: a recurrent layer).
KINDS = (Rows, Ring, Recurrent)


def owner(window: Window) -> int:
    """The index in KINDS of the kind that keeps a layer of this window's cache."""
    return next(i for i, kind in enumerate(KINDS) if kind.owns(window))


@dataclass(frozen=True)
class StateShape:
    """A recurrent layer's cache sizes: its convolution's channels (q, k and v of every head) and
    kernel, and its state's heads, key and value widths."""

    channels: int
    kernel: int
    heads: int
    key_width: int
    value_width: int


NO_STATE = StateShape(0, 1, 0, 0, 0)  # a model without recurrent layers


@dataclass(frozen=True)
class CacheShape:
    """The sizes every kind of cache is made from: each layer's window (KINDS), the positions,
    an attention layer's heads and K/V widths (GPTConfig.cache_layout), a recurrent one's
    state."""

    windows: tuple[Window, ...]
    max_len: int
    heads: int
    k_width: int
    v_width: int
    state: StateShape = NO_STATE


class KVCache:
    """Preallocated K and V of every attention layer, laid out as GPTConfig.cache_layout says: K/V
    heads un-repeated (MHA/GQA/MQA), or MLA's one head of [latent | rotary key]; and a recurrent
    layer's state. Each kind of layer keeps its own (`kinds`): the global layers' Rows, the local
    layers' Ring, the recurrent layers' Recurrent. `pos` counts positions written; GPT.forward
    advances it once per call, after the last layer. zeros() makes an empty one. Only this module
    reads or writes the tensors: the engine calls the methods below."""

    def __init__(
        self, kinds: tuple[Rows | Recurrent, ...], shape: CacheShape, pos: int = 0
    ) -> None:
        self.kinds = kinds  # one of each of KINDS
        self.shape = shape
        self.max_len = kinds[0].k.size(3)  # the global layers' slots
        # a local layer's slots, 0 without one (its masks: attention_mask's ring)
        self.ring = next((kind.size for kind in kinds if isinstance(kind, Ring)), 0)
        self.where = []  # each layer's kind and its index among that kind's layers
        seen = [0] * len(KINDS)
        for window in shape.windows:
            kind = owner(window)
            self.where.append((kind, seen[kind]))
            seen[kind] += 1
        self.windows = shape.windows
        self.pos = pos

    @classmethod
    def zeros(
        cls, shape: CacheShape, batch_size: int, device: Device, dtype: torch.dtype
    ) -> "KVCache":
        """An empty cache of these sizes (the local layers share one window)."""
        owners = [owner(window) for window in shape.windows]
        kinds = tuple(
            kind.zeros(owners.count(i), batch_size, shape, device, dtype)
            for i, kind in enumerate(KINDS)
        )
        return cls(kinds, shape)

    @classmethod
    def of_tensors(cls, tensors: list[torch.Tensor], shape: CacheShape) -> "KVCache":
        """A cache over tensors (those of tensors(), e.g. a compiled step's inputs)."""
        kinds = tuple(kind(*tensors[2 * i : 2 * i + 2]) for i, kind in enumerate(KINDS))
        return cls(kinds, shape)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache: the inputs of a compiled step (of_tensors builds it back)."""
        return [t for kind in self.kinds for t in kind.tensors()]

    def grows(self) -> list[bool]:
        """For each of tensors(): whether its slots are the cache's length."""
        return [kind.grows for kind in self.kinds for _ in kind.tensors()]

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

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A recurrent layer's convolution inputs (B, channels, kernel - 1) and state (B, heads,
        d_k, d_v) before pos (Recurrent.read)."""
        kind, i = self.where[layer]
        return self.kinds[kind].read(i, self.pos)

    def remember(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """A recurrent layer's convolution inputs and state after the tokens at hand."""
        kind, i = self.where[layer]
        self.kinds[kind].write(i, conv, state)

    def refill(self, rows: list[int], own: "KVCache | None") -> None:
        """Write own (a cache of these rows alone, its positions from 0) into these rows,
        right-aligned at pos: own's last position goes at pos - 1. None: the rows start again
        from nothing (their slots before pos are hidden by their pad)."""
        at = torch.tensor(rows, device=self.device)
        if own is None:
            for kind in self.kinds:
                kind.reset(at)
            return
        for mine, theirs in zip(self.kinds, own.kinds, strict=True):
            if theirs.layers:
                mine.splice(at, self.pos - own.pos, theirs, own.pos)

    def shift(self, by: int) -> None:
        """Move every layer's positions left by `by` (slots no row sees), making room at the end."""
        for kind in self.kinds:
            if kind.layers:
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
    the unwritten ones); a recurrent layer's state read and written whole. masks: what the query
    at pos sees, for each window (a recurrent layer's: None, every row is real)."""

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
        self.masks[RECURRENT] = None
        if cache.ring:  # a local layer's ring: the positions its slots hold
            window = next(w for w in cache.windows if isinstance(w, int))
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

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kind_index, i = self.cache.where[layer]
        kind = self.cache.kinds[kind_index]
        return kind.conv[i], kind.state[i]

    def remember(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """Written in place with index_put_ (a compiled step's inputs, not a copy of them)."""
        kind_index, i = self.cache.where[layer]
        kind = self.cache.kinds[kind_index]
        at = (torch.full((), i, device=conv.device),)
        kind.conv.index_put_(at, conv.to(kind.conv.dtype))
        kind.state.index_put_(at, state)


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


def real_tokens(
    T: int, start: int, pad: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """A recurrent layer's mask (B, T) of the tokens at start..start+T-1: True where a row's token
    is real, False on its left padding (pad[b] slots of row b); None without padding."""
    if pad is None:
        return None
    return torch.arange(start, start + T, device=device)[None, :] >= pad[:, None]


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


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x (B, heads, T, head_dim) with its first features rotated (as many as the rotary tables
    hold: all of them, or a rope_fraction's), the others as they are."""
    if rope is None:
        return x
    rotated = 2 * rope[0].size(-1)
    if rotated == x.size(-1):
        return apply_rope(x, *rope)
    return torch.cat((apply_rope(x[..., :rotated], *rope), x[..., rotated:]), dim=-1)


class OutputGate(nn.Module):
    """Gated Attention (arXiv 2505.06708): attention's output times sigmoid of a projection of the
    layer's input, one gate a head ('head') or a feature ('element', Qwen3.5's)."""

    def __init__(self, n_embd: int, n_head: int, kind: str, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_gate = Linear(n_embd, n_embd if kind == "element" else n_head, bias=bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (B, T, n_head, head_dim) gated by x (B, T, n_embd)."""
        B, T, _ = x.shape
        gate = self.c_gate(x).view(B, T, self.n_head, -1)  # (B, T, n_head, head_dim or 1)
        return y * torch.sigmoid(gate)


def output_gate(n_embd: int, n_head: int, kind: str, bias: bool) -> OutputGate | None:
    """The gate GPTConfig.attn_gate names, or None ('none')."""
    return None if kind == "none" else OutputGate(n_embd, n_head, kind, bias)


# The GPTConfig keys an attention layer reads beyond the model's own (its sizes, norm, MLP and kind
# of positions): its K/V heads or MLA's latents (CausalSelfAttention, LatentAttention), Qwen3.5's
# options, and the rotary tables' base and fraction. model.py's LAYER_KINDS names them for L and
# S, and GPTConfig refuses each where no layer of the pattern reads it.
READS = frozenset(
    {
        "n_kv_head",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "q_lora_rank",
        "latent_norm",
        "attn_gate",
        "qk_norm",
        "rope_theta",
        "rope_fraction",
    }
)
LOCAL_READS = READS | {"window"}  # a local layer's: an attention layer's and its window


class CausalSelfAttention(nn.Module):
    """n_head query heads over n_kv_head K/V heads: MHA (equal), GQA (a divisor), MQA (one);
    optionally q and k RMS-normalised per head before their rotation (qk_norm, as Qwen3's) and
    the output gated (OutputGate)."""

    def __init__(
        self,
        layer: int,
        n_embd: int,
        n_head: int,
        n_kv_head: int,
        bias: bool,
        dropout: float,
        qk_norm: bool = False,
        gate: str = "none",
    ) -> None:
        super().__init__()
        self.layer, self.n_head, self.n_kv_head = layer, n_head, n_kv_head
        self.head_dim = n_embd // n_head
        kv_dim = n_kv_head * self.head_dim
        self.c_q = Linear(n_embd, n_embd, bias=bias)
        self.c_k = Linear(n_embd, kv_dim, bias=bias)
        self.c_v = Linear(n_embd, kv_dim, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim)
            self.k_norm = RMSNorm(self.head_dim)
        self.qk_norm = qk_norm
        self.gate = output_gate(n_embd, n_head, gate, bias)
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape  # C is n_embd
        H, G, hd = self.n_head, self.n_kv_head, self.head_dim
        if kv_cache is None and rope is not None and not self.qk_norm:
            # q, k and v as one product, q and k rotated as one
            qkv = (
                joint_linear(x, self.c_q, self.c_k, self.c_v)
                .view(B, T, H + 2 * G, hd)
                .transpose(1, 2)
            )
            qk, v = qkv.split((H + G, G), dim=1)
            q, k = rotate(qk, rope).split((H, G), dim=1)
        else:
            # each Linear on its own: decoding's few-row products (fast_paths.Linear), and faster on
            # CUDA without RoPE (docs/performance-cpu.md "Training")
            q = self.c_q(x).view(B, T, H, hd)
            k = self.c_k(x).view(B, T, G, hd)
            v = self.c_v(x).view(B, T, G, hd).transpose(1, 2)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q.transpose(1, 2), rope), rotate(k.transpose(1, 2), rope)
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer, k, v)  # (B, n_kv_head, Tk, head_dim)
        # q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, Tk, head_dim)
        dropout_p = self.dropout if self.training else 0.0
        y = attention(q, k, v, mask, dropout_p, cached=kv_cache is not None)
        y = y.transpose(1, 2)  # (B, T, n_head, head_dim)
        if self.gate is not None:
            y = self.gate(x, y)
        y = y.contiguous().view(B, T, C)  # (B, T, n_embd)
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
        gate: str = "none",
    ) -> None:
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, n_head, n_embd // n_head
        self.gate = output_gate(n_embd, n_head, gate, bias)
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
        y = y.transpose(1, 2)  # (B, T, n_head, head_dim)
        if self.gate is not None:
            y = self.gate(x, y)
        y = y.reshape(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))
