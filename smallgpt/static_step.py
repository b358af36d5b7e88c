"""The one-token decoding step at fixed shapes, for the faster steps of the decoding engine: the CUDA graph
(generation.CUDAGraphStep) and the compiled CPU step (smallgpt/compiled_step.py). K/V are written
at a position held in a
tensor and the cache is read whole under a mask (or up to a length), so every step has the same shapes and no host
sync; the eager path (GPT.forward with a KVCache) computes the same logits (tests/test_model.py).
"""

import torch

import attention
from attention import KVCache
from model import GPT


class StaticKVView:
    """A KVCache as decode_static uses it: K/V written at a position held in a 1-element tensor (a local layer's at
    its ring slot), in place into the cache tensors (not a view of them, which a compiled step would copy whole),
    and returned whole: a global layer's first `length` positions, or all max_len when length is None (the step
    masks the unwritten ones)."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, length: int | None) -> None:
        B, G = cache.k.shape[1:3]
        self.cache, self.length, dev = cache, length, pos.device
        self.rows = (
            torch.arange(B, device=dev)[:, None],
            torch.arange(G, device=dev)[None, :],
        )  # (B, G) slots
        self.slot = {
            False: pos,
            True: pos % cache.ring if cache.ring else None,
        }  # a global layer's, a local one's

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local, i = self.cache.where[layer]
        keys, values = (
            (self.cache.ring_k, self.cache.ring_v) if local else (self.cache.k, self.cache.v)
        )
        at = (torch.full((), i, device=k.device), *self.rows, self.slot[local])
        keys.index_put_(at, k[:, :, 0])
        if v.size(-1):  # MLA's cache has no V (its values are the latent, in K)
            values.index_put_(at, v[:, :, 0])
        k, v = keys[i], values[i]
        if local or self.length is None:
            return k, v
        return k.narrow(2, 0, self.length), v.narrow(2, 0, self.length)


def decode_static(
    model: GPT, idx: torch.Tensor, pos: torch.Tensor, kv_cache: KVCache, length: int | None = None
) -> torch.Tensor:
    """Logits (B, 1, vocab) of one token per row, idx (B, 1), at position pos (a 1-element tensor), attending over
    the whole cache under a mask (the same shapes every step and no host sync, for CUDAGraphStep), or over a global
    layer's first `length` positions (the compiled CPU step's one dynamic size); a local layer over its ring."""
    x, rope = model.embed(idx, pos)
    keys = torch.arange(length or kv_cache.max_len, device=idx.device)
    masks = {
        None: None if length else (keys <= pos)[None, None, None, :]
    }  # what the query at pos sees
    if kv_cache.ring:  # a local layer's ring: its written slots (all in the window)
        seen = attention.ring_positions(pos + 1, kv_cache.ring, idx.device) >= 0
        masks[model.config.window] = seen[None, None, None, :]
    view = StaticKVView(kv_cache, pos, length)
    for block, window in zip(model.transformer.h, model.config.layer_windows, strict=True):
        x = block(x, rope, masks[window], view)
    return model.lm_head(model.transformer.ln_f(x))
