"""The one-token decoding step at fixed shapes, for the faster steps of the decoding engine: the CUDA graph
(generation.CUDAGraphStep) and the compiled CPU step (compiled_step.py). K/V are written at a position held in a
tensor and the cache is read whole under a mask (or up to a length), so every step has the same shapes and no host
sync; the eager path (GPT.forward with a KVCache) computes the same logits (tests/test_model.py).
"""

import torch

from attention import KVCache
from model import GPT


class StaticKVView:
    """A KVCache as decode_static uses it: K/V written at a position held in a 1-element tensor, in place into
    the cache tensors (not a view of them, which a compiled step would copy whole), and the first `length`
    positions returned, or all max_len when length is None (the step masks the unwritten ones)."""

    def __init__(self, cache: KVCache, pos: torch.Tensor, length: int | None) -> None:
        B, G = cache.k.shape[1:3]
        self.cache, self.length, dev = cache, length, pos.device
        self.at = (torch.arange(B, device=dev)[:, None], torch.arange(G, device=dev)[None, :], pos)  # (B, G) slots

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = (torch.full((), layer, device=k.device), *self.at)
        self.cache.k.index_put_(at, k[:, :, 0])
        if v.size(-1):  # MLA's cache has no V (its values are the latent, in K)
            self.cache.v.index_put_(at, v[:, :, 0])
        k, v = self.cache.k[layer], self.cache.v[layer]
        return (k, v) if self.length is None else (k.narrow(2, 0, self.length), v.narrow(2, 0, self.length))


def decode_static(model: GPT, idx: torch.Tensor, pos: torch.Tensor, kv_cache: KVCache, length: int | None = None
                  ) -> torch.Tensor:
    """Logits (B, 1, vocab) of one token per row, idx (B, 1), at position pos (a 1-element tensor), attending over
    the whole cache under a mask (the same shapes every step and no host sync, for CUDAGraphStep), or over its
    first `length` positions (the compiled CPU step's one dynamic size)."""
    x, rope = model.embed(idx, pos)
    keys = torch.arange(length or kv_cache.max_len, device=idx.device)
    masks = {}  # per window (None: a global layer): what the query at pos sees of the cache
    windows = model.config.layer_windows
    for window in set(windows):
        seen = (keys <= pos) & (keys > pos - window) if window else keys <= pos
        masks[window] = None if length and window is None else seen[None, None, None, :]
    view = StaticKVView(kv_cache, pos, length)
    for block, window in zip(model.transformer.h, windows, strict=True):
        x = block(x, rope, masks[window], view)
    return model.lm_head(model.transformer.ln_f(x))

