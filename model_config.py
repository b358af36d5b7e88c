"""The model's configuration: GPTConfig (its keys, their checks, each layer's kind and the
accounting a config alone decides: parameters, FLOPs, cache bytes, the model's one line), and the
table of the kinds of layer (LAYER_KINDS, register_kind). model.py re-exports them, so every
`from model import GPTConfig` keeps working; model.py holds the modules built from a config."""

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

import attention
from attention import GlobalAttention, LocalAttention
from gated_deltanet import GatedDeltaNet
from kimi_delta import KimiDeltaAttention
from kv_cache import CacheShape
from layer_kind import LayerKind, declaration_problems

# the positions choice_problems accepts: GPT-2's learned table, or rotary (RoPE)
POS_ENCODINGS = ("learned", "rope")

# The kinds of layer, each by its letter in layer_pattern (and window_pattern's S and L). A new
# kind is a file and a row here, or register_kind at run time (docs/architecture.md).
LAYER_KINDS: dict[str, type[LayerKind]] = {
    "L": GlobalAttention,
    "S": LocalAttention,
    "D": GatedDeltaNet,
    "K": KimiDeltaAttention,
}


# The kinds every process has: the rows above, which importing model.py makes. A kind that
# register_kind adds is this process's alone; a script run as a process of its own (compare.py's
# train.py runs) does not know it.
IMPORTED_KINDS: dict[str, type[LayerKind]] = dict(LAYER_KINDS)


def register_kind(kind: type[LayerKind]) -> None:
    """Add a kind of layer to LAYER_KINDS at run time, under its letter (one upper-case letter
    no other kind has), once it declares all LayerKind asks (layer_kind.declaration_problems)."""
    # a kind that lacks a declaration would train, and fail only when its model samples or exports
    problems = declaration_problems(kind)
    if problems:
        # the letter may be what it lacks, so the message cannot assume one
        letter = repr(kind.letter) if hasattr(kind, "letter") else "no letter"
        raise ValueError(
            f"layer kind {kind.__name__} ({letter}) {'; '.join(problems)}: declare what it lacks "
            'as layer_kind.LayerKind says (docs/architecture.md "Adding a kind of layer")'
        )
    # one letter a kind, so that a letter of a pattern names one kind
    letter = kind.letter
    if not (len(letter) == 1 and letter.isupper()):
        raise ValueError(f"a kind's letter is one upper-case letter, not {letter!r}")
    # the same class again changes nothing; another kind under a taken letter is refused
    if LAYER_KINDS.get(letter, kind) is not kind:
        raise ValueError(f"letter {letter!r} is {LAYER_KINDS[letter].name}'s already")
    LAYER_KINDS[letter] = kind


def unregistered_letters(keys: dict) -> tuple[str, list[str]]:
    """A saved config's (keys: a checkpoint's model_args) layer_pattern, and the kinds' letters in
    it (upper-case letters, as register_kind takes) that this process has not registered; none
    where the pattern holds other characters too (a damaged config, GPTConfig's to say)."""
    pattern = keys.get("layer_pattern")
    # None (window_pattern names the layers) or no string: no kind's letter to look up
    if not isinstance(pattern, str):
        return "", []
    # the distinct letters in the pattern's order, those that could be a kind's
    letters = [x for x in dict.fromkeys(pattern) if x.isascii() and x.isupper()]
    # some other character too: GPTConfig's checks say what is wrong, not a missing kind
    if len(letters) != len(set(pattern)):
        return pattern, []
    return pattern, [x for x in letters if x not in LAYER_KINDS]


def kind_names(letters: list[str]) -> str:
    """The kinds of these letters, as a message names them: 'global and local attention'."""
    names = [LAYER_KINDS[letter].name for letter in letters]
    # each name split at its last word: 'global attention' -> ['global', 'attention']
    *firsts, last = [name.rsplit(" ", 1) for name in names]
    if firsts and all(len(n) == 2 and n[1] == last[-1] for n in [*firsts, last]):
        # one noun: 'global and local attention'
        return " and ".join(n[0] for n in [*firsts, last]) + " " + last[-1]
    # else each name whole: 'global attention and Gated DeltaNet'
    return " and ".join(names)


