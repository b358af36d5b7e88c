"""What a kind of layer is: the row of model.LAYER_KINDS that a letter of layer_pattern names, and
the mixer it builds for each such layer (the module that mixes tokens, in a block between the
norm and the MLP). A kind declares everything the rest of the code asks of it, so that a new
kind is a new file and a row: docs/architecture.md "Adding a kind of layer"."""

import types
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import torch
import torch.nn as nn

from kv_cache import Cache, Spec

# model.GPTConfig, which the kinds read (model.py imports them, so they cannot import it)
Config = Any
Rope = tuple[torch.Tensor, torch.Tensor] | None  # the rotary cos and sin at the positions at hand
Mask = torch.Tensor | None  # what a layer's queries see: attention's (B or 1, 1, T, Tk), or its own


@dataclass(frozen=True)
class Tokens:
    """Where a forward's tokens sit, as a mask reads it: T tokens a row from position start, each
    row's left padding pad (B,) (None: no row is padded), on device. start is an int, or in the
    fixed-shape step (smallgpt/static_step.py) a 1-element tensor: its one token's position, which
    the host does not read (no sync)."""

    T: int
    start: int | torch.Tensor
    pad: torch.Tensor | None
    device: torch.device


class Mixer(nn.Module):
    """A layer's mixer: forward(x, rope, mask, kv_cache) -> (B, T, n_embd), reading and writing
    its own part of the cache through the Cache methods. GPT.blocks (every forward's loop)
    computes each mask once for the layers of one mask_key, by the first such layer's mask()."""

    # its Linears whose weights AdamW takes under optimizer='muon' (smallgpt/optim.py), as for
    # the embeddings: none but where a kind says otherwise
    adamw_matrices: tuple[str, ...] = ()
    # its Linears whose weight forward reads as a matrix rather than calling the Linear: int8
    # decoding (smallgpt/quantize.py) keeps them in the model's dtype (MLA's absorbed kv_b)
    matrices: tuple[str, ...] = ()

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def take_attention(self, source: "Mixer") -> None:
        """A kind that converts_attention: its weights from a global attention layer's."""
        raise NotImplementedError

    def keep_decay(self, decay: torch.Tensor) -> None:
        """A kind that converts_attention: each head's state kept decay (n_head,) a token, for
        every token."""
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        raise NotImplementedError

    @property
    def mask_key(self) -> Hashable:
        """Layers of equal keys share one mask."""
        return type(self)

    def mask(self, at: Tokens, cache: Cache | None) -> Mask:
        """What the tokens `at` (their positions and padding) see: over a KVCache (or none) in
        GPT.forward, or over the fixed-shape step's StaticKVCache (one token a row, its position
        in a tensor). The one declaration of what a kind's queries see, for both."""
        raise NotImplementedError

    def initial(self, name: str, generator: torch.Generator | None) -> torch.Tensor | None:
        """The initial values of its own parameter `name` where GPT-2's rule (N(0, 0.02), zero
        biases) does not suit it; None: that rule."""
        return None

    def mixing_flops(self, seq_len: int) -> int:
        """Training FLOPs a token beyond the 6 a weight of its Linears: attention's scores and
        weighted sums, a recurrence's products."""
        return 0


