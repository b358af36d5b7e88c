"""The recurrent mixing kind: Gated DeltaNet (https://arxiv.org/abs/2412.06464), a linear-attention
layer whose cache is a fixed state (attention.Recurrent) instead of keys and values, behind the same
interface to the block and the cache as attention.py's kinds; the gated delta rule it runs is in
smallgpt/delta_rule.py. model.py builds it where GPTConfig.layer_pattern says D."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import Cache, RMSNorm, Rope
from smallgpt import delta_rule
from smallgpt.fast_paths import Linear


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x over the root of its squared features' sum (plus 1e-6, as Qwen3.5 and fla write it)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer, Gated DeltaNet (arXiv 2412.06464) as Qwen3.5 builds it: q, k and v
    of n_head heads from one projection through a short causal depthwise convolution and SiLU, q
    and k L2-normalised; per head and token a write strength b = sigmoid(c_b x) and a decay exp(g),
    g = -exp(A_log) softplus(c_a x + dt_bias); the gated delta rule (smallgpt/delta_rule.py)
    carries a state of head_dim x head_dim a head, chunked over a sequence and one step at a time
    while decoding; its output RMS-normalised per head times SiLU(c_z x), then projected. No
    positions: the recurrence orders the tokens. Its cache (Recurrent) is the state and the
    convolution's last kernel - 1 inputs, whatever the context's length.

    mask (B, T), True at a real token (None: all are): a left pad enters as zeros that neither
    decay nor write, so a row's state is what its own tokens make."""

    kernel = 4  # the convolution's taps
    # the GPTConfig keys it reads beyond the model's own: none (its sizes are n_embd and n_head),
    # so an attention key on a model of these layers alone changes nothing (model.LAYER_KINDS)
    READS: frozenset[str] = frozenset()
    chunk = 64  # tokens a step of delta_rule.chunked (docs/compare.md "the chunk")

    def __init__(self, layer: int, n_embd: int, n_head: int, bias: bool, dropout: float) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.c_qkv = Linear(n_embd, 3 * n_embd, bias=bias)  # [q | k | v], head by head
        self.conv = nn.Parameter(torch.empty(3 * n_embd, 1, self.kernel))  # nn.Conv1d's shape
        self.c_z = Linear(n_embd, n_embd, bias=bias)
        self.c_b = Linear(n_embd, n_head, bias=bias)
        self.c_a = Linear(n_embd, n_head, bias=bias)
        self.A_log = nn.Parameter(torch.empty(n_head))
        self.dt_bias = nn.Parameter(torch.empty(n_head))
        self.norm = RMSNorm(self.head_dim)
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def initial(self, name: str, generator: torch.Generator | None) -> torch.Tensor:
        """The initial values of the parameters no other layer has, as fla initialises them: the
        convolution as nn.Conv1d's default bound, A uniform in [1, 16], and dt_bias the inverse
        softplus of a step log-uniform in [0.001, 0.1]."""
        if name == "conv":
            bound = self.kernel**-0.5
            return torch.empty(self.conv.shape).uniform_(-bound, bound, generator=generator)
        if name == "A_log":
            return torch.empty(self.n_head).uniform_(1.0, 16.0, generator=generator).log()
        assert name == "dt_bias", f"no initial values for {name}"
        low, high = math.log(0.001), math.log(0.1)
        dt = (torch.rand(self.n_head, generator=generator) * (high - low) + low).exp()
        return dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape
        H, hd = self.n_head, self.head_dim
        if mask is not None:
            x = x * mask[..., None]  # a pad token: zeros in
        qkv = self.c_qkv(x).transpose(1, 2)  # (B, 3 C, T)
        if kv_cache is None:
            conv_in = qkv.new_zeros(B, 3 * C, self.kernel - 1)
            state = None
        else:
            conv_in, state = kv_cache.recurrent(self.layer)
        # the causal convolution over the last kernel - 1 inputs then these
        inputs = torch.cat((conv_in.to(qkv.dtype), qkv), dim=-1)  # (B, 3 C, kernel - 1 + T)
        qkv = F.silu(F.conv1d(inputs, self.conv.to(qkv.dtype), groups=3 * C))  # (B, 3 C, T)
        # q, k, v: (B, H, T, head_dim) in fp32, as the recurrence runs
        q, k, v = qkv.float().view(B, 3, H, hd, T).transpose(-1, -2).unbind(1)
        q = l2_normalised(q) * hd**-0.5
        k = l2_normalised(k)
        b = torch.sigmoid(self.c_b(x).float()).transpose(1, 2)  # (B, H, T)
        g = -self.A_log.float().exp() * F.softplus(self.c_a(x).float() + self.dt_bias.float())
        g = g.transpose(1, 2)  # (B, H, T)
        if mask is not None:  # a pad neither decays nor writes
            b = b * mask[:, None]
            g = g * mask[:, None]
        if T == 1 and state is not None:
            o, state = delta_rule.recurrent(q, k, v, g, b, state)
        else:
            o, state = delta_rule.chunked(q, k, v, g, b, state, self.chunk)
        if kv_cache is not None:
            kv_cache.remember(self.layer, inputs[..., -(self.kernel - 1) :], state)
        z = self.c_z(x).view(B, T, H, hd)
        o = self.norm(o.transpose(1, 2)) * F.silu(z.float())  # (B, T, H, head_dim)
        return self.resid_dropout(self.c_proj(o.to(x.dtype).reshape(B, T, C)))
