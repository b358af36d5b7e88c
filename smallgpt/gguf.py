"""GGUF files for llama.cpp, made by llama.cpp's own convert_hf_to_gguf.py from the transformers
folder smallgpt/hf.py writes (byte-level BPE vocabularies only: llama.cpp has no char-level one).
"""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model import GPT
from smallgpt.atomic import cannot_write, temp_path
from smallgpt.errors import UserError
from smallgpt.hf import save, to_hf, update_json
from smallgpt.hf_kimi import llama_cpp_keys, llama_cpp_names, wants_kimi

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
# Runs llama.cpp's converter (argv: converter, its arguments). The converter names a BPE
# pre-tokenizer by a hash of the tokens one known model's tokenizer gives for a fixed text, so it
# knows GPT-2's vocabulary but no vocabulary trained here; every byte-level BPE of this project
# pre-tokenizes as GPT-2 does, which llama.cpp calls 'gpt-2'. Its Llama tries a SentencePiece
# tokenizer.model first, importing sentencepiece (no requirement of ours) before it looks for the
# file: without the file, it is told so before that import, and goes on to the BPE.
CONVERT = """
import runpy, sys
sys.path[:0] = [sys.argv[1].rpartition("/")[0], sys.argv[1].rpartition("/")[0] + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
spm = getattr(base.TextModel, "_create_vocab_sentencepiece", None)
def no_spm(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return spm(self)
if spm:
    base.TextModel._create_vocab_sentencepiece = no_spm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check_gguf_vocabulary(tok: Any) -> None:
    """llama.cpp reads byte-level BPE vocabularies only: anything else (char-level) is refused
    before its converter runs, not inside it."""
    if type(tok.backend_tokenizer.model).__name__ != "BPE":
        raise UserError(
            "GGUF needs a byte-level BPE vocabulary (llama.cpp has no char-level one): train on a "
            "dataset prepared with --tokenizer=bpe or gpt2"
        )


def to_gguf(model: GPT, tok: Any, file: Path, llama_cpp: str, outtype: str, name: str = "") -> None:
    """model and tok as the GGUF file named name (default: the file's stem), written whole or not at
    all."""
    check_gguf_vocabulary(tok)
    tmp = temp_path(file)  # removed when stale by the next export there (export.py), under its lock
    try:
        tmp.mkdir()
    except OSError as e:
        raise cannot_write(file, e) from e
    try:
        folder = tmp / "hf"
        part = tmp / file.name
        llama_cpp_folder(model, tok, folder)
        convert_folder(folder, part, llama_cpp, outtype, name or file.stem)
        os.replace(part, file)
    finally:
        shutil.rmtree(tmp)  # the folder made above, with what was written into it


def llama_cpp_folder(model: GPT, tok: Any, folder: Path) -> None:
    """The transformers folder llama.cpp's converter turns into what model computes
    (hf.to_hf(llama_cpp=True)): Starcoder2 with every bias (llama.cpp's has no bias-free variant);
    DeepSeek-V3 with its rotary rows in pairs, and without q_lora_rank as q_lora_rank=0, which
    llama.cpp's deepseek2 requires (it reads 0 as no query latent) but transformers cannot build;
    Kimi Linear with the original checkpoint's keys and dense MLP names (hf_kimi): a folder for
    the converter only (docs/export.md)."""
    save(to_hf(model, llama_cpp=True), tok, folder)
    c = model.config
    if c.kv_lora_rank is not None and c.q_lora_rank is None:
        update_json(folder / "config.json", {"q_lora_rank": 0})
    if wants_kimi(c):  # the original checkpoint's keys and dense MLPs' names
        update_json(folder / "config.json", llama_cpp_keys(c))
        renamed_weights(folder, llama_cpp_names)


def renamed_weights(folder: Path, rename: Callable[[dict], dict]) -> None:
    """A saved folder's weights under rename's names, as one file (any shards joined)."""
    import safetensors.torch

    files = sorted(folder.glob("*.safetensors"))
    state = {k: v for f in files for k, v in safetensors.torch.load_file(f).items()}
    for f in [*files, folder / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    weights = rename(state)
    safetensors.torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def convert_folder(folder: Path, file: Path, llama_cpp: str, outtype: str, name: str = "") -> None:
    """llama.cpp's convert_hf_to_gguf.py (in the source folder llama_cpp) on a transformers folder,
    into file; name: the model's name in the GGUF (general.name), which the converter otherwise
    takes from the folder's name."""
    converter = Path(llama_cpp).resolve() / "convert_hf_to_gguf.py"
    args = [str(converter), str(folder), "--outfile", str(file), "--outtype", outtype]
    architectures = json.loads((folder / "config.json").read_text()).get("architectures", [])
    if "Qwen3_5ForCausalLM" in architectures:
        # its converter expects multi-token-prediction layers unless told there are none
        args.append("--no-mtp")
    if name:
        args += ["--model-name", name]
    r = subprocess.run([sys.executable, "-c", CONVERT, *args], capture_output=True, text=True)
    if r.returncode or not file.is_file():
        last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"llama.cpp's convert_hf_to_gguf.py failed: {last}")
