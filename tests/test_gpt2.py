import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, cli, run
from smallgpt.checkpoint import load_checkpoint
from smallgpt.generation import generate
from smallgpt.hf import from_hf


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A randomly initialised Hugging Face GPT-2 saved to a local folder: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=32,
        vocab_size=100,
        n_positions=64,
        bos_token_id=99,
        eos_token_id=99,
    )
    hf = GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("hf-gpt2")
    hf.save_pretrained(path)
    return hf, path


def test_logits_match_hugging_face(hf_gpt2: tuple) -> None:
    hf, path = hf_gpt2
    ours = from_hf(str(path)).eval()
    assert (
        ours.config.gelu == "tanh" and ours.config.n_kv_head == 4 and ours.config.block_size == 64
    )
    idx = torch.randint(0, 100, (3, 50))
    with torch.no_grad():
        ref = hf(idx).logits
    got, _ = ours(idx, targets=idx)
    assert (got - ref).abs().max() <= 1e-4


def test_greedy_generation_matches_hugging_face(hf_gpt2: tuple) -> None:
    hf, path = hf_gpt2
    ours = from_hf(str(path)).eval()
    idx = torch.randint(0, 99, (2, 6))
    ref = hf.generate(idx, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert generate(ours, idx, 40, temperature=0).tolist() == ref.tolist()


def test_no_weights_offline_is_one_clear_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "sample.py", "--init_from=gpt2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert "error: cannot load GPT-2 weights 'gpt2'" in r.stderr and "save_pretrained" in r.stderr


def test_finetune_gpt2_into_gqa_then_sample(tmp_path: Path) -> None:
    """GPT-2 (a local folder) fine-tuned on a GPT-2-BPE dataset, converted to 2 K/V groups on the
    way. The model's shape comes from the weights: a shape key beside them (n_head=5 here) is
    refused, not silently ignored, and the run records the shape it trained (issue 42)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_head=4,
            n_embd=32,
            vocab_size=260,
            n_positions=64,
            bos_token_id=256,
            eos_token_id=256,
        )
    ).save_pretrained(tmp_path / "hf")
    bpe = (
        tmp_path / "tiny.tiktoken"
    )  # a byte-level BPE in tiktoken's format stands in for GPT-2's (a download)
    bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    env = {"GPT2_BPE_FILE": str(bpe)}
    (tmp_path / "input.txt").write_text("To be, or not to be, that is the question.\n" * 60)
    run(
        [
            "data/shakespeare/prepare.py",
            f"--input={tmp_path / 'input.txt'}",
            f"--out_dir={tmp_path / 'data'}",
        ],
        env=env,
    )
    out = tmp_path / "out"
    args = [
        "train.py",
        f"--init_from=hf:{tmp_path / 'hf'}",
        f"--dataset={tmp_path / 'data'}",
        f"--out_dir={out}",
        "--n_kv_head=2",
        "--block_size=32",
        "--batch_size=4",
        "--max_iters=20",
        "--eval_interval=10",
        "--eval_iters=2",
        "--learning_rate=1e-3",
        "--device=cpu",
    ]
    refused = cli([*args, "--n_head=5"], env=env)
    assert refused.returncode == 2 and "drop --n_head" in refused.stderr and not out.exists()
    run(args, env=env)
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["model_config"]["n_kv_head"] == 2 and ckpt["model_config"]["n_layer"] == 2
    assert ckpt["config"]["n_head"] == ckpt["model_config"]["n_head"] == 4
    assert ckpt["model_config"]["gelu"] == "tanh" and ckpt["model_config"]["block_size"] == 32
    assert ckpt["model"]["transformer.wpe.weight"].shape == (32, 32)
    run(
        [
            "train.py",
            "--init_from=resume",
            f"--dataset={tmp_path / 'data'}",
            f"--out_dir={out}",
            "--n_kv_head=2",
            "--n_head=4",
            "--block_size=32",
            "--batch_size=4",
            "--max_iters=30",
            "--eval_interval=10",
            "--eval_iters=2",
            "--learning_rate=1e-3",
            "--device=cpu",
            "--always_save_checkpoint=True",
        ],
        env=env,
    )
    assert (
        load_checkpoint(out / "ckpt.pt")["iter_num"] == 30
    )  # a fine-tuned GPT-2 resumes with its own shape
    r = run(
        ["sample.py", f"--out_dir={out}", "--start=To be", "--max_new_tokens=10", "--device=cpu"],
        env=env,
    )
    assert r.stdout.startswith("To be") and "GQA (n_head=4, n_kv_head=2)" in r.stderr
    r = run(
        [
            "sample.py",
            f"--init_from=hf:{tmp_path / 'hf'}",
            "--start=To be",
            "--max_new_tokens=10",
            "--device=cpu",
            "--temperature=0",
        ],
        env=env,
    )
    assert r.stdout.startswith("To be") and "MHA (n_head=4, n_kv_head=4)" in r.stderr
