import csv
from pathlib import Path

import pytest
import torch

from checkpoint import convert_kv_heads, load_checkpoint
from conftest import TINY_TRAIN, cli, read_log, run, tiny_model

SWEEP = ["--n_layer=2", "--n_head=4", "--n_embd=32", "--block_size=32", "--batch_size=8", "--eval_iters=4",
         "--log_interval=10", "--device=cpu", "--max_iters=30", "--eval_interval=10", "--learning_rate=3e-3",
         "--warmup_iters=5", "--decode_tokens=16", "--decode_batch=2", "--decode_context=40", "--decode_steps=3"]


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
@pytest.mark.parametrize("G", [4, 2, 1])
def test_converting_heads_already_equal_within_groups_keeps_the_logits(G: int, pos_encoding: str) -> None:
    m = tiny_model(4, pos_encoding, n_head=8, n_embd=64)  # 4 K/V heads: pool them into G groups
    with torch.no_grad():
        for block in m.transformer.h:  # make the K/V heads of each future group identical
            for lin in (block.attn.c_k, block.attn.c_v):
                w = lin.weight.view(G, 4 // G, 8, 64)
                w.copy_(w[:, :1].expand_as(w))
                b = lin.bias.view(G, 4 // G, 8)
                b.copy_(b[:, :1].expand_as(b))
    converted = convert_kv_heads(m, G).eval()
    assert converted.config.n_kv_head == G
    idx = torch.randint(0, 61, (2, 24))
    # The weights are the same numbers; the logits differ at most by float rounding of SDPA over G vs 4 heads.
    torch.testing.assert_close(converted(idx, targets=idx)[0], m(idx, targets=idx)[0], rtol=0, atol=1e-6)


def test_conversion_is_the_mean_of_each_groups_heads() -> None:
    m = tiny_model(None)  # MHA, 4 heads of 8 dims, 32 wide
    c = convert_kv_heads(m, 2)
    for old, new in zip(m.transformer.h, c.transformer.h, strict=True):
        for name in ("c_k", "c_v"):
            w, b = getattr(old.attn, name).weight, getattr(old.attn, name).bias
            by_hand = torch.cat([(w[0:8] + w[8:16]) / 2, (w[16:24] + w[24:32]) / 2])
            torch.testing.assert_close(getattr(new.attn, name).weight, by_hand, rtol=0, atol=1e-7)
            torch.testing.assert_close(getattr(new.attn, name).bias, torch.cat([(b[0:8] + b[8:16]) / 2,
                                                                                (b[16:24] + b[24:32]) / 2]))
        assert torch.equal(new.attn.c_q.weight, old.attn.c_q.weight)
        assert torch.equal(new.attn.c_proj.weight, old.attn.c_proj.weight)
        assert torch.equal(new.mlp.c_fc.weight, old.mlp.c_fc.weight)


def test_converted_checkpoint_trains_samples_and_resumes(pycode_small: Path, tmp_path: Path) -> None:
    src, dst = tmp_path / "mha", tmp_path / "mqa"
    run(["train.py", f"--dataset={pycode_small}", f"--out_dir={src}", *TINY_TRAIN, "--max_iters=20",
         "--eval_interval=20"])
    run(["train.py", f"--dataset={pycode_small}", f"--out_dir={dst}", *TINY_TRAIN, f"--init_from=convert:{src}",
         "--n_kv_head=1", "--max_iters=10", "--eval_interval=10"])
    ckpt = load_checkpoint(dst / "ckpt.pt")
    assert ckpt["model_config"]["n_kv_head"] == 1 and ckpt["iter_num"] == 10
    assert ckpt["model"]["transformer.h.0.attn.c_k.weight"].shape == (8, 32)
    first = [r for r in read_log(dst) if r["event"] == "eval"][0]
    src_evals = [r["val_loss"] for r in read_log(src) if r["event"] == "eval"]  # at iterations 0 and 20
    assert first["iter"] == 0 and first["val_loss"] < (src_evals[0] + src_evals[-1]) / 2  # near the trained model
    out = run(["sample.py", f"--out_dir={dst}", "--start=def ", "--max_new_tokens=20", "--device=cpu"])
    assert out.stdout.startswith("def ") and "MQA (n_kv_head=1)" in out.stderr
    run(["train.py", f"--dataset={pycode_small}", f"--out_dir={dst}", *TINY_TRAIN, "--init_from=resume",
         "--n_kv_head=1", "--max_iters=20", "--eval_interval=10", "--always_save_checkpoint=True"])
    assert load_checkpoint(dst / "ckpt.pt")["iter_num"] == 20


def test_converting_to_a_group_count_that_does_not_divide_n_head_is_one_line(pycode_small: Path,
                                                                             tmp_path: Path) -> None:
    r = cli(["train.py", f"--dataset={pycode_small}", f"--out_dir={tmp_path}",
                        *TINY_TRAIN, f"--init_from=convert:{tmp_path / 'x'}", "--n_kv_head=3"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert "n_head=4 must be divisible by n_kv_head=3" in r.stderr


def test_sweep_and_report_end_to_end(pycode_small: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    r = run(["compare.py", f"--dataset={pycode_small}", f"--out_dir={out}", *SWEEP, "--convert=True",
             "--uptrain_fraction=0.5", "--kv_seq_len=100", "--kv_batch=3"], env={"WANDB_MODE": "disabled"})
    assert "wrote" in r.stdout
    rows = {row["variant"]: row for row in csv.DictReader(open(out / "report.csv"))}
    assert list(rows) == ["mha", "gqa2", "mqa", "mha-to-gqa2", "mha-to-mqa"]
    D, H, L, V, T = 32, 4, 2, int(read_log(out / "mha")[0]["model_config"]["vocab_size"]), 32
    for row in rows.values():
        G = int(row["n_kv_head"])
        attn = 2 * D * D + 2 * D * D * G // H  # bias=False, the TrainConfig default
        assert int(row["attention_params"]) == L * attn
        assert int(row["params"]) == L * (attn + 8 * D * D + 2 * D) + D + V * D + T * D  # learned positions
        assert int(row["kv_bytes@32"]) == 2 * L * 1 * G * T * (D // H) * 2  # bfloat16
        assert int(row["kv_bytes@100x3"]) == 2 * L * 3 * G * 100 * (D // H) * 2
        assert int(row["kv_bytes_fp32@40x2"]) == 2 * L * 2 * G * 40 * (D // H) * 4
        assert float(row["decode_tok_s@40x2"]) > 0
        assert float(row["decode_tok_s"]) > 0 and float(row["best_val_loss"]) <= float(row["final_val_loss"]) + 1e-9
    assert float(rows["mha-to-mqa"]["val_loss_after_conversion"]) > 0
    assert rows["mha-to-mqa"]["scratch_final_val_loss"] == rows["mqa"]["final_val_loss"]
    assert (out / "report.png").stat().st_size > 10_000 and (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "| mha | 4 | 4 |" in (out / "report.md").read_text()
    # each variant ran with the group and a tag naming it
    cfg = read_log(out / "gqa2")[0]["config"]
    assert cfg["wandb_group"] == "cmp" and "gqa2" in cfg["wandb_tags"] and cfg["n_kv_head"] == 2
    # the sweep run again resumes each run from its checkpoint: those at their last iteration say they are done
    finished = {d.name: load_checkpoint(d / "ckpt.pt")["iter_num"] == (15 if "-to-" in d.name else 30)
                for d in out.iterdir() if d.is_dir()}
    logs = {name: (out / name / "log.jsonl").read_text() for name, done in finished.items() if done}
    r = run(["compare.py", f"--dataset={pycode_small}", f"--out_dir={out}", *SWEEP, "--convert=True",
             "--uptrain_fraction=0.5", "--mode=train"], env={"WANDB_MODE": "disabled"})
    assert len(finished) == 5 and sum(finished.values()) >= 2  # the converted runs save at every evaluation
    assert r.stdout.count("--init_from=resume") == 5  # (train.py's own output is not captured here)
    assert all((out / name / "log.jsonl").read_text() == log for name, log in logs.items())  # nothing trained again
    # runs as a killed sweep leaves them: a last line cut short, a run stopped before its first evaluation
    with open(out / "gqa2" / "log.jsonl", "a") as f:
        f.write('{"event": "eval", "iter": 4')
    mqa_log = out / "mqa" / "log.jsonl"
    mqa_log.write_text(mqa_log.read_text().splitlines()[0] + "\n")
    r = run(["compare.py", f"--dataset={pycode_small}", f"--out_dir={out}", *SWEEP, "--mode=report"])
    assert f"left out of the report, no evaluation logged yet: {out / 'mqa'}" in r.stderr
    again = {row["variant"]: row for row in csv.DictReader(open(out / "report.csv"))}
    assert list(again) == ["mha", "gqa2", "mha-to-gqa2", "mha-to-mqa"]
    assert again["gqa2"]["final_val_loss"] == rows["gqa2"]["final_val_loss"]
    mqa_log.write_text("")
    r = cli(["compare.py", f"--out_dir={out}", *SWEEP, "--mode=report"])
    assert r.returncode == 2 and r.stderr == f"error: {mqa_log} holds no run's config record: not a log written by " \
                                             "train.py\n"


@pytest.mark.parametrize(("arg", "message"), [("--kv_dtype=bogus", "kv_dtype='bogus' must be"),
                                              ("--decode_steps=0", "decode_steps=0: must be positive"),
                                              ("--kv_heads=[0]", "kv_heads=[0] and uptrain_fraction=0.1 must be")])
def test_bad_report_settings_are_one_line_before_any_training(tmp_path: Path, arg: str, message: str) -> None:
    r = cli(["compare.py", f"--out_dir={tmp_path / 'cmp'}", *SWEEP, arg])
    assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr
    assert not (tmp_path / "cmp").exists()


def test_costs_table_lists_every_divisor() -> None:
    r = run(["compare.py", "--mode=costs", "--n_head=6", "--n_embd=48", "--n_layer=2", "--block_size=64"])
    kinds = [line.split("|")[2].strip() for line in r.stdout.splitlines()[2:] if line.startswith("|")]
    assert kinds == ["MHA", "GQA", "GQA", "MQA"]  # n_kv_head 6, 3, 2, 1
