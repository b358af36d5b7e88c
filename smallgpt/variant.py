"""A comparison's variant names (compare.py --variants, its runs' folders and tags): the one
grammar, read by Variant.parse and written by str(Variant), and the model each name makes of an
MHA model. The kind in a name is GPTConfig.attention_kind's, in lower case."""

import dataclasses
import re
from dataclasses import dataclass

from model import GPTConfig

# a name, all lower case: its kind and size (mha, gqa<n_kv_head>, mqa, mla<kv_lora_rank>), then
# its local layers' pattern and window, if any (mha-sssl64: window_pattern='SSSL', window=64)
NAME = re.compile(
    r"(?P<kind>mha|mqa|gqa(?P<n_kv_head>[1-9][0-9]*)|mla(?P<kv_lora_rank>[1-9][0-9]*))"
    r"(?:-(?P<pattern>[sl]+)(?P<window>[1-9][0-9]*))?"
)


@dataclass(frozen=True, slots=True)
class Variant:
    """An attention variant as its name says: 'mha', 'gqa2', 'mqa', 'mla16', 'mha-sssl64'."""

    kind: str  # 'mha', 'gqa', 'mqa' or 'mla': GPTConfig.attention_kind in lower case
    n_kv_head: int | None = None  # gqa's K/V heads (mha's and mqa's follow from n_head)
    kv_lora_rank: int | None = None  # mla's latent width
    window: int | None = None  # the local layers' window; None: every layer global
    window_pattern: str | None = None  # train.py's --window_pattern ('SSSL'), with window

    @classmethod
    def parse(cls, name: str) -> "Variant":
        """The variant name names; a ValueError for a name of none (names are lower case)."""
        parts = NAME.fullmatch(name)
        if parts is None:
            raise ValueError(f"{name!r} is not a variant name")
        window = None
        window_pattern = None
        if parts["pattern"]:
            window = int(parts["window"])
            window_pattern = parts["pattern"].upper()  # train.py's window_pattern is upper case
        kind = parts["kind"][:3]
        n_kv_head = int(parts["n_kv_head"]) if kind == "gqa" else None
        kv_lora_rank = int(parts["kv_lora_rank"]) if kind == "mla" else None
        return cls(kind, n_kv_head, kv_lora_rank, window, window_pattern)

    @classmethod
    def from_config(cls, config: GPTConfig) -> "Variant":
        """The variant a model is (its attention_kind, then its local layers)."""
        kind = config.attention_kind.lower()
        n_kv_head = config.n_kv_head if kind == "gqa" else None
        kv_lora_rank = config.kv_lora_rank if kind == "mla" else None
        window_pattern = config.window_pattern if config.window is not None else None
        return cls(kind, n_kv_head, kv_lora_rank, config.window, window_pattern)

    def config(self, mha: GPTConfig) -> GPTConfig:
        """This variant of an all-global MHA model (a ValueError where it cannot be one at that
        shape)."""

        if self.window is not None:
            mha = dataclasses.replace(mha, window=self.window, window_pattern=self.window_pattern)
        if self.kind == "mla":
            return dataclasses.replace(mha, kv_lora_rank=self.kv_lora_rank)
        n_kv_head = {"mha": mha.n_head, "mqa": 1}.get(self.kind, self.n_kv_head)
        return dataclasses.replace(mha, n_kv_head=n_kv_head)

    @property
    def window_suffix(self) -> str:
        """'-<window_pattern><window>' where layers are local ('-sssl64'), '' where none is."""
        if self.window is None:
            return ""
        return f"-{self.window_pattern.lower()}{self.window}"

    def __str__(self) -> str:
        size = self.n_kv_head if self.kind == "gqa" else self.kv_lora_rank
        return f"{self.kind}{size or ''}{self.window_suffix}"


MHA = Variant("mha")  # the all-global MHA model, what a comparison measures the others against