@dataclass(frozen=True)
class Layer:
    """One layer as the pattern keys make it (GPTConfig.layers, the one place they are read): its
    kind (a row of LAYER_KINDS), the tokens a query sees (a local layer's window; None: every
    earlier one, or a kind that reads no window) and whether it rotates its queries and keys
    where the model has rotary positions (rope_pattern's R; N: none, NoPE). Every other reader
    asks a layer this, never a pattern string (transformers' config.layer_types[i] likewise)."""

    kind: type[LayerKind]  # a row of LAYER_KINDS: what the layer builds
    window: int | None  # tokens a query sees, itself included; None: every earlier one
    rotary: bool  # rope_pattern's R (True) or N (False, NoPE)

    @property
    def letter(self) -> str:
        """The kind's letter, as layer_pattern spells it."""
        return self.kind.letter

    @property
    def attends(self) -> bool:
        """Whether the layer attends, rather than a recurrence ordering its tokens."""
        return self.kind.attends


def tiled(pattern: str, n_layer: int) -> str:
    """A pattern's letters repeated over n_layer layers, one a layer: 'SL' over 5 is 'SLSLS'."""
    # n_layer repeats cover n_layer layers whatever the pattern's length; the cut drops the rest
    return (pattern * n_layer)[:n_layer]


def shortest_period(letters: str) -> str:
    """The shortest pattern whose repeats give every layer's letter ('DDDL' of 'DDDLDDDL'): the
    inverse of `tiled`, as layer_pattern and rope_pattern are written from a list a layer."""
    n = len(letters)
    # p = n always fits (the letters themselves), so next() never runs out
    return next(letters[:p] for p in range(1, n + 1) if tiled(letters[:p], n) == letters)


def shortest_window_pattern(letters: str) -> str:
    """The shortest window_pattern whose repeats give every layer's letter, the last layer always
    global ('L'); the letters themselves where none does (their last is 'S')."""
    n = len(letters)
    # a candidate need match only up to the last layer, which the kinds make global anyway
    return next(
        (letters[:p] for p in range(1, n + 1) if tiled(letters[:p], n)[: n - 1] + "L" == letters),
        letters,
    )


def pattern_keys(letters: str, rotary: Sequence[bool] = ()) -> dict[str, str]:
    """The keys whose patterns give these layers (a letter a layer; where given, whether each
    rotates), shortest, a key at its default left out: none where every layer is global
    attention, window_pattern where the others are local (nanochat's S and L), else
    layer_pattern; rope_pattern where some layer has no positions. GPTConfig.layers' inverse, for
    the configs read from transformers' folders."""
    # a key left out is at its default: window_pattern 'L', layer_pattern None, rope_pattern 'R'
    keys = {}
    # only S and L, some of them S: nanochat's window_pattern spells them
    if set(letters) <= {"S", "L"} and "S" in letters:
        keys["window_pattern"] = shortest_window_pattern(letters)
    # any other kind among them: layer_pattern; every layer L needs neither (the default)
    elif set(letters) != {"L"}:
        keys["layer_pattern"] = shortest_period(letters)
    # all(()) is True: no rotary given, no rope_pattern
    if not all(rotary):
        keys["rope_pattern"] = shortest_period("".join("R" if r else "N" for r in rotary))
    return keys


def pattern_problems(c: "GPTConfig") -> list[str]:
    """What is wrong with the keys that make each layer (GPTConfig.layers): window_pattern (S and
    L, as nanochat's) or layer_pattern (any kind's letter), not both; rope_pattern's letters."""
    # the pattern in use: layer_pattern where given, else window_pattern
    key = c.pattern_key
    pattern = getattr(c, key)
    # window_pattern: attention.py checks nanochat's S and L
    if key == "window_pattern":
        problems = attention.window_pattern_problems(pattern)
    elif c.window_pattern != type(c).__dataclass_fields__["window_pattern"].default:  # both given
        return [
            f"layer_pattern={pattern!r} and window_pattern={c.window_pattern!r}: give one "
            "(layer_pattern spells window_pattern's S and L too)"
        ]
    # layer_pattern: any registered kind's letters (lower case is caught below)
    elif isinstance(pattern, str) and pattern and set(pattern.upper()) <= set(LAYER_KINDS):
        problems = []
    else:
        # name every kind this process knows, so the message lists the choices
        kinds = [f"{letter} ({kind.name})" for letter, kind in LAYER_KINDS.items()]
        problems = [
            f"layer_pattern={pattern!r} must be letters {', '.join(kinds[:-1])} and {kinds[-1]},"
            " one a layer, repeated over the layers"
        ]
    # the right letters in lower case: say the upper-case spelling that was meant
    if not problems and pattern != pattern.upper():
        problems.append(
            f"{key}={pattern!r}: its letters are upper case, {key}={pattern.upper()!r} "
            "(compare.py's variant names spell them lower case, e.g. mha-sl8)"
        )
    # rope_pattern is checked whichever key names the kinds
    rope = c.rope_pattern
    if not (isinstance(rope, str) and rope and set(rope) <= {"R", "N"}):
        problems.append(
            f"rope_pattern={rope!r} must be letters R (rotary positions) and N (none, NoPE), "
            "one a layer, repeated over the layers, e.g. 'RRRN'"
        )
    return problems


