"""The one-token decoding step at fixed shapes, for the faster steps of the decoding engine: the
CUDA graph (generation.CUDAGraphStep) and the compiled CPU step (smallgpt/compiled_step.py). K/V
are written at a position held in a tensor and the cache is read whole under a mask (or up to a
length), so every step has the same shapes and no host sync; the eager path (GPT.forward with a
KVCache) computes the same logits (tests/test_model.py)."""

import torch

from attention import KVCache
from model import GPT


def decode_static(
    model: GPT, idx: torch.Tensor, pos: torch.Tensor, kv_cache: KVCache, length: int | None = None
) -> torch.Tensor:
    """Logits (B, 1, vocab) of one token per row, idx (B, 1), at position pos (a 1-element
    tensor), attending over the whole cache under a mask (the same shapes every step and no host
    sync, for CUDAGraphStep), or over a global layer's first `length` positions (the compiled CPU
    step's one dynamic size); a local layer over its ring."""
    x, rope = model.embed(idx, pos)
    view = kv_cache.static(pos, length)  # writes at pos, reads whole; its masks for each window
    for block, window in zip(model.transformer.h, model.config.layer_windows, strict=True):
        x = block(x, rope, view.masks[window], view)
    return model.lm_head(model.transformer.ln_f(x))
