"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464), the recurrence of a linear-attention
layer: per head a state S (d_k x d_v) that every token decays, corrects and reads,

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t,

with a_t = exp(g_t) in (0, 1] the decay and b_t in (0, 1) the write strength. Two forms of the same
function: `recurrent`, one token after another (decoding: O(1) a token), and `chunked`, which
trains and prefills in chunks of C tokens, a few matrix products and one triangular solve a chunk
(the WY form of Yang et al. 2024, arXiv 2406.06484). Both take and return the state, so a prefill
can stop anywhere and decoding go on from it. q and k come normalised and q scaled by the caller.

Shapes: q, k (B, H, T, d_k); v (B, H, T, d_v); g, b (B, H, T); state (B, H, d_k, d_v).

Kimi Delta Attention (KDA, arXiv 2510.26692) is the same rule with a decay per channel of the
key, S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T: both forms take such a g
(B, H, T, d_k) too, and one equal in every channel computes what the per-head g computes.

On CUDA with flash-linear-attention installed (`pip install flash-linear-attention`, its package
`fla`), `on_kernels` runs the chunked form on its Triton kernels instead; `chunked` stays the
reference it is checked against (scripts/fla_check.py, docs/gpu.md). On a CPU, `sequence` runs the
rule as one compiled kernel, forward and backward (smallgpt/delta_rule_kernel.py: the recurrent
form in C++, a (batch, head) a thread), where it builds and SMALLGPT_DELTA_RULE is not 'torch'.
"""

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from smallgpt import delta_rule_kernel


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs (B, H, T, d_v) and the final state, token by token: decay the state, write the
    part of v_t it does not already predict for k_t, read it with q_t."""
    B, H, T, d_k = k.shape
    d_v = v.shape[-1]
    if state is None:
        state = q.new_zeros(B, H, d_k, d_v)
    out = []
    per_channel = g.dim() == 4
    for t in range(T):
        # each row of the state (a channel of the key) decayed by its own g, or all by the head's
        decay = g[..., t, :, None] if per_channel else g[..., t, None, None]
        state = state * decay.exp()
        # what the state predicts for k_t, and the correction b_t writes along k_t
        predicted = (k[..., t, :, None] * state).sum(-2)  # S^T k: (B, H, d_v)
        delta = b[..., t, None] * (v[..., t, :] - predicted)
        state = state + k[..., t, :, None] * delta[..., None, :]
        out.append((q[..., t, :, None] * state).sum(-2))  # S^T q
    return torch.stack(out, dim=2), state


def in_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, ...]:
    """The inputs as n chunks of `chunk` tokens: q, k, v (B, H, n, C, d), g (B, H, n, C) or per
    channel (B, H, n, C, d_k), b (B, H, n, C), the last chunk padded with tokens that neither
    decay nor write (g = 0, b = 0)."""
    T = q.size(2)
    pad = -T % chunk
    per_channel = g.dim() == 4
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad) if per_channel else (0, pad))
        b = F.pad(b, (0, pad))
    n = (T + pad) // chunk
    q, k, v, g = (x.unflatten(2, (n, chunk)) for x in (q, k, v, g))
    return q, k, v, g, b.unflatten(2, (n, chunk))


