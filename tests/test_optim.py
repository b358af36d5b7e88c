"""smallgpt/optim.py: Muon against torch.optim.Muon, the chained optimizer, the learning-rate
schedule."""

from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from smallgpt import sharding
from smallgpt.errors import UserError
from smallgpt.optim import Muon, lr_at, make_optimizer, orthogonalised


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is in torch >= 2.9")
def test_muon_in_bf16_is_torch_optim_muon() -> None:
    """With the orthogonalisation in bf16 (as torch's always is), our Muon's steps are
    torch.optim.Muon's exactly."""
    torch.manual_seed(0)
    ours, theirs = torch.randn(48, 32), None
    theirs = ours.clone().requires_grad_()
    ours.requires_grad_()
    opt_ours = Muon([ours], lr=0.02, ns_dtype=torch.bfloat16)
    opt_theirs = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.0)
    for _ in range(3):
        grad = torch.randn(48, 32)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert torch.equal(ours, theirs)
    assert torch.equal(
        opt_ours.state[ours]["momentum_buffer"], opt_theirs.state[theirs]["momentum_buffer"]
    )


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (32, 32)])
def test_orthogonalised_pushes_singular_values_towards_one(shape: tuple[int, int]) -> None:
    """The quintic Newton-Schulz iteration brings singular values spread over two decades into a
    band around one (it trades exactness for speed: roughly 0.5 to 1.5); fp32 and bf16 agree to
    bf16's precision."""
    torch.manual_seed(0)
    k = min(shape)
    u, v = (
        torch.linalg.qr(torch.randn(shape[0], k))[0],
        torch.linalg.qr(torch.randn(shape[1], k))[0],
    )
    g = u @ torch.diag(torch.logspace(-1, 1, k)) @ v.T  # singular values 0.1 ... 10
    out = orthogonalised(g, torch.float32)
    s = torch.linalg.svdvals(out)
    assert out.shape == g.shape and 0.3 < s.min() and s.max() < 1.5 and s.max() / s.min() < 5, s
    torch.testing.assert_close(orthogonalised(g, torch.bfloat16), out, rtol=0, atol=0.05)


def test_muon_chain_covers_every_parameter_once_and_trains() -> None:
    model = tiny_model(n_kv_head=2).train()
    opt = make_optimizer(model, "muon", 0.1, 1e-2, (0.9, 0.95), "cpu", muon_lr=0.05)
    muon, adamw = opt.optimizers
    inner = {id(p) for g in muon.param_groups for p in g["params"]}
    rest = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert inner.isdisjoint(rest) and inner | rest == {id(p) for p in model.parameters()}
    names = {n for n, p in model.named_parameters() if id(p) in inner}
    assert names == {
        n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("transformer.h.")
    }
    assert [g["lr_scale"] for g in opt.param_groups] == pytest.approx([5.0, 1.0, 1.0])
    x = torch.randint(0, 61, (4, 32))
    y = torch.roll(x, -1, dims=1)
    first = model(x, y)[1].item()
    for _ in range(30):
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    assert model(x, y)[1].item() < 0.05 * first  # one batch, memorised
    state = opt.state_dict()
    again = make_optimizer(model, "muon", 0.1, 1e-2, (0.9, 0.95), "cpu", muon_lr=0.05)
    again.load_state_dict(state)
    assert again.param_groups == [
        *again.optimizers[0].param_groups,
        *again.optimizers[1].param_groups,
    ]
    assert all(
        a is b for a, b in zip(again.param_groups, again.optimizers[0].param_groups, strict=False)
    )
    assert torch.equal(
        again.optimizers[0].state[model.transformer.h[0].mlp.c_fc.weight]["momentum_buffer"],
        muon.state[model.transformer.h[0].mlp.c_fc.weight]["momentum_buffer"],
    )


def test_lr_schedule_warms_up_then_decays_to_min_lr() -> None:
    lrs = [lr_at(it, 1e-3, 1e-4, 10, 100) for it in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert max(lrs) <= 1e-3 and lrs[10] == pytest.approx(1e-3) and lrs[100:] == [1e-4] * 20
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lr_at(50, 1e-3, 1e-4, 10, 100, decay=False) == 1e-3


def test_muon_orthogonalises_same_shaped_matrices_as_one_stack_as_it_would_one_at_a_time() -> None:
    """Muon's step over matrices of four shapes, several of most (stacked and orthogonalised as one
    batch), their gradients at scales 100x apart (a norm over the whole stack instead of each
    matrix's would show), 3 steps with weight decay, in fp32: each matrix ends where
    torch.optim.Muon's update, written out here one at a time, puts it."""
    torch.manual_seed(0)
    shapes = [(32, 32)] * 3 + [(128, 32)] * 2 + [(32, 128)] * 2 + [(16, 32)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref, bufs = [p.detach().clone() for p in params], [torch.zeros(s) for s in shapes]
    opt = Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    for _ in range(3):
        grads = [torch.randn(s) * 10.0 ** (i % 3 - 1) for i, s in enumerate(shapes)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for w, g, buf in zip(ref, grads, bufs, strict=True):
            buf.lerp_(g, 1 - 0.95)
            update = orthogonalised(g.lerp(buf, 0.95), torch.float32)
            w.mul_(1 - 0.02 * 0.1)
            w.add_(update, alpha=-0.02 * max(1.0, w.size(0) / w.size(1)) ** 0.5)
    for p, w in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    assert len(opt.shapes) == 1  # the grouping by shape made once, on the first step


def test_muon_takes_a_recurrent_layers_matrices_and_adamw_its_convolution_and_vectors() -> None:
    """In a Gated DeltaNet layer Muon takes the matrices, its per-head gate projections included;
    AdamW the depthwise convolution's filters (measured worse under Muon: docs/performance-cpu.md
    "Which parameters Muon takes") and the per-head A_log and dt_bias vectors."""
    model = tiny_model(layer_pattern="DL")
    muon, adamw = make_optimizer(model, "muon", 0.1, 1e-2, (0.9, 0.95), "cpu", 0.05).optimizers
    ids = {id(p): n for n, p in model.named_parameters()}
    inner = {ids[id(p)] for g in muon.param_groups for p in g["params"]}
    rest = {ids[id(p)] for g in adamw.param_groups for p in g["params"]}
    layer = "transformer.h.0.attn."
    assert {layer + m + ".weight" for m in ("c_qkv", "c_z", "c_b", "c_a", "c_proj")} <= inner
    assert {layer + m for m in ("conv", "A_log", "dt_bias")} <= rest


def test_an_optimizer_state_split_otherwise_is_refused_in_one_line(tmp_path: Path) -> None:
    """Resuming from a state whose groups hold other parameters (saved by a version that split
    them otherwise between Muon and AdamW) is a one-line UserError naming the way on, not torch's
    ValueError; the optimizer is left as it was."""
    model = tiny_model(layer_pattern="DL")
    opt = make_optimizer(model, "muon", 0.1, 1e-2, (0.9, 0.95), "cpu", muon_lr=0.05)
    saved = opt.state_dict()
    saved["chain"][0]["param_groups"][0]["params"].pop()  # one matrix fewer in Muon's group
    with pytest.raises(UserError, match=r"optimizer state does not fit.*--init_from=convert:"):
        sharding.load_optimizer({"optimizer": saved}, tmp_path, model, opt)
    assert (
        opt.state_dict()
        == make_optimizer(model, "muon", 0.1, 1e-2, (0.9, 0.95), "cpu", muon_lr=0.05).state_dict()
    )
