"""The recurrent kind of layer: Gated DeltaNet (https://arxiv.org/abs/2412.06464), a linear
attention whose cache is a fixed state instead of keys and values, behind the same interface to
the block and the cache as attention's kinds; the gated delta rule it runs is in
smallgpt/delta_rule.py. D in layer_pattern: model.LAYER_KINDS holds it as a row."""

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import RMSNorm
from kv_cache import Cache, StateSpec
from layer_kind import Config, LayerKind, Mask, Mixer, Rope, Tokens
from smallgpt import delta_rule, delta_rule_kernel
from smallgpt.fast_paths import Linear

KERNEL = 4  # the convolution's taps


def real_tokens(
    T: int, start: int, pad: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """The mask (B, T) of the tokens at start..start+T-1: True where a row's token is real, False
    on its left padding (pad[b] slots of row b); None without padding."""
    if pad is None:
        return None
    # (1, T) positions against (B, 1) pads: a row's first pad[b] positions are its padding
    return torch.arange(start, start + T, device=device)[None, :] >= pad[:, None]


def short_convolution(
    x: torch.Tensor, conv: torch.Tensor, conv_in: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise convolution (conv: nn.Conv1d's (width, 1, kernel)) over x
    (B, T, width) after conv_in (B, kernel - 1, width), its last inputs before these; and the
    last kernel - 1 inputs (B, kernel - 1, width), which the next tokens start from.

    A sequence on a CPU goes through the compiled kernel (smallgpt/delta_rule_kernel.py: one pass
    each way, in fp32) where it runs; elsewhere (CUDA, one decoded token, the torch path chosen)
    a sum of shifted products in x's type: elementwise, so inductor fuses it and its backward
    (docs/performance-cpu.md)."""
    T = x.size(1)
    kernel = conv.size(-1)
    # the cache keeps the inputs in its own dtype: cast to x's, for the sums below
    conv_in = conv_in.to(x.dtype)
    # the last kernel - 1 inputs; with fewer tokens than that (one decoded), some are conv_in's
    last = torch.cat((conv_in, x[:, -(kernel - 1) :]), dim=1)[:, -(kernel - 1) :]
    taps = conv.view(-1, kernel).t()  # (kernel, width): tap j of every channel side by side
    # a sequence on a CPU: the compiled op (in fp32 inside), which reads the taps contiguous
    if T > 1 and x.device.type == "cpu" and delta_rule_kernel.available():
        return F.silu(delta_rule_kernel.convolve(x, conv_in, taps.contiguous())), last
    # (B, kernel - 1 + T, width): the cached inputs, then these tokens'
    inputs = torch.cat((conv_in, x), dim=1)
    taps = taps.to(x.dtype)
    # output t sums inputs t..t + kernel - 1, tap kernel - 1 on token t itself: causal, as
    # nn.Conv1d with kernel - 1 zeros of left padding
    y = inputs[:, :T] * taps[0]
    for j in range(1, kernel):
        y = y + inputs[:, j : j + T] * taps[j]
    return F.silu(y), last


class Recurrence(Mixer):
    """What the recurrent kinds' mixers share beside their forward (Gated DeltaNet's, KDA's): the
    recurrence orders the tokens, so a mask only says which are real; their FLOPs are the chunked
    delta rule's; their cache is the state and the convolution's last inputs; their q, k and v
    come from one product through the convolution (`queries_keys_values`). A subclass sets
    n_head, head_dim, chunk, c_qkv and conv."""

    n_head: int
    head_dim: int
    chunk: int
    c_qkv: nn.Linear
    conv: nn.Parameter

    def queries_keys_values(
        self, x: torch.Tensor, kv_cache: Cache | None
    ) -> tuple[torch.Tensor, ...]:
        """q, k, v (B, H, T, head_dim) of x (B, T, n_embd; pads already zeros) through the
        convolution after the cache's last inputs, in fp32 (or a float64 model's own dtype), q and
        k before their L2 norm and q's scale (`normalised`; delta_rule.sequence applies both);
        the state before these tokens (None from an empty context); the convolution's last
        inputs (remember's); the products' dtype (the autocast's)."""
        B, T, C = x.shape
        qkv = self.c_qkv(x)  # (B, T, 3 C)
        # no cache (training, a recompute): zeros before the first token, the rule from zeros
        if kv_cache is None:
            conv_in = qkv.new_zeros(B, KERNEL - 1, 3 * C)
            state = None
        else:
            # the cache's: the convolution's last inputs and the state, zeros at position 0
            conv_in, state = kv_cache.read_state(self.layer)
            conv_in = conv_in.transpose(1, 2)  # the cache keeps (B, 3 C, kernel - 1)
        # the products' dtype before the casts below: fla's kernels take q, k and v in it
        products = qkv.dtype
        qkv, inputs = short_convolution(qkv, self.conv, conv_in)  # (B, T, 3 C)
        # fp32 for the recurrence (float64 stays float64): its state sums over every token
        wide = torch.promote_types(products, torch.float32)
        # c_qkv's rows are [q | k | v], each head by head: views (B, H, T, head_dim) of the
        # (B, T, H, head_dim) thirds, which the kernel reads as they lie. Split, their gradients
        # join in one copy (unbound from a permuted view: a stack, then a copy into the layout)
        thirds = qkv.to(wide).split(C, dim=-1)
        q, k, v = (x.view(B, T, self.n_head, -1).transpose(1, 2) for x in thirds)
        return q, k, v, state, inputs, products

    @property
    def q_scale(self) -> float:
        """q's scale after its L2 norm, head_dim^-0.5 as attention's scores have it: the rule
        itself applies none."""
        return self.head_dim**-0.5

    def normalised(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as the rule reads them: L2-normalised, q then scaled (for the paths that take
        them so: one decoded token, fla's kernels; delta_rule.sequence does it itself)."""
        return delta_rule.l2_normalised(q) * self.q_scale, delta_rule.l2_normalised(k)

    def remember(self, kv_cache: Cache | None, inputs: torch.Tensor, state: torch.Tensor) -> None:
        """What the next tokens start from: the convolution's last inputs and the state."""
        if kv_cache is not None:
            # back to the cache's (B, 3 C, kernel - 1) layout, channels first
            kv_cache.write_state(self.layer, inputs.transpose(1, 2), state)

    def mask(self, at: Tokens, cache: Cache | None) -> Mask:
        # the fixed-shape step's one token a row is never padding: no mask
        return real_tokens(at.T, at.start, at.pad, at.device)

    def mixing_flops(self, seq_len: int) -> int:
        # its products a token (delta_rule.chunked), about four over its chunk (q.k, k.k, the
        # solves, the scores' sum) and four with its state
        chunk = min(self.chunk, seq_len)
        return 6 * self.n_head * self.head_dim * (4 * chunk + 4 * self.head_dim)

    @classmethod
    def cache_spec(cls, config: Config) -> StateSpec:
        """q, k and v of every head through its convolution (its last kernel - 1 inputs), and a
        head_dim x head_dim state a head in fp32 (a running sum over every token)."""
        hd = config.head_dim
        # the convolution's last inputs, every channel of q, k and v
        conv = (3 * config.n_embd, KERNEL - 1)
        # a head's state maps a key (head_dim) to a value (head_dim): keys as wide as values
        state = (config.n_head, hd, hd)
        # only the state in fp32: the convolution's inputs are a window, not a running sum
        return StateSpec((conv, state), (False, True))


class GatedDeltaNet(Recurrence, LayerKind):
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

    letter = "D"
    name = "Gated DeltaNet"
    # it reads no key beyond the model's own (its sizes are n_embd and n_head), so an attention
    # key on a model of these layers alone changes nothing
    reads = frozenset()
    # Qwen3.5's (transformers' Qwen3_5ForCausalLM): its layer type, and its parameters' names
    hf_model = "qwen3_5_text"
    hf_layer_type = "linear_attention"
    hf_names = {
        "c_qkv.weight": "linear_attn.in_proj_qkv.weight",
        "conv": "linear_attn.conv1d.weight",
        "c_z.weight": "linear_attn.in_proj_z.weight",
        "c_b.weight": "linear_attn.in_proj_b.weight",
        "c_a.weight": "linear_attn.in_proj_a.weight",
        "A_log": "linear_attn.A_log",
        "dt_bias": "linear_attn.dt_bias",
        "norm.weight": "linear_attn.norm.weight",
        "c_proj.weight": "linear_attn.out_proj.weight",
    }
    converts_attention = True  # smallgpt/hybridize.py: take_attention, keep_decay
    kernel = KERNEL
    chunk = 64  # tokens a step of delta_rule.chunked (docs/compare.md "the chunk")

    def __init__(self, config: Config, layer: int) -> None:
        super().__init__(layer)
        n_embd = config.n_embd
        n_head = config.n_head
        bias = config.bias
        dropout = config.dropout
        self.n_head = n_head
        self.head_dim = config.head_dim
        self.c_qkv = Linear(n_embd, 3 * n_embd, bias=bias)  # [q | k | v], head by head
        self.conv = nn.Parameter(torch.empty(3 * n_embd, 1, self.kernel))  # nn.Conv1d's shape
        self.c_z = Linear(n_embd, n_embd, bias=bias)  # the output gate: one a feature
        self.c_b = Linear(n_embd, n_head, bias=bias)  # b: one write strength a head
        self.c_a = Linear(n_embd, n_head, bias=bias)  # the decay's rate: one a head
        self.A_log = nn.Parameter(torch.empty(n_head))  # each head's A, as its log (A > 0)
        self.dt_bias = nn.Parameter(torch.empty(n_head))  # each head's, inside the softplus
        self.norm = RMSNorm(self.head_dim)  # over head_dim, one weight shared by the heads
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def initial(self, name: str, generator: torch.Generator | None) -> torch.Tensor:
        """The initial values of the parameters no other layer has, as fla initialises them: the
        convolution as nn.Conv1d's default bound, A uniform in [1, 16], and dt_bias the inverse
        softplus of a step log-uniform in [0.001, 0.1]."""
        if name == "conv":
            # nn.Conv1d's default bound 1 / sqrt(fan_in), a depthwise channel's fan_in its kernel
            bound = self.kernel**-0.5
            return torch.empty(self.conv.shape).uniform_(-bound, bound, generator=generator)
        if name == "A_log":
            # A = exp(A_log) in [1, 16]: each head's -g starts at A times its step
            return torch.empty(self.n_head).uniform_(1.0, 16.0, generator=generator).log()
        assert name == "dt_bias", f"no initial values for {name}"
        # a step log-uniform in [0.001, 0.1] a head, then dt_bias its inverse softplus
        low, high = math.log(0.001), math.log(0.1)
        dt = (torch.rand(self.n_head, generator=generator) * (high - low) + low).exp()
        return dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: torch.Tensor | None, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_head
        hd = self.head_dim
        # q, k and v of every head from one product; a pad token enters as zeros
        if mask is not None:
            x = x * mask[..., None]
        # in fp32 as the recurrence runs (fla's kernels take them in the products' dtype)
        q, k, v, state, inputs, products = self.queries_keys_values(x, kv_cache)
        # the recurrence's dtype (fp32, or float64), for b, g and the gate too
        wide = q.dtype
        # per head and token: how strongly it writes (b), and how much of the state it keeps (g)
        b = torch.sigmoid(self.c_b(x).to(wide)).transpose(1, 2)  # (B, H, T)
        # g = -A softplus(c_a x + dt_bias) <= 0, so the decay exp(g) is in (0, 1]
        rate = self.c_a(x).to(wide) + self.dt_bias.to(wide)
        g = -self.A_log.to(wide).exp() * F.softplus(rate)  # (B, T, H)
        g = g.transpose(1, 2)  # (B, H, T)
        if mask is not None:  # a pad neither decays nor writes
            # b and g are (B, H, T), the mask (B, T): one flag a token, the same for every head
            b = b * mask[:, None]
            g = g * mask[:, None]
        # the gated delta rule: one step while decoding, chunk by chunk over a sequence
        # in fp32 whatever the autocast: its many small products would each be cast
        with torch.autocast(x.device.type, enabled=False):
            if T == 1 and state is not None:
                # one decoded token after a state: the step form, O(1) a token
                o, state = delta_rule.recurrent(*self.normalised(q, k), v, g, b, state)
            elif kernel := delta_rule.kernels_for(q):
                # CUDA with fla: its Triton kernels, q, k and v in the products' dtype
                q, k = self.normalised(q, k)
                o, state = delta_rule.on_kernels(kernel, q, k, v, g, b, state, products)
            else:
                # a CPU's compiled kernel (the norms in it), else the chunked torch form
                # (delta_rule.sequence picks)
                o, state = delta_rule.sequence(q, k, v, g, b, state, self.chunk, self.q_scale)
        # the state after these tokens, (B, H, head_dim, head_dim), for the next call
        self.remember(kv_cache, inputs, state)
        # each head's output normed and gated by SiLU(c_z x), then projected
        z = self.c_z(x).view(B, T, H, hd)
        # o from the rule is (B, H, T, head_dim): heads back to dim 2, each normed over head_dim
        o = self.norm(o.transpose(1, 2)) * F.silu(z.to(wide))  # (B, T, H, head_dim)
        # back to the residual's dtype, the heads side by side again: (B, T, C)
        return self.resid_dropout(self.c_proj(o.to(x.dtype).reshape(B, T, C)))

    @torch.no_grad()
    def take_attention(self, source: Mixer) -> None:
        """A global attention layer's weights, as the conversion papers copy them (the W_q, W_k,
        W_v, W_o of smallgpt/hybridize.py's text): its q rows, its K/V heads repeated over their
        groups (query head h from K/V head h // group), a q/k RMSNorm's weights folded into the
        rows (the L2 norm here drops its scale), W_o as c_proj; the convolution the identity (its
        last tap 1), and an elementwise output gate's weights as c_z."""
        # query heads a K/V head serves (GQA; 1 for MHA)
        group = source.n_head // source.n_kv_head
        hd = self.head_dim

        def per_query_head(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            # t's rows: n_kv_head heads of head_dim each (then a weight's columns; a bias has none)
            heads = t.view(source.n_kv_head, hd, *t.shape[1:])
            # each K/V head once for each of its query heads, as GQA's attention reads it
            return heads.repeat_interleave(group, dim=0).reshape(self.n_head * hd, *t.shape[1:])

        # the weights first, then the biases where the layer has them
        for attr in ("weight", "bias"):
            q = getattr(source.c_q, attr)
            if q is None:
                continue
            k = per_query_head(getattr(source.c_k, attr))
            v = per_query_head(getattr(source.c_v, attr))
            if source.qk_norm:  # l2norm(rmsnorm(x) w) = l2norm(x w): w scales the rows
                # one norm weight of head_dim, shared by the heads: repeated over n_head, a row each
                q_scale = source.q_norm.weight.repeat(self.n_head)
                k_scale = source.k_norm.weight.repeat(self.n_head)
                q = q * (q_scale[:, None] if attr == "weight" else q_scale)
                k = k * (k_scale[:, None] if attr == "weight" else k_scale)
            # [q | k | v], as c_qkv's rows are laid out
            getattr(self.c_qkv, attr).copy_(torch.cat((q, k, v)))
            getattr(self.c_proj, attr).copy_(getattr(source.c_proj, attr))
        # the convolution as the identity (SiLU still follows it)
        self.conv.zero_()
        self.conv[:, 0, -1] = 1.0  # the last tap reads the token itself
        gate = source.gate
        # only an elementwise gate fits c_z; one gate a head (n_head outputs) is left out
        if gate is not None and gate.c_gate.weight.shape == self.c_z.weight.shape:
            self.c_z.load_state_dict(gate.c_gate.state_dict())

    @torch.no_grad()
    def keep_decay(self, decay: torch.Tensor) -> None:
        # the same for every token: c_a zeroed, A_log 0 and dt_bias the inverse softplus of
        # -log a, so g = -softplus(dt_bias) = log a
        self.c_a.weight.zero_()
        if self.c_a.bias is not None:
            self.c_a.bias.zero_()
        self.A_log.zero_()
        # in float64: a decay near 1 leaves a step near 0, whose log(expm1) needs the precision
        step = -decay.double().log()
        self.dt_bias.copy_(torch.log(torch.expm1(step)))

    @classmethod
    def hf_config(cls, config: Config) -> dict[str, Any]:
        """Its keys of transformers' Qwen3_5TextConfig: its heads are ours, keys as wide as
        values."""
        return dict(
            linear_conv_kernel_dim=KERNEL,
            linear_key_head_dim=config.head_dim,
            linear_value_head_dim=config.head_dim,
            linear_num_key_heads=config.n_head,
            linear_num_value_heads=config.n_head,
        )

    @classmethod
    def hf_problems(cls, hf_config: Any) -> list[str]:
        """What a Qwen3.5 config's linear-attention layers hold that this kind cannot."""
        c = hf_config
        # our head_dim: hidden_size over the heads
        hd = c.hidden_size // c.num_attention_heads
        linear = (c.linear_key_head_dim, c.linear_value_head_dim)
        linear_heads = (c.linear_num_key_heads, c.linear_num_value_heads)
        problems = []
        # ours: n_head heads of head_dim, keys as wide as values
        if linear != (hd, hd) or linear_heads != (c.num_attention_heads,) * 2:
            problems.append(
                f"linear heads {linear_heads} of widths {linear} (ours: "
                f"{c.num_attention_heads} of {hd}, keys as wide as values)"
            )
        if c.linear_conv_kernel_dim != KERNEL:
            problems.append(f"linear_conv_kernel_dim={c.linear_conv_kernel_dim}")
        return problems
