"""Export a trained model to a Hugging Face transformers folder, and from it to a GGUF file for llama.cpp:

    python export.py --out_dir=out-pycode-char [--to=DIR] [--overwrite=True]
    python export.py --out_dir=OUT --gguf=model.gguf --llama_cpp=../llama.cpp [--gguf_type=f32]

DIR (default <out_dir>/hf) then loads with transformers' own classes, no code of ours:
AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR). It holds config.json,
model.safetensors, generation_config.json, the dataset's tokenizer (char-level, GPT-2's BPE or its own) and a
README.md model card. Which class holds which model: hf.py. The GGUF file is written by llama.cpp's own
convert_hf_to_gguf.py from such a folder (byte-level BPE tokenizers only: llama.cpp has no char-level vocabulary).
Each is written whole or not at all.
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
from dataset import data_dir, load_meta
from model import GPT
from runlog import read_run


@dataclass(slots=True)
class ExportConfig:
    out_dir: str = "out"  # the run to export: its ckpt.pt, and its dataset's tokenizer
    to: str = ""  # the folder to write; '': <out_dir>/hf
    overwrite: bool = False  # replace a folder (or GGUF file) that is there and not empty
    gguf: str = ""  # also write this GGUF file, converted from the folder by llama.cpp's converter
    llama_cpp: str = ""  # gguf: a llama.cpp source folder (its convert_hf_to_gguf.py and gguf-py)
    gguf_type: str = "f32"  # gguf: the converter's --outtype: f32, f16, bf16 or q8_0

    def __post_init__(self) -> None:
        if self.gguf_type not in hf.GGUF_TYPES:
            raise ValueError(f"gguf_type={self.gguf_type!r} must be one of {', '.join(hf.GGUF_TYPES)}")
        if bool(self.gguf) != bool(self.llama_cpp):
            raise ValueError("--gguf=FILE and --llama_cpp=DIR go together: the file is made by llama.cpp's converter")


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
    if cfg.gguf and not (Path(cfg.llama_cpp) / "convert_hf_to_gguf.py").is_file():
        raise UserError(f"no convert_hf_to_gguf.py in --llama_cpp={cfg.llama_cpp}: pass a llama.cpp source folder "
                        f"(e.g. the one vendored in the llama-cpp-python sdist)")
    if cfg.gguf and (Path(cfg.gguf).is_dir() or Path(cfg.gguf).exists() and not cfg.overwrite):
        raise UserError(f"{cfg.gguf} is there: choose another --gguf, or --overwrite=True to replace it")
    ckpt = load_checkpoint(out / "ckpt.pt")
    model = model_from_checkpoint(ckpt).float().eval()
    meta = ckpt.get("data_meta") or load_meta(data_dir(run_config(ckpt).get("dataset", "?")))
    if cfg.gguf and meta.get("tokenizer") == "char":
        raise UserError("GGUF needs a byte-level BPE vocabulary (llama.cpp has no char-level one): train on a "
                        "dataset prepared with --tokenizer=bpe or gpt2")
    tok, hf_model = hf.tokenizer(meta), hf.to_hf(model)
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
    if cfg.gguf:
        Path(cfg.gguf).parent.mkdir(parents=True, exist_ok=True)
        hf.to_gguf(model, tok, Path(cfg.gguf), cfg.llama_cpp, cfg.gguf_type)
        print(f"wrote {cfg.gguf}: {cfg.gguf_type}, by llama.cpp's convert_hf_to_gguf.py")
    return dest


if __name__ == "__main__":
    run_cli(export, ExportConfig)