class LayerKind:
    """A kind of layer: what its letter builds and what the model, the cache, the config's checks,
    describe(), the decoding engine and export need to know of it. Every method reads the model's
    GPTConfig; none of them builds anything but what it says."""

    letter: ClassVar[str]  # its letter in layer_pattern (upper case)
    name: ClassVar[str]  # as messages name it: 'global attention', 'Gated DeltaNet'
    attends: ClassVar[bool] = False  # whether it attends (n_kv_head and MLA size its K/V)
    # the GPTConfig keys it reads beyond the model's own (sizes, norm, MLP, dropout, positions):
    # a key that no layer of a model's pattern reads would change nothing, so GPTConfig refuses it
    reads: ClassVar[frozenset[str]] = frozenset()
    # the letter it takes on the last layer, where it is not allowed there (None: it is)
    on_last_layer: ClassVar[str | None] = None
    # why the fixed-shape one-token step (CUDA graph, compiled CPU step) cannot run it; "": it can
    static_step: ClassVar[str] = ""
    # tokens a step of its chunked form over a sequence, where it has one (bench.py --chunks)
    chunk: ClassVar[int | None] = None
    # transformers' name of it in a config's layer_types; None: no transformers class holds it
    hf_layer_type: ClassVar[str | None] = None
    # the model_type of the one transformers class that holds layers of it ('qwen3_5_text' for
    # Gated DeltaNet, 'kimi_linear' for KDA); None: attention, which several classes hold
    hf_model: ClassVar[str | None] = None
    # its mixer's parameters, ours (under the block's 'attn.') -> transformers' (under a layer's)
    hf_names: ClassVar[dict[str, str]] = {}
    # whether a global attention layer converts into it (smallgpt/hybridize.py): its mixer's
    # take_attention and keep_decay
    converts_attention: ClassVar[bool] = False
    # whether its layers (MHA, GQA or MQA: not MLA) are what such a kind converts from
    conversion_source: ClassVar[bool] = False

    @classmethod
    def build(cls, config: Config, layer: int) -> Mixer:
        """The mixer of layer `layer` of a model of this config."""
        # by default the kind is its own mixer; a kind of several forms (attention: MHA/GQA/MQA
        # or MLA) overrides this to pick one
        return cls(config, layer)  # type: ignore[call-arg]

    @classmethod
    def problems(cls, config: Config) -> list[str]:
        """What is wrong with the keys it reads, each as one line (GPTConfig raises them all)."""
        return []

    @classmethod
    def cache_spec(cls, config: Config) -> Spec:
        """What a layer of this kind keeps in the cache (kv_cache.py)."""
        raise NotImplementedError

    @classmethod
    def describe(cls, config: Config, layers: list[int]) -> str | None:
        """Its part of GPTConfig.describe(): the layers of this kind; None: nothing to add."""
        return f"{cls.name} layers {layers} of {config.n_layer}"

    @classmethod
    def hf_config(cls, config: Config) -> dict[str, Any]:
        """Its keys of the transformers config that holds it (beyond the model's sizes)."""
        return {}

    @classmethod
    def hf_problems(cls, hf_config: Any) -> list[str]:
        """What such layers of a transformers config hold that this kind cannot, each as the
        setting that says it."""
        return []


def overrides(kind: type, base: type, member: str) -> bool:
    """Whether kind defines member other than base's (a method or classmethod base leaves
    unimplemented)."""
    ours = getattr(kind, member, None)
    theirs = getattr(base, member)
    # a classmethod is a new bound object at every lookup: compare the functions under them
    return getattr(ours, "__func__", ours) is not getattr(theirs, "__func__", theirs)


def runtime_types(hint: Any) -> tuple[type, ...]:
    """The classes isinstance checks a value of this annotation against: str | None -> (str,
    NoneType), frozenset[str] -> (frozenset,)."""
    # typing.Union (Optional[...]) and the | form are two spellings of one union
    if get_origin(hint) in (Union, types.UnionType):
        return tuple(get_origin(arg) or arg for arg in get_args(hint))
    # a generic (frozenset[str], dict[str, str]) is checked by its class alone
    return (get_origin(hint) or hint,)


def declaration_problems(kind: type[LayerKind]) -> list[str]:
    """What kind leaves out of what LayerKind asks with no default (its letter, name and
    cache_spec; where it is its own mixer, Mixer's forward and mask, take_attention and
    keep_decay where it converts_attention), and each
    declaration of the wrong type: model.register_kind refuses a kind that has any, which would
    otherwise train and fail only when its model samples or exports."""
    missing = []
    mistyped = []
    # the declarations: ClassVar[<type>] each
    for member, hint in get_type_hints(LayerKind).items():
        if not hasattr(kind, member):
            missing.append(member)
            continue
        value = getattr(kind, member)
        # ClassVar[T]'s T, as the classes isinstance takes
        expected = runtime_types(get_args(hint)[0])
        if not isinstance(value, expected):
            names = " or ".join(t.__name__ for t in expected)
            mistyped.append(f"has {member}={value!r}, not a {names}")
    # every layer keeps something in the cache, so no default could be right
    if not overrides(kind, LayerKind, "cache_spec"):
        missing.append("cache_spec")
    # a kind that builds itself (the default build) is its own mixer
    if not overrides(kind, LayerKind, "build"):
        if not issubclass(kind, Mixer):
            mistyped.append("builds itself (build's default) but is no layer_kind.Mixer")
        else:
            # a mixer's forward and mask have no default: each kind's own
            required = ["forward", "mask"]
            # a conversion from attention calls these two on the new layer
            if getattr(kind, "converts_attention", False):
                required += ["take_attention", "keep_decay"]
            missing += [m for m in required if not overrides(kind, Mixer, m)]
    # one line for what is missing, then one for each declaration of the wrong type
    problems = [f"leaves out {', '.join(missing)}"] if missing else []
    return problems + mistyped
