r"""Side-by-side benchmarks against what users would pick instead (called by bench.py; results go
in docs/peers.md).

    python bench.py --mode=hf --n_layer=6 --n_head=6 --n_embd=384 --block_size=1024 \
        --vocab_size=50257
    python bench.py --mode=nanogpt --nanogpt_dir=/path/to/nanoGPT config/train_cpu_fast.py

hf: this project's decoding vs Hugging Face `GPT2LMHeadModel.generate` on the same random
GPT-2-shaped weights, greedy from a 1-token prompt; the fp32 tokens of the two must be identical.
With --llama_cpp=DIR (a llama.cpp source folder with its `llama-bench` built), the same weights also
go through its `convert_hf_to_gguf.py` to `llama-bench`. nanogpt: karpathy/nanoGPT's documented
recipe for the device (GPU or CPU) vs this project's config on the same char-level dataset (its
best val loss and wall time against ours), and the ms/iter of a 6x384 training step in each.
"""

import copy
import functools
import json
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model import GPTConfig
from smallgpt import hf
from smallgpt.checkpoint import Source, load_run
from smallgpt.data import data_dir, load_meta
from smallgpt.errors import UserError
from smallgpt.generation import generate
from smallgpt.gguf import check_gguf_vocabulary, convert_folder, to_gguf
from smallgpt.quantize import quantize
from smallgpt.runlog import read_run
from smallgpt.runtime import synchronize
from smallgpt.tokenizer import gpt2_encoding

REPO = Path(__file__).resolve().parent.parent  # where train.py and the configs are

# nanoGPT's README: "I have a GPU" (its config as it is: bf16 where supported, compiled) and "I only
# have a macbook"
NANOGPT_GPU_RECIPE = ["config/train_shakespeare_char.py"]
NANOGPT_CPU_RECIPE = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
STEP_SHAPE = [
    "--n_layer=6",
    "--n_head=6",
    "--n_embd=384",
    "--block_size=256",
    "--batch_size=8",
    "--dropout=0.0",
    "--gradient_accumulation_steps=1",
]


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    if isinstance(out, torch.Tensor):
        synchronize(out.device)
    return time.perf_counter() - t0, out


