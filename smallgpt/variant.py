"""A comparison's variant names (compare.py --variants, its runs' folders and tags): the one
grammar, read by Variant.parse and written by str(Variant), and the model each name makes of an
MHA model. The attention in a name is GPTConfig.attention_type's, in lower case; its pattern's
letters are LAYER_KINDS'."""

import dataclasses
import re
from dataclasses import dataclass

import attention
from model import LAYER_KINDS, GPTConfig

# the keys a variant may set besides its attention's, in the order its name spells them: the
# layers' pattern and window, then Qwen3.5's attention options, then sinks and the layers without
# positions
OPTIONS = (
    "layer_pattern",
    "window_pattern",
    "window",
    "attn_gate",
    "qk_norm",
    "rope_fraction",
    "attn_sinks",
    "rope_pattern",
)
GATES = {None: "none", "-gate": "element", "-headgate": "head"}


def name_grammar() -> re.Pattern:
    """A name, all lower case: its attention and size (mha, gqa<n_kv_head>, mqa,
    mla<kv_lora_rank>), then its layers' pattern if not all global attention, letters of
    LAYER_KINDS with the window after it where some layer is local (mha-sssl64:
    window_pattern='SSSL', window=64; gqa2-dddl: layer_pattern='DDDL'), then Qwen3.5's attention
    options: -gate (per feature) or -headgate, -qknorm, -rope<percent>; then -sink (attn_sinks),
    and -nope (no layer has positions, rope_pattern='N') or -rp<letters> (rope_pattern: -rprrrn is
    'RRRN'). Read from the table at each call, so that a kind registered at run time has its
    letter."""
    letters = "".join(LAYER_KINDS).lower()
    return re.compile(
        r"(?P<attention>mha|mqa|gqa(?P<n_kv_head>[1-9][0-9]*)|mla(?P<kv_lora_rank>[1-9][0-9]*))"
        rf"(?:-(?P<pattern>[{letters}]+)(?P<window>[1-9][0-9]*)?)?"
        r"(?P<gate>-gate|-headgate)?(?P<qk_norm>-qknorm)?(?:-rope(?P<rope>[1-9][0-9]?))?"
        r"(?P<sink>-sink)?(?:(?P<nope>-nope)|-rp(?P<rope_pattern>[rn]+))?"
    )


def pattern_keys(pattern: str | None, window: int | None) -> dict[str, object]:
    """The keys that give a variant's layers this pattern (upper case) and window: window_pattern
    where its letters are nanochat's S and L (attention.window_pattern_problems), else
    layer_pattern."""
    keys: dict[str, object] = {}
    if pattern is None:
        return keys
    if attention.window_pattern_problems(pattern):
        keys["layer_pattern"] = pattern
    else:
        keys["window_pattern"] = pattern
    if window is not None:
        keys["window"] = window
    return keys


