"""smallgpt/delta_rule_kernel.py, the gated delta rule as one compiled CPU kernel: its outputs,
final state and every gradient against the float64 recurrence (delta_rule.recurrent) on sharpened
inputs, a float64 gradcheck, torch.library's opcheck, the bugs the comparison must catch, the
short convolution's op against its sum by hand, a hybrid's logits and cached decoding against the
torch path (the rule and the convolution), and torch.compile through the ops.
Every test here needs the kernel: where it cannot be built (or SMALLGPT_DELTA_RULE=torch) they
skip, saying so."""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from conftest import lively, tiny_model
from smallgpt import delta_rule, delta_rule_kernel
from smallgpt.delta_rule_kernel import CHECKPOINT

pytestmark = pytest.mark.skipif(
    not delta_rule_kernel.available(),
    reason=f"the delta-rule kernel does not run here ({delta_rule_kernel.Build.failed or 'torch'})",
)

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def sharp_inputs(
    B: int,
    H: int,
    T: int,
    per_channel: bool,
    dtype: torch.dtype,
    seed: int = 0,
    d: int = 8,
    d_v: int | None = None,
) -> list[torch.Tensor]:
    """q, k (unit rows), v, g, b and an initial state, sharpened: decays near 0 and near 1 (log
    decays from -12 to -1e-4, a third of each), write strengths near 1 (b up to 1 - 1e-4). v is
    d_v wide (default d + 3: a transposed state cannot pass)."""
    d_v = d + 3 if d_v is None else d_v
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(draw(B, H, T, d), dim=-1) * d**-0.5
    k = F.normalize(draw(B, H, T, d), dim=-1)
    v = draw(B, H, T, d_v)
    shape = (B, H, T, d) if per_channel else (B, H, T)
    pick = torch.randint(0, 3, shape, generator=gen)
    near_zero = -12 + 4 * torch.rand(shape, generator=gen, dtype=torch.float64)
    near_one = -1e-4 * torch.rand(shape, generator=gen, dtype=torch.float64)
    middle = -2 * torch.rand(shape, generator=gen, dtype=torch.float64)
    g = torch.where(pick == 0, near_zero, torch.where(pick == 1, near_one, middle))
    b = 1 - 1e-4 * torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    b[..., ::2] = torch.rand(B, H, (T + 1) // 2, generator=gen, dtype=torch.float64)
    state = draw(B, H, d, d_v)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, b, state)]


