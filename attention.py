"""Attention, the kinds of layer that attend: global (L in layer_pattern: every earlier token) and
local (S: the newest `window` tokens), each as MHA, GQA or MQA (CausalSelfAttention, set by its
number of K/V heads, with Qwen3.5's options: an output gate, q/k norms, a rotary fraction) or as
Multi-head Latent Attention (LatentAttention, where kv_lora_rank is set: its cache holds one
low-rank latent and one rotary key per token); with the rotary positions and the masks they share,
and the checks of the keys they read. model.LAYER_KINDS holds the two kinds as rows.

GQA: https://arxiv.org/abs/2305.13245, MQA: https://arxiv.org/abs/1911.02150, MLA:
https://arxiv.org/abs/2405.04434"""

from collections.abc import Hashable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kv_cache import Cache, RingSpec, RowsSpec, StaticKVCache
from layer_kind import Config, LayerKind, Mask, Mixer, Rope, Tokens
from smallgpt.fast_paths import Linear, joint_linear, sdpa

NORM_EPS = 1e-5  # every RMSNorm's, as nn.LayerNorm's default (exported as Llama's rms_norm_eps)


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm with this project's epsilon, computed in its weight's dtype: under
    autocast a bf16 input would miss the fused kernel (and warn)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, eps=NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in the weight's dtype (the fused kernel), returned in x's (the caller's)
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


# ---- the checks of the keys attention reads (GPTConfig gathers them through the kinds) ----


def latent_problems(c: Config) -> list[str]:
    """What is wrong with GPTConfig's MLA keys, a key that would change nothing included."""
    kv_lora_rank = c.kv_lora_rank
    qk_rope_head_dim = c.qk_rope_head_dim
    q_lora_rank = c.q_lora_rank
    latent_norm = c.latent_norm
    pos_encoding = c.pos_encoding
    n_kv_head = c.n_kv_head
    n_head = c.n_head
    n_embd = c.n_embd
    # no latent: no layer is MLA, so any other MLA key given would change nothing
    if kv_lora_rank is None:
        given = {"qk_rope_head_dim": qk_rope_head_dim, "q_lora_rank": q_lora_rank}
        if latent_norm is not True:  # its default: anything else asks for a latent's norm
            given["latent_norm"] = latent_norm
        return [
            f"{k}={v} is an MLA key: set kv_lora_rank too"
            for k, v in given.items()
            if v is not None
        ]
    problems = []
    # the ranks are Linears' widths (q_lora_rank None: the queries get no latent of their own)
    for key, value in (("kv_lora_rank", kv_lora_rank), ("q_lora_rank", q_lora_rank)):
        if value is not None and (type(value) is not int or value < 1):
            problems.append(f"{key}={value!r} must be a positive integer")
    # rotary positions need rotary features to ride on; learned ones have nothing to rotate
    rope = qk_rope_head_dim
    if type(rope) is not int or rope < 0 or (rope == 0) != (pos_encoding == "learned"):
        problems.append(
            f"qk_rope_head_dim={rope!r} must be a positive integer with pos_encoding='rope', "
            "0 with 'learned'"
        )
    # MLA's K and V come per head from the latent, so there are no K/V groups to size
    if n_kv_head != n_head:
        problems.append(
            f"n_kv_head={n_kv_head} does not apply to MLA (every head has its own K and V, made "
            "from the latent): leave it out"
        )
    # the widths below need every size valid: compare them only once nothing else is wrong
    if problems or type(n_embd) is not int or type(n_head) is not int or n_head < 1:
        return problems
    # the width each head's K and V get from the latent (kv_b)
    head_dim = n_embd // n_head
    if rope > head_dim:
        problems.append(
            f"qk_rope_head_dim={rope} is wider than a head (head_dim={head_dim}): give at most "
            f"{head_dim}"
        )
    elif kv_lora_rank + rope >= 2 * n_embd:  # MHA caches 2 n_embd features a token and layer
        problems.append(
            f"kv_lora_rank={kv_lora_rank} with qk_rope_head_dim={rope} caches "
            f"{kv_lora_rank + rope} features a token, not fewer than the {2 * n_embd} of the K and "
            f"V it replaces (2 n_embd): give kv_lora_rank below {2 * n_embd - rope}"
        )
    return problems


def window_problems(c: Config) -> list[str]:
    """What is wrong with the local layers' window, against the pattern and block_size: a
    pattern of S needs a window, a window needs an S on a layer but the last (always global)."""
    # layer_pattern where given, else window_pattern: the messages name the key given
    key = c.pattern_key
    pattern = getattr(c, key)
    window = c.window
    if window is None:
        if "S" in pattern:
            return [f"{key}={pattern!r} has local layers (S): give their window"]
        return []
    if type(window) is not int or window < 1:
        return [f"window={window!r} must be a positive integer (the tokens a local layer sees)"]
    if "S" not in pattern:
        return [
            f"window={window} with {key}={pattern!r}: no layer is local; give a pattern "
            "with S, e.g. 'SSSL' (the last layer is always global)"
        ]
    if type(c.block_size) is int and window >= c.block_size:
        return [
            f"window={window} is not below block_size={c.block_size}, so a local layer would see "
            f"what a global one sees: give a window below {c.block_size}, or leave window out"
        ]
    # the pattern repeats over the layers and the last turns L: 'LS' on 2 layers has no S left
    if len(pattern) <= c.n_layer and "S" not in c.layer_letters:
        n = c.n_layer
        return [
            f"{key}={pattern!r} on n_layer={n} makes no layer local (the last layer is "
            f"always global), so window={window} would change nothing: give a pattern "
            f"with S among the first {n - 1} layers, or leave window out"
        ]
    return []


def window_pattern_problems(pattern: str) -> list[str]:
    """What is wrong with window_pattern's letters: nanochat's S (local) and L (global)."""
    if not (isinstance(pattern, str) and pattern and set(pattern.upper()) <= {"S", "L"}):
        return [
            f"window_pattern={pattern!r} must be letters S (a local layer) and L (a global one), "
            "e.g. 'SSSL'"
        ]
    return []


def sink_problems(c: Config) -> list[str]:
    """What is wrong with the attention sinks' key and the layers without positions (NoPE)."""
    problems = []
    if type(c.attn_sinks) is not bool:
        problems.append(f"attn_sinks={c.attn_sinks!r} must be True or False")
    # rope_pattern's letters are the config's to check (model_config.pattern_problems)
    if c.positionless_layers and c.pos_encoding != "rope":
        problems.append(
            f"rope_pattern={c.rope_pattern!r} takes the rotary positions off some layers: it "
            f"needs pos_encoding='rope', not {c.pos_encoding!r}"
        )
    return problems


def gate_problems(c: Config) -> list[str]:
    """What is wrong with the keys of Qwen3.5's attention: its output gate, q/k norms and rotary
    fraction (GPTConfig checks the fraction's rotated width)."""
    attn_gate = c.attn_gate
    qk_norm = c.qk_norm
    rope_fraction = c.rope_fraction
    # MLA has its own latent norm and rotary width, so two of Qwen3.5's options do not apply
    mla = c.kv_lora_rank is not None
    problems = []
    if attn_gate not in ("none", "head", "element"):
        problems.append(f"attn_gate={attn_gate!r} must be one of none, head, element")
    if type(qk_norm) is not bool:
        problems.append(f"qk_norm={qk_norm!r} must be True or False")
    elif qk_norm and mla:
        problems.append(
            "qk_norm=True does not apply to MLA (its latent has its own norm, latent_norm): "
            "leave it out"
        )
    # the share of each head's features rotated; 0 would rotate none (rope_pattern's N does that)
    if not (isinstance(rope_fraction, int | float) and 0 < rope_fraction <= 1):
        problems.append(f"rope_fraction={rope_fraction!r} must be a number in (0, 1]")
    elif rope_fraction != 1 and mla:
        problems.append(
            f"rope_fraction={rope_fraction} does not apply to MLA (its rotary width is "
            "qk_rope_head_dim): leave it out"
        )
    return problems


# ---- positions and masks ----


def rope_tables(dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin (https://arxiv.org/abs/2104.09864) for `dim` rotated features, each
    (length, dim // 2)."""
    # one frequency a pair of features, from 1 down toward 1 / theta
    inv_freq = theta ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim // 2,)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (length, dim // 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, dim) half by half in fp32; cos, sin are (B or 1, 1, T, dim // 2). A
    bf16 x is made fp32 first: products of one dtype run vectorised, mixed ones do not
    (docs/performance-cpu.md "Training")."""
    # the first half of the features pairs with the second (GPT-NeoX's layout, not interleaved)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def ring_positions(end: int | torch.Tensor, ring: int, device: torch.device) -> torch.Tensor:
    """The position each slot of a ring of `ring` slots holds (KVCache: position p at slot p %
    ring) once positions below end are written: the newest such, negative where none is yet. end:
    an int or a 1-element tensor."""
    # slot s holds the newest p < end with p % ring == s: last minus how far s lags last's slot
    last = end - 1
    return last - (last - torch.arange(ring, device=device)).remainder(ring)  # (ring,)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The one rule of every mask: a query sees a key at its position or before it, written
    (a ring slot not written yet holds a negative position), and within its window if it has one."""
    mask = (key_pos <= query_pos) & (key_pos >= 0)
    if window is not None:
        # a window of w: the query itself and the w - 1 positions before it
        mask = mask & (key_pos > query_pos - window)
    return mask


def attention_mask(
    T: int,
    start: int,
    pad: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
    ring: int | None = None,
) -> Mask:
    """The mask (B or 1, 1, T, Tk) of queries at start..start+T-1 over the keys at 0..start+T-1,
    or None where none is needed: a causal block from an empty cache, or one token without
    padding (SDPA's is_causal aligns top-left), that no window cuts. Left padding (pad[b] slots
    in row b) is hidden from real queries; a pad query sees only itself, so no row is fully
    masked (which gives NaNs). window (a local layer's): a query sees only itself and the window
    - 1 slots before it. ring: the slots of a local layer's cache (KVCache), whose keys are then
    the ring's slots, for a chunk followed by its own."""
    # the keys KVCache.update returns: the ring's slots (then a chunk's own)
    if ring is not None and start > 0:
        # every slot written: all of them in the window
        if T == 1 and pad is None and start + 1 >= ring:
            return None
        # one token is written before the ring is read, a chunk after it (KVRing.update)
        key_pos = ring_positions(start + (T == 1), ring, device)
        if T > 1:
            # a chunk's own keys follow the ring's slots: Tk = ring + T
            key_pos = torch.cat((key_pos, torch.arange(start, start + T, device=device)))
    elif pad is None and (start == 0 or T == 1) and (window is None or start + T <= window):
        # no mask needed: a causal block from an empty cache, or one token seeing every key
        return None
    else:
        # keys in position order (no cache, or a growing one): 0..start+T-1
        key_pos = torch.arange(start + T, device=device)
    query_pos = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
    key_pos = key_pos[None, :]  # (1, Tk)
    mask = visible(query_pos, key_pos, window)  # (T, Tk)
    # no padding: one mask for every row, (1, 1, T, Tk)
    if pad is None:
        return mask[None, None]
    # row b's first pad[b] keys hidden from its real queries; a pad query still sees itself
    mask = mask & ((key_pos >= pad[:, None, None]) | (key_pos == query_pos))  # (B, T, Tk)
    return mask[:, None]  # (B, 1, T, Tk)


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x (B, heads, T, head_dim) with its first features rotated (as many as the rotary tables
    hold: all of them, or a rope_fraction's), the others as they are."""
    if rope is None:
        return x
    # the tables hold one angle a pair of features, so twice their width is rotated
    rotated = 2 * rope[0].size(-1)
    if rotated == x.size(-1):
        return apply_rope(x, *rope)
    # a rope_fraction: the features past the rotated ones carry no position
    return torch.cat((apply_rope(x[..., :rotated], *rope), x[..., rotated:]), dim=-1)


class OutputGate(nn.Module):
    """Gated Attention (arXiv 2505.06708): attention's output times sigmoid of a projection of the
    layer's input, one gate a head ('head') or a feature ('element', Qwen3.5's)."""

    def __init__(self, n_embd: int, n_head: int, per: str, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        # one gate a feature (n_embd outputs) or one a head (n_head), as attn_gate says
        self.c_gate = Linear(n_embd, n_embd if per == "element" else n_head, bias=bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (B, T, n_head, head_dim) gated by x (B, T, n_embd)."""
        B, T, _ = x.shape
        gate = self.c_gate(x).view(B, T, self.n_head, -1)  # (B, T, n_head, head_dim or 1)
        # a per-head gate of width 1 broadcasts over the head's features
        return y * torch.sigmoid(gate)


def output_gate(n_embd: int, n_head: int, per: str, bias: bool) -> OutputGate | None:
    """The gate GPTConfig.attn_gate names (per 'head' or 'element'), or None ('none')."""
    return None if per == "none" else OutputGate(n_embd, n_head, per, bias)


# The GPTConfig keys an attention layer reads beyond the model's own (its sizes, norm, MLP and kind
# of positions): its K/V heads or MLA's latents (CausalSelfAttention, LatentAttention), Qwen3.5's
# options, and the rotary tables' base and fraction. GPTConfig refuses each where no layer of the
# pattern reads it.
READS = frozenset(
    {
        "n_kv_head",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "q_lora_rank",
        "latent_norm",
        "attn_gate",
        "qk_norm",
        "rope_theta",
        "rope_fraction",
        "attn_sinks",
        "rope_pattern",
    }
)


def sink_parameter(config: Config) -> nn.Parameter | None:
    """Each head's sink logit where attn_sinks is set (its initial value 0: Mixer.initial)."""
    return nn.Parameter(torch.zeros(config.n_head)) if config.attn_sinks else None


def with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    sinks: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Mask]:
    """q, k, v and mask for sdpa() with one more key that every query sees, whose score is its
    head's sink logit and whose value is zero (gpt-oss's sinks): the softmax may give a share of
    each query's attention to nothing, so the output is softmax(scores) V times sigmoid(LSE -
    sink). The sink's score rides on one more feature: the queries' is sink / scale, the real
    keys' 0, the sink key's 1 (query head h meets the sink as its own, whatever its K/V group).
    q (B, H, T, d), k (B, G, Tk, d), v (B, G, Tk, d_v), mask None or (B or 1, 1, T, Tk)."""
    B, H, T, _ = q.shape
    G, Tk = k.size(1), k.size(2)
    # each query's extra feature: its head's sink logit over scale, which SDPA's scaling undoes
    logit = (sinks.to(q.dtype) / scale).view(1, H, 1, 1).expand(B, H, T, 1)
    q = torch.cat((q, logit), dim=-1)  # (B, H, T, d + 1)
    sink_key = F.pad(k.new_ones(B, G, 1, 1), (k.size(-1), 0))  # (B, G, 1, d + 1): [0 ... 0 1]
    # real keys get a 0 there (no sink score); the sink key joins them as key Tk
    k = torch.cat((F.pad(k, (0, 1)), sink_key), dim=2)  # (B, G, Tk + 1, d + 1)
    v = torch.cat((v, v.new_zeros(B, G, 1, v.size(-1))), dim=2)  # (B, G, Tk + 1, d_v)
    if mask is None and T > 1:  # the causal block, now with the sink's column after it
        mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)[None, None]
    # the sink's column after the real keys', seen by every query
    if mask is not None:
        mask = torch.cat((mask, mask.new_ones(*mask.shape[:-1], 1)), dim=-1)
    return q, k, v, mask


def one_query_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """with_sinks' attention for one query a head (decoding), q (B, H, 1, d), over k and v as they
    are: the sink's logit joins the scores as one more column, so the cache is not copied to add
    its key (each K/V head's queries as its rows: no copies for GQA/MQA either). In fp32, or a
    float64 model's own dtype."""
    B, H, _, d = q.shape
    G = k.size(1)
    # fp32, or float64 where the model is: promote_types never narrows
    wide = torch.promote_types(q.dtype, torch.float32)
    # each K/V head's H // G query heads as its rows: k is read as it is, with no repeat
    scores = (q.view(B, G, H // G, d).to(wide) @ k.to(wide).mT) * scale  # (B, G, H // G, Tk)
    if mask is not None:  # (B or 1, 1, 1, Tk)
        scores = scores.masked_fill(~mask, float("-inf"))
    # each head's sink logit, laid out as the queries' (G, H // G) grouping
    sink = sinks.to(wide).view(1, G, H // G, 1).expand(B, G, H // G, 1)
    # the sink takes its share of the softmax, then its column (value zero) is dropped
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ v.to(wide)).to(q.dtype).view(B, H, 1, v.size(-1))  # (B, H, 1, d_v)


class Attention(Mixer):
    """What the two forms of attention share: their window (None: global), masks, whether the
    layer has positions (rotary, or none: rope_pattern's N) and its sinks (attn_sinks)."""

    def __init__(self, config: Config, layer: int, window: int | None) -> None:
        super().__init__(layer)
        self.window = window
        self.rotary = config.layers[layer].rotary  # False on rope_pattern's N (NoPE)
        self.sinks = sink_parameter(config)  # (n_head,), or None

    def initial(self, name: str, generator: torch.Generator | None) -> torch.Tensor | None:
        """The sinks start at 0 (as transformers' GraniteSWA and gpt-oss): a sink as strong as
        one key of score 0."""
        return torch.zeros(self.sinks.shape) if name == "sinks" else None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Mask,
        cached: bool,
        scale: float | None = None,
    ) -> torch.Tensor:
        """sdpa() of q over k and v, with the sinks' column where the layer has sinks."""
        dropout_p = self.dropout if self.training else 0.0
        if self.sinks is not None:
            # q's own scale: once with_sinks adds a feature, SDPA's default would be (d + 1) ** -0.5
            scale = scale or q.size(-1) ** -0.5
            if q.size(2) == 1 and not dropout_p:  # decoding: the cache as it is
                return one_query_with_sinks(q, k, v, mask, self.sinks, scale)
            # training and prefill: the sink as one more key, through whichever SDPA path
            q, k, v, mask = with_sinks(q, k, v, mask, self.sinks, scale)
        return sdpa(q, k, v, mask, dropout_p, cached=cached, scale=scale)

    @property
    def mask_key(self) -> Hashable:
        return ("attention", self.window)

    def mask(self, at: Tokens, cache: Cache | None) -> Mask:
        if isinstance(cache, StaticKVCache):  # the fixed-shape step: one token at start (a tensor)
            pos = at.start  # a 1-element tensor the host never reads (no sync)
            # a global layer's slots hold positions 0..: over its first `length` it sees them all
            if self.window is None:
                if cache.length:
                    return None
                # length None: all max_len slots are read, the unwritten ones masked by position
                keys = torch.arange(cache.max_len, device=at.device)
            else:  # a ring: the positions its slots hold
                keys = ring_positions(pos + 1, cache.slots(self.layer), at.device)
            return visible(pos, keys, self.window)[None, None, None, :]  # (1, 1, 1, Tk)
        # a local layer's cache is a ring: its keys are the ring's slots
        ring = None
        if self.window is not None and cache is not None:
            ring = cache.slots(self.layer)
        return attention_mask(at.T, at.start, at.pad, at.device, self.window, ring)


class CausalSelfAttention(Attention):
    """n_head query heads over n_kv_head K/V heads: MHA (equal), GQA (a divisor), MQA (one);
    optionally q and k RMS-normalised per head before their rotation (qk_norm, as Qwen3's) and
    the output gated (OutputGate). window: a local layer's (None: global)."""

    def __init__(self, config: Config, layer: int, window: int | None = None) -> None:
        super().__init__(config, layer, window)
        n_embd = config.n_embd
        bias = config.bias
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        kv_dim = self.n_kv_head * self.head_dim  # below n_embd for GQA/MQA: their smaller cache
        self.c_q = Linear(n_embd, n_embd, bias=bias)
        self.c_k = Linear(n_embd, kv_dim, bias=bias)
        self.c_v = Linear(n_embd, kv_dim, bias=bias)
        # Qwen3's q/k norms: each head's query and key RMS-normalised before the rotation
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim)
            self.k_norm = RMSNorm(self.head_dim)
        self.gate = output_gate(n_embd, self.n_head, config.attn_gate, bias)
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.dropout = config.dropout  # attention's dropout (attend), beside resid_dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def mixing_flops(self, seq_len: int) -> int:
        # 6 a feature of every query and value over seq_len keys: scores and weighted sums (PaLM)
        width = self.n_head * self.head_dim
        return 6 * seq_len * 2 * width

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape  # C is n_embd
        H = self.n_head
        G = self.n_kv_head  # K/V heads, each serving H // G query heads
        hd = self.head_dim
        rope = rope if self.rotary else None  # a NoPE layer's queries and keys are not rotated
        # q, k and v of every head, q and k rotated; with a cache, k and v joined to the earlier
        if kv_cache is None and rope is not None and not self.qk_norm:
            # q, k and v as one product, q and k rotated as one
            qkv = (
                joint_linear(x, self.c_q, self.c_k, self.c_v)
                .view(B, T, H + 2 * G, hd)
                .transpose(1, 2)
            )
            qk, v = qkv.split((H + G, G), dim=1)  # q and k stay joined for one rotation
            q, k = rotate(qk, rope).split((H, G), dim=1)
        else:
            # each Linear on its own: decoding's few-row products (fast_paths.Linear), and faster on
            # CUDA without RoPE (docs/performance-cpu.md "Training")
            q = self.c_q(x).view(B, T, H, hd)
            k = self.c_k(x).view(B, T, G, hd)
            v = self.c_v(x).view(B, T, G, hd).transpose(1, 2)  # (B, G, T, hd): v is never rotated
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q.transpose(1, 2), rope), rotate(k.transpose(1, 2), rope)
            # prefill or decoding: this step's k, v written to the cache, the earlier ones read back
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer, k, v)  # (B, n_kv_head, Tk, head_dim)
        # each query head over its group's K/V head: q (B, n_head, T, head_dim), k and v
        # (B, n_kv_head, Tk, head_dim)
        y = self.attend(q, k, v, mask, cached=kv_cache is not None)
        # the heads side by side, gated, projected back into the residual stream
        y = y.transpose(1, 2)  # (B, T, n_head, head_dim)
        if self.gate is not None:
            y = self.gate(x, y)  # gated by the layer's input, not attention's output
        y = y.contiguous().view(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))


class LatentAttention(Attention):
    """Multi-head Latent Attention (DeepSeek-V2, section 2.1): K and V of every head are
    up-projected (kv_b) from one latent of kv_lora_rank features a token, and positions ride on
    rope_dim extra query/key features, the rotary key shared by the heads (decoupled RoPE); the
    latent carries no position. Queries come from x directly, or through their own latent of
    q_lora_rank. Names follow DeepSeek's (q_a, q_b, kv_a, kv_b) where GPT-2's have no match.

    Training builds K and V from the latent. With a cache (decoding), the cache holds [latent |
    rotary key] as one K head and nothing as V, and kv_b's key half is folded into the query and
    its value half applied after attention (V2's appendix C): attention is MQA over that one
    head, its values the latent (the key's first kv_lora_rank features), so K and V of the heads
    are never rebuilt."""

    # Linears whose weight forward reads as a matrix: the absorbed step multiplies by kv_b's halves
    # itself and never calls kv_b while decoding, so smallgpt/quantize.py keeps these in the model's
    # dtype
    matrices: tuple[str, ...] = ("kv_b",)

    def __init__(self, config: Config, layer: int, window: int | None = None) -> None:
        super().__init__(config, layer, window)
        n_embd = config.n_embd
        n_head = config.n_head
        bias = config.bias
        self.n_head = n_head
        self.head_dim = config.head_dim
        self.gate = output_gate(n_embd, n_head, config.attn_gate, bias)
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_dim = config.rope_dim
        # each head's query: head_dim features for the latent's keys, then rope_dim rotary ones
        q_dim = n_head * (self.head_dim + self.rope_dim)
        if self.q_lora_rank is None:
            # no query latent: one projection from x to every head's query
            self.c_q = Linear(n_embd, q_dim, bias=bias)
        else:  # the queries' own latent
            self.q_a = Linear(n_embd, self.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(self.q_lora_rank)  # DeepSeek's q_a_layernorm
            self.q_b = Linear(self.q_lora_rank, q_dim, bias=False)
        # [latent | rotary key], then each head's [k | v] (head_dim each) from the latent
        self.kv_a = Linear(n_embd, self.kv_lora_rank + self.rope_dim, bias=bias)
        # the latent's norm (DeepSeek's kv_a_layernorm), left out by latent_norm=False
        self.kv_norm = RMSNorm(self.kv_lora_rank) if config.latent_norm else nn.Identity()
        # each head's [k | v] from the latent: n_head * 2 * head_dim = 2 n_embd outputs;
        # no bias: the absorbed step multiplies by kv_b's weight alone, so a bias would be lost
        self.kv_b = Linear(self.kv_lora_rank, 2 * n_embd, bias=False)
        self.c_proj = Linear(n_embd, n_embd, bias=bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def mixing_flops(self, seq_len: int) -> int:
        # as CausalSelfAttention's, each query wider by its rotary features
        width = self.n_head * self.head_dim
        return 6 * seq_len * (2 * width + self.n_head * self.rope_dim)

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, kv_cache: Cache | None
    ) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_head
        hd = self.head_dim
        R = self.kv_lora_rank  # the latent's width
        # the queries, directly or through their own latent, each head's split into the features
        # that meet the latent's keys and the rotary ones
        q = self.c_q(x) if self.q_lora_rank is None else self.q_b(self.q_norm(self.q_a(x)))
        q = q.view(B, T, H, hd + self.rope_dim).transpose(1, 2)  # (B, H, T, head_dim + rope_dim)
        q, q_rope = q.split((hd, self.rope_dim), dim=-1)  # (B, H, T, hd), (B, H, T, rope_dim)
        # the latent (B, T, R) and the one rotary key the heads share, (B, 1, T, rope_dim)
        latent, k_rope = self.kv_a(x).split((R, self.rope_dim), dim=-1)
        latent = self.kv_norm(latent)
        k_rope = k_rope[:, None]
        # positions ride on the rotary features alone; a NoPE layer's (Kimi Linear's MLA) keep
        # them unrotated
        if rope is not None and self.rotary:
            q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        scale = (hd + self.rope_dim) ** -0.5  # as if K held head_dim + rope_dim features a head
        if kv_cache is None:
            # K and V of every head from the latent, each (B, H, T, head_dim)
            kv = self.kv_b(latent).view(B, T, H, 2, hd)  # (B, T, H, [k | v], head_dim)
            k, v = kv.permute(3, 0, 2, 1, 4).unbind(0)  # [k | v] first: (2, B, H, T, hd)
            # every head's key gets the one rotary key after its own features
            k = torch.cat((k, k_rope.expand(B, H, T, self.rope_dim)), dim=-1)
            q = torch.cat((q, q_rope), dim=-1)  # (B, H, T, head_dim + rope_dim)
            y = self.attend(q, k, v, mask, cached=False, scale=scale)  # (B, H, T, head_dim)
        else:
            # absorbed: q . (W_uk latent) = (q W_uk) . latent, then the softmax-weighted latents
            # times W_uv. The cache holds [latent | rotary key], one head, and no V.
            key = torch.cat((latent[:, None], k_rope), dim=-1)  # (B, 1, T, R + rope_dim)
            # V of width 0: only the key is cached, as the values are its first R features
            key, _ = kv_cache.update(self.layer, key, key[..., :0])  # (B, 1, Tk, R + rope_dim)
            # each head's key and value maps, (H, hd, R)
            w_uk, w_uv = self.kv_b.weight.view(H, 2, hd, R).unbind(1)
            # the query into the latent's space: kv_b's key half applied to it, not to every key
            q = torch.cat((q @ w_uk, q_rope), dim=-1)  # (B, H, T, R + rope_dim)
            # MQA over the one cached head, its values the latent: (B, H, T, R)
            latents = self.attend(q, key, key[..., :R], mask, cached=True, scale=scale)
            y = latents @ w_uv.mT  # (B, H, T, head_dim)
        # the heads side by side, gated, projected back into the residual stream
        y = y.transpose(1, 2)  # (B, T, n_head, head_dim)
        if self.gate is not None:
            y = self.gate(x, y)
        y = y.reshape(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))


def attention_for(config: Config, layer: int, window: int | None) -> Attention:
    """The attention the config names: MLA where kv_lora_rank is set, else MHA/GQA/MQA."""
    if config.kv_lora_rank is None:
        return CausalSelfAttention(config, layer, window)
    return LatentAttention(config, layer, window)


def rows_spec(c: Config) -> RowsSpec:
    """One attention layer's cache a token: K/V heads un-repeated and their widths, or MLA's one
    head of [latent | rotary key] and no V (its values are the latent: LatentAttention)."""
    if c.kv_lora_rank is not None:
        return RowsSpec(1, c.kv_lora_rank + c.qk_rope_head_dim, 0)
    return RowsSpec(c.n_kv_head, c.head_dim, c.head_dim)


def attention_problems(c: Config) -> list[str]:
    """The attention keys' problems where some layer attends (else they are unread keys)."""
    if not c.attends:
        return []
    return latent_problems(c) + gate_problems(c) + sink_problems(c)


# Qwen3.5's names of an attention layer's parameters (transformers' Qwen3_5ForCausalLM), ours under
# a block's "attn." -> theirs under a layer's, but c_q: its q_proj holds each head's query and gate
# side by side (smallgpt/hf_qwen.py)
HF_NAMES = {
    "c_k.weight": "self_attn.k_proj.weight",
    "c_v.weight": "self_attn.v_proj.weight",
    "c_proj.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
}


class GlobalAttention(LayerKind):
    """L: attention over every earlier token."""

    letter = "L"
    name = "global attention"
    attends = True
    reads = READS
    conversion_source = True  # where kv_lora_rank is not set (smallgpt/hybridize.py)
    hf_layer_type = "full_attention"  # its name in transformers' layer_types
    hf_names = HF_NAMES

    @classmethod
    def build(cls, config: Config, layer: int) -> Attention:
        return attention_for(config, layer, None)

    @classmethod
    def problems(cls, config: Config) -> list[str]:
        return attention_problems(config)

    @classmethod
    def cache_spec(cls, config: Config) -> RowsSpec:
        return rows_spec(config)

    @classmethod
    def describe(cls, config: Config, layers: list[int]) -> None:
        return None  # the attention heads the line: GPTConfig.mixing


class LocalAttention(LayerKind):
    """S: attention over the newest `window` tokens (a query sees itself and window - 1 before
    it), nanochat's sliding window; its cache a ring of the window's slots."""

    letter = "S"
    name = "local attention"
    attends = True
    reads = READS | {"window"}  # and the window, which no global layer reads
    on_last_layer = "L"  # the last layer sees the whole context (nanochat's rule)
    hf_layer_type = "sliding_attention"  # its name in transformers' layer_types
    hf_names = HF_NAMES

    @classmethod
    def build(cls, config: Config, layer: int) -> Attention:
        return attention_for(config, layer, config.window)

    @classmethod
    def problems(cls, config: Config) -> list[str]:
        # the window first: the other keys are reported once it is right
        return window_problems(config) or attention_problems(config)

    @classmethod
    def cache_spec(cls, config: Config) -> RingSpec:
        rows = rows_spec(config)
        # the rows a global layer keeps, in a ring of the window's slots
        return RingSpec(rows.heads, rows.k_width, rows.v_width, config.window)

    @classmethod
    def describe(cls, config: Config, layers: list[int]) -> str:
        return f"local layers {layers} of {config.n_layer} (window {config.window})"