@dataclass(frozen=True, slots=True)
class Variant:
    """A model variant as its name says: 'mha', 'gqa2', 'mqa', 'mla16', 'mha-sssl64',
    'gqa2-dddl-gate-qknorm', 'mha-gate-sink', 'mla16-kkkl-nope': its attention and size, and the
    keys it sets away from an all-global MHA model without options (changes, in OPTIONS' order)."""

    attention: str  # 'mha', 'gqa', 'mqa' or 'mla': GPTConfig.attention_type in lower case
    size: int | None = None  # gqa's n_kv_head, mla's kv_lora_rank (mha's and mqa's: None)
    changes: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, attention: str, size: int | None, keys: dict[str, object]) -> "Variant":
        """The variant of this attention and size that sets these keys (their defaults left out)."""
        fields = GPTConfig.__dataclass_fields__
        changes = tuple(
            (key, keys[key])
            for key in OPTIONS
            if keys.get(key, fields[key].default) != fields[key].default
        )
        return cls(attention, size, changes)

    @classmethod
    def parse(cls, name: str) -> "Variant":
        """The variant name names; a ValueError for a name of none (names are lower case)."""
        parts = name_grammar().fullmatch(name)
        pattern = parts and parts["pattern"] and parts["pattern"].upper()
        window = int(parts["window"]) if parts and parts["window"] else None
        keys = pattern_keys(pattern, window)
        # a pattern of S and L only names local layers: their window follows it
        if parts is None or ("window_pattern" in keys and window is None):
            raise ValueError(f"{name!r} is not a variant name")
        keys["attn_gate"] = GATES[parts["gate"]]
        keys["qk_norm"] = bool(parts["qk_norm"])
        keys["rope_fraction"] = int(parts["rope"]) / 100 if parts["rope"] else 1.0
        keys["attn_sinks"] = bool(parts["sink"])
        keys["rope_pattern"] = "N" if parts["nope"] else (parts["rope_pattern"] or "r").upper()
        attention = parts["attention"][:3]
        size = parts["n_kv_head"] or parts["kv_lora_rank"]
        return cls.of(attention, int(size) if size else None, keys)

    @classmethod
    def from_config(cls, config: GPTConfig) -> "Variant":
        """The variant a model is (its attention_type, then its layers' pattern and options)."""
        attention = config.attention_type.lower()
        size = {"gqa": config.n_kv_head, "mla": config.kv_lora_rank}.get(attention)
        pattern = config.layer_pattern
        if pattern is None and config.window is not None:
            pattern = config.window_pattern
        keys = pattern_keys(pattern, config.window)
        for key in ("attn_gate", "qk_norm", "rope_fraction", "attn_sinks", "rope_pattern"):
            keys[key] = getattr(config, key)
        return cls.of(attention, size, keys)

    def config(self, mha: GPTConfig) -> GPTConfig:
        """This variant of an all-global MHA model (a ValueError where it cannot be one at that
        shape): the model's options as this variant's, its K/V as its attention's."""
        fields = GPTConfig.__dataclass_fields__
        keys = {key: fields[key].default for key in OPTIONS} | dict(self.changes)
        model = dataclasses.replace(mha, **keys)
        if self.attention == "mla":
            return dataclasses.replace(model, kv_lora_rank=self.size)
        n_kv_head = {"mha": model.n_head, "mqa": 1}.get(self.attention, self.size)
        return dataclasses.replace(model, n_kv_head=n_kv_head)

    @property
    def kinds_only(self) -> str | None:
        """The layers' letters of a variant whose one change is its layers' kinds (e.g. 'DDDL'
        of 'mha-dddl'), else None."""
        keys = dict(self.changes)
        return keys["layer_pattern"] if set(keys) == {"layer_pattern"} else None

    @property
    def suffix(self) -> str:
        """'-<pattern>[<window>]' where some layer is local or of another kind ('-sssl64',
        '-dddl'), then the attention options ('-gate-qknorm'); '' for all-global attention
        without options."""
        keys = dict(self.changes)
        suffix = ""
        pattern = keys.get("layer_pattern") or keys.get("window_pattern")
        if pattern:
            suffix = f"-{pattern.lower()}{keys.get('window') or ''}"
        gate = {"element": "-gate", "head": "-headgate"}.get(keys.get("attn_gate"), "")
        suffix += gate + ("-qknorm" if keys.get("qk_norm") else "")
        if keys.get("rope_fraction", 1) != 1:
            suffix += f"-rope{round(keys['rope_fraction'] * 100)}"
        suffix += "-sink" if keys.get("attn_sinks") else ""
        rope_pattern = keys.get("rope_pattern", "R")
        if rope_pattern != "R":
            suffix += "-nope" if set(rope_pattern) == {"N"} else f"-rp{rope_pattern.lower()}"
        return suffix

    def __str__(self) -> str:
        return f"{self.attention}{self.size or ''}{self.suffix}"


MHA = Variant("mha")  # the all-global MHA model, what a comparison measures the others against
