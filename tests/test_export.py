"""export.py: a trained run out to a transformers folder that stock classes load and that computes, decodes and
tokenizes as this project does."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint import load_checkpoint, model_from_checkpoint
from conftest import TINY_TRAIN, cli, read_log, run


def load(folder: Path) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval(), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(("pos_encoding", "n_kv_head"), [("rope", 2), ("learned", 1)])
def test_export_loads_in_transformers_and_decodes_as_sample_py(pycode_small: Path, tmp_path: Path, pos_encoding: str,
                                                              n_kv_head: int) -> None:
    out = tmp_path / "out"
    run(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, "--max_iters=60",
         "--eval_interval=60", f"--pos_encoding={pos_encoding}", f"--n_kv_head={n_kv_head}"])
    r = run(["export.py", f"--out_dir={out}"])
    folder = out / "hf"
    assert f"wrote {folder}" in r.stdout and {"config.json", "model.safetensors", "generation_config.json",
                                               "tokenizer.json", "README.md"} <= {p.name for p in folder.iterdir()}
    hf, tok = load(folder)
    assert type(hf).__name__ == {"rope": "Starcoder2ForCausalLM", "learned": "GPTBigCodeForCausalLM"}[pos_encoding]
    ours = model_from_checkpoint(load_checkpoint(out / "ckpt.pt")).eval()
    idx = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx, targets=idx)[0], rtol=0, atol=1e-4)
    # the tokenizer round-trips the dataset's own text and numbers it as the dataset does
    meta = json.loads((pycode_small / "meta.json").read_text())
    val = np.fromfile(pycode_small / "val.bin", dtype=meta["dtype"])[:2000].tolist()
    text = "".join(meta["chars"][i] for i in val)
    assert tok(text)["input_ids"] == val and tok.decode(val) == text
    # greedy text from transformers is sample.py's (within block_size: transformers has no sliding window)
    s = run(["sample.py", f"--out_dir={out}", "--start=def ", "--max_new_tokens=24", "--temperature=0",
             "--device=cpu"])
    with torch.no_grad():
        ids = hf.generate(**tok("def ", return_tensors="pt"), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert len(ids[0]) == 28 and s.stdout.startswith(tok.decode(ids[0]))
    # back in: a run from the exported folder starts from the same model (its first evaluation is the run's last)
    if pos_encoding == "rope":
        run(["train.py", f"--dataset={pycode_small}", f"--out_dir={tmp_path / 'again'}", *TINY_TRAIN,
             f"--init_from=hf:{folder}", "--max_iters=1", "--eval_interval=1"])
        first = [r for r in read_log(tmp_path / "again") if r["event"] == "eval"][0]
        last = [r for r in read_log(out) if r["event"] == "eval"][-1]
        assert first["iter"] == 0 and first["val_loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    card = (folder / "README.md").read_text()
    assert f"n_kv_head={n_kv_head}" in card and "val loss" in card


def test_gpt2_bpe_dataset_exports_its_bpe_tokenizer(tmp_path: Path) -> None:
    bpe = tmp_path / "tiny.tiktoken"  # a byte-level BPE with one merge, in tiktoken's format, stands in for GPT-2's
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the"]
    bpe.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    env = {"GPT2_BPE_FILE": str(bpe)}
    text = "To be, or not to be, that is the question. The rest is silence.\n" * 40
    (tmp_path / "input.txt").write_text(text)
    run(["data/shakespeare/prepare.py", f"--input={tmp_path / 'input.txt'}", f"--out_dir={tmp_path / 'data'}"],
        env=env)
    out = tmp_path / "out"
    run(["train.py", f"--dataset={tmp_path / 'data'}", f"--out_dir={out}", *TINY_TRAIN, "--max_iters=2",
         "--eval_interval=2", "--pos_encoding=learned"], env=env)
    run(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'hf'}"], env=env)
    _, tok = load(tmp_path / "hf")
    import tiktoken  # noqa: F401  (the dataset's own encoding, through dataset.py)

    from dataset import gpt2_encoding
    enc = gpt2_encoding(str(bpe))
    sample = "The rest is silence, the question. <|endoftext|>"
    assert tok(sample)["input_ids"] == enc.encode(sample, allowed_special="all")
    assert 257 in tok("the")["input_ids"] and tok.eos_token_id == 258 and tok.decode(tok(text)["input_ids"]) == text


def test_export_refuses_what_it_cannot_do_in_one_line(pycode_small: Path, tmp_path: Path) -> None:
    r = cli(["export.py", f"--out_dir={tmp_path / 'none'}"])
    assert r.returncode == 2 and r.stderr.startswith("error: no checkpoint at") and len(r.stderr.splitlines()) == 1
    out = tmp_path / "out"
    run(["train.py", f"--dataset={pycode_small}", f"--out_dir={out}", *TINY_TRAIN, "--max_iters=2",
         "--eval_interval=2"])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    r = cli(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'taken'}"])
    assert r.returncode == 2 and "is there and not empty" in r.stderr and len(r.stderr.splitlines()) == 1
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    run(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'taken'}", "--overwrite=True"])
    assert (tmp_path / "taken" / "config.json").is_file() and not (tmp_path / "taken" / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    (tmp_path / "llama").mkdir()
    for args, message in [([f"--gguf={tmp_path / 'm.gguf'}"], "--gguf=FILE and --llama_cpp=DIR go together"),
                          ([f"--gguf={tmp_path / 'm.gguf'}", f"--llama_cpp={tmp_path / 'llama'}"],
                           "no convert_hf_to_gguf.py in --llama_cpp="),
                          (["--gguf_type=q4_0"], "gguf_type='q4_0' must be one of f32, f16, bf16, q8_0")]:
        r = cli(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'g'}", *args])
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    (tmp_path / "llama" / "convert_hf_to_gguf.py").write_text("raise SystemExit('not to be run')\n")
    r = cli(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'g'}", f"--gguf={tmp_path / 'm.gguf'}",
             f"--llama_cpp={tmp_path / 'llama'}"])
    assert r.returncode == 2 and "GGUF needs a byte-level BPE vocabulary" in r.stderr, r.stderr
    assert not (tmp_path / "g").exists() and not (tmp_path / "m.gguf").exists()
    # an old checkpoint without the dataset's meta, whose dataset is gone: the tokenizer is unknown
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    del ckpt["data_meta"]
    torch.save(ckpt | {"config": ckpt["config"] | {"dataset": str(tmp_path / "gone")}}, out / "ckpt.pt")
    r = cli(["export.py", f"--out_dir={out}", f"--to={tmp_path / 'g'}"])
    assert r.returncode == 2 and r.stderr.startswith(f"error: no dataset at {tmp_path / 'gone'}"), r.stderr
    assert not (tmp_path / "g").exists()