@dataclass(slots=True)
class GPTConfig:
    # ---- the model's size ----
    block_size: int = 1024  # the longest sequence: the learned positions' and rotary tables' rows
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 for faster matmuls
    n_layer: int = 12  # blocks, each a norm, a mixer, a norm and an MLP
    n_head: int = 12  # query heads, each head_dim = n_embd // n_head wide
    n_kv_head: int | None = None  # None or n_head: MHA; 1: MQA; a divisor of n_head in between: GQA
    n_embd: int = 768  # the residual stream's width
    # ---- the block: GPT-2's by default, Llama's with rmsnorm and swiglu ----
    dropout: float = 0.0  # a rate in [0, 1); 0.0: no dropout
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2
    pos_encoding: str = "learned"  # 'learned' (GPT-2 absolute positions) or 'rope' (rotary)
    rope_theta: float = 10000.0  # pair i turns theta ** (-2i / rope_dim) radians a token
    gelu: str = "exact"  # 'exact' or 'tanh' (the approximation OpenAI's GPT-2 was trained with)
    mlp_hidden: int | None = None  # None: GPT-2's 4 * n_embd, or as many weights in SwiGLU
    norm: str = "layernorm"  # or 'rmsnorm' (Llama's)
    mlp: str = "gelu"  # or 'swiglu' (Llama's gated MLP: https://arxiv.org/abs/2002.05202)
    # ---- MLA (DeepSeek's names) ----
    # the latent's width d_c (None: no MLA), the rotary key's width d_R (None: head_dim // 2 with
    # rope, 0 with learned positions), the queries' own latent (None: none), an RMSNorm on the
    # latent
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    q_lora_rank: int | None = None
    latent_norm: bool = True
    # ---- which kind each layer is ----
    # a local layer's window in tokens (a query sees itself and window - 1 before it), and which
    # layers are local: nanochat's letters (S local, L global) repeated over the layers, the last
    # one always global
    window: int | None = None
    window_pattern: str = "L"
    # each layer's kind, letters of LAYER_KINDS repeated over the layers: L global attention, S
    # local (its window), D Gated DeltaNet (a linear recurrence), e.g. 'DDDL' as Qwen3.5's; None:
    # window_pattern's S and L, the last layer never local either way
    layer_pattern: str | None = None
    # ---- Qwen3.5's attention options ----
    # the output gated by sigmoid of a projection of x, one gate a head or a feature
    # (https://arxiv.org/abs/2505.06708); q and k RMS-normalised per head; the fraction of each
    # head's features rotated (the first ones)
    attn_gate: str = "none"  # 'none', 'head' (a gate a head) or 'element' (a gate a feature)
    qk_norm: bool = False
    rope_fraction: float = 1.0  # 1.0: every feature of a head rotates
    # ---- gpt-oss's sinks, and layers without positions ----
    # a learned logit a head beside the scores, whose share of the softmax reads nothing (each
    # head may attend to nothing); which attention layers rotate (R) and which have no positions
    # (N, NoPE: Kimi Linear's MLA, Llama 4's global layers), letters repeated over the layers
    attn_sinks: bool = False
    rope_pattern: str = "R"  # 'R': every attention layer rotates (with pos_encoding='rope')

    def __post_init__(self) -> None:
        # the keys left out that follow from others
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.mlp_hidden is None and type(self.n_embd) is int:  # SwiGLU: 3 matrices of 8/3 n_embd
            swiglu = self.mlp == "swiglu"
            self.mlp_hidden = 8 * round(self.n_embd / 3) if swiglu else 4 * self.n_embd
        # MLA's rotary width default reads head_dim, so only once n_embd and n_head are sound
        sizes_known = all(type(n) is int and n > 0 for n in (self.n_embd, self.n_head))
        if self.kv_lora_rank is not None and self.qk_rope_head_dim is None and sizes_known:
            self.qk_rope_head_dim = self.latent_rope_default
        # every problem found, raised as one line: sizes, then the pattern, then each kind's keys
        problems = self.size_problems()
        problems += pattern_problems(self)
        if not problems:  # the sizes and letters are sound, so each layer's kind is known
            problems += self.layer_problems()
            for kind in LAYER_KINDS.values():
                problems += [p for p in kind.problems(self) if p not in problems]
        # a key that no layer of the pattern reads: its own checks would only add noise
        unread = {} if problems else self.unread_keys()
        problems += unread.values()
        if not problems:  # the layers' kinds and rope_pattern's letters are sound
            problems += self.position_problems()
        if not problems:  # the sizes are integers, so their ratios can be checked
            problems += self.ratio_problems()
        # the choices are checked whatever else is wrong; the rotary width only where nothing is
        problems += self.choice_problems(rope_checkable=not problems)
        # keys the model never uses, less those unread_keys named already
        problems += [line for key, line in self.unused_keys().items() if key not in unread]
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    def size_problems(self) -> list[str]:
        """The sizes that are not positive integers."""
        problems = []
        sizes = ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
        # mlp_hidden as __post_init__ filled it in (still None where n_embd is no integer)
        for name in (*sizes, "mlp_hidden"):
            value = getattr(self, name)
            # type() rather than isinstance: a bool is an int, but True is no size
            if type(value) is not int or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        return problems

    def layer_problems(self) -> list[str]:
        """A pattern with more letters than layers: the letters past the last layer name none."""
        key = self.pattern_key
        pattern = getattr(self, key)
        n = self.n_layer
        # fewer letters than layers are repeated; only more is a mistake
        if len(pattern) <= n:
            return []
        # the letters the model really gets, to show what the cut makes
        model = self.layer_letters
        # the kinds the cut leaves out, or all attention
        lost = [LAYER_KINDS[x].name for x in dict.fromkeys(pattern) if x not in model]
        # no attention layer left at all: say that, rather than each attention kind lost
        if not self.attends and any(LAYER_KINDS[x].attends for x in pattern):
            lost = ["attention"]
        note = f", no {' or '.join(lost)} layer" if lost else ""
        example = pattern[: n - 1] + pattern[-1]  # the pattern's last letter on the last layer
        letters = "letters" if n > 1 else "letter"
        return [
            f"{key}={pattern!r} has {len(pattern)} letters and n_layer={n}: the letters "
            f"past layer {n} name no layer (the model would be {model!r}{note}); give at "
            f"most {n} {letters}, e.g. {example!r}"
        ]

    def position_problems(self) -> list[str]:
        """rope_pattern letters that would change nothing: past the last layer, or an N (no
        positions) on a layer of a kind that has none to take off (one not reading rope_pattern)."""
        pattern = self.rope_pattern
        n = self.n_layer
        # as layer_problems: letters past the last layer name none
        if len(pattern) > n:
            return [
                f"rope_pattern={pattern!r} has {len(pattern)} letters and n_layer={n}: the letters "
                f"past layer {n} name no layer (the model's layers would be "
                f"{tiled(pattern, n)!r}); give at most {n}"
            ]
        if set(pattern) == {"N"}:  # no positions anywhere: said of the model, not of a layer
            return []
        # the N layers whose kind does not read rope_pattern: they have no rotary positions to drop
        layers = self.layers
        without = [
            i for i in self.positionless_layers if "rope_pattern" not in layers[i].kind.reads
        ]
        if not without:
            return []
        # each such kind named once, in the order its layers come
        names = kind_names(list(dict.fromkeys(self.layer_letters[i] for i in without)))
        return [
            f"rope_pattern={pattern!r} takes the positions off layer "
            f"{', '.join(map(str, without))}, of {names}, which has none to take off: put N "
            f"on attention layers only (each layer's letter in turn, over {self.layer_letters!r})"
        ]

    def unread_keys(self) -> dict[str, str]:
        """Each key set away from its default that no layer of this pattern reads (LAYER_KINDS),
        and its problem line."""
        # the keys this model's kinds read; a key no kind reads is the model's own (sizes, norm)
        read = frozenset().union(*(kind.reads for kind in set(self.layer_kinds)))
        unread = {}
        # each key some kind reads, set away from its default, that none of this model's kinds reads
        for f in fields(self):
            key = f.name
            # the kinds that would read it: any registered, not only this model's
            readers = [x for x, kind in LAYER_KINDS.items() if key in kind.reads]
            if not readers or key in read or getattr(self, key) == self.default_of(key):
                continue
            pattern = getattr(self, self.pattern_key)
            unread[key] = (
                f"{key}={getattr(self, key)!r} is read only by {kind_names(readers)} layers "
                f"({', '.join(readers)}), and {self.pattern_key}={pattern!r} on "
                f"n_layer={self.n_layer} has none: leave it out"
            )
        return unread

    def default_of(self, key: str) -> object:
        """key's value had it been left out: n_kv_head's is n_head, qk_rope_head_dim's follows from
        kv_lora_rank and the positions, the others' their field's default."""
        # these two default to None, which __post_init__ replaces by what follows from the others
        if key == "n_kv_head":
            return self.n_head
        if key == "qk_rope_head_dim" and self.kv_lora_rank is not None:
            return self.latent_rope_default
        return GPTConfig.__dataclass_fields__[key].default

    @property
    def latent_rope_default(self) -> int:
        """MLA's rotary key width when qk_rope_head_dim is left out: half a head with rotary
        positions, none with learned ones."""
        # with learned positions nothing rotates, so MLA's key has no rotary part
        return self.head_dim // 2 if self.pos_encoding == "rope" else 0

    def ratio_problems(self) -> list[str]:
        """Heads that do not divide the width, K/V heads that do not divide the heads."""
        problems = []
        # each head takes head_dim = n_embd // n_head of the width
        if self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        # GQA: each K/V head serves n_head // n_kv_head query heads, so it must divide
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            problems.append(
                f"n_head={self.n_head} must be divisible by "
                f"n_kv_head={self.n_kv_head} (1 <= n_kv_head <= n_head; "
                "n_head: MHA, 1: MQA, a divisor in between: GQA)"
            )
        return problems

    def choice_problems(self, rope_checkable: bool) -> list[str]:
        """Keys that name a choice (positions, activation, norm, MLP) or a rate out of range;
        rope_checkable: the sizes are sound, so the rotary width can be checked."""
        problems = []
        # an int is accepted (dropout=0); 1.0 would zero every activation
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if self.pos_encoding not in POS_ENCODINGS:
            choices = ", ".join(POS_ENCODINGS)
            problems.append(f"pos_encoding={self.pos_encoding!r} must be one of {choices}")
        elif self.pos_encoding == "rope" and rope_checkable and self.rope_fraction != 1:
            # rotary positions turn features in pairs, so the rotated part needs an even width
            rotated = self.rope_dim
            if rotated < 2 or rotated % 2:
                problems.append(
                    f"rope_fraction={self.rope_fraction} rotates int({self.head_dim} * "
                    f"{self.rope_fraction}) = {rotated} features of each head: give a fraction "
                    "that rotates an even number, at least 2"
                )
        elif self.pos_encoding == "rope" and rope_checkable and self.rope_dim % 2:
            # the whole head (or MLA's rotary key) rotates: it too must be even
            what = "qk_rope_head_dim" if self.kv_lora_rank else "head_dim"
            problems.append(f"pos_encoding='rope' needs an even {what}, got {what}={self.rope_dim}")
        if self.gelu not in ("exact", "tanh"):
            problems.append(f"gelu={self.gelu!r} must be 'exact' or 'tanh'")
        # each a choice between GPT-2's (first) and Llama's
        for key, choices in (("norm", ("layernorm", "rmsnorm")), ("mlp", ("gelu", "swiglu"))):
            if getattr(self, key) not in choices:
                problems.append(f"{key}={getattr(self, key)!r} must be one of {', '.join(choices)}")
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            problems.append(f"rope_theta={self.rope_theta!r} must be a positive number")
        return problems

    def unused_keys(self) -> dict[str, str]:
        """Keys set away from their defaults where this model has no use for them (whatever its
        layers: unread_keys), each with its problem line."""
        unused = {}
        # rotary's keys with learned positions: nothing reads them
        if self.pos_encoding == "learned" and self.rope_theta != 10000.0:
            unused["rope_theta"] = (
                f"rope_theta={self.rope_theta} applies to rotary positions: "
                "set pos_encoding='rope', or leave rope_theta out"
            )
        if self.pos_encoding == "learned" and self.rope_fraction != 1:
            unused["rope_fraction"] = (
                f"rope_fraction={self.rope_fraction} applies to rotary positions: "
                "set pos_encoding='rope', or leave rope_fraction out"
            )
        # SwiGLU's gate is SiLU, so gelu's approximation would change nothing
        if self.mlp == "swiglu" and self.gelu != "exact":
            unused["gelu"] = (
                f"gelu={self.gelu!r} applies to mlp='gelu' (SwiGLU gates with SiLU): leave gelu out"
            )
        return unused

    @property
    def head_dim(self) -> int:
        # each head's features: exact only where n_head divides n_embd (ratio_problems)
        return self.n_embd // self.n_head

    @property
    def pattern_key(self) -> str:
        """The key that names each layer's kind: layer_pattern where given, else window_pattern."""
        return "window_pattern" if self.layer_pattern is None else "layer_pattern"

    @property
    def layers(self) -> tuple[Layer, ...]:
        """Each layer's plan (Layer: kind, window, rotary), from the pattern keys: layer_pattern,
        else window_pattern, and rope_pattern, each repeated over the layers. On the last layer a
        kind that may not be there gives way (a local layer becomes global)."""
        # one letter a layer: the pattern repeated, then cut to n_layer
        letters = tiled(getattr(self, self.pattern_key), self.n_layer)
        # a kind not allowed last names its stand-in (a local layer's is 'L'); None: it stays
        last = LAYER_KINDS[letters[-1]].on_last_layer or letters[-1]
        kinds = [LAYER_KINDS[letter] for letter in letters[:-1] + last]
        # rope_pattern repeats over the layers on its own, whatever the kinds' period
        rope = tiled(self.rope_pattern, self.n_layer)
        return tuple(
            # a window where the kind reads one (a local layer)
            Layer(kind, self.window if "window" in kind.reads else None, letter == "R")
            for kind, letter in zip(kinds, rope, strict=True)
        )

    @property
    def layer_letters(self) -> str:
        """Each layer's letter, as layer_pattern spells a kind: 'DDDL'."""
        return "".join(layer.letter for layer in self.layers)

    @property
    def layer_kinds(self) -> list[type[LayerKind]]:
        """Each layer's kind (LAYER_KINDS)."""
        return [layer.kind for layer in self.layers]

    def layers_of(self, kind: type[LayerKind]) -> list[int]:
        """The layers of this kind."""
        return [i for i, k in enumerate(self.layer_kinds) if k is kind]

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's window: the window where its kind reads one (a local layer), else None."""
        return [layer.window for layer in self.layers]

    @property
    def positionless_layers(self) -> list[int]:
        """The layers without positions: rope_pattern's N (NoPE) on them."""
        return [i for i, layer in enumerate(self.layers) if not layer.rotary]

    @property
    def local_layers(self) -> list[int]:
        """The layers that see a window of the context."""
        return [i for i, window in enumerate(self.layer_windows) if window is not None]

    @property
    def recurrent_layers(self) -> list[int]:
        """The layers that do not attend: a recurrence orders their tokens."""
        return [i for i, layer in enumerate(self.layers) if not layer.attends]

    @property
    def rope_dim(self) -> int:
        """The features a head rotates: MLA's rotary key width, else rope_fraction of the head."""
        if self.kv_lora_rank is not None:
            # MLA rotates only the decoupled rotary part of its queries and keys
            return self.qk_rope_head_dim
        # int() rounds down, so choice_problems checks the width is even and at least 2
        return int(self.head_dim * self.rope_fraction)

    @property
    def attends(self) -> bool:
        """Whether some layer attends (LAYER_KINDS), rather than every one being recurrent."""
        return any(kind.attends for kind in self.layer_kinds)

    @property
    def attention_type(self) -> str:
        """The attention layers' kind, as code dispatches on it: 'MLA' (kv_lora_rank set), else
        'MHA' (n_kv_head == n_head), 'MQA' (n_kv_head == 1 < n_head) or 'GQA' (in between); 'MHA'
        where no layer attends (n_kv_head is n_head there). A user reads attention_label."""
        if self.kv_lora_rank is not None:
            return "MLA"
        # one K/V head a query head; else each shared by a group
        if self.n_kv_head == self.n_head:
            return "MHA"
        return "MQA" if self.n_kv_head == 1 else "GQA"

    @property
    def kv_label(self) -> str:
        """The keys that size K and V besides n_head: n_kv_head, or MLA's latents."""
        if self.kv_lora_rank is None:
            return f"n_kv_head={self.n_kv_head}"
        # MLA has no K/V heads to count: its latents' widths say the size instead
        return (
            f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"q_lora_rank={self.q_lora_rank}"
        )

    @property
    def attention_label(self) -> str:
        """The attention as a table's column says it: attention_type, or 'none' where no layer
        attends."""
        return self.attention_type if self.attends else "none"

    def kind_fragments(self) -> list[str]:
        """What each kind of this model's layers adds to describe(), in LAYER_KINDS' order."""
        fragments = []
        for kind in LAYER_KINDS.values():
            layers = self.layers_of(kind)
            # a kind with no layers here, or nothing to add (describe's None), adds no fragment
            fragment = kind.describe(self, layers) if layers else None
            if fragment:
                fragments.append(fragment)
        return fragments

    @property
    def mixing(self) -> str:
        """How the layers mix tokens, as describe() and export.py's model card begin: the
        attention kind and its K/V sizes, or, where no layer attends, the other layers."""
        # no attention: n_kv_head and MLA size nothing, so name the other kinds
        if not self.attends:
            layers = ", ".join(self.kind_fragments())
            return f"no attention layer: {layers} (n_head={self.n_head})"
        return f"{self.attention_type} (n_head={self.n_head}, {self.kv_label})"

    def describe(self) -> str:
        """The model's one line, as every script prints it: its attention, positions, and the
        layers of other kinds, e.g. 'GQA (n_head=4, n_kv_head=2), rope positions, local layers
        [0, 1] of 3 (window 8)'."""
        line = self.mixing
        # the attention's options, after the attention they change
        extras = []
        if self.attn_gate != "none":
            extras.append(f"gated by {self.attn_gate}")
        if self.qk_norm:
            extras.append("q/k normed")
        if self.attn_sinks:
            extras.append("with sinks")
        if extras:
            line += " " + ", ".join(extras)
        # then the positions, and which features or layers do without them
        line += f", {self.pos_encoding} positions"
        if self.rope_fraction != 1:
            line += f" on {self.rope_dim} of {self.head_dim} features"
        if "N" in self.rope_pattern:
            line += f" (none on the N layers of rope_pattern={self.rope_pattern!r}: NoPE)"
        if self.attends:  # else mixing named them
            for fragment in self.kind_fragments():
                line += f", {fragment}"
        return line

    def cache_shape(self, max_len: int) -> CacheShape:
        """The sizes of a cache of max_len positions: each layer's kind's spec (kv_cache.py)."""
        # one spec a layer, in layer order: its kind decides what it keeps (K/V, a window, a state)
        specs = tuple(kind.cache_spec(self) for kind in self.layer_kinds)
        return CacheShape(specs, max_len)

    def kv_cache_bytes(
        self, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32
    ) -> int:
        """Bytes of the cache in every layer for batch_size sequences of seq_len positions: each
        layer's kind's (an attention layer's K/V, at most a local layer's window of them; a
        recurrent layer's state, whatever seq_len)."""
        # a spec's bytes are one sequence's, hence the batch_size factor
        specs = self.cache_shape(seq_len).specs
        return batch_size * sum(spec.nbytes(seq_len, dtype) for spec in specs)
