"""Export a trained model to a Hugging Face transformers folder:

    python export.py --out_dir=out-pycode-char [--to=DIR] [--overwrite=True]

DIR (default <out_dir>/hf) then loads with transformers' own classes, no code of ours:
AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR). It holds config.json,
model.safetensors, generation_config.json, the dataset's tokenizer (char-level, GPT-2's BPE or its own) and a
README.md model card. Which class holds which model: hf.py. The folder is written whole or not at all.
"""

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hf
from checkpoint import load_checkpoint, model_from_checkpoint, run_config
from configurator import UserError, run_cli
from dataset import EOT, data_dir, gpt2_encoding, load_meta
from model import GPT
from runlog import read_run


@dataclass(slots=True)
class ExportConfig:
    out_dir: str = "out"  # the run to export: its ckpt.pt, and its dataset's tokenizer
    to: str = ""  # the folder to write; '': <out_dir>/hf
    overwrite: bool = False  # replace a folder that is there and not empty


def tokenizer(meta: dict) -> Any:
    """The dataset's tokenizer as a transformers fast tokenizer: char-level (one token per character of the
    dataset's list), GPT-2's BPE (from tiktoken's ranks, offline from $GPT2_BPE_FILE), or the dataset's own BPE."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer") == "char":
        chars = meta["chars"]
        tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
        tok.decoder = decoders.Fuse()  # joined with nothing between
        return PreTrainedTokenizerFast(tokenizer_object=tok)
    if meta.get("tokenizer") == "gpt2":
        from transformers.convert_slow_tokenizer import TikTokenConverter

        enc = gpt2_encoding()
        specials = sorted(enc._special_tokens, key=enc._special_tokens.get)  # each numbered after the ranks
        assert [enc._special_tokens[t] for t in specials] == list(range(len(enc._mergeable_ranks), enc.n_vocab))
        converter = TikTokenConverter(pattern=enc._pat_str, extra_special_tokens=specials)
        converter.load_tiktoken_bpe = lambda _: enc._mergeable_ranks  # the ranks tiktoken holds, from any file
        eot = {"eos_token": EOT, "bos_token": EOT} if enc.eot_token is not None else {}
        return PreTrainedTokenizerFast(tokenizer_object=converter.converted(), **eot)
    if meta.get("tokenizer") == "bpe":
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(meta["bpe"]), eos_token=EOT, bos_token=EOT)
    raise UserError(f"unknown tokenizer {meta.get('tokenizer')!r} in the checkpoint's dataset meta")


def model_card(model: GPT, hf_model: Any, run: dict, ckpt: dict) -> str:
    """README.md: what the model is, what it scored, how to load it."""
    c = model.config
    evals = run.get("evals") or []
    lines = [f"# {Path(run.get('dir', 'model')).name}", "",
             "A GPT trained with smallgpt, exported to a stock transformers class (no remote code).", "",
             "| | |", "|---|---|", f"| class | `{type(hf_model).__name__}` |",
             f"| attention | {c.attention_kind} (n_head={c.n_head}, n_kv_head={c.n_kv_head}) |",
             f"| shape | {c.n_layer} layers, {c.n_embd} wide, MLP {c.mlp_hidden}, block_size {c.block_size}, "
             f"{c.pos_encoding} positions |", f"| parameters | {model.num_params():,} |",
             f"| KV cache per token (fp32, as exported) | {hf_kv_bytes(c):,} bytes (this model: "
             f"{c.kv_cache_bytes(1, 1):,}) |",
             f"| dataset | {run_config(ckpt).get('dataset', '?')} ({ckpt.get('data_meta', {}).get('tokenizer', '?')} "
             f"tokens, vocab {c.vocab_size}) |",
             f"| trained | {ckpt.get('iter_num', '?')} iterations; val loss "
             f"{evals[-1]['val_loss']:.4f} at iteration {evals[-1]['iter']} |" if evals else "| trained | - |"]
    if c.pos_encoding == "learned" and c.attention_kind == "GQA":
        lines += ["", f"GPT-2 has no GQA: each of the {c.n_kv_head} K/V heads is repeated for its group of "
                      f"{c.n_head // c.n_kv_head} query heads. The logits are exact, but the cache is MHA's size."]
    lines += ["", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(DIR)", "tok = AutoTokenizer.from_pretrained(DIR)",
              "ids = model.generate(**tok(\"def \", return_tensors=\"pt\"), max_new_tokens=50, do_sample=False)",
              "print(tok.decode(ids[0]))", "```"]
    return "\n".join(lines) + "\n"


def hf_kv_bytes(c: Any) -> int:
    """KV-cache bytes per token of the exported model (GPT-2 holds a GQA model's K/V heads repeated)."""
    repeated = c.pos_encoding == "learned" and c.attention_kind == "GQA"
    return dataclasses.replace(c, n_kv_head=c.n_head).kv_cache_bytes(1, 1) if repeated else c.kv_cache_bytes(1, 1)


def export(cfg: ExportConfig) -> Path:
    out = Path(cfg.out_dir)
    dest = Path(cfg.to) if cfg.to else out / "hf"
    if dest.is_file() or dest.is_dir() and any(dest.iterdir()) and not cfg.overwrite:
        raise UserError(f"{dest} is there and not empty: choose another --to, or --overwrite=True to replace it")
    ckpt = load_checkpoint(out / "ckpt.pt")
    model = model_from_checkpoint(ckpt).float().eval()
    meta = ckpt.get("data_meta") or load_meta(data_dir(run_config(ckpt).get("dataset", "?")))
    tok, hf_model = tokenizer(meta), hf.to_hf(model)
    try:
        run = read_run(out) | {"dir": str(out)}
    except (UserError, OSError):
        run = {"dir": str(out)}
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
        folder = Path(tmp) / "hf"
        hf_model.save_pretrained(folder)
        tok.save_pretrained(folder)
        (folder / "README.md").write_text(model_card(model, hf_model, run, ckpt))
        with open(folder / "smallgpt.json", "w") as f:  # where it came from
            json.dump({"model_config": ckpt["model_config"], "iter_num": ckpt.get("iter_num")}, f, indent=1)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(folder, dest)
    print(f"wrote {dest}: {type(hf_model).__name__} ({model.config.attention_kind}), {model.num_params():,} "
          f"parameters, {meta.get('tokenizer')} tokenizer")
    return dest


if __name__ == "__main__":
    run_cli(export, ExportConfig)
