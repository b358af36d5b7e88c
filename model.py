"""A GPT: token embeddings, n_layer blocks and the tied output head, each block a norm, a layer
that mixes tokens, a norm and an MLP (GPT-2's block, or Llama's: norm='rmsnorm', mlp='swiglu').
The layer that mixes tokens is of the kind its letter in layer_pattern names, a row of LAYER_KINDS:
global or local attention (attention.py: MHA, GQA or MQA by n_kv_head, or MLA by kv_lora_rank) or
Gated DeltaNet (gated_deltanet.py). Decoding keeps each layer's cache in a KVCache (kv_cache.py)."""

import math
import zlib
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

import attention
from attention import RMSNorm
from kv_cache import Cache, KVCache
from layer_kind import Mask, Mixer, Rope, Tokens
from model_config import (  # noqa: F401 (re-exported: `from model import GPTConfig` and the table)
    IMPORTED_KINDS,
    LAYER_KINDS,
    POS_ENCODINGS,
    GPTConfig,
    kind_names,
    pattern_problems,
    register_kind,
)
from smallgpt.fast_paths import Linear


def norm_for(config: GPTConfig, width: int) -> nn.LayerNorm | RMSNorm:
    """The block's norm: Llama's RMSNorm, or GPT-2's LayerNorm (its bias only with bias=True)."""
    if config.norm == "rmsnorm":
        return RMSNorm(width)
    return nn.LayerNorm(width, bias=config.bias)


class MLP(nn.Module):
    """GPT-2's MLP: c_proj(gelu(c_fc(x))), mlp_hidden wide (4 n_embd unless matched to another
    model's parameters: compare.py --match=params)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # up to mlp_hidden for the activation, then back into the residual stream
        self.c_fc = Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        # OpenAI's GPT-2 was trained with the tanh approximation: its weights load with gelu='tanh'
        self.approximate = "tanh" if config.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, n_embd) -> (B, T, mlp_hidden) -> (B, T, n_embd)
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class SwiGLU(nn.Module):
    """Llama's MLP: c_proj(silu(c_gate(x)) * c_fc(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # three matrices, not two: mlp_hidden's default 8/3 n_embd keeps GPT-2's weight count
        self.c_gate = Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_fc = Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the gate and the value, both (B, T, mlp_hidden), then back to (B, T, n_embd)
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x)))


