"""smallgpt/delta_rule.py, the gated delta rule: the recurrence against its definition written as
matrices, the chunked form against the recurrence (float64, a state to start from, T not a multiple
of the chunk), both against transformers' own pure-torch Qwen3.5 functions, and the bugs a test must
catch (the decay after the update, b dropped)."""

import pytest
import torch
import torch.nn.functional as F

from smallgpt import delta_rule

B, H, DK, DV = 2, 3, 8, 5


def inputs(T: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """q, k (unit rows, q scaled by 1/sqrt(d_k), as the layer gives them), v, g (log decays from
    about -3 to 0), b (in (0, 1)) and a nonzero state to start from."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = F.normalize(draw(B, H, T, DK), dim=-1) * DK**-0.5
    k = F.normalize(draw(B, H, T, DK), dim=-1)
    v = draw(B, H, T, DV)
    g = -3 * torch.rand(B, H, T, generator=gen, dtype=dtype)
    b = torch.rand(B, H, T, generator=gen, dtype=dtype)
    state = draw(B, H, DK, DV)
    return q, k, v, g, b, state


def by_definition(q, k, v, g, b, state):  # noqa: ANN001, ANN201
    """S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T and o_t = S_t^T q_t, as
    matrices, one (batch, head) at a time."""
    out = torch.empty(*v.shape, dtype=v.dtype)
    state = state.clone()
    eye = torch.eye(DK, dtype=v.dtype)
    for i in range(B):
        for h in range(H):
            S = state[i, h]
            for t in range(v.shape[2]):
                kt, vt = k[i, h, t, :, None], v[i, h, t, :, None]
                S = g[i, h, t].exp() * (eye - b[i, h, t] * kt @ kt.T) @ S + b[i, h, t] * kt @ vt.T
                out[i, h, t] = S.T @ q[i, h, t]
            state[i, h] = S
    return out, state


def test_the_recurrence_is_the_definition() -> None:
    q, k, v, g, b, state = inputs(9)
    out, final = delta_rule.recurrent(q, k, v, g, b, state)
    want, want_final = by_definition(q, k, v, g, b, state)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("T", "chunk"), [(37, 16), (37, 64), (32, 8), (1, 4), (5, 1)])
def test_the_chunked_form_equals_the_recurrence(T: int, chunk: int) -> None:
    """Any T, a multiple of the chunk or not, from a nonzero state; a prefill cut anywhere goes on
    from the state it returns."""
    q, k, v, g, b, state = inputs(T, seed=T)
    want, want_final = delta_rule.recurrent(q, k, v, g, b, state)
    out, final = delta_rule.chunked(q, k, v, g, b, state, chunk)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-10)
    cut = T // 3
    first, mid = delta_rule.chunked(*(x[:, :, :cut] for x in (q, k, v, g, b)), state, chunk)
    rest, end = delta_rule.chunked(*(x[:, :, cut:] for x in (q, k, v, g, b)), mid, chunk)
    torch.testing.assert_close(torch.cat((first, rest), dim=2), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(end, want_final, rtol=1e-10, atol=1e-10)


def test_both_forms_agree_with_transformers_qwen3_5_functions() -> None:
    """transformers' pure-torch chunked and recurrent gated delta rules (test-only import), given
    q and k before their L2 norm (it normalises and scales them itself), in float32."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    q, k, v, g, b, state = (x.float() for x in inputs(45, seed=3))
    raw_q, raw_k = q * 7.0, k * 0.5  # any length: both sides normalise
    ours_q = F.normalize(raw_q, dim=-1, eps=1e-6) * DK**-0.5
    ours_k = F.normalize(raw_k, dim=-1, eps=1e-6)
    theirs = [x.transpose(1, 2) for x in (raw_q, raw_k, v, g, b)]  # (B, T, H, ...)
    for fn, ours in (
        (qwen.torch_chunk_gated_delta_rule, delta_rule.chunked),
        (qwen.torch_recurrent_gated_delta_rule, delta_rule.recurrent),
    ):
        out, final = fn(
            *theirs, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        mine, mine_final = ours(ours_q, ours_k, v, g, b, state)
        torch.testing.assert_close(mine, out.transpose(1, 2), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine_final, final, rtol=1e-4, atol=1e-5)


def test_a_planted_bug_fails_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The definition tells apart a recurrence that decays after the update, or drops b."""
    q, k, v, g, b, state = inputs(6)
    want, _ = by_definition(q, k, v, g, b, state)

    def decay_after(q, k, v, g, b, state):  # noqa: ANN001, ANN202
        out = []
        for t in range(v.shape[2]):
            predicted = (k[..., t, :, None] * state).sum(-2)
            state = (
                state
                + k[..., t, :, None] * (b[..., t, None] * (v[..., t, :] - predicted))[..., None, :]
            )
            state = state * g[..., t, None, None].exp()
            out.append((q[..., t, :, None] * state).sum(-2))
        return torch.stack(out, dim=2), state

    assert not torch.allclose(decay_after(q, k, v, g, b, state)[0], want, atol=1e-3)
    no_b, _ = delta_rule.recurrent(q, k, v, g, torch.ones_like(b), state)
    assert not torch.allclose(no_b, want, atol=1e-3)


def test_the_chunked_forms_gradients_are_the_recurrences() -> None:
    """Training differentiates the chunked form: every input's gradient (the state's too) is the
    recurrence's, in float64, for a loss on the outputs and the final state (T past two chunks,
    not a multiple of the chunk)."""
    grads = []
    for rule in (delta_rule.recurrent, delta_rule.chunked):
        leaves = [x.clone().requires_grad_() for x in inputs(21, seed=3)]
        out, final = rule(
            *leaves[:5], leaves[5], **({"chunk": 8} if rule is delta_rule.chunked else {})
        )
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        ((out * weights).sum() + final.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("T", [1, 6, 8])
def test_one_chunk_from_an_empty_state_is_the_recurrence(T: int) -> None:
    """Training on blocks no longer than the chunk starts each from no state, the chunked form's
    shortcut (no part from S_0): outputs, final state and every input's gradient are the
    recurrence's."""
    results = []
    for rule in (delta_rule.recurrent, delta_rule.chunked):
        leaves = [x.clone().requires_grad_() for x in inputs(T, seed=5)[:5]]
        out, final = rule(*leaves, **({"chunk": 8} if rule is delta_rule.chunked else {}))
        ((out * out.detach().sign()).sum() + final.square().sum()).backward()
        results.append([out, final, *(x.grad for x in leaves)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