def bench_hf(
    mcfg: GPTConfig,
    new_tokens: list[int],
    dtypes: list[str],
    repeats: int,
    device: str = "cpu",
    llama_cpp: str = "",
) -> list[dict]:
    """tokens/s of GPT.generate and of generate(GPT2LMHeadModel, use_cache=True) on the same weights
    (and of llama.cpp's llama-bench on them, converted to GGUF, when llama_cpp names its folder)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging
    except ImportError as e:
        raise UserError(f"--mode=hf needs transformers ({e}); pip install transformers") from e
    logging.set_verbosity_error()
    tools = llama_cpp_tools(llama_cpp) if llama_cpp else None  # checked before any work
    # a Hugging Face GPT-2 of mcfg's shape with random weights
    torch.manual_seed(0)
    hf_cfg = GPT2Config(
        vocab_size=mcfg.vocab_size,
        n_positions=mcfg.block_size,
        n_embd=mcfg.n_embd,
        n_layer=mcfg.n_layer,
        n_head=mcfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = GPT2LMHeadModel(hf_cfg).eval()
    # the same weights in ours (through the GPT-2 loader users would use) and in llama.cpp
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_run(Source("hf", d), tokenizer=False).model.eval()
        llama = llama_cpp_runners(Path(d), *tools, dtypes) if tools else {}
        if not tools:
            print(
                "# llama.cpp skipped: pass --llama_cpp=DIR, a llama.cpp folder with "
                "build/bin/llama-bench",
                file=sys.stderr,
            )
        # each dtype's rows, the decoders taking turns
        rows = [
            row
            for dtype_name in dtypes
            for row in bench_dtype(
                hf, ours, dtype_name, new_tokens, repeats, device, llama.get(dtype_name)
            )
        ]
    # fp32 checks the two compute the same function
    bad = [r for r in rows if r["dtype"] == "float32" and not r["same_tokens"]]
    if bad:
        raise RuntimeError(
            f"greedy fp32 tokens differ from Hugging Face's at {[r['new_tokens'] for r in bad]} "
            f"new tokens: the two models do not compute the same function"
        )
    return rows


def bench_dtype(
    hf: torch.nn.Module,
    ours: torch.nn.Module,
    dtype_name: str,
    new_tokens: list[int],
    repeats: int,
    device: str,
    llama: Callable[[int], float] | None,
) -> list[dict]:
    """bench_hf's rows for one dtype: Hugging Face, ours eager and compiled, and llama.cpp (given
    its runner) taking turns in each repeat, so a slow spell of the machine falls on all of them.
    'int8' is our fp32 model with int8 weights (smallgpt/quantize.py), beside llama.cpp's Q8_0,
    its tokens compared to fp32's."""
    int8 = dtype_name == "int8"
    dtype = torch.float32 if int8 else getattr(torch, dtype_name)
    hf = hf.to(device, dtype)
    ours = ours.to(device, dtype)
    model = quantize(copy.deepcopy(ours), "int8") if int8 else ours
    decoders = greedy_decoders(hf, model, device)
    rows = []
    with torch.inference_mode():
        # warm-up (the compiled step compiles here)
        for decode in decoders.values():
            decode(8)
        for n in new_tokens:
            runs, llama_tok_s = taking_turns(decoders, llama, n, repeats, int8)
            row = hf_row(runs, llama_tok_s, n, device, dtype_name)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def greedy_decoders(
    hf: torch.nn.Module, model: torch.nn.Module, device: str
) -> dict[str, Callable[[int], torch.Tensor]]:
    """n new greedy tokens from a 1-token prompt: Hugging Face's generate, ours eager, ours with
    the compiled step."""
    idx = torch.tensor([[1]], device=device)

    def run_hf(n: int) -> torch.Tensor:
        return hf.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )[0, 1:]

    def run_ours(n: int) -> torch.Tensor:
        return generate(model, idx, n, temperature=0.0, compile_step=False)[0, 1:]

    def run_compiled(n: int) -> torch.Tensor:
        return generate(model, idx, n, temperature=0.0, compile_step=True)[0, 1:]

    return {"hf": run_hf, "ours": run_ours, "compiled": run_compiled}


def taking_turns(
    decoders: dict[str, Callable[[int], torch.Tensor]],
    llama: Callable[[int], float] | None,
    n: int,
    repeats: int,
    int8: bool,
) -> tuple[dict[str, list[tuple[float, torch.Tensor]]], list[float]]:
    """Each decoder's (seconds, tokens) of n new tokens and llama.cpp's tokens/s (given its
    runner), all in turn in each of repeats; int8: Hugging Face's fp32 tokens, once."""
    runs = {name: [] for name in decoders}
    llama_tok_s = []
    for i in range(repeats):
        for name, decode in decoders.items():
            if name == "hf" and int8 and i > 0:
                continue
            runs[name].append(timed(lambda: decode(n)))
        if llama:
            llama_tok_s.append(llama(n))
    return runs, llama_tok_s


def hf_row(
    runs: dict[str, list[tuple[float, torch.Tensor]]],
    llama_tok_s: list[float],
    n: int,
    device: str,
    dtype_name: str,
) -> dict:
    """One row of bench_hf: the median tokens/s of each decoder's runs, the speedups, and whether
    our tokens are Hugging Face's."""
    int8 = dtype_name == "int8"
    hf_s = statistics.median(t for t, _ in runs["hf"])
    our_s = statistics.median(t for t, _ in runs["ours"])
    compiled_s = statistics.median(t for t, _ in runs["compiled"])
    hf_tokens = runs["hf"][0][1]
    same = all(torch.equal(hf_tokens, runs[name][0][1]) for name in ("ours", "compiled"))
    row = {
        "mode": "hf",
        "device": device,
        "dtype": dtype_name,
        "new_tokens": n,
        "hf_tok_s": None if int8 else n / hf_s,
        "ours_tok_s": n / our_s,
        "compiled_tok_s": n / compiled_s,
        "speedup": None if int8 else hf_s / compiled_s,
        "same_tokens": same,
        "agreement": (hf_tokens == runs["compiled"][0][1]).float().mean().item(),
    }
    if llama_tok_s:
        row["llama_cpp_tok_s"] = statistics.median(llama_tok_s)
        row["vs_llama_cpp"] = n / compiled_s / row["llama_cpp_tok_s"]
    return row


GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}


def write_gpt2_tokenizer(folder: Path) -> None:
    """GPT-2's vocab.json and merges.txt in folder, made from tiktoken's GPT-2 BPE (so offline with
    GPT2_BPE_FILE): llama.cpp's converter reads the tokenizer through transformers and recognises
    GPT-2's by its output."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = gpt2_encoding()

    class FromRanks(TikTokenConverter):
        def load_tiktoken_bpe(self, _: str) -> dict[bytes, int]:
            return enc._mergeable_ranks

    vocab, merges = FromRanks().extract_vocab_merges_from_model("")
    vocab["<|endoftext|>"] = enc.eot_token
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def llama_cpp_tools(llama_cpp: str, program: str = "llama-bench") -> tuple[Path, Path]:
    """llama.cpp's convert_hf_to_gguf.py and its built program (llama-bench, llama-simple) in the
    folder llama_cpp."""
    root = Path(llama_cpp).resolve()
    convert = root / "convert_hf_to_gguf.py"
    binary = root / "build" / "bin" / program
    if not (convert.is_file() and binary.is_file()):
        raise UserError(
            f"--llama_cpp={llama_cpp}: no convert_hf_to_gguf.py and build/bin/{program} there "
            f"({root}); build it there with cmake --build build --target {program} "
            f"(docs/export.md)"
        )
    return convert, binary


def llama_cpp_runners(
    hf_dir: Path, convert: Path, binary: Path, dtypes: list[str]
) -> dict[str, Callable[[int], float]]:
    """For each dtype, the Hugging Face GPT-2 folder hf_dir converted by llama.cpp's
    convert_hf_to_gguf.py (llama_cpp_tools gives it and llama-bench) and llama_bench on that file, n
    new tokens to go."""
    write_gpt2_tokenizer(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"n_ctx": config["n_positions"]}))
    out = {}
    for dtype in dtypes:
        gguf = hf_dir / f"model-{GGUF_TYPES[dtype]}.gguf"
        convert_folder(hf_dir, gguf, str(convert.parent), GGUF_TYPES[dtype])
        out[dtype] = functools.partial(llama_bench, binary, gguf)
    return out


def llama_bench(binary: Path, gguf: Path, n: int) -> float:
    """Generation tokens/s of one llama-bench run of n new tokens on gguf, as many threads as torch
    uses."""
    r = subprocess.run(
        [
            binary,
            "-m",
            gguf,
            "-p",
            "0",
            "-n",
            str(n),
            "-t",
            str(torch.get_num_threads()),
            "-r",
            "1",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise UserError(f"llama-bench failed on {gguf.name}: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout)[0]["avg_ts"]


def run_timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    """Wall time and stdout of a command (python ...), which must succeed."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *cmd], cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        last = (r.stderr or r.stdout).strip().splitlines()[-1:]
        raise UserError(f"{' '.join(cmd[:2])} in {cwd} failed: {last}")
    return time.perf_counter() - t0, r.stdout


