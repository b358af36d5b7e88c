"""The one-token decoding step at fixed shapes, for the faster steps of the decoding engine: the
CUDA graph (generation.CUDAGraphStep) and the compiled CPU step (smallgpt/compiled_step.py). K/V
are written at a position held in a tensor and the cache is read whole under a mask (or up to a
length), so every step has the same shapes and no host sync; the eager path (GPT.forward with a
KVCache) computes the same logits (tests/test_model.py)."""

import torch

from kv_cache import KVCache
from layer_kind import Tokens
from model import GPT


def decode_static(
    model: GPT, idx: torch.Tensor, pos: torch.Tensor, kv_cache: KVCache, length: int | None = None
) -> torch.Tensor:
    """Logits (B, 1, vocab) of one token per row, idx (B, 1), at position pos (a 1-element
    tensor), attending over the whole cache under a mask (the same shapes every step and no host
    sync, for CUDAGraphStep), or over a global layer's first `length` positions (the compiled CPU
    step's one dynamic size); a local layer over its ring."""
    x, rope = model.embed(idx, pos)
    # the cache as this step reads it: written at pos, read whole
    view = kv_cache.static(pos, length)
    # GPT.forward's loop of blocks, each kind's mask over this view (one token a row at pos)
    x = model.blocks(x, rope, Tokens(1, pos, None, pos.device), view)
    return model.lm_head(model.transformer.ln_f(x))
