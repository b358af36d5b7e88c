"""The cache a model decodes with: each layer's keys and values (or its recurrent state) kept
between calls, so that a new token is computed from what the earlier ones left instead of from
the whole context again.

A kind of layer says what it keeps by a spec (LayerKind.cache_spec): every position's K/V rows
(RowsSpec), a ring of the newest ones (RingSpec: a local layer sees no further back), or a fixed
state (StateSpec: a recurrent layer). Layers of equal specs share one stacked store (KVRows,
KVRing, States), and KVCache routes each layer to its store. Only this module reads or writes
the stores' tensors: the layers and the decoding engine call the methods below."""

from dataclasses import dataclass
from typing import Protocol

import torch

Device = torch.device | str


class Cache(Protocol):
    """What a layer asks of a cache (KVCache, or its fixed-shape view StaticKVCache): an
    attention layer writes its keys and values and reads those it attends over (update); a
    recurrent one reads its state before the tokens at hand and writes it after them."""

    # K/V: write these tokens' keys and values, get back every key and value the layer attends over
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # a state: the one before these tokens (zeros at position 0), its tensors in the spec's order
    def read_state(self, layer: int) -> tuple[torch.Tensor, ...]: ...

    # the state after these tokens, its tensors in the order read_state gave them
    def write_state(self, layer: int, *state: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class RowsSpec:
    """K/V rows of every position: heads a token, the widths of a key and of a value (MLA keeps
    one head of [latent | rotary key] and values of no width)."""

    heads: int
    k_width: int
    v_width: int

    def slots(self, max_len: int) -> int:
        """The positions a layer keeps in a cache of max_len."""
        return max_len

    def nbytes(self, seq_len: int, dtype: torch.dtype) -> int:
        """One layer's bytes for one sequence of seq_len positions."""
        # the features of one position: every head's key and value
        features = self.heads * (self.k_width + self.v_width)
        # slots() is a ring's window for a local layer: its bytes stop growing past it
        return self.slots(seq_len) * features * dtype.itemsize

    tensor_count = 2  # K and V

    def wrap(self, tensors: list[torch.Tensor]) -> "KVRows":
        """The store over these tensors (a compiled step's inputs)."""
        return KVRows(*tensors)  # [K, V], as tensors() lists them

    def zeros(
        self, layers: int, batch_size: int, max_len: int, device: Device, dtype: torch.dtype
    ) -> "KVRows":
        """An empty store for `layers` such layers."""
        slots = self.slots(max_len)
        # K and V each (layers, B, heads, slots, width): this spec's layers stacked, a slice each
        k, v = (
            torch.zeros(layers, batch_size, self.heads, slots, width, device=device, dtype=dtype)
            for width in (self.k_width, self.v_width)
        )
        return KVRows(k, v)


@dataclass(frozen=True)
class RingSpec(RowsSpec):
    """K/V rows of the newest `window` positions: all that a layer seeing no further back needs."""

    window: int

    def slots(self, max_len: int) -> int:
        # a window longer than the cache needs no more slots than the cache has positions
        return min(self.window, max_len)

    def wrap(self, tensors: list[torch.Tensor]) -> "KVRing":
        return KVRing(*tensors)

    def zeros(
        self, layers: int, batch_size: int, max_len: int, device: Device, dtype: torch.dtype
    ) -> "KVRing":
        # the same tensors as every position's rows, only fewer slots: KVRing reads them by p % size
        rows = super().zeros(layers, batch_size, max_len, device, dtype)
        return KVRing(rows.k, rows.v)


@dataclass(frozen=True)
class StateSpec:
    """A fixed state, whatever the context's length: one tensor of each shape a sequence, in the
    cache's dtype, or at least float32 where `fp32` says so (a running sum over every token: a
    float64 cache keeps it in float64)."""

    shapes: tuple[tuple[int, ...], ...]
    fp32: tuple[bool, ...]

    @property
    def tensor_count(self) -> int:
        return len(self.shapes)

    def wrap(self, tensors: list[torch.Tensor]) -> "States":
        return States(tensors)

    def nbytes(self, seq_len: int, dtype: torch.dtype) -> int:
        # as zeros() allocates: a wide tensor at least 4 bytes an element, 8 in a float64 cache
        total = 0
        for shape, fp32 in zip(self.shapes, self.fp32, strict=True):
            itemsize = max(4, dtype.itemsize) if fp32 else dtype.itemsize
            total += itemsize * torch.Size(shape).numel()
        return total

    def zeros(
        self, layers: int, batch_size: int, max_len: int, device: Device, dtype: torch.dtype
    ) -> "States":
        # float32 for the running sums, float64 where the whole cache is (never narrower than dtype)
        wide = torch.promote_types(dtype, torch.float32)
        # each (layers, B, *shape) in the spec's order: Gated DeltaNet's conv inputs, then state
        tensors = [
            torch.zeros(layers, batch_size, *shape, device=device, dtype=wide if fp32 else dtype)
            for shape, fp32 in zip(self.shapes, self.fp32, strict=True)
        ]
        return States(tensors)


Spec = RowsSpec | StateSpec


class KVRows:
    """The K and V of some layers at every position: (layers, B, heads, slots, width), position p
    at slot p."""

    grows = True  # its slots are the cache's length (a compiled step's dynamic size)

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # k (layers, B, heads, slots, width); v the same, or of width 0 (MLA keeps no V)
        self.k = k
        self.v = v

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    @property
    def layers(self) -> int:
        return self.k.size(0)

    @property
    def slots(self) -> int:
        return self.k.size(3)

    def update(
        self, i: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer i's k, v (B, heads, T, width) at start; return its keys and values so far."""
        # the new positions go at their slots, then the layer attends over all written so far
        end = start + k.size(2)
        self.k[i, :, :, start:end] = k
        self.v[i, :, :, start:end] = v
        # views of the store, cut at end: the slots after it hold nothing of this sequence yet
        return self.k[i, :, :, :end], self.v[i, :, :, :end]  # (B, heads, end, width)

    def slot(self, pos: torch.Tensor) -> torch.Tensor:
        """The slot of the position held in pos (a 1-element tensor), for the static step."""
        return pos  # position p at slot p: the slot is the position itself

    def put(self, i: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write layer i's k, v of one token (B, heads, 1, width) at the position held in pos,
        in place with index_put_ (a compiled step's inputs, not copies of them)."""
        # every (row, head) at the slot of pos, indexed by tensors: no host sync, one shape
        batch = torch.arange(k.size(0), device=k.device)[:, None]
        heads = torch.arange(k.size(1), device=k.device)[None, :]
        # i as a 0-d tensor too (index_put_ takes only tensors); batch, heads and the slot (1,)
        # broadcast to (B, heads): one place a row and head, at layer i
        at = (torch.full((), i, device=k.device), batch, heads, self.slot(pos))
        # the one token's rows, (B, heads, width): one for each of those places
        self.k.index_put_(at, k[:, :, 0])
        if v.size(-1):  # MLA's cache has no V (its values are the latent, in K)
            self.v.index_put_(at, v[:, :, 0])

    def view(self, i: int, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values for the static step: its first length slots, or all."""
        k = self.k[i]
        v = self.v[i]
        # None: all max_len slots, under the step's mask (the CUDA graph's fixed shapes)
        if length is None:
            return k, v
        # a length: the compiled CPU step's global layers read the filled positions only, narrowed
        # as views (its one dynamic size)
        return k.narrow(2, 0, length), v.narrow(2, 0, length)

    def splice(self, rows: torch.Tensor, start: int, own: "KVRows", count: int) -> None:
        """Write own's first count positions (a cache of the rows alone, filled from position 0)
        at start.. in those rows of this one."""
        # right-aligned: own's position 0 lands at start in these rows
        end = start + count
        # own.k is (layers, len(rows), heads, slots, width), positions 0..count - 1 at their slots
        self.k[:, rows, :, start:end] = own.k[..., :count, :]
        self.v[:, rows, :, start:end] = own.v[..., :count, :]

    def shift(self, by: int, end: int) -> None:
        """Move the positions by..end to 0..end - by (the slots no row sees are dropped)."""
        # a copy first: the source and destination slots overlap
        for t in (self.k, self.v):
            # t is (layers, B, heads, slots, width), the positions along dim 3; the slots
            # end - by..end keep stale rows past the new pos: each is written before it is read
            t[..., : end - by, :] = t[..., by:end, :].clone()

    def reset(self, rows: torch.Tensor) -> None:
        """Forget what these rows held: nothing to do, the mask hides slots before a row's pad."""


class KVRing(KVRows):
    """The K and V of some layers at their newest positions: a ring of `size` slots a layer,
    (layers, B, heads, size, width), position p at slot p % size."""

    grows = False  # its slots are the window's, whatever the cache's length

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__(k, v)
        # min(window, max_len): RingSpec.slots
        self.size = k.size(3)

    def update(
        self, i: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer i's k, v (B, heads, T, width) at start; return the keys and values it
        attends over, in slot order (their positions: attention.attention_mask's `ring`): after
        the write for one token; before it, then the chunk's own, for a chunk (whose writes would
        overwrite keys its first queries see); only the chunk's from an empty cache."""
        # T: the tokens at hand; start: the first one's position
        T = k.size(2)
        ring_k = self.k[i]  # (B, heads, size, width)
        ring_v = self.v[i]  # views: the writes below land in the store
        # one token: written at its slot, then the whole ring read
        if T == 1:
            ring_k[:, :, start % self.size] = k[:, :, 0]
            ring_v[:, :, start % self.size] = v[:, :, 0]
            # at position 0 the other slots hold nothing of this sequence: it sees only itself
            if start == 0:
                return k, v
            # the whole ring: slots not yet written are masked (their positions are negative)
            return ring_k, ring_v
        # a chunk: its queries see the ring as it was, then the chunk itself
        # from an empty cache the ring holds nothing yet: the chunk sees only itself
        if start == 0:
            seen = (k, v)
        else:
            # (B, heads, size + T, width): the ring's slots first, as attention_mask's ring expects
            seen = (torch.cat((ring_k, k), dim=2), torch.cat((ring_v, v), dim=2))
        # only the chunk's newest `size` tokens stay
        n = min(T, self.size)
        # their positions start + T - n.. at their slots, wrapping past the ring's end; n is at most
        # size, so the slots are distinct and no write lands on another of the chunk's
        slots = torch.arange(start + T - n, start + T, device=k.device) % self.size
        ring_k.index_copy_(2, slots, k[:, :, T - n :])
        ring_v.index_copy_(2, slots, v[:, :, T - n :])
        return seen

    def slot(self, pos: torch.Tensor) -> torch.Tensor:
        return pos % self.size  # the static step's write: position p at slot p % size

    def view(self, i: int, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]  # the whole ring: every slot written is in the window

    def splice(self, rows: torch.Tensor, start: int, own: "KVRing", count: int) -> None:
        """Write the positions own's ring holds (the newest of count, filled from position 0 for
        the rows alone) at their slots in those rows of this one, where they are start.. ."""
        # own's ring has own.size = min(window, count) slots, the newest count - own.size..count - 1
        held = torch.arange(count - own.size, count, device=rows.device)  # own's positions
        # each position moves from its slot in own's ring to its slot in this one, where it
        # sits start later
        for mine, theirs in ((self.k, own.k), (self.v, own.v)):
            # indexing rows and slots together would pair the two index tensors up, so the
            # rows' rings are copied out, written at their slots, and copied back
            rings = mine[:, rows]  # (layers, rows, heads, size, width)
            rings[:, :, :, (start + held) % self.size] = theirs[:, :, :, held % own.size]
            mine[:, rows] = rings

    def shift(self, by: int, end: int) -> None:
        """Turn the ring so that each position sits at its slot once positions move left by by."""
        # position p at slot p % size moves to slot (p - by) % size: every slot rolls by -by;
        # copy_ writes in place, so the tensors a CUDA graph was handed keep their storage
        for t in (self.k, self.v):
            t.copy_(t.roll(-by, dims=3))


class States:
    """The fixed states of some recurrent layers: each of its tensors (layers, B, *shape). It
    holds no positions: a prefill from an empty cache starts from zeros, a refill takes the rows'
    own state (recomputed from the tokens they keep) and a shift leaves it as it is."""

    grows = False

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        # in the spec's order: Gated DeltaNet's and KDA's are [convolution inputs, state]
        self.parts = tensors

    def tensors(self) -> list[torch.Tensor]:
        return list(self.parts)

    @property
    def layers(self) -> int:
        return self.parts[0].size(0)

    def read(self, i: int, start: int) -> tuple[torch.Tensor, ...]:
        """Layer i's state before position start: zeros at 0 (whatever an earlier sequence
        left)."""
        # a new sequence starts from nothing, whatever the store holds from the last one
        # past 0, the store's own: for a slid row, what a refill (splice or reset) put there
        if start == 0:
            return tuple(torch.zeros_like(t[i]) for t in self.parts)
        return tuple(t[i] for t in self.parts)

    def write(self, i: int, state: tuple[torch.Tensor, ...]) -> None:
        # each tensor (B, *shape) into layer i's slice: the copy casts it to the store's dtype
        for t, new in zip(self.parts, state, strict=True):
            t[i] = new

    def view(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's state for the static step: the store's own tensors, whole."""
        # views of the store: for a compiled step, its input tensors, read without a copy
        return tuple(t[i] for t in self.parts)

    def put(self, i: int, state: tuple[torch.Tensor, ...]) -> None:
        """Write layer i's state in place with index_put_ (a compiled step's inputs)."""
        # i as a 0-d tensor: index_put_ takes only tensors, and this one picks layer i's whole slice
        at = (torch.full((), i, device=self.parts[0].device),)
        for t, new in zip(self.parts, state, strict=True):
            # index_put_ casts nothing (t[i] = new would): the values take the store's dtype first
            t.index_put_(at, new.to(t.dtype))

    def splice(self, rows: torch.Tensor, start: int, own: "States", count: int) -> None:
        """These rows take own's state: what the rows' own tokens left (the positions mean
        nothing to a state)."""
        # own's tensors are (layers, len(rows), *shape): the rows' states whole, nothing to align
        for mine, theirs in zip(self.parts, own.parts, strict=True):
            mine[:, rows] = theirs

    def shift(self, by: int, end: int) -> None:
        """Nothing moves: the positions dropped are slots no row sees, never in a state."""

    def reset(self, rows: torch.Tensor) -> None:
        """These rows start again from nothing (a row whose context slid to a single token)."""
        # zeros are the state before any token: where a prefill from an empty cache starts too
        for t in self.parts:
            t[:, rows] = 0


Store = KVRows | States


@dataclass(frozen=True)
class CacheShape:
    """What a cache is made from: each layer's spec (its kind's cache_spec) and the positions."""

    specs: tuple[Spec, ...]
    max_len: int

    @property
    def stores(self) -> list[Spec]:
        """The distinct specs in the order of their first layer: one store each."""
        return list(dict.fromkeys(self.specs))  # first-seen order, no repeats


class KVCache:
    """Preallocated K/V rows and states of every layer, one store for each distinct spec (the
    global layers', the local layers', the recurrent layers'). `pos` counts positions written;
    GPT.forward advances it once per call, after the last layer. zeros() makes an empty one."""

    def __init__(self, stores: list[Store], shape: CacheShape, pos: int = 0) -> None:
        self.stores = stores  # one for each of shape.stores
        self.shape = shape
        self.max_len = shape.max_len
        # each layer's store, and its index among that store's layers: a layer reads and writes
        # only its own slice
        self.where: list[tuple[int, int]] = []
        seen = [0] * len(stores)
        specs = shape.stores
        for spec in shape.specs:
            # specs are frozen dataclasses, equal by value: layers of equal sizes find one store
            store = specs.index(spec)
            self.where.append((store, seen[store]))
            seen[store] += 1
        # positions written so far, one count for every layer (GPT.forward advances it)
        self.pos = pos

    @classmethod
    def zeros(
        cls, shape: CacheShape, batch_size: int, device: Device, dtype: torch.dtype
    ) -> "KVCache":
        """An empty cache of these sizes."""
        # a store for each distinct spec, as deep as the number of layers that share it
        stores = [
            spec.zeros(shape.specs.count(spec), batch_size, shape.max_len, device, dtype)
            for spec in shape.stores
        ]
        return cls(stores, shape)

    @classmethod
    def of_tensors(cls, tensors: list[torch.Tensor], shape: CacheShape) -> "KVCache":
        """A cache over tensors (those of tensors(), e.g. a compiled step's inputs)."""
        # tensors() lists each store's tensors in turn: each spec takes its count
        stores = []
        at = 0
        for spec in shape.stores:
            count = spec.tensor_count
            stores.append(spec.wrap(tensors[at : at + count]))
            at += count
        return cls(stores, shape)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache: the inputs of a compiled step (of_tensors builds it back)."""
        # store by store, each in its own order (K then V, or the state's tensors)
        return [t for store in self.stores for t in store.tensors()]

    def growing(self) -> list[bool]:
        """For each of tensors(): whether its slots are the cache's length."""
        # KVRows' K and V grow with max_len; a ring's and a state's keep their shapes
        return [store.grows for store in self.stores for _ in store.tensors()]

    def example(self, length: int) -> list[torch.Tensor]:
        """Tensors shaped as tensors() for a cache of `length` positions (to export a step on)."""
        # the tensors that grow with the length get `length` slots; the others are as they are
        tensors = self.tensors()
        for i, grows in enumerate(self.growing()):
            if grows:
                t = tensors[i]
                # (layers, B, heads, length, width): only dimension 3 is dynamic in the export
                tensors[i] = t.new_zeros(*t.shape[:3], length, t.size(4))
        return tensors

    def fixed_shapes(self) -> tuple[torch.Size, ...]:
        """The shapes of the tensors that do not grow: what a compiled step is specialised to."""
        # a ring's size and a state's shapes: a change between streams means another compiled step
        return tuple(t.shape for t, g in zip(self.tensors(), self.growing(), strict=True) if not g)

    def store_of(self, layer: int) -> tuple[Store, int]:
        """The layer's store, and the layer's index in it."""
        # where: (store index, layer index in it), worked out once in __init__
        store, i = self.where[layer]
        return self.stores[store], i

    def slots(self, layer: int) -> int:
        """The positions a K/V layer keeps: the cache's length, or its ring's size."""
        store, _ = self.store_of(layer)
        # attention's masks read it: a ring's keys are its slots (attention.ring_positions)
        return store.slots

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())  # as allocated: the fp32 states at their width

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors()[0].dtype

    @property
    def batch_size(self) -> int:
        return self.tensors()[0].size(1)  # dimension 1 of every store's tensors

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, heads, T, width) at pos; return the keys and values the layer attends
        over: from 0 to pos + T, or a ring's (KVRing.update)."""
        # pos: the positions before these, the same for every layer until GPT.forward advances it
        store, i = self.store_of(layer)
        return store.update(i, self.pos, k, v)

    def read_state(self, layer: int) -> tuple[torch.Tensor, ...]:
        """A recurrent layer's state before pos (States.read)."""
        store, i = self.store_of(layer)
        # at pos 0 it is zeros, whatever the store held from an earlier sequence
        return store.read(i, self.pos)

    def write_state(self, layer: int, *state: torch.Tensor) -> None:
        """A recurrent layer's state after the tokens at hand."""
        # written whole at layer i; pos is not advanced here: GPT.forward does, after the last layer
        store, i = self.store_of(layer)
        store.write(i, state)

    def refill(self, rows: list[int], own: "KVCache | None") -> None:
        """Write own (a cache of these rows alone, its positions from 0) into these rows,
        right-aligned at pos: own's last position goes at pos - 1. None: the rows start again
        from nothing (their slots before pos are hidden by their pad)."""
        # the rows as a tensor: each store indexes its dimension 1 with it
        at = torch.tensor(rows, device=self.device)
        # nothing kept: the stores that hold state forget it (K/V slots are hidden by the pad)
        if own is None:
            for store in self.stores:
                store.reset(at)
            return
        # own's stores are made from the same specs, so they pair up one to one
        # own's last position goes at pos - 1, so its count = own.pos positions start at
        # pos - own.pos in these rows
        for mine, theirs in zip(self.stores, own.stores, strict=True):
            mine.splice(at, self.pos - own.pos, theirs, own.pos)

    def shift(self, by: int) -> None:
        """Move every layer's positions left by `by` (slots no row sees), making room at the end."""
        # every store moves by the same `by`, so all layers keep one pos
        for store in self.stores:
            store.shift(by, self.pos)
        # the next position written is the old pos - by: the room made at the end
        self.pos -= by

    def static(self, pos: torch.Tensor, length: int | None) -> "StaticKVCache":
        """This cache as the fixed-shape one-token step reads it (StaticKVCache)."""
        return StaticKVCache(self, pos, length)


class StaticKVCache:
    """A KVCache as the fixed-shape one-token step (static_step.decode_static) uses it: K/V written
    at a position held in a 1-element tensor (a ring's at its slot), in place into the cache's
    tensors (not a view of them, which a compiled step would copy whole), and read whole: a
    K/V layer's first `length` positions, or all max_len when length is None (the step masks the
    unwritten ones); a recurrent layer's state read and written whole."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, length: int | None) -> None:
        # the eager cache the step writes into; its int pos is the engine's to advance
        self.cache = cache
        # length: the global layers' filled slots (the compiled CPU step), or None (the CUDA graph)
        self.length = length
        # pos is a 1-element tensor: the step reads it on the device, with no host sync, every call
        self.pos = pos

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        store, i = self.cache.store_of(layer)
        # written in place at pos's slot, then read back as view gives it, under the step's mask
        store.put(i, self.pos, k, v)
        return store.view(i, self.length)

    def read_state(self, layer: int) -> tuple[torch.Tensor, ...]:
        store, i = self.cache.store_of(layer)
        # the store's own tensors, not copies: the step reads the state whole, as it stands
        return store.view(i)

    def write_state(self, layer: int, *state: torch.Tensor) -> None:
        store, i = self.cache.store_of(layer)
        # in place, so the step's input tensors hold the new state once the step returns
        store.put(i, state)

    def slots(self, layer: int) -> int:
        # a ring's size, for attention's mask over its slots; a KVRows' max_len
        return self.cache.slots(layer)

    @property
    def max_len(self) -> int:
        # the keys the step's mask spans for a global layer when length is None
        return self.cache.max_len
