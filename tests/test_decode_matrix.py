"""Each mixing kind (MHA, GQA, MQA, MLA with and without a query latent, local layers, Gated
DeltaNet layers beside Qwen3.5's attention) through each decoding path, against its reference
(issue 54): int8 weights against the float model, a left-padded batch against each prompt alone, a
Hugging Face folder (hf:) against its run, the compiled CPU step and CUDA graphs against the greedy
tokens; sample.py --quantize=int8 on MLA."""

import copy
import string
from pathlib import Path

import pytest
import torch

from conftest import COMPILES, cli, distinct, lively, tiny_model
from model import GPT

# smallgpt.compiled_step (torch's inductor: 1.5 s a process, then conftest's registration of its
# template choice, 1.4 s) is imported in the tests that use it, not as the workers collect
from smallgpt.checkpoint import load_run, parse_source, save_checkpoint
from smallgpt.errors import UserError
from smallgpt.generation import generate, left_pad
from smallgpt.hf import to_hf
from smallgpt.quantize import Int8Linear, quantize

LLAMA = dict(norm="rmsnorm", mlp="swiglu", bias=False, pos_encoding="rope")  # MLA exports with it
# Each kind as it exports: Starcoder2 (MHA, GQA), GPTBigCode (MQA), DeepseekV3 (MLA), GraniteSWA
# (local layers), Qwen3.5 (a Gated DeltaNet layer, gated attention with q/k norms and half its
# features rotated); no stock class holds MLA with local layers. The int8 products take rows of
# other widths than 16's multiples too: the Llama block's SwiGLU (88 wide), MLA-q's latent (12).
# MLA-window-GDN has a query latent, a Gated DeltaNet and a KDA layer too: its compiled int8 step
# (below) holds MLA's kv_b, the query latent's rows, a ring and two recurrent states in one
# program; its attention has sinks, its global layer no positions (Kimi Linear's NoPE MLA).
# sinks-NoPE: GQA with sinks on a local layer and a global one without positions (GraniteSWA).
# KDA: Kimi Linear's hybrid (KimiLinearForCausalLM).
KINDS = {
    "MHA": dict(n_kv_head=4, pos_encoding="rope"),
    "GQA": dict(n_kv_head=2, pos_encoding="rope"),
    "MQA": dict(n_kv_head=1),
    "MLA": LLAMA | dict(kv_lora_rank=8),
    "MLA-q": LLAMA | dict(kv_lora_rank=8, q_lora_rank=12),
    "window": LLAMA | dict(n_kv_head=1, window=8, window_pattern="SL"),
    "MLA-window-GDN": LLAMA
    | dict(
        kv_lora_rank=8,
        q_lora_rank=12,
        window=8,
        layer_pattern="DKSL",
        n_layer=4,
        attn_sinks=True,
        rope_pattern="RRRN",
    ),
    "KDA": LLAMA | dict(kv_lora_rank=8, layer_pattern="KL", rope_pattern="N"),
    "sinks-NoPE": LLAMA
    | dict(n_kv_head=2, window=8, window_pattern="SL", attn_sinks=True, rope_pattern="RN"),
    "hybrid": LLAMA
    | dict(n_kv_head=2, layer_pattern="DL", attn_gate="element", qk_norm=True, rope_fraction=0.5),
}
CHARS = list(string.printable[:61])  # the tokenizer of the run sample.py reads: a token a character


def build(kind: str) -> GPT:
    """A lively model of the kind (its greedy tokens follow its context), MLA's latents as sharp as
    its queries (as test_window's)."""
    torch.manual_seed(0)
    m = lively(tiny_model(**KINDS[kind]))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("kv_a.weight", "q_b.weight")):
                p.mul_(4.0)
            if name.endswith("sinks"):  # sinks that take a share of the softmax
                p.normal_(2.0, 4.0)
    return m


@pytest.fixture(scope="module")
def models() -> dict[str, GPT]:
    """Each kind's model, built once for the file (no test changes one)."""
    return {kind: build(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def int8_models(models: dict[str, GPT]) -> dict[str, GPT]:
    """Each kind's model with int8 weights."""
    return {kind: quantize(copy.deepcopy(m), "int8") for kind, m in models.items()}


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 61, (n,), generator=gen).tolist() for n in lengths]


def cached_logits(m: GPT, idx: torch.Tensor, prefill: int) -> torch.Tensor:
    """The logits (B, steps, vocab) of each one-token step through one cache after a prefill of
    idx's first `prefill` tokens, fed idx's tokens whatever the model predicts."""
    cache = m.make_kv_cache(idx.size(0), idx.size(1))
    m(idx[:, :prefill], kv_cache=cache)
    steps = range(prefill, idx.size(1))
    return torch.cat([m(idx[:, t : t + 1], kv_cache=cache)[0] for t in steps], dim=1)