def within_chunks(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """What each chunk computes of its own tokens, all chunks at once: G (the decay's log summed
    up to each token), A (the corrections' system), the scores exp(G_t - G_s) (k_s . q_t) for
    s <= t, and each key decayed to the chunk's end."""
    chunk = q.size(-2)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    if g.dim() == q.dim():  # a decay per channel (KDA)
        return within_chunks_per_channel(q, k, g, b, causal)
    G = g.cumsum(-1)
    # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: no overflow)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # q . k and k . k of the chunk's tokens in one product
    qk, kk = (torch.cat((q, k), dim=-2) @ k.mT).split(chunk, dim=-2)
    # I + A with A's strictly lower part: the solve reads only that (its diagonal is taken as
    # ones, its upper part as zeros), so neither the identity nor a tril is built
    A = b[..., None] * kk * decay
    scores = qk * decay
    k_to_end = (G[..., -1:] - G).exp()[..., None] * k  # exp(G_C - G_s) k_s
    return G, A, scores, k_to_end


# tokens a block of a chunk whose decays a per-channel decay computes channel by channel (below)
BLOCK = 8


def within_chunks_per_channel(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, b: torch.Tensor, causal: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """within_chunks with a decay per channel, g (B, H, n, C, d_k): the decay between tokens s and
    t is exp(G_t - G_s) channel by channel, inside the q . k and k . k sums. It cannot be split
    as exp(G_t) exp(-G_s) over a whole chunk (exp(-G_s) overflows fp32 over a chunk of strong
    decays), so the chunk is cut into blocks of BLOCK tokens: within a block (the diagonal) each
    pair's decays are computed channel by channel, (BLOCK, BLOCK, d_k) a block; a key s of block
    j meets every later query t through the block's last token e, exp(G_t - G_e) exp(G_e - G_s),
    both factors at most 1, so those scores are one product a block (fla's secondary chunking)."""
    G = g.cumsum(-2)  # (B, H, n, C, d_k)
    C = q.size(-2)
    block = BLOCK if C % BLOCK == 0 else C  # a short prompt's one chunk: one block
    m = C // block
    # the diagonal blocks, each pair's decays channel by channel: (.., m, block, block, d_k)
    Gb, qb, kb = (x.unflatten(-2, (m, block)) for x in (G, q, k))
    gap = Gb[..., :, None, :] - Gb[..., None, :, :]  # G_t - G_s
    decay = gap.masked_fill(~causal[:block, :block, None], float("-inf")).exp()
    diagonal_scores = (qb[..., :, None, :] * decay * kb[..., None, :, :]).sum(-1)
    diagonal_kk = (kb[..., :, None, :] * decay * kb[..., None, :, :]).sum(-1)
    scores = q.new_zeros(*q.shape[:-1], C)
    kk = q.new_zeros(*q.shape[:-1], C)
    for i in range(m):
        rows = slice(i * block, (i + 1) * block)
        scores[..., rows, rows] = diagonal_scores[..., i, :, :]
        kk[..., rows, rows] = diagonal_kk[..., i, :, :]
    # below the diagonal: block j's keys decayed to its last token, the later tokens from it
    for j in range(m - 1):
        keys = slice(j * block, (j + 1) * block)
        later = slice((j + 1) * block, C)
        end = G[..., (j + 1) * block - 1, None, :]  # (.., 1, d_k)
        k_to_end_of_block = k[..., keys, :] * (end - G[..., keys, :]).exp()
        since_block = (G[..., later, :] - end).exp()
        scores[..., later, keys] = (q[..., later, :] * since_block) @ k_to_end_of_block.mT
        kk[..., later, keys] = (k[..., later, :] * since_block) @ k_to_end_of_block.mT
    A = b[..., None] * kk
    k_to_end = (G[..., -1:, :] - G).exp() * k  # exp(G_C - G_s) k_s, channel by channel
    return G, A, scores, k_to_end


def decays(G: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """From G (the decay's log summed over each chunk, (B, H, n, C) or per channel (B, H, n, C,
    d_k)): each token's decay since its chunk's start, broadcast over the key's channels, and each
    chunk's whole decay, broadcast over the state's rows (B, H, n, d_k or 1, 1)."""
    if per_channel:
        return G.exp(), G[..., -1, :, None].exp()
    return G.exp()[..., None], G[..., -1, None, None].exp()


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent's outputs and final state, a chunk of `chunk` tokens at a time, any T (the last
    chunk padded with tokens that neither decay nor write: g = 0, b = 0).

    In a chunk starting from state S_0, with G_t the decay's log summed over the chunk up to t,
    the corrections u_t = b_t (v_t - S_{t-1}'s prediction for k_t) satisfy a unit lower-triangular
    system, (I + A) u = b (v - exp(G) K S_0) with A_ts = b_t exp(G_t - G_s) k_t . k_s (s < t); then
    o_t = exp(G_t) S_0^T q_t + sum_{s <= t} exp(G_t - G_s) (k_s . q_t) u_s and
    S_C = exp(G_C) S_0 + sum_s exp(G_C - G_s) k_s u_s^T."""
    B, H, T, d_k = k.shape
    d_v = v.shape[-1]
    empty = state is None
    if empty:
        state = q.new_zeros(B, H, d_k, d_v)
    if T == 0:
        return v.new_zeros(B, H, 0, d_v), state
    chunk = min(chunk, T)  # a short sequence (a prompt) is one chunk of its own length
    q, k, v, g, b = in_chunks(q, k, v, g, b, chunk)
    n = q.size(2)
    G, A, scores, k_to_end = within_chunks(q, k, g, b)
    # one chunk from an empty state (training on short blocks, a prompt): S_0 adds nothing
    if empty and n == 1:
        u = torch.linalg.solve_triangular(A, b[..., None] * v, upper=False, unitriangular=True)
        out = (scores @ u).squeeze(2)  # (B, H, C, d_v)
        return out[:, :, :T], (k_to_end.mT @ u).squeeze(2)
    since_start, kept = decays(G, per_channel=g.dim() == q.dim())
    # the corrections' two parts, from v and per unit of S_0, in one solve for every chunk
    rhs = torch.cat((b[..., None] * v, b[..., None] * since_start * k), dim=-1)
    u_v, u_s = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split(
        (d_v, d_k), dim=-1
    )
    q_decayed = since_start * q
    # chunk by chunk, the state carried from one to the next; each input unbound once (a
    # chunk's slice taken in the loop would cost a full-size gradient per slice in backward)
    chunks = zip(
        u_v.unbind(2),
        u_s.unbind(2),
        q_decayed.unbind(2),
        scores.unbind(2),
        k_to_end.unbind(2),
        kept.unbind(2),
        strict=True,
    )
    out = []
    for u_v_i, u_s_i, q_i, scores_i, k_i, kept in chunks:
        u = u_v_i - u_s_i @ state
        out.append(q_i @ state + scores_i @ u)
        state = kept * state + k_i.mT @ u
    return torch.cat(out, dim=2)[:, :, :T], state


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x over the root of its squared features' sum (plus 1e-6, as Qwen3.5 and fla write it)."""
    # over the last dim (head_dim): a unit key makes (I - b k k^T) a contraction (eigenvalues
    # 1 - b along k, 1 elsewhere), so the rule's corrections cannot blow the state up
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int,
    q_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over a sequence (training, a prefill): on a CPU, the compiled kernel where it runs
    (delta_rule_kernel), else `chunked` in chunks of `chunk` tokens. With q_scale, q and k come
    before their L2 norm (l2_normalised), q then scaled by it: the kernel applies both in its own
    passes (a tenth of a layer's time in torch's, eager), the torch path here."""
    if not q.is_cuda and delta_rule_kernel.available():
        return delta_rule_kernel.run(q, k, v, g, b, state, q_scale)
    if q_scale is not None:
        q, k = l2_normalised(q) * q_scale, l2_normalised(k)
    return chunked(q, k, v, g, b, state, chunk)


def find_fla() -> Callable | None:
    """flash-linear-attention's chunked gated delta rule, or None: without CUDA, where fla is not
    installed (or its Triton cannot load), or where SMALLGPT_FLA=0 turns it off."""
    if os.environ.get("SMALLGPT_FLA") == "0" or not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or installed without a working Triton: the torch path
        return None
    return chunk_gated_delta_rule


# looked up once, at import: torch.compile would otherwise trace the lookup into every graph
FLA = find_fla()


def kernels_for(q: torch.Tensor) -> Callable | None:
    """The kernel `on_kernels` would run for these inputs: fla's on CUDA where installed, else
    None (then `chunked` runs)."""
    return FLA if q.is_cuda else None


def on_kernels(
    kernel: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked's outputs (fp32) and final state through `kernel`, which takes fla's layout
    (B, T, H, d) with q, k and v in `dtype` (the autocast's: bf16 products, as transformers'
    Qwen3.5 runs them), g and b in fp32, the state in fp32, and q already scaled (scale=1)."""
    # fla's kernels read (B, T, H, d) with its own strides: contiguous copies, not views
    q, k, v = (x.transpose(1, 2).to(dtype).contiguous() for x in (q, k, v))
    o, state = kernel(
        q,
        k,
        v,
        g.transpose(1, 2).float().contiguous(),
        b.transpose(1, 2).float().contiguous(),
        scale=1.0,
        initial_state=None if state is None else state.float(),
        output_final_state=True,
    )
    return o.transpose(1, 2).float(), state.float()