def gradients(rule: Rule, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs, the final state and the gradients of every input, of a loss that weighs each
    output and state entry by its own fixed number."""
    out, final = rule(*xs)
    gen = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    w_final = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    loss = (out * w_out).sum() + (final * w_final).sum()
    grads = torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True)
    return [out, final, *grads]


NAMES = ("outputs", "final state", "dq", "dk", "dv", "dg", "db", "d state")


def mismatches(
    rule: Rule, xs: list[torch.Tensor], rtol: float, oracle: Rule = delta_rule.recurrent
) -> list[str]:
    """What of rule's outputs, final state and gradients differs from the float64 recurrence's
    (or oracle's, in float64) by more than rtol of the largest entry of each (empty: all agree)."""
    wide = [x.detach().double().requires_grad_() for x in xs]
    want = gradients(oracle, wide)
    got = gradients(rule, xs)
    bad = []
    for name, a, b in zip(NAMES, got, want, strict=True):
        scale = b.abs().max().item() or 1.0
        if (a.double() - b).abs().max().item() > rtol * scale:
            bad.append(name)
    return bad


# (B, H, T, d_k, d_v): a square state of a common head size takes the kernel's unrolled loops
# (delta_rule_kernel.cpp's with_width), any other its loops of sizes read at run time
CASES = [
    pytest.param(1, 1, 1, 8, 11, id="T=1"),
    pytest.param(1, 2, 2 * CHECKPOINT + 21, 8, 11, id="T past two checkpoints, BxH below cores"),
    pytest.param(3, 3, CHECKPOINT, 8, 11, id="T one checkpoint, BxH above the cores"),
    pytest.param(2, 2, CHECKPOINT + 3, 32, 32, id="a square state of 32, unrolled"),
    # the capacity protocol's 64-wide models have heads of 16
    pytest.param(1, 2, CHECKPOINT + 5, 16, 16, id="a square state of 16, unrolled"),
]


def through_the_op(*xs: torch.Tensor, q_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule through the custom op and its registered autograd formula, as torch.compile runs
    it (an eager call of `run` takes delta_rule_kernel.EagerRule); q_scale > 0: q and k raw."""
    q, k, v, g, b, state = xs
    per_head_g = g if g.dim() == 4 else g[..., None]
    out, final, _ = delta_rule_kernel.delta_rule_op(q, k, v, per_head_g, b, state, q_scale)
    return out, final


@pytest.mark.parametrize("per_channel", [False, True], ids=["per head", "per channel"])
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_the_kernels_l2_norms_are_the_layers(
    per_channel: bool, dtype: torch.dtype, rtol: float
) -> None:
    """Given q_scale, the kernel L2-normalises q and k itself (q then scaled), as the layers did
    before the rule: the float64 recurrence on delta_rule.l2_normalised's rows gives the same
    outputs, final state and gradients of every input, q and k's being those of the rows before
    the norm; eagerly and through the op. The rows' norms spread from 0.03 to 30, so that a
    gradient missing the norm's projection (r (I - n n^T)) or its scale cannot pass."""
    xs = sharp_inputs(2, 3, CHECKPOINT + 5, per_channel, dtype, d=8, d_v=11)
    gen = torch.Generator().manual_seed(2)
    spread = (10 ** (3 * torch.rand(2, 3, CHECKPOINT + 5, 1, generator=gen) - 1.5)).to(dtype)
    for i in (0, 1):  # q and k off the unit sphere
        xs[i] = (xs[i].detach() * spread.roll(i, dims=2)).requires_grad_()
    scale = 8**-0.5

    def oracle(q, k, v, g, b, state):  # noqa: ANN001, ANN202
        q, k = delta_rule.l2_normalised(q) * scale, delta_rule.l2_normalised(k)
        return delta_rule.recurrent(q, k, v, g, b, state)

    def eager(q, k, v, g, b, state):  # noqa: ANN001, ANN202
        return delta_rule_kernel.run(q, k, v, g, b, state, q_scale=scale)

    def op(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return through_the_op(*xs, q_scale=scale)

    assert mismatches(eager, xs, rtol, oracle) == []
    assert mismatches(op, xs, rtol, oracle) == []
    # the norm forgotten is told apart
    assert {"outputs", "dq", "dk"} <= set(mismatches(delta_rule_kernel.run, xs, rtol, oracle))


@pytest.mark.parametrize("per_channel", [False, True], ids=["per head", "per channel"])
@pytest.mark.parametrize(("B", "H", "T", "d", "d_v"), CASES)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_the_kernel_is_the_recurrence_in_outputs_state_and_every_gradient(
    B: int, H: int, T: int, d: int, d_v: int, per_channel: bool, dtype: torch.dtype, rtol: float
) -> None:
    xs = sharp_inputs(B, H, T, per_channel, dtype, d=d, d_v=d_v)
    assert mismatches(delta_rule_kernel.run, xs, rtol) == []
    assert mismatches(through_the_op, xs, rtol) == []


@pytest.mark.parametrize("per_channel", [False, True], ids=["per head", "per channel"])
def test_a_float64_gradcheck_on_tiny_shapes(per_channel: bool) -> None:
    xs = sharp_inputs(1, 2, 5, per_channel, torch.float64, d=3)
    assert torch.autograd.gradcheck(delta_rule_kernel.run, xs)


def test_the_op_passes_torch_librarys_opcheck() -> None:
    """The schema, the fake (meta) implementation torch.compile traces with, and the autograd
    registration, as torch.library checks a custom op."""
    q, k, v, g, b, state = (x.detach() for x in sharp_inputs(1, 2, 70, True, torch.float32))
    for x in (q, k, v):
        x.requires_grad_()
    for q_scale in (0.0, 8**-0.5):  # q and k as they are, and normalised by the kernel
        args = (q, k, v, g.contiguous(), b, state, q_scale)
        torch.library.opcheck(delta_rule_kernel.delta_rule_op, args)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per head", "per channel"])
def test_views_of_the_layers_layout_give_the_contiguous_results(per_channel: bool) -> None:
    """q, k and v as the recurrent layers hand them in (views of the (B, T, H, d) thirds of one
    (B, T, 3 C) product, v's tokens 3 C apart), g and b as (B, T, H) transposed: the kernel reads
    them where they lie and gives the contiguous inputs' outputs, final state and gradients, the
    same numbers; its outputs laid out (B, T, H, d); the op's fake agrees (opcheck)."""
    B, H, T, d = 2, 3, CHECKPOINT + 6, 8
    xs = sharp_inputs(B, H, T, per_channel, torch.float32, d=d, d_v=d)
    q, k, v, g, b = (x.detach() for x in xs[:5])
    state = xs[5]
    # the layer's layouts: one (B, T, 3 C) tensor of [q | k | v], heads side by side
    packed = torch.cat([x.transpose(1, 2).reshape(B, T, H * d) for x in (q, k, v)], -1)
    packed.requires_grad_()
    g_rows = g.transpose(1, 2).contiguous().requires_grad_()  # (B, T, H) or (B, T, H, d)
    b_rows = b.transpose(1, 2).contiguous().requires_grad_()
    views = [x.view(B, T, H, d).transpose(1, 2) for x in packed.split(H * d, dim=-1)]
    views += [g_rows.transpose(1, 2), b_rows.transpose(1, 2)]
    assert views[2].stride(2) == 3 * H * d and not views[2].is_contiguous()
    got = gradients(delta_rule_kernel.run, [*views, state])
    assert got[0].transpose(1, 2).is_contiguous()  # the outputs as the layer reads them
    want = gradients(delta_rule_kernel.run, [x.clone().requires_grad_() for x in xs])
    for name, a, c in zip(NAMES, got, want, strict=True):
        assert torch.equal(a, c), name
    per_head_g = views[3] if per_channel else views[3][..., None]
    torch.library.opcheck(
        delta_rule_kernel.delta_rule_op, [*views[:3], per_head_g, *views[4:], state, 0.0]
    )


def test_a_planted_bug_fails_the_comparison() -> None:
    """The comparison above catches a dropped decay, a transposed state (its initial state read as
    its transpose) and a backward that skips the last span of tokens."""
    xs = sharp_inputs(1, 2, CHECKPOINT + 9, False, torch.float64)
    run = delta_rule_kernel.run

    def dropped_decay(q, k, v, g, b, state):  # noqa: ANN001, ANN202
        return run(q, k, v, torch.zeros_like(g), b, state)

    def transposed_state(q, k, v, g, b, state):  # noqa: ANN001, ANN202
        square = state[..., : state.shape[-2]]
        return run(q, k, v, g, b, torch.cat((square.mT, state[..., square.shape[-1] :]), -1))

    def last_span_skipped(q, k, v, g, b, state):  # noqa: ANN001, ANN202
        out, final = run(q, k, v, g, b, state)
        cut = CHECKPOINT * (q.shape[2] // CHECKPOINT)
        # the same values, but no gradient reaches the inputs through the last span's outputs
        kept = torch.cat((out[:, :, :cut], out[:, :, cut:].detach()), dim=2)
        return kept, final

    assert mismatches(run, xs, 1e-10) == []
    assert "outputs" in mismatches(dropped_decay, xs, 1e-10)
    assert "outputs" in mismatches(transposed_state, xs, 1e-10)
    assert {"dq", "dv"} <= set(mismatches(last_span_skipped, xs, 1e-10))


def shifted_products(x: torch.Tensor, before: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The convolution by hand: output t is the sum over taps j of taps[j] * the input at
    t + j - (K - 1), the inputs being before's K - 1 rows then x's."""
    K, T = taps.size(0), x.size(1)
    inputs = torch.cat((before, x), dim=1)
    return sum(taps[j] * inputs[:, j : j + T] for j in range(K))


@pytest.mark.parametrize("T", [1, 2, 70])  # one token, fewer than the taps, rows past a task's
def test_the_convolution_op_is_the_shifted_products_with_every_gradient(T: int) -> None:
    """The short convolution's op against the sum written above, in float64: its output and the
    gradients of x, the inputs before it and the taps, each within 1e-12; a gradcheck and
    torch.library's opcheck. The same sum with its taps reversed (the causal order flipped) is
    told apart."""
    gen = torch.Generator().manual_seed(T)
    x, before, taps = (
        torch.randn(*shape, generator=gen, dtype=torch.float64)
        for shape in ((3, T, 40), (3, 3, 40), (4, 40))
    )
    inputs = [t.requires_grad_() for t in (x, before, taps)]
    d_y = torch.randn(3, T, 40, generator=gen, dtype=torch.float64)

    def output_and_gradients(convolve: Callable) -> list[torch.Tensor]:
        y = convolve(*inputs)
        return [y, *torch.autograd.grad(y, inputs, d_y)]

    def reversed_taps(x, before, taps):  # noqa: ANN001, ANN202
        return shifted_products(x, before, taps.flip(0))

    want = output_and_gradients(shifted_products)
    # eager calls of convolve (EagerConvolution), and the op torch.compile takes
    for path in (delta_rule_kernel.convolve, delta_rule_kernel.convolution_op):
        for got, expected in zip(output_and_gradients(path), want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(output_and_gradients(reversed_taps)[0], want[0])
    torch.library.opcheck(delta_rule_kernel.convolution_op, inputs)
    # gradcheck perturbs each input number in turn: on two rows of 5 channels
    tiny = [t[..., :5].detach().clone().requires_grad_() for t in (x[:2], before[:2], taps)]
    assert torch.autograd.gradcheck(delta_rule_kernel.convolution_op, tiny)


def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' rule on delta_rule.chunked, as where the kernel does not build."""
    monkeypatch.setattr(delta_rule_kernel, "available", lambda: False)


@pytest.mark.parametrize("layers", ["DDL", "KKL"])
def test_a_hybrids_logits_cache_and_gradients_are_the_torch_paths(
    layers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharpened hybrid (Gated DeltaNet or KDA layers and attention) over 150 tokens (past two
    of the torch path's chunks): the same logits and gradients within 1e-5, and a prefill of 100
    tokens then 3 decoded gives the full forward's logits."""
    m = lively(tiny_model(None, "rope", n_layer=3, layer_pattern=layers, block_size=160))
    idx = torch.randint(0, 61, (2, 150), generator=torch.Generator().manual_seed(3))

    def logits_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        m.zero_grad()
        logits, loss = m(idx, idx)
        loss.backward()
        return logits.detach(), [p.grad.clone() for p in m.parameters()]

    kernel_logits, kernel_grads = logits_and_grads()
    with monkeypatch.context() as patch:
        torch_path(patch)
        torch_logits, torch_grads = logits_and_grads()
    torch.testing.assert_close(kernel_logits, torch_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(kernel_grads, torch_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # prefill (the kernel) then decode (one step each) against the whole forward
    with torch.no_grad():
        cache = m.make_kv_cache(2, 160)
        steps = {100: m(idx[:, :100], kv_cache=cache)[0][:, -1]}
        for t in range(100, 103):
            steps[t + 1] = m(idx[:, t : t + 1], kv_cache=cache)[0][:, -1]
        for end, logits in steps.items():
            torch.testing.assert_close(logits, m(idx[:, :end])[0][:, -1], atol=1e-5, rtol=0)


def test_compiled_training_through_the_op_is_eager() -> None:
    """torch.compile traces the op as one call (fullgraph: no graph break), through its fake
    implementation and autograd formula (AOTAutograd, the aot_eager backend: what inductor would
    be handed, without a minute of code generation; bench.py --mode=delta compiles the step with
    inductor), and gives eager's loss and gradients."""
    m = lively(tiny_model(None, "rope", n_layer=2, layer_pattern="DL"))
    idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(5))
    loss = m(idx, idx)[1]
    loss.backward()
    eager = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    compiled_loss = compiled(idx, idx)[1]
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
    for p, want in zip(m.parameters(), eager, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5)


def test_torch_compile_asks_whether_the_kernel_runs_once_without_tracing_its_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """available() carries the mark of torch.compiler.assume_constant_result, set by hand (the
    decorator imports torch._dynamo): traced before the kernel is loaded, torch.compile calls it
    (which loads it) instead of tracing the build's file reads, which would break the graph."""
    monkeypatch.setattr(delta_rule_kernel.Build, "module", None)
    torch._dynamo.reset()
    ask = torch.compile(
        lambda x: x + 1 if delta_rule_kernel.available() else x, fullgraph=True, backend="eager"
    )
    assert torch.equal(ask(torch.zeros(2)), torch.ones(2))
    assert delta_rule_kernel.Build.module is not None
