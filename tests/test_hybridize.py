"""smallgpt/hybridize.py, attention converted into a Gated DeltaNet hybrid: the copied rows, a copy
that converts nothing, the decay calibrated from attention maps, the layer ranking, the two
distillation losses, and the converted model against the cache and export oracles."""

import math
import shutil
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import QWEN, TINY_TRAIN, cli, exported_logits, lively, read_log, run, tiny_model
from gated_deltanet import GatedDeltaNet
from model import GPT
from smallgpt import hybridize
from smallgpt.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from smallgpt.data import Batches, load_meta, write_dataset
from smallgpt.delta_rule import l2_normalised
from smallgpt.errors import UserError
from smallgpt.measure import evaluate


def teacher(**overrides: object) -> GPT:
    """A lively 3-layer GQA model (4 query heads over 2 K/V heads), learned positions."""
    torch.manual_seed(0)
    return lively(tiny_model(**(dict(n_layer=3, n_kv_head=2) | overrides)))


def tokens(T: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 61, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_copied_rows_are_the_teachers_k_v_heads_repeated_over_their_groups(
    qk_norm: bool,
) -> None:
    """q rows are W_q's, head h of k and v is the teacher's K/V head h // 2, W_o is c_proj, the
    convolution is the identity; with Qwen3's q/k norms folded in, the layer's normalised q and k
    are the teacher's normalised ones. Every parameter outside the converted layer is the
    teacher's."""
    t = teacher(**(QWEN | dict(n_layer=3, n_kv_head=2, qk_norm=qk_norm)))
    if qk_norm:
        with torch.no_grad():
            for block in t.transformer.h:
                block.attn.q_norm.weight.uniform_(0.5, 2.0)
                block.attn.k_norm.weight.uniform_(0.5, 2.0)
    h = hybridize.to_hybrid(t, "DLL")
    ours, theirs = h.transformer.h[0].attn, t.transformer.h[0].attn
    assert isinstance(ours, GatedDeltaNet)
    C, hd = 32, 8
    q_rows, k_rows, v_rows = ours.c_qkv.weight.split(C)
    if not qk_norm:
        assert torch.equal(q_rows, theirs.c_q.weight)
        for head in range(4):
            rows = slice(head * hd, (head + 1) * hd)
            kv = slice(head // 2 * hd, (head // 2 + 1) * hd)
            assert torch.equal(k_rows[rows], theirs.c_k.weight[kv])
            assert torch.equal(v_rows[rows], theirs.c_v.weight[kv])
    assert torch.equal(ours.c_proj.weight, theirs.c_proj.weight)
    assert torch.equal(ours.conv[:, 0], torch.tensor([0.0, 0.0, 0.0, 1.0]).expand(3 * C, 4))
    x = torch.randn(2, 5, C)
    with torch.no_grad():
        q, k, v = ours.c_qkv(x).view(2, 5, 3, 4, hd).unbind(2)
        tq, tk = theirs.c_q(x).view(2, 5, 4, hd), theirs.c_k(x).view(2, 5, 2, hd)
        if qk_norm:
            tq, tk = theirs.q_norm(tq), theirs.k_norm(tk)
        torch.testing.assert_close(l2_normalised(q), l2_normalised(tq), atol=1e-6, rtol=0)
        want_k = l2_normalised(tk).repeat_interleave(2, dim=2)
        torch.testing.assert_close(l2_normalised(k), want_k, atol=1e-6, rtol=0)
    teachers = t.state_dict()
    for name, value in h.state_dict().items():
        if not name.startswith("transformer.h.0.attn."):
            assert torch.equal(value, teachers[name]), name


def test_converting_no_layer_gives_the_teachers_logits_exactly() -> None:
    t = teacher(pos_encoding="rope").eval()
    h = hybridize.to_hybrid(t, "L").eval()
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(h(idx, idx)[0], t(idx, idx)[0])


def test_what_cannot_be_converted_is_one_line() -> None:
    t = teacher(window=4, window_pattern="SL")
    with pytest.raises(UserError, match="layer 0 is local attention: .*global attention"):
        hybridize.to_hybrid(t, "DSL")
    with pytest.raises(UserError, match="layer_pattern='DX'"):
        hybridize.to_hybrid(teacher(), "DX")
    # a kept layer of another kind: said by its layer and kinds, never a weight's name
    hybrid = hybridize.to_hybrid(teacher(), "DLL")
    with pytest.raises(UserError) as e:
        hybridize.to_hybrid(hybrid, "LLL")
    assert "cannot convert layer 0: it is Gated DeltaNet in the source and layer_pattern=" in str(
        e.value
    )
    assert "give layer 0 its letter 'D'" in str(e.value) and "weight" not in str(e.value)


def geometric_probs(half_lives: list[float], T: int) -> torch.Tensor:
    """Causal attention maps (1, heads, T, T) whose weights fall as 2^(-d / half-life) with the
    distance d back."""
    d = (torch.arange(T)[:, None] - torch.arange(T)).double()
    rows = []
    for h in half_lives:
        w = torch.where(d >= 0, 0.5 ** (d / h), torch.zeros(()))
        rows.append(w / w.sum(-1, keepdim=True))
    return torch.stack(rows)[None]


def test_calibration_recovers_planted_half_lives() -> None:
    """Heads of geometric attention with half-lives from 1.5 to 40 tokens over 128 positions (most
    queries see less than the longest's tail): each comes back within 5%."""
    planted = [1.5, 4.0, 11.0, 40.0]
    mean, reach = hybridize.look_back(geometric_probs(planted, 128))
    got = hybridize.half_life(hybridize.decay_for(mean, reach))
    assert torch.allclose(got, torch.tensor(planted, dtype=torch.float64), rtol=0.05)
    # the model path records the teacher's own maps: layer 0's by hand, from its weights
    t = teacher().eval()
    idx = tokens(T=20)
    att = t.transformer.h[0].attn
    with torch.no_grad():
        x = t.transformer.h[0].ln_1(t.transformer.wte(idx) + t.transformer.wpe(torch.arange(20)))
        q = att.c_q(x).view(2, 20, 4, 8).transpose(1, 2)
        k = att.c_k(x).view(2, 20, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        scores = (q @ k.mT) / math.sqrt(8)
        causal = torch.ones(20, 20, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        decays = hybridize.decays(t, [idx])
    assert sorted(decays) == [0, 1, 2]
    torch.testing.assert_close(decays[0], hybridize.decay_for(*hybridize.look_back(probs)))
    # a calibrated layer keeps that decay for every token
    h = hybridize.to_hybrid(t, "DLL", decays)
    layer = h.transformer.h[0].attn
    g = -layer.A_log.exp() * F.softplus(layer.c_a(torch.randn(3, 32)) + layer.dt_bias)
    torch.testing.assert_close(g.exp(), decays[0].expand(3, 4), rtol=1e-5, atol=0)


def test_the_ranking_puts_first_the_one_layer_that_carries_the_output() -> None:
    """Layers 0 and 2 write nothing (W_o zero), layer 1's attention carries the prediction: by the
    loss of converting each alone and by the KL with each restored, layer 1 ranks first."""
    t = teacher(pos_encoding="rope").eval()
    with torch.no_grad():
        for i in (0, 2):
            t.transformer.h[i].attn.c_proj.weight.zero_()
            t.transformer.h[i].attn.c_proj.bias.zero_()
        idx = tokens(T=24, seed=5)
        targets = t(idx, idx)[0].argmax(-1)  # the teacher's own predictions: its loss is low
    batches = [(idx, targets)]
    assert hybridize.ranked_layers(t, batches, "loss")[0] == 1
    assert hybridize.ranked_layers(t, batches, "kl")[0] == 1
    with pytest.raises(UserError, match="'loss' or 'kl'"):
        hybridize.ranked_layers(t, batches, "entropy")


def test_stage_one_trains_only_the_converted_layers_on_the_mse_to_the_teachers_output() -> None:
    t = teacher().eval()
    h = hybridize.to_hybrid(t, "DLD")
    idx = tokens()
    io = hybridize.mixer_io(t, idx, [0, 2])
    # the recorded output is the teacher's attention on its input
    x0, y0 = io[0]
    with torch.no_grad():
        assert torch.equal(t.transformer.h[0].attn(x0, None, None, None), y0)
    loss = hybridize.layer_matching_loss(h, io)
    by_hand = sum(
        ((h.transformer.h[i].attn(x, None, None, None) - y) ** 2).mean() for i, (x, y) in io.items()
    )
    torch.testing.assert_close(loss, by_hand / 2)
    hybridize.train_only(h, [0, 2])
    before = {n: p.detach().clone() for n, p in h.named_parameters()}
    opt = torch.optim.SGD([p for p in h.parameters() if p.requires_grad], lr=0.1)
    loss.backward()
    opt.step()
    for name, p in h.named_parameters():
        converted = name.startswith(("transformer.h.0.attn.", "transformer.h.2.attn."))
        if converted and name.endswith("c_qkv.weight"):
            assert not torch.equal(p, before[name]), name
        if not converted:
            assert torch.equal(p, before[name]), name


def test_the_kl_is_zero_to_itself_and_torchs_kl_div() -> None:
    gen = torch.Generator().manual_seed(0)
    student, teacher_ = (torch.randn(2, 7, 61, generator=gen) * 3 for _ in range(2))
    assert hybridize.kl_to_teacher(teacher_, teacher_).abs() < 1e-6
    want = F.kl_div(
        F.log_softmax(student.view(-1, 61), -1),
        F.log_softmax(teacher_.view(-1, 61), -1),
        log_target=True,
        reduction="batchmean",
    )
    torch.testing.assert_close(hybridize.kl_to_teacher(student, teacher_), want)
    targets = torch.randint(0, 61, (2, 7), generator=gen)
    ce = F.cross_entropy(student.view(-1, 61), targets.view(-1))
    mixed = hybridize.distillation_loss(student, teacher_, targets, 0.3)
    torch.testing.assert_close(mixed, want + 0.3 * ce)


def test_a_converted_hybrid_passes_the_cache_and_export_oracles() -> None:
    """A teacher of Qwen3.5's attention (GQA, gated, q/k normed) made DDL and calibrated, then
    sharpened: prefill + decode equals one forward at 70 tokens (past one 64-token chunk), and
    Qwen3_5ForCausalLM gives its logits."""
    qwen_attention = dict(n_layer=3, n_kv_head=2, block_size=96, attn_gate="element", qk_norm=True)
    t = teacher(**(QWEN | qwen_attention)).eval()
    idx = tokens(T=70, seed=2)
    h = hybridize.to_hybrid(t, "DDL", hybridize.decays(t, [idx]))
    h = lively(h).eval()
    with torch.no_grad():
        full = h(idx, idx)[0]
        cache = h.make_kv_cache(2, 70)
        outs = [h(idx[:, :40], kv_cache=cache, targets=idx[:, :40])[0]]
        outs += [h(idx[:, i : i + 1], kv_cache=cache)[0] for i in range(40, 70)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=5e-5, rtol=1e-4)
    ours, theirs = exported_logits(h, idx)
    assert (ours - theirs).abs().max() < 1e-4
    assert full.std() > 0.1


@pytest.fixture(scope="module")
def rope_run(pycode_small: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny rotary MHA run of 2 layers, 20 iterations: the teacher."""
    out = tmp_path_factory.mktemp("teacher")
    train(pycode_small, out, "--pos_encoding=rope", "--max_iters=20", "--eval_interval=20")
    return out


def train(data: Path, out: Path, *flags: str) -> None:
    run(["train.py", f"--dataset={data}", f"--out_dir={out}", *TINY_TRAIN, *flags])


def test_train_py_converts_ranks_calibrates_distills_and_resumes(
    pycode_small: Path, rope_run: Path, tmp_path: Path
) -> None:
    """--init_from=convert: into one D layer of two, the attention layer kept chosen by the KL
    ranking on 4 training batches, calibrated: iteration 0 is that model; stage 2 trains on the
    KL plus half the cross-entropy and resumes from the teacher it recorded. Stage 1 changes only
    the converted layer."""
    convert = [
        f"--init_from=convert:{rope_run}",
        "--layer_pattern=DL",
        "--always_save_checkpoint=True",
    ]
    stage2 = tmp_path / "stage2"
    train(
        pycode_small,
        stage2,
        *convert,
        "--convert_layers=kl",
        "--distill=logits",
        "--distill_ce=0.5",
        "--max_iters=10",
        "--eval_interval=10",
    )
    teacher_model = model_from_checkpoint(load_checkpoint(rope_run / "ckpt.pt"))
    batches = Batches(pycode_small, 32, 8, 1337, "cpu")
    calibration = [batches.train(0, micro) for micro in range(4)]
    start = hybridize.for_uptraining(teacher_model, "DL", "kl", True, calibration, seed=1337)
    torch.manual_seed(7)  # the global generator: nothing of the conversion reads it
    again = hybridize.for_uptraining(teacher_model, "DL", "kl", True, calibration, seed=1337)
    assert all(
        torch.equal(a, b) for a, b in zip(start.parameters(), again.parameters(), strict=True)
    )
    expected = evaluate(start, batches, 4, nullcontext())
    evals = [r for r in read_log(stage2) if r["event"] == "eval"]
    assert abs(evals[0]["val_loss"] - expected["val"]) < 1e-5
    ckpt = load_checkpoint(stage2 / "ckpt.pt")
    assert ckpt["config"]["teacher"] == str(rope_run)
    assert ckpt["model_config"]["layer_pattern"] == start.config.layer_pattern
    assert ckpt["config"]["layer_pattern"] == start.config.layer_pattern
    train(pycode_small, stage2, "--init_from=resume", "--max_iters=20", "--eval_interval=10")
    assert load_checkpoint(stage2 / "ckpt.pt")["iter_num"] == 20
    # stage 1: only the converted layer 0 trains
    stage1 = tmp_path / "stage1"
    train(pycode_small, stage1, *convert, "--distill=layers", "--max_iters=5", "--eval_interval=5")
    trained = load_checkpoint(stage1 / "ckpt.pt")["model"]
    begun = hybridize.for_uptraining(teacher_model, "DL", "given", True, calibration, seed=1337)
    begun = begun.state_dict()
    changed = [name for name, t in trained.items() if not torch.equal(t, begun[name])]
    assert changed and all(name.startswith("transformer.h.0.attn.") for name in changed)


def test_distilling_without_a_teacher_is_one_line(pycode_small: Path, tmp_path: Path) -> None:
    r = cli(
        [
            "train.py",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path}",
            *TINY_TRAIN,
            "--distill=logits",
        ]
    )
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "needs a teacher: --teacher=" in r.stderr
    assert not (tmp_path / "ckpt.pt").exists()


def refused(r: object, *said: str) -> str:
    """The one error line of a refused train.py, holding each of said."""
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    for words in said:
        assert words in r.stderr, r.stderr
    return r.stderr


def char_dataset(path: Path, chars: list[str], seed: int = 0) -> Path:
    """A char dataset of these characters, every id of its vocabulary in its splits."""
    ids = np.random.default_rng(seed).integers(0, len(chars), 3000).astype(np.uint16)
    meta = {"tokenizer": "char", "vocab_size": len(chars), "chars": chars}
    write_dataset(path, ids[:2500], ids[2500:], meta)
    return path


def test_a_conversion_and_its_teacher_are_checked_before_any_work(
    pycode_small: Path, rope_run: Path, tmp_path: Path
) -> None:
    """A convert: source or a teacher on other tokens (a bigger vocabulary, or the same size in
    another order), a 'layers' teacher of another depth, and a teacher trained on since the run
    began: each one line naming it, before the ranking, calibration or any training; a moved
    teacher's line says that --teacher=<new place> resumes, and it does."""
    chars = load_meta(pycode_small)["chars"]
    bigger = char_dataset(tmp_path / "bigger", [*chars, *(chr(0x3B1 + i) for i in range(25))])
    shuffled = char_dataset(tmp_path / "shuffled", chars[::-1])
    out = tmp_path / "out"
    ranked = [f"--init_from=convert:{rope_run}", "--layer_pattern=DL", "--convert_layers=kl"]
    for data in (bigger, shuffled):
        r = cli(["train.py", f"--dataset={data}", f"--out_dir={out}", *TINY_TRAIN, *ranked])
        line = refused(r, f"cannot convert {rope_run}", "convert a run trained on dataset")
        assert "vocab_size (the dataset" not in line and not out.exists()
    # a teacher on the same tokens in another order
    other = tmp_path / "other-teacher"
    train(shuffled, other, "--pos_encoding=rope", "--max_iters=2", "--eval_interval=2")
    distil = [*ranked, "--distill=logits", f"--teacher={other}"]
    r = cli(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, *distil])
    refused(r, f"the teacher {other}", "trained on other tokens")
    # stage 1 with a teacher of three layers
    deep = tmp_path / "deep"
    deep.mkdir()
    model = tiny_model(None, "rope", n_layer=3, vocab_size=95)
    meta = load_meta(pycode_small)
    save_checkpoint(deep / "ckpt.pt", model, iter_num=0, data_meta=meta, config={})
    stage1 = [*ranked[:2], "--distill=layers", f"--teacher={deep}"]
    r = cli(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, *stage1])
    refused(r, "the teacher", "has 3 layers, the run 2")
    assert not out.exists()
    # a run distils from a copy of the teacher, which then trains on, then moves
    teacher_copy = tmp_path / "teacher"
    shutil.copytree(rope_run, teacher_copy)
    student = [
        f"--init_from=convert:{teacher_copy}",
        "--layer_pattern=DL",
        "--distill=logits",
        "--max_iters=4",
        "--eval_interval=4",
    ]
    train(pycode_small, out, *student)
    train(pycode_small, teacher_copy, "--init_from=resume", "--max_iters=22")
    resume = ["--init_from=resume", "--max_iters=8", "--eval_interval=4"]
    resume.append("--always_save_checkpoint=True")
    r = cli(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, *resume])
    refused(r, f"the teacher {teacher_copy} changed", "iteration 20, it is at 22 now")
    moved = tmp_path / "moved"
    shutil.copytree(rope_run, moved)  # the teacher as the run began, in another place
    shutil.rmtree(teacher_copy)
    r = cli(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, *resume])
    refused(r, f"the teacher this run distils from, {teacher_copy}", "--teacher=<its new place>")
    train(pycode_small, out, *resume, f"--teacher={moved}")
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 8


def test_conversion_keys_that_would_do_nothing_are_refused(
    pycode_small: Path, rope_run: Path, tmp_path: Path
) -> None:
    """The teacher's keys without --distill, the conversion's keys on a run that converts nothing,
    and --convert_layers where no layer becomes recurrent or none stays attention: one line each,
    nothing written."""
    out = tmp_path / "out"
    source = f"--init_from=convert:{rope_run}"
    cases = {
        ("--distill_ce=0.5",): "distill_ce=0.5 steers a distillation",
        (f"--teacher={rope_run}",): "teacher=",
        ("--convert_layers=kl",): "convert_layers='kl' steers a conversion",
        ("--convert_calibrate=False",): "init_from='scratch' converts nothing",
        (source, "--convert_layers=loss"): "makes no layer recurrent",
        (source, "--layer_pattern=DD", "--convert_layers=kl"): "keeps none: nothing to choose",
    }
    for flags, said in cases.items():
        r = cli(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, *flags])
        refused(r, said)
        assert not out.exists()