def recomputed_logits(m: GPT, idx: torch.Tensor, prefill: int) -> torch.Tensor:
    """cached_logits' oracle: each step's prefix recomputed whole, without a cache."""
    return torch.cat([m(idx[:, : t + 1])[0] for t in range(prefill, idx.size(1))], dim=1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest over the steps of |got - want| / |want|, for logits (B, steps, vocab)."""
    return float(((got - want).norm(dim=(0, 2)) / want.norm(dim=(0, 2))).max())


def shortfalls(m: GPT, row: list[int], start: int) -> list[float]:
    """How far below the top logit each of row's tokens from start on is (over the largest
    |logit|), the logits recomputed without a cache over the window the engine decodes it from
    (test_generate's by_hand: block_size tokens at most, then the newest block_size // 2): 0 where
    the token is the greedy one."""
    bs = m.config.block_size
    device = m.transformer.wte.weight.device
    first = max(0, start - bs)
    out = []
    for p in range(start, len(row)):
        if p - first > bs:
            first = p - bs // 2
        logits = m(torch.tensor([row[first:p]], device=device))[0][0, -1]
        out.append(float((logits.max() - logits[row[p]]) / logits.abs().max()))
    return out


def assert_greedy(m: GPT, tokens: torch.Tensor, start: int) -> None:
    """Each of tokens' (B, T) from start on is m's greedy one, but at a near tie (int8's lm_head
    gives bf16 logits, whose ties products summed in another order may break the other way)."""
    gaps = [gap for row in tokens.tolist() for gap in shortfalls(m, row, start)]
    assert max(gaps) < 0.02 and sum(gap == 0 for gap in gaps) >= 0.95 * len(gaps)


@pytest.mark.parametrize("width", [8, 12, 24, 40, 48, 88])
def test_int8_products_are_the_float_ones_at_any_width(width: int) -> None:
    """Int8Linear of rows of any width, one row (decoding) and several (prefill): within int8
    rounding of nn.Linear's. torch's bf16 kernel reads past a row whose width is no multiple of
    16 (wrong products, or a crash): such rows multiply in fp32."""
    layer = torch.nn.Linear(width, 40)
    q = Int8Linear(layer)
    for rows in (1, 5):
        x = torch.randn(rows, width)
        with torch.inference_mode():
            want, got = layer(x), q(x)
        assert (got - want).norm() / want.norm() < 0.01, f"{rows} rows"


@pytest.mark.parametrize("kind", KINDS)
def test_int8_decoding_through_the_cache_follows_the_float_model(
    kind: str, models: dict[str, GPT], int8_models: dict[str, GPT]
) -> None:
    """Through the cache (MLA's absorbed step), int8 logits are within int8 rounding of the float
    model's (test_quantize's bound, on a model as initialised) and of their own recomputed without
    a cache (MLA's unabsorbed step; bf16 activations, so not fp32's 1e-5); on a lively model, whose
    argmax moves with the context, nearly every step picks the float model's token."""
    idx = torch.randint(0, 61, (3, 28), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = tiny_model(**KINDS[kind])
    with torch.inference_mode():
        want = cached_logits(plain, idx, 4)
        got = cached_logits(quantize(copy.deepcopy(plain), "int8"), idx, 4)
        assert relative_error(got, want) < 0.02
        q = int8_models[kind]
        got = cached_logits(q, idx, 4)
        assert relative_error(got, recomputed_logits(q, idx, 4)) < 0.01
        want = cached_logits(models[kind], idx, 4)
    picks = want.argmax(-1)
    assert distinct(picks) >= 12  # the float model's tokens follow its context
    assert (got.argmax(-1) == picks).float().mean() >= 0.85


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_padded_batch_decodes_what_each_prompt_does_alone(
    kind: str, int8: bool, models: dict[str, GPT], int8_models: dict[str, GPT]
) -> None:
    """Prompts of 9, 3 and 14 tokens left-padded into one batch, 24 greedy tokens (the longest
    row's window slides past block_size 32): each row's are its prompt's alone, float or int8."""
    m = (int8_models if int8 else models)[kind]
    rows = prompts(2, (9, 3, 14))
    idx, pad = left_pad(rows)
    with torch.inference_mode():
        batch = generate(m, idx, 24, temperature=0, pad=pad)[:, -24:]
        alone = [generate(m, torch.tensor([p]), 24, temperature=0)[0, -24:] for p in rows]
    assert [b.tolist() for b in batch] == [a.tolist() for a in alone]
    assert distinct(batch) >= 10


def exported(model: GPT, folder: Path) -> GPT:
    """model saved as a transformers folder (as export.py does), loaded back by init_from=hf:."""
    to_hf(model).save_pretrained(folder)
    return load_run(parse_source(f"hf:{folder}"), tokenizer=False).model.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_an_hf_folder_decodes_what_its_run_does(
    kind: str, models: dict[str, GPT], tmp_path: Path
) -> None:
    """Exported and loaded back (hf:), each kind that a stock class holds decodes its run's greedy
    tokens, past block_size; MLA with local layers, which none holds, is refused in one line."""
    m = models[kind]
    if kind == "MLA-window-GDN":
        with pytest.raises(UserError, match="export needs .*no local layers .*no sinks") as e:
            exported(m, tmp_path)
        assert "\n" not in str(e.value)
        return
    idx = torch.tensor(prompts(3, (5, 5)))
    with torch.inference_mode():
        back = exported(m, tmp_path)
        want = generate(m, idx, 40, temperature=0)
        assert torch.equal(generate(back, idx, 40, temperature=0), want)
    assert distinct(want[:, 5:]) >= 10


def test_an_hf_folder_decodes_what_its_run_does_with_int8(
    models: dict[str, GPT], int8_models: dict[str, GPT], tmp_path: Path
) -> None:
    """The same with int8 weights, for MLA with a query latent: the folder's model quantized decodes
    the run's int8 tokens (MLA's latent rows come back to within a float rounding, which the int8
    weights and bf16 scales round away)."""
    idx = torch.tensor(prompts(4, (6, 6)))
    with torch.inference_mode():
        back = quantize(exported(models["MLA-q"], tmp_path), "int8")
        want = generate(int8_models["MLA-q"], idx, 30, temperature=0)
        assert torch.equal(generate(back, idx, 30, temperature=0), want)
    assert distinct(want[:, 6:]) >= 8


# One compiled step new to the suite (test_generate's and test_quantize's are fp32 MHA, GQA and
# MLA, and int8 MHA): int8 MLA with a query latent and a local layer (its ring an input of the
# step), at batch 1 (sample.py's below loads it). It was two steps (int8 MLA-q at batch 1, int8
# local layers at batch 2), each ~20 s of compiling: this one holds what either held.
@COMPILES
def test_the_compiled_int8_step_decodes_the_greedy_tokens(int8_models: dict[str, GPT]) -> None:
    """compile_step=True with int8 weights (their products in inductor's GEMM template, MLA's kv_b
    read as a float matrix, the query latent's 12-wide rows, the local layer's ring), compiled
    once, decodes the greedy tokens past block_size."""
    from smallgpt.compiled_step import STEPS

    q = int8_models["MLA-window-GDN"]
    idx = torch.tensor(prompts(5, (3,)))
    with torch.inference_mode():
        compiled = generate(q, idx, 70, temperature=0, compile_step=True)
        assert_greedy(q, compiled, 3)
    assert distinct(compiled[:, 3:]) >= 5 and len(STEPS[q]) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_cuda_graph_step_decodes_the_greedy_tokens(
    kind: str, int8: bool, models: dict[str, GPT]
) -> None:
    """On CUDA each one-token step replays a CUDA graph of decode_static: the greedy tokens, past
    block_size, float or int8, as the eager step's."""
    m = copy.deepcopy(models[kind]).cuda()
    if int8:
        m = quantize(m, "int8")
    idx = torch.tensor(prompts(6, (3, 3)), device="cuda")
    with torch.inference_mode():
        eager = generate(m, idx, 70, temperature=0, cuda_graph=False)
        graphed = generate(m, idx, 70, temperature=0, cuda_graph=True)
        assert_greedy(m, graphed, 3)
        assert_greedy(m, eager, 3)
    assert distinct(graphed[:, 3:]) >= 10


@COMPILES
def test_sample_py_decodes_an_mla_run_with_int8_weights(tmp_path: Path) -> None:
    """sample.py --quantize=int8 on an MLA run with a query latent (whose absorbed step read the
    int8 kv_b as floats: a crash) writes its text and exits 0; so it does from the run exported to
    a Hugging Face folder (hf:), and with --compile=True on an MLA run with local layers too (the
    step compiled above; no stock class holds that run, so it is not exported)."""
    meta = {"tokenizer": "char", "vocab_size": len(CHARS), "chars": CHARS}
    run, local = tmp_path / "run", tmp_path / "local"
    for folder, kind in ((run, "MLA-q"), (local, "MLA-window-GDN")):
        folder.mkdir()
        save_checkpoint(
            folder / "ckpt.pt", build(kind), iter_num=0, data_meta=meta, config={"dataset": "chars"}
        )
    args = [
        "--start=def",
        "--max_new_tokens=40",
        "--temperature=0",
        "--quantize=int8",
        "--device=cpu",
    ]
    r = cli(["sample.py", f"--out_dir={run}", *args])
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert text.startswith("def") and len(text) == len("def") + 40 + 1 and distinct(text) >= 8
    eager = cli(["sample.py", f"--out_dir={local}", *args])
    assert eager.returncode == 0 and distinct(eager.stdout) >= 8, eager.stderr
    r = cli(["sample.py", f"--out_dir={local}", *args, "--compile=True"])
    assert r.returncode == 0 and "compiled step ready" in r.stderr, r.stderr
    assert r.stdout.startswith("def") and len(r.stdout) == len(eager.stdout)  # ties may break
    r = cli(["export.py", f"--out_dir={run}", f"--to={tmp_path / 'hf'}"])
    assert r.returncode == 0, r.stderr
    r = cli(["sample.py", f"--init_from=hf:{tmp_path / 'hf'}", *args])
    assert r.returncode == 0 and r.stdout == text, r.stderr
