import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import COMPILES, DECODE, cli, distinct, lively, run, tiny_model
from model import GPT, GPTConfig

# smallgpt.compiled_step (torch's inductor: 1.5 s a process, then conftest's registration of its
# template choice, 1.4 s) is imported in the tests that use it, not as the workers collect
from smallgpt.checkpoint import save_checkpoint
from smallgpt.data import Batches, write_dataset
from smallgpt.generation import generate
from smallgpt.quantize import Int8Linear, quantize


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_rounds_each_row_to_its_own_scale(bias: bool) -> None:
    """Each output feature's weights are int8 times one scale (its largest magnitude maps to 127),
    so every weight is within half a step of the original and the product is within int8 rounding of
    nn.Linear's."""
    layer = torch.nn.Linear(64, 48, bias=bias)
    with torch.no_grad():
        layer.weight[3] *= 100  # one row far larger than the others keeps its own scale
    q = Int8Linear(layer)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (48,) and q.weight.abs().max() == 127
    step = layer.weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.weight * q.scale[:, None] - layer.weight).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        want, got = layer(x), q(x)
    assert got.shape == want.shape
    assert (got - want).norm() / want.norm() < 0.01
    # on CPU the product takes bf16 activations and scales, its result rounded to bf16 (torch's int8
    # kernel)
    bf16 = lambda t: t.bfloat16().float()  # noqa: E731
    want_exact = bf16(bf16(x) @ (q.weight * bf16(q.scale)[:, None]).T) + (layer.bias if bias else 0)
    torch.testing.assert_close(got, want_exact, rtol=8e-3, atol=1e-3)


@COMPILES
def test_quantized_model_decodes_close_to_fp32_and_compiles() -> None:
    """quantize() makes every Linear int8 (the lm_head its own copy: the embedding it was tied to
    keeps fp32); the logits stay close to fp32's (GQA, 2 rows), and the compiled step decodes the
    eager int8 tokens past block_size (the DECODE model, which bench.py --mode=int8 compiles next:
    one package for both), its int8 products through inductor's GEMM template (autotuning may still
    pick torch's kernel for some)."""
    from smallgpt.compiled_step import STEPS

    m = tiny_model(2, "rope", block_size=16, vocab_size=101)
    q = quantize(copy.deepcopy(m), "int8")
    assert not [mod for mod in q.modules() if isinstance(mod, torch.nn.Linear)]
    assert q.lm_head.weight.dtype == torch.int8 and torch.equal(
        q.transformer.wte.weight, m.transformer.wte.weight
    )
    idx = torch.randint(0, 101, (2, 12))
    d = quantize(tiny_model(**DECODE), "int8")
    with torch.inference_mode():
        want, got = m(idx, idx)[0], q(idx, idx)[0]
        assert (got - want).norm() / want.norm() < 0.02
        eager = generate(d, idx[:1, :3], 80, temperature=0)
        assert torch.equal(generate(d, idx[:1, :3], 80, temperature=0, compile_step=True), eager)
    ((_, sources, lent),) = STEPS[
        d
    ].values()  # its int8 products through inductor's GEMM template: blocked int8 copies
    int8 = {
        f"model.{name}.weight" for name, mod in d.named_modules() if isinstance(mod, Int8Linear)
    }
    assert {source for source, *_ in sources.values()} <= int8 and sources
    assert all(lent[name][0].dtype == torch.int8 for name in sources)
    with pytest.raises(ValueError, match="quantize='int4' must be one of"):
        quantize(m, "int4")


@COMPILES
def test_int8_bench_reports_val_loss_and_agreement_of_a_checkpoint(tmp_path: Path) -> None:
    """bench.py --mode=int8 reads a checkpoint and its dataset: fp32 and int8 val losses close, the
    next-token and greedy agreements those computed here, weight bytes those counted by hand; its
    header describes the checkpoint's model. (Its speeds are reported, not checked: nothing in the
    suite is timed.)"""
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    meta = {"vocab_size": 96, "tokenizer": "char", "chars": [chr(32 + i) for i in range(96)]}
    write_dataset(data, rng.integers(0, 96, 4000), rng.integers(0, 96, 1000), meta)
    # a lively model (its greedy text follows its prompt) whose int8 form changes some of its greedy
    # tokens (at seed 0, 60% agree): an agreement computed wrong shows
    torch.manual_seed(0)
    model = lively(GPT(GPTConfig(**DECODE))).eval()
    save_checkpoint(tmp_path / "ckpt.pt", model, iter_num=0, config={"dataset": str(data)})
    r = run(
        [
            "bench.py",
            "--mode=int8",
            f"--out_dir={tmp_path}",
            "--eval_iters=2",
            "--batch_size=4",
            "--new_tokens=[12]",
        ]
    )
    fp32, int8 = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert abs(int8["val_loss"] - fp32["val_loss"]) < 0.01 and int8["top1_agreement"] > 0.9
    # the agreements computed here: the first eval_iters val batches (train.py's default seed), and
    # 12 greedy tokens after the first 16 tokens of the first 4 rows of the first val batch, fp32
    # against int8 weights
    batches = Batches(data, 64, 4, 1337, "cpu")
    val = [batches.eval("val", k) for k in range(2)]
    q = quantize(copy.deepcopy(model), "int8")
    with torch.inference_mode():
        picks = [torch.stack([m(x, y)[0].argmax(-1) for x, y in val]) for m in (model, q)]
        greedy = [generate(m, val[0][0][:4, :16], 12, temperature=0)[:, 16:] for m in (model, q)]
    assert distinct(greedy[0]) >= 12  # not 4 rows of one token each, as a random model's would be
    assert int8["top1_agreement"] == pytest.approx(
        (picks[0] == picks[1]).float().mean().item(), abs=1e-9
    )
    assert int8["greedy_agreement"] == pytest.approx(
        (greedy[0] == greedy[1]).float().mean().item(), abs=1e-9
    )
    # weight bytes by hand: fp32 4 a parameter (lm_head tied); int8 keeps the embeddings, norms and
    # biases in fp32, each Linear's (out, in) weight in one byte each and its out scales in fp32 and
    # bf16
    D, V, T, L = 32, 96, 64, 2
    linears = [(D, D)] * 4 + [(4 * D, D), (D, 4 * D)]  # c_q, c_k, c_v, c_proj; c_fc, mlp.c_proj
    biases = L * sum(out for out, _ in linears)
    kept = (
        V * D + T * D + L * 2 * 2 * D + 2 * D + biases
    )  # wte, wpe, ln_1 and ln_2 of each block, ln_f, biases
    assert fp32["weight_bytes"] == 4 * (kept + L * sum(o * i for o, i in linears))
    assert int8["weight_bytes"] == 4 * kept + sum(
        o * i + (4 + 2) * o for o, i in linears * L + [(V, D)]
    )
    assert {"eager_tok_s", "compiled_tok_s"} <= fp32.keys() & int8.keys()
    assert (
        "int8 benchmark on cpu" in r.stderr and "2 layers, 4 heads, 32 wide, vocab 96" in r.stderr
    )


def test_sample_refuses_an_unknown_quantization(tmp_path: Path) -> None:
    r = cli(["sample.py", f"--out_dir={tmp_path}", "--quantize=int4"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip().splitlines()[-1].startswith("error: ")
        and "quantize='int4' must be one of" in r.stderr
    )
