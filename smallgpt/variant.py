"""A comparison's variant names (compare.py --variants, its runs' folders and tags): the one
grammar, read by Variant.parse and written by str(Variant), and the model each name makes of an
MHA model. The kind in a name is GPTConfig.attention_kind's, in lower case."""

import dataclasses
import re
from dataclasses import dataclass

from model import GPTConfig

# a name, all lower case: its kind and size (mha, gqa<n_kv_head>, mqa, mla<kv_lora_rank>), then
# its layers' pattern if not all global attention: S local (with the window after it), D Gated
# DeltaNet (mha-sssl64: window_pattern='SSSL', window=64; gqa2-dddl: layer_pattern='DDDL'), then
# Qwen3.5's attention options: -gate (per feature) or -headgate, -qknorm, -rope<percent>
NAME = re.compile(
    r"(?P<kind>mha|mqa|gqa(?P<n_kv_head>[1-9][0-9]*)|mla(?P<kv_lora_rank>[1-9][0-9]*))"
    r"(?:-(?P<pattern>[sld]+)(?P<window>[1-9][0-9]*)?)?"
    r"(?P<gate>-gate|-headgate)?(?P<qk_norm>-qknorm)?(?:-rope(?P<rope>[1-9][0-9]?))?"
)
GATES = {None: "none", "-gate": "element", "-headgate": "head"}


@dataclass(frozen=True, slots=True)
class Variant:
    """A model variant as its name says: 'mha', 'gqa2', 'mqa', 'mla16', 'mha-sssl64',
    'gqa2-dddl-gate-qknorm'."""

    kind: str  # 'mha', 'gqa', 'mqa' or 'mla': GPTConfig.attention_kind in lower case
    n_kv_head: int | None = None  # gqa's K/V heads (mha's and mqa's follow from n_head)
    kv_lora_rank: int | None = None  # mla's latent width
    window: int | None = None  # the local layers' window; None: no layer local
    window_pattern: str | None = None  # train.py's --window_pattern ('SSSL'), with window
    layer_pattern: str | None = None  # train.py's --layer_pattern where it has D ('DDDL')
    attn_gate: str = "none"  # train.py's --attn_gate
    qk_norm: bool = False
    rope_fraction: float = 1.0

    @classmethod
    def parse(cls, name: str) -> "Variant":
        """The variant name names; a ValueError for a name of none (names are lower case)."""
        parts = NAME.fullmatch(name)
        pattern = parts and parts["pattern"]
        # a pattern of S and L only names local layers: their window follows it
        if parts is None or (pattern and "d" not in pattern and not parts["window"]):
            raise ValueError(f"{name!r} is not a variant name")
        window = int(parts["window"]) if parts["window"] else None
        window_pattern = None
        layer_pattern = None
        if pattern and "d" in pattern:
            layer_pattern = pattern.upper()  # train.py's patterns are upper case
        elif pattern:
            window_pattern = pattern.upper()
        kind = parts["kind"][:3]
        n_kv_head = int(parts["n_kv_head"]) if kind == "gqa" else None
        kv_lora_rank = int(parts["kv_lora_rank"]) if kind == "mla" else None
        rope_fraction = int(parts["rope"]) / 100 if parts["rope"] else 1.0
        return cls(
            kind,
            n_kv_head,
            kv_lora_rank,
            window,
            window_pattern,
            layer_pattern,
            GATES[parts["gate"]],
            bool(parts["qk_norm"]),
            rope_fraction,
        )

    @classmethod
    def from_config(cls, config: GPTConfig) -> "Variant":
        """The variant a model is (its attention_kind, then its layers' pattern and options)."""
        kind = config.attention_kind.lower()
        n_kv_head = config.n_kv_head if kind == "gqa" else None
        kv_lora_rank = config.kv_lora_rank if kind == "mla" else None
        window_pattern = None
        layer_pattern = None
        if config.recurrent_layers:
            layer_pattern = config.layer_pattern
        elif config.window is not None:
            window_pattern = config.layer_pattern or config.window_pattern
        return cls(
            kind,
            n_kv_head,
            kv_lora_rank,
            config.window,
            window_pattern,
            layer_pattern,
            config.attn_gate,
            config.qk_norm,
            config.rope_fraction,
        )

    def config(self, mha: GPTConfig) -> GPTConfig:
        """This variant of an all-global MHA model (a ValueError where it cannot be one at that
        shape)."""
        mha = dataclasses.replace(
            mha,
            attn_gate=self.attn_gate,
            qk_norm=self.qk_norm,
            rope_fraction=self.rope_fraction,
            window=self.window,
            window_pattern=self.window_pattern or "L",
            layer_pattern=self.layer_pattern,
        )
        if self.kind == "mla":
            return dataclasses.replace(mha, kv_lora_rank=self.kv_lora_rank)
        n_kv_head = {"mha": mha.n_head, "mqa": 1}.get(self.kind, self.n_kv_head)
        return dataclasses.replace(mha, n_kv_head=n_kv_head)

    @property
    def suffix(self) -> str:
        """'-<pattern>[<window>]' where some layer is local or recurrent ('-sssl64', '-dddl'), then
        the attention options ('-gate-qknorm'); '' for all-global attention without options."""
        suffix = ""
        pattern = self.layer_pattern or self.window_pattern
        if pattern:
            suffix = f"-{pattern.lower()}{self.window or ''}"
        gate = {"element": "-gate", "head": "-headgate"}.get(self.attn_gate, "")
        suffix += gate + ("-qknorm" if self.qk_norm else "")
        if self.rope_fraction != 1:
            suffix += f"-rope{round(self.rope_fraction * 100)}"
        return suffix

    @property
    def recurrent(self) -> bool:
        """Whether some layer is a Gated DeltaNet one."""
        return self.layer_pattern is not None

    def __str__(self) -> str:
        size = self.n_kv_head if self.kind == "gqa" else self.kv_lora_rank
        return f"{self.kind}{size or ''}{self.suffix}"


MHA = Variant("mha")  # the all-global MHA model, what a comparison measures the others against
