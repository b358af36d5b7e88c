"""The transformers models hf.to_hf makes compute what this project's model computes, and come back
unchanged."""

import base64
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import assert_same_greedy_tokens, cli
from model import GPT, GPTConfig
from smallgpt.errors import UserError
from smallgpt.hf import from_hf, from_transformers, save, target_class, to_hf, tokenizer


def sharp_model(
    pos_encoding: str, n_kv_head: int, bias: bool, gelu: str = "exact", vocab_size: int = 61
) -> GPT:
    """A random model with weights 4x GPT-2's scale: peaked logits, so greedy decoding does not
    repeat one token."""
    torch.manual_seed(0)
    config = GPTConfig(
        block_size=32,
        vocab_size=vocab_size,
        n_layer=2,
        n_head=4,
        n_kv_head=n_kv_head,
        n_embd=32,
        bias=bias,
        pos_encoding=pos_encoding,
        mlp_hidden=72,
        gelu=gelu,
    )
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)
    return model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("pos_encoding", ["rope", "learned"])
def test_stock_transformers_model_gives_the_same_logits_and_greedy_tokens(
    pos_encoding: str, n_kv_head: int, bias: bool
) -> None:
    model = sharp_model(pos_encoding, n_kv_head, bias, gelu="tanh" if bias else "exact")
    hf = to_hf(model)
    assert type(hf).__name__ == target_class(model.config)
    assert (
        type(hf).__name__
        == {
            "rope": "Starcoder2ForCausalLM",
            "learned": "GPTBigCodeForCausalLM" if n_kv_head == 1 else "GPT2LMHeadModel",
        }[pos_encoding]
    )
    idx = torch.randint(
        0, 61, (3, 32), generator=torch.Generator().manual_seed(1)
    )  # up to block_size
    with torch.no_grad():
        ours, theirs = model(idx, targets=idx)[0], hf(idx).logits
    assert ours.abs().max() > 3  # peaked logits: a mapping error would show
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    assert_same_greedy_tokens(model, hf, idx[:, :8])


@pytest.mark.parametrize(
    ("pos_encoding", "n_kv_head", "bias"),
    [
        ("rope", 4, False),
        ("rope", 2, True),
        ("rope", 1, False),
        ("learned", 1, True),
        ("learned", 2, False),
    ],
)
def test_a_saved_export_comes_back_with_the_same_logits(
    tmp_path: Path, pos_encoding: str, n_kv_head: int, bias: bool
) -> None:
    model = sharp_model(pos_encoding, n_kv_head, bias)
    to_hf(model).save_pretrained(tmp_path)
    back = from_hf(str(tmp_path)).eval()
    idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            back(idx, targets=idx)[0], model(idx, targets=idx)[0], rtol=0, atol=1e-5
        )
    # learned GQA comes back as GPT-2, its K/V heads repeated: the same function with MHA's head
    # count
    assert back.config.n_kv_head == (
        4 if (pos_encoding, n_kv_head) == ("learned", 2) else n_kv_head
    )


def test_a_folder_this_model_cannot_hold_is_refused_in_one_line(tmp_path: Path) -> None:
    hf = to_hf(sharp_model("rope", 2, False))
    hf.config.sliding_window, hf.config.norm_epsilon = 8, 1e-6
    hf.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="cannot hold sliding_window=8, norm epsilon 1e-06"):
        from_hf(str(tmp_path))
    # a GPT-2 folder given to from_transformers (from_hf's to read): one line, not a traceback
    gpt2 = tmp_path / "gpt2"
    to_hf(sharp_model("learned", 4, True)).save_pretrained(gpt2)
    with pytest.raises(UserError, match="model_type 'gpt2' is none that from_transformers reads"):
        from_transformers(str(gpt2))


def one_line(r: object, *parts: str) -> None:
    """A command refused in one `error:` line that holds each of parts."""
    assert (
        r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: ")
    ), r.stderr
    assert all(part in r.stderr for part in parts), r.stderr


def test_a_truncated_weights_file_in_an_hf_folder_is_one_line_naming_it(
    pycode_small: Path, tmp_path: Path
) -> None:
    meta = json.loads((pycode_small / "meta.json").read_text())
    folder, file = tmp_path / "hf", tmp_path / "hf" / "model.safetensors"
    save(
        to_hf(sharp_model("rope", 2, False, vocab_size=meta["vocab_size"])), tokenizer(meta), folder
    )
    os.truncate(file, file.stat().st_size // 2)  # a copy cut short
    one_line(cli(["sample.py", f"--init_from=hf:{folder}", "--device=cpu"]), str(file), "truncated")
    one_line(
        cli(
            [
                "train.py",
                f"--init_from=hf:{folder}",
                f"--dataset={pycode_small}",
                f"--out_dir={tmp_path / 'o'}",
                "--block_size=32",
                "--batch_size=4",
                "--max_iters=1",
                "--device=cpu",
            ]
        ),
        str(file),
        "truncated",
    )


def test_an_hf_folder_without_its_tokenizer_is_read_as_gpt2_only_if_it_is_gpt2(
    pycode_small: Path, tmp_path: Path
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    bpe = (
        tmp_path / "tiny.tiktoken"
    )  # a byte-level BPE of 257 tokens stands in for GPT-2's 50257 (a download)
    bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    env = {"GPT2_BPE_FILE": str(bpe)}
    sample = ["sample.py", "--start=To be", "--max_new_tokens=4", "--device=cpu"]
    to_hf(sharp_model("rope", 2, False, vocab_size=300)).save_pretrained(
        tmp_path / "starcoder2"
    )  # no tokenizer
    for args in (
        [*sample, f"--init_from=hf:{tmp_path / 'starcoder2'}"],
        [
            "train.py",
            f"--init_from=hf:{tmp_path / 'starcoder2'}",
            f"--dataset={pycode_small}",
            f"--out_dir={tmp_path / 'o'}",
            "--max_iters=1",
            "--device=cpu",
        ],
    ):
        one_line(
            cli(args, env=env),
            f"{tmp_path / 'starcoder2'} has no tokenizer.json",
            "model_type 'starcoder2'",
        )
    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=61, n_positions=64)
    ).save_pretrained(tmp_path / "small")  # a GPT-2 model, but without rows for GPT-2's tokens
    one_line(
        cli([*sample, f"--init_from=hf:{tmp_path / 'small'}"], env=env),
        "has no tokenizer.json",
        "vocab_size=61 is below GPT-2's 257 tokens",
    )
    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=260, n_positions=64)
    ).save_pretrained(tmp_path / "gpt2")
    r = cli([*sample, f"--init_from=hf:{tmp_path / 'gpt2'}"], env=env)
    assert r.returncode == 0 and r.stdout.startswith("To be"), r.stderr
    assert f"{tmp_path / 'gpt2'} has no tokenizer.json: its text is read as GPT-2's BPE" in r.stderr