def nanogpt_dataset(nanogpt_dir: Path, dataset: str) -> str:
    """Our dataset (a uint16 token file, like nanoGPT's) linked into nanoGPT's data/ folder with its
    meta.pkl."""
    src = data_dir(dataset)
    name = f"smallgpt_{Path(dataset).name}"
    meta = load_meta(src)
    if meta["dtype"] != "uint16":
        raise UserError(f"nanoGPT reads uint16 token files; {src} holds {meta['dtype']}")
    dst = nanogpt_dir / "data" / name
    dst.mkdir(parents=True, exist_ok=True)
    for split in ("train.bin", "val.bin"):
        link = dst / split
        if link.exists() and not link.is_symlink():  # only the links made here are replaced
            raise UserError(
                f"{link} is a file, not the link to {src / split} this benchmark makes: move it "
                f"away"
            )
        link.unlink(missing_ok=True)
        link.symlink_to((src / split).resolve())
    (dst / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": meta["vocab_size"]}))
    return name


def ms_per_iter(stdout: str, skip: int = 3) -> float:
    """Median of nanoGPT's 'iter N: loss X, time Yms' lines after the first few."""
    return statistics.median(
        float(m) for m in re.findall(r"^iter \d+: .*time ([\d.]+)ms", stdout, re.M)[skip:]
    )


def bench_nanogpt(
    nanogpt_dir: str,
    dataset: str,
    our_args: list[str],
    device: str,
    our_step_ms: Callable[[], dict[bool, float]],
) -> list[dict]:
    """nanoGPT's recipe for the device (its README's GPU or CPU command) vs ours on `dataset`: its
    best val loss and wall time against our last val loss and wall time; and the 6x384 step's
    ms/iter (nanoGPT as its recipe runs; ours eager and compiled: our_step_ms gives {compiled:
    ms})."""
    root = nanogpt_checkout(nanogpt_dir)
    name = nanogpt_dataset(root, dataset)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [time_to_loss(root, name, dataset, our_args, device, tmp)]
        ref_ms = nanogpt_step_ms(root, name, device, tmp)
    for compiled, ms in our_step_ms().items():
        rows.append(
            {
                "mode": "nanogpt",
                "what": "6x384 step ms",
                "nanogpt_ms": ref_ms,
                "ours_compile": compiled,
                "ours_ms": ms,
                "ratio": ref_ms / ms,
            }
        )
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def nanogpt_checkout(nanogpt_dir: str) -> Path:
    """The karpathy/nanoGPT checkout at nanogpt_dir, outside this repository."""
    root = Path(nanogpt_dir).resolve()
    if root == REPO:
        raise UserError(
            f"--nanogpt_dir={nanogpt_dir} is this repository: pass a karpathy/nanoGPT checkout "
            f"outside it"
        )
    if not (root / "train.py").is_file():
        raise UserError(
            f"no nanoGPT checkout at {root}: git clone https://github.com/karpathy/nanoGPT there "
            f"(outside this repository) and pass --nanogpt_dir"
        )
    return root


def time_to_loss(
    root: Path, name: str, dataset: str, our_args: list[str], device: str, tmp: str
) -> dict:
    """nanoGPT's recipe for the device on its copy of the dataset (name), then our train.py with
    our_args on ours: each one's val loss and wall time."""
    recipe = NANOGPT_GPU_RECIPE if device.startswith("cuda") else NANOGPT_CPU_RECIPE
    theirs = ["train.py", *recipe, f"--dataset={name}", f"--out_dir={tmp}/nanogpt"]
    t_ref, out = run_timed(theirs, root)
    ref_loss = min(float(v) for v in re.findall(r"val loss ([\d.]+)", out))
    ours = [
        "train.py",
        *our_args,
        f"--device={device}",
        f"--dataset={data_dir(dataset)}",
        f"--out_dir={tmp}/ours",
    ]
    t_ours, _ = run_timed(ours, REPO)
    our_loss = read_run(Path(tmp) / "ours")["evals"][-1]["val_loss"]
    return {
        "mode": "nanogpt",
        "what": "time to loss",
        "nanogpt_val_loss": ref_loss,
        "nanogpt_s": t_ref,
        "ours_val_loss": our_loss,
        "ours_s": t_ours,
        "ratio": t_ref / t_ours,
    }


def nanogpt_step_ms(root: Path, name: str, device: str, tmp: str) -> float:
    """nanoGPT's ms/iter of the 6x384 step (STEP_SHAPE), compiled on a GPU as its recipe runs."""
    gpu = device.startswith("cuda")
    _, out = run_timed(
        [
            "train.py",
            *STEP_SHAPE,
            f"--device={device}",
            f"--compile={gpu}",
            f"--dataset={name}",
            "--max_iters=12",
            "--eval_iters=1",
            "--eval_interval=1000",
            f"--out_dir={tmp}/step",
        ],
        root,
    )
    return ms_per_iter(out)


def bench_gguf(out_dir: str, llama_cpp: str, prompt: str, new_tokens: int) -> list[dict]:
    """The checkpoint in out_dir through export's GGUF path (to_gguf, f32) into llama.cpp's
    llama-simple, greedy, against this project's greedy decoding of the same prompt: the same tokens
    give the same text."""
    if not llama_cpp:
        print(
            "# gguf check skipped: pass --llama_cpp=DIR, a llama.cpp source folder with "
            "build/bin/llama-simple"
        )
        return []
    _, binary = llama_cpp_tools(llama_cpp, "llama-simple")
    # the run's model and tokenizer, and its tokenizer as Hugging Face's
    loaded = load_run(Source("resume"), out_dir)
    model = loaded.model.float().eval()
    meta = loaded.meta
    tok = loaded.tokenizer
    hf_tok = hf.tokenizer(meta)
    check_gguf_vocabulary(hf_tok)  # before any decoding: a char-level run has no GGUF
    c = model.config
    # our greedy text: llama.cpp slides no window, so stay within the positions
    ids = tok.encode(prompt)
    n = min(new_tokens, c.block_size - len(ids))
    new = generate(model, torch.tensor([ids]), n, temperature=0)[0, len(ids) :].tolist()
    if tok.eot_token in new:  # llama.cpp stops there, silently
        new = new[: new.index(tok.eot_token)]
    ours = tok.decode(ids + new)
    # llama.cpp's greedy text from the same model as GGUF
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "model.gguf"
        to_gguf(model, hf_tok, gguf, llama_cpp, "f32")
        r = subprocess.run(
            [str(binary), "-m", str(gguf), "-n", str(n), prompt], capture_output=True, text=True
        )
    if r.returncode:
        raise UserError(
            f"llama-simple failed: {(r.stderr.strip() or 'no output').splitlines()[-1]}"
        )
    # how far the two texts agree
    theirs = r.stdout.removesuffix("\n")
    agree = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
    )
    row = {
        "mode": "gguf",
        "model": c.describe(),
        "class": hf.target_class(c),
        "tokenizer": meta.get("tokenizer"),
        "new_tokens": len(new),
        "same_text": ours == theirs,
        "chars_agreeing": agree,
        "chars": len(ours),
    }
    print(json.dumps(row), flush=True)
    if ours != theirs:
        print(f"# ours:      {ours!r}\n# llama.cpp: {theirs!r}", flush=True)
    return [row]


def bench_recipes(configs: list[str], train_args: list[str]) -> list[dict]:
    """Each train.py config file (then train_args, for all alike) trained from scratch in a
    temporary out_dir, one after another on this machine: its final val loss and the wall time of
    the whole process."""
    if missing := [c for c in configs if not Path(c).is_file()]:
        raise UserError(f"config file {missing[0]} not found")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            seconds, _ = run_timed(["train.py", config, *train_args, f"--out_dir={tmp}/{i}"], REPO)
            run = read_run(Path(tmp) / str(i))
            rows.append(
                {
                    "mode": "recipes",
                    "config": config,
                    "iters": run["evals"][-1]["iter"],
                    "val_loss": run["evals"][-1]["val_loss"],
                    "eval_iters": run["config"]["eval_iters"],
                    "wall_s": seconds,
                    "vs_first": seconds / rows[0]["wall_s"] if rows else 1.0,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows
