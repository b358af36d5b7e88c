"""Kimi Delta Attention (KDA, arXiv 2510.26692), Kimi Linear's recurrent kind of layer: Gated
DeltaNet with a decay per channel of the key instead of one per head,

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t,

the decay from a low-rank map of the input, the output through an RMSNorm gated by sigmoid of a
low-rank map. The rule itself is smallgpt/delta_rule.py's (a g per channel). K in layer_pattern:
model.LAYER_KINDS holds it as a row; Kimi Linear interleaves three with one MLA layer without
positions ('KKKL' with kv_lora_rank and rope_pattern='N')."""

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import RMSNorm
from gated_deltanet import KERNEL, Recurrence
from kv_cache import Cache
from layer_kind import Config, LayerKind, Rope
from smallgpt import delta_rule
from smallgpt.fast_paths import Linear


class KimiDeltaAttention(Recurrence, LayerKind):
    """A KDA layer as transformers' KimiLinearDeltaAttention builds it: q, k and v of n_head heads
    (head_dim each) from one product through a short causal depthwise convolution and SiLU, q and
    k L2-normalised; per head and token a write strength b = sigmoid(c_b x), and per channel a
    decay exp(g), g = -exp(A_log[head]) softplus(f_b(f_a(x)) + dt_bias), f_a to head_dim features
    and f_b back; the gated delta rule chunked over a sequence and one step at a time while
    decoding; each head's output RMS-normalised times sigmoid(g_b(g_a(x))), then projected. No
    positions. Its mask, FLOPs and cache are Gated DeltaNet's (Recurrence): the state and the
    convolution's last kernel - 1 inputs. mask (B, T): True at a real token; a left pad neither
    decays nor writes."""

    letter = "K"
    name = "Kimi Delta Attention"
    reads = frozenset()  # its sizes are n_embd, n_head and head_dim: the model's own
    # transformers' KimiLinearForCausalLM (smallgpt/hf_kimi.py): its layer type, and its
    # parameters' names; c_qkv is its q_proj, k_proj and v_proj, one above the other
    hf_model = "kimi_linear"
    hf_layer_type = "linear_attention"
    hf_names = {
        "conv": "self_attn.conv1d.weight",
        "f_a.weight": "self_attn.forget_gate.f_a_proj.weight",
        "f_b.weight": "self_attn.forget_gate.f_b_proj.weight",
        "dt_bias": "self_attn.forget_gate.dt_bias",
        "A_log": "self_attn.forget_gate.A_log",
        "c_b.weight": "self_attn.b_proj.weight",
        "g_a.weight": "self_attn.g_a_proj.weight",
        "g_b.weight": "self_attn.g_b_proj.weight",
        "norm.weight": "self_attn.o_norm.weight",
        "c_proj.weight": "self_attn.o_proj.weight",
    }
    kernel = KERNEL
    # tokens a step of delta_rule.chunked: half Gated DeltaNet's, its per-channel decays computed
    # block by block within it (delta_rule.within_chunks_per_channel)
    chunk = 32

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__(layer)
        n_embd = config.n_embd
        n_head = config.n_head
        bias = config.bias
        self.n_head = n_head
        self.head_dim = hd = config.head_dim
        self.c_qkv = Linear(n_embd, 3 * n_embd, bias=bias)  # [q | k | v], head by head
        self.conv = nn.Parameter(torch.empty(3 * n_embd, 1, self.kernel))  # nn.Conv1d's shape
        # the decay's low-rank map (head_dim wide, as Kimi Linear's), its bias a channel, and
        # each head's rate
        self.f_a = Linear(n_embd, hd, bias=False)  # down to the rank (head_dim)
        self.f_b = Linear(hd, n_embd, bias=False)  # back up: one rate a channel of every head's key
        self.dt_bias = nn.Parameter(torch.empty(n_embd))  # n_embd = n_head x head_dim channels
        self.A_log = nn.Parameter(torch.empty(n_head))  # one a head, scaling all its channels
        self.c_b = Linear(n_embd, n_head, bias=bias)  # b: one write strength a head
        # the output gate's low-rank map
        self.g_a = Linear(n_embd, hd, bias=False)  # down to the rank (head_dim)
        self.g_b = Linear(hd, n_embd, bias=False)  # back up: one gate a feature
        self.norm = RMSNorm(hd)  # over head_dim, one weight shared by the heads
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def initial(self, name: str, generator: torch.Generator | None) -> torch.Tensor | None:
        """As fla and transformers initialise them: the convolution as nn.Conv1d's default
        bound, A uniform in [1, 16], dt_bias the inverse softplus of a step log-uniform in
        [0.001, 0.1] (a channel each)."""
        if name == "conv":
            # nn.Conv1d's default bound 1 / sqrt(fan_in), a depthwise channel's fan_in its kernel
            bound = self.kernel**-0.5
            return torch.empty(self.conv.shape).uniform_(-bound, bound, generator=generator)
        if name == "A_log":
            # A = exp(A_log) in [1, 16] a head, as Gated DeltaNet's
            return torch.empty(self.n_head).uniform_(1.0, 16.0, generator=generator).log()
        if name == "dt_bias":
            low, high = math.log(0.001), math.log(0.1)
            # n_embd steps: every head's channels, each a step of its own
            width = self.dt_bias.numel()
            dt = (torch.rand(width, generator=generator) * (high - low) + low).exp()
            return dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
        # anything else: GPT-2's rule (Mixer.initial)
        return None

    def decay(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """g (B, H, T, head_dim): each channel's decay's log, -exp(A_log) softplus(f_b(f_a(x)) +
        dt_bias), in dtype."""
        B, T, _ = x.shape
        # the low-rank map to a rate a channel, (B, T, n_embd), plus each channel's bias
        rate = self.f_b(self.f_a(x)).to(dtype) + self.dt_bias.to(dtype)
        # softplus keeps each rate positive; (B, T, H, head_dim): a head's channels together
        rates = F.softplus(rate).view(B, T, self.n_head, -1)
        # A a head, broadcast over its channels: g <= 0, so each channel's decay exp(g) is in
        # (0, 1]; then (B, H, T, head_dim), the rule's layout
        return (-self.A_log.to(dtype).exp()[:, None] * rates).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_head
        hd = self.head_dim
        if mask is not None:  # a pad token enters as zeros
            x = x * mask[..., None]
        # the recurrence in fp32 whatever the autocast (or a float64 model's own dtype)
        q, k, v, state, inputs, _ = self.queries_keys_values(x, kv_cache)
        # the recurrence's dtype (fp32, or float64), for b, g and the gate too
        wide = q.dtype
        b = torch.sigmoid(self.c_b(x).to(wide)).transpose(1, 2)  # (B, H, T)
        g = self.decay(x, wide)  # (B, H, T, head_dim)
        if mask is not None:  # a pad neither decays nor writes
            # the mask (B, T) over the heads, and for g over each head's channels too
            b = b * mask[:, None]
            g = g * mask[:, None, :, None]
        with torch.autocast(x.device.type, enabled=False):
            # one decoded token after a state: the step form, O(1) a token
            if T == 1 and state is not None:
                o, state = delta_rule.recurrent(*self.normalised(q, k), v, g, b, state)
            else:
                # a CPU's compiled kernel (the norms in it), else the chunked form; no fla path
                # here: the kernel kernels_for finds takes one decay a head
                o, state = delta_rule.sequence(q, k, v, g, b, state, self.chunk, self.q_scale)
        # the state after these tokens, and the convolution's last inputs, for the next call
        self.remember(kv_cache, inputs, state)
        # each head's output normed, gated by sigmoid of the low-rank gate, then projected
        gate = self.g_b(self.g_a(x)).view(B, T, H, hd)
        # o from the rule is (B, H, T, head_dim): heads back to dim 2, each normed over head_dim
        o = self.norm(o.transpose(1, 2)) * torch.sigmoid(gate.to(wide))  # (B, T, H, head_dim)
        # back to the residual's dtype, the heads side by side again: (B, T, C)
        return self.resid_dropout(self.c_proj(o.to(x.dtype).reshape(B, T, C)))

    @classmethod
    def hf_config(cls, config: Config) -> dict[str, Any]:
        """Its keys of transformers' KimiLinearConfig: its heads are ours."""
        return dict(
            linear_conv_kernel_dim=KERNEL,
            linear_head_dim=config.head_dim,
            linear_num_heads=config.n_head,
        )

    @classmethod
    def hf_problems(cls, hf_config: Any) -> list[str]:
        """What a Kimi Linear config's KDA layers hold that this kind cannot."""
        c = hf_config
        # our head_dim: hidden_size over the heads
        hd = c.hidden_size // c.num_attention_heads
        problems = []
        if (c.linear_num_heads, c.linear_head_dim) != (c.num_attention_heads, hd):
            problems.append(
                f"linear_num_heads={c.linear_num_heads}, linear_head_dim={c.linear_head_dim} "
                f"(ours: {c.num_attention_heads} heads of {hd})"
            )
        if c.linear_conv_kernel_dim != KERNEL:
            problems.append(f"linear_conv_kernel_dim={c.linear_conv_kernel_dim}")
        return problems