class Block(nn.Module):
    """A norm, the layer's mixer (its kind's: config.layer_kinds), a norm, the MLP; each added to
    the residual stream."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = norm_for(config, config.n_embd)
        # the mixer of this layer's kind (attention, or a recurrence), named attn as GPT-2's is,
        # so that GPT-2's and exported weights keep their names
        self.attn = config.layer_kinds[layer].build(config, layer)
        self.ln_2 = norm_for(config, config.n_embd)
        self.mlp = SwiGLU(config) if config.mlp == "swiglu" else MLP(config)

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        # pre-norm residual: mix the tokens, then transform each token; x stays (B, T, n_embd)
        x = x + self.attn(self.ln_1(x), rope, mask, kv_cache)
        return x + self.mlp(self.ln_2(x))


def gpt2_initial(
    module: nn.Module,
    owner: str,
    leaf: str,
    shape: torch.Size,
    residual_std: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """GPT-2's initial values of a parameter: norms' weights one, biases zero, other weights
    N(0, 0.02), those of a projection back into the residual stream (c_proj) residual_std."""
    # drawn on the CPU whatever the parameter's device: the same seed, the same numbers
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        return torch.full(shape, 1.0 if leaf == "weight" else 0.0, device="cpu")
    if leaf == "bias":
        return torch.zeros(shape, device="cpu")
    # a smaller std where a layer writes into the residual stream, which sums 2 n_layer of them
    std = residual_std if owner.endswith("c_proj") else 0.02
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)


class GPT(nn.Module):
    """The decoder: token (and learned position) embeddings, n_layer blocks, a final norm and
    the output head tied to the token embeddings."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # GPT-2's module names (wte, h, ln_f), so that its weights load as they are; each block's
        # mixer of its layer's kind
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=norm_for(config, config.n_embd),
            )
        )
        # positions: a learned embedding each, or the rotary tables (derived from the config, so
        # kept out of the state_dict)
        if config.pos_encoding == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:
            table_shape = (config.block_size, config.rope_dim // 2)  # a frequency a pair
            self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
            self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)
        # the output head, (B, T, n_embd) -> (B, T, vocab_size)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, https://arxiv.org/abs/1608.05859
        # every buffer and weight set here, none left to nn.Module's defaults (a model built on
        # the meta device and then materialised gets the same numbers: sharding.build)
        self.init_buffers()
        self.init_weights()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the buffers derived from the config: the rotary tables."""
        if self.config.pos_encoding == "rope":
            c = self.config
            # (block_size, rope_dim // 2) each: a row a position, a column a rotated pair's angle
            cos, sin = attention.rope_tables(c.rope_dim, c.block_size, c.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(
        self,
        seed: int | None = None,
        assign: Callable[[torch.Tensor, torch.Tensor], Any] = torch.Tensor.copy_,
    ) -> None:
        """GPT-2's initialisation: weights N(0, 0.02) (c_proj's std / sqrt(2 * n_layer)), zero
        biases, LayerNorm weights one, stored by assign(param, values); meta parameters skipped.
        Given a seed, each is drawn whole on CPU from a generator seeded by (seed, its name): models
        of other shapes share every equal-shaped one; a larger one starts with a smaller's rows."""
        # 2 n_layer: a block's mixer and its MLP each write once into the residual stream
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        # lm_head's weight is wte's (tied): named_parameters yields it once
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            # the module that holds the parameter, and the parameter's own name in it
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner)
            generator = None
            if seed is not None:  # crc32: a CPU generator keeps 32 bits of its seed
                generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            # a mixer's own rule for its own parameters (a recurrence's decay), else GPT-2's
            values = module.initial(leaf, generator) if isinstance(module, Mixer) else None
            if values is None:
                values = gpt2_initial(module, owner, leaf, p.shape, residual_std, generator)
            assign(p, values)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; non_embedding leaves out token (= lm_head) and position embeddings."""
        count = sum(p.numel() for p in self.parameters())  # the tied lm_head counted once
        if non_embedding:  # nanoGPT's convention, for the FLOP estimates of the scaling papers
            count -= self.transformer.wte.weight.numel()
            if "wpe" in self.transformer:
                count -= self.transformer.wpe.weight.numel()
        return count

    def attention_params_per_layer(self) -> int:
        """The first layer's mixer's parameters (every layer's, but in a hybrid: mixing_params)."""
        return sum(p.numel() for p in self.transformer.h[0].attn.parameters())

    def mixing_params(self) -> int:
        """The parameters of every layer's mixer: attention, or Gated DeltaNet."""
        return sum(p.numel() for block in self.transformer.h for p in block.attn.parameters())

    def make_kv_cache(
        self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        """An empty cache of max_len (default block_size) positions, a local layer's its window, a
        recurrent layer's its state."""
        weight = self.transformer.wte.weight
        # each layer's part as its kind declares it (kv_cache.py), on the model's device and dtype
        shape = self.config.cache_shape(max_len or self.config.block_size)
        return KVCache.zeros(shape, batch_size, weight.device, dtype or weight.dtype)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        pad: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size) and the loss, or without targets the last position's logits.

        idx (B, T) continues kv_cache (if any). pad (B,) counts each row's left-padding tokens (the
        cache's too): they are masked out and the row's positions start after them."""
        B, T = idx.shape  # B rows of T new tokens each
        # these tokens' positions: after the cache's, and after each row's padding
        start = 0 if kv_cache is None else kv_cache.pos
        end = start + T  # one past these tokens' last position
        block_size = self.config.block_size
        # learned positions and the rotary tables stop at block_size (generation slides a window)
        if end > block_size:
            raise ValueError(f"sequence of {end} tokens is longer than block_size={block_size}")
        if kv_cache is not None and end > kv_cache.max_len:
            raise ValueError(f"KV cache holds {kv_cache.max_len} positions, {end} needed")
        pos = torch.arange(start, end, device=idx.device)  # (T,)
        if pad is not None:  # a left-padded row's first real token is its position 0
            pos = (pos[None, :] - pad[:, None]).clamp(min=0)  # (B, T)
        # the token embeddings, with the learned positions added or the rotary tables to apply
        x, rope = self.embed(idx, pos)  # (B, T, n_embd)
        x = self.transformer.drop(x)  # GPT-2's dropout on the embeddings, as on every residual
        x = self.blocks(x, rope, Tokens(T, start, pad, idx.device), kv_cache)
        # the cache now holds these T positions too
        if kv_cache is not None:
            kv_cache.pos += T
        # the final norm, then the logits (tied to the token embeddings)
        x = self.transformer.ln_f(x)
        # a cached decode step or a prefill needs only the next token's logits (a vocabulary-wide
        # product a position saved)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None  # (B, 1, vocab_size)
        logits = self.lm_head(x)
        flat_logits = logits.view(-1, logits.size(-1))  # (B * T, vocab_size)
        # targets of -1 (MQAR's positions that are not answers, padding) count for nothing
        loss = F.cross_entropy(flat_logits, targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def blocks(self, x: torch.Tensor, rope: Rope, at: Tokens, cache: Cache | None) -> torch.Tensor:
        """The blocks over x (B, T, n_embd), the tokens `at`: the one loop of every forward, this
        model's and the fixed-shape step's (smallgpt/static_step.py, over its StaticKVCache)."""
        # each layer's mask by its kind's rule, computed once for the layers that share it (a
        # causal one for global attention, a band for a window, a pad mask for a recurrence)
        masks: dict[Hashable, Mask] = {}
        for block in self.transformer.h:
            key = block.attn.mask_key
            if key not in masks:
                masks[key] = block.attn.mask(at, cache)
            # each block reads and writes its own part of the cache
            x = block(x, rope, masks[key], cache)
        return x

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """Embeddings (B, T, n_embd) of idx (B, T) at positions pos, (T,) or (B, T), and the rotary
        cos and sin there, each (B or 1, 1, T, rope_dim // 2), or None for learned positions."""
        x = self.transformer.wte(idx)  # (B, T, n_embd)
        if self.config.pos_encoding == "learned":  # GPT-2's: a vector a position, added once
            return x + self.transformer.wpe(pos), None
        # rotary: the tables' rows at these positions, applied to q and k in each layer
        T = idx.size(1)
        half_dim = self.config.rope_dim // 2  # the rotated features of a head, in pairs
        cos = self.rope_cos[pos].view(-1, 1, T, half_dim)  # (B or 1, 1, T, head_dim // 2)
        sin = self.rope_sin[pos].view(-1, 1, T, half_dim)
        return x, (cos, sin)

    def configure_optimizers(
        self,
        weight_decay: float,
        learning_rate: float,
        betas: tuple[float, float],
        device_type: str,
        params: list[nn.Parameter] | None = None,
    ) -> torch.optim.AdamW:
        """AdamW over params (default: all), decaying matrices (embeddings included) only."""
        if params is None:
            params = list(self.parameters())
        # frozen parameters (distill='layers' trains the converted layers alone) are left out
        trainable = [p for p in params if p.requires_grad]
        # nanoGPT's split: weight decay on matrices, none on biases, norms and per-head vectors
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        # two groups: the decayed matrices and the rest, one learning rate (train.py schedules it)
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # CPU: torch's default loop (foreach was no faster); fused drifts gloo ranks apart
        # (performance-cpu.md)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, as in the PaLM paper's appendix B: 6 per
        matmul weight (lm_head and K/V projections included) plus 6 * n_layer * seq_len * (the
        widths of all heads' queries and values) for attention scores and weighted sums (causal
        masking not subtracted), or another kind's own (Mixer.mixing_flops)."""
        seq_len = seq_len or self.config.block_size
        # a weight is a multiply-add forward and two backward (its input's and its own gradient)
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        # the work that is not a weight's: attention's scores, a recurrence's state updates
        mixing = sum(block.attn.mixing_flops(seq_len) for block in self.transformer.h)
        return 6 * matmul_weights + mixing

    def estimate_mfu(
        self, tokens_per_iter: int, dt: float, peak_flops: float, seq_len: int | None = None
    ) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak_flops."""
        # the model's FLOPs, not the hardware's: recomputation and padding do not count
        return self.flops_per_token(seq_len) * tokens_per_iter / dt / peak_flops
