import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's flat modules: model, train, ...

from model import GPT, GPTConfig  # noqa: E402

VARIANTS = {"MHA": 4, "GQA": 2, "MQA": 1}  # n_kv_head for n_head=4


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1337)


def tiny_model(n_kv_head: int | None = None, pos_encoding: str = "learned", **overrides: object) -> GPT:
    """A 2-layer, 32-wide model in eval mode, fp32 on CPU."""
    cfg = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, dropout=0.0,
               bias=True, pos_encoding=pos_encoding) | overrides
    return GPT(GPTConfig(**cfg)).eval()
