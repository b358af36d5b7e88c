"""Sample from a checkpoint with the KV cache:
`python sample.py --out_dir=out-pycode-char --start="def "`.

--start=FILE:path reads the prompt from a file; --start=LINES:path makes one prompt of each line,
decoded as one left-padded batch. A single sample streams to the terminal; timings go to stderr.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import UserError, run_cli

# isort: split
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint import load_run, parse_source
from dataset import read_text
from generation import check_sampling, left_pad, stream_text
from hf import GPT2_NAMES
from model import GPT
from quantize import QUANTIZE, quantize
from runtime import resolve_device, resolve_dtype
from tokenizer import encode_prompt


@dataclass(slots=True)
class SampleConfig:
    init_from: str = "resume"  # 'resume' (out_dir/ckpt.pt), 'gpt2' ... 'gpt2-xl', or 'hf:<folder>'
    out_dir: str = "out"
    start: str = "\n"  # the prompt, or FILE:path, or LINES:path (one prompt per line)
    num_samples: int = 1  # samples per prompt, all decoded in one batch
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 200
    top_p: float | None = None
    stop: str | None = None  # end a sample at this string (kept); \n and \t are a newline and a tab
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # float32, bfloat16, float16 or auto: bf16 where it decodes faster
    kv_cache: bool = True  # False recomputes the whole context every token, for comparison
    cuda_graph: bool = True  # on CUDA, replay each one-token step as a CUDA graph (docs/gpu.md)
    compile: bool = False  # on CPU, compile the one-token step (faster after a compile)
    quantize: str = ""  # 'int8': int8 weights, one scale per output feature (quantize.py)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)  # a ValueError: one line
        problems = []
        if self.num_samples < 1:
            problems.append(f"num_samples={self.num_samples} must be at least 1")
        if self.max_new_tokens < 0:
            problems.append(f"max_new_tokens={self.max_new_tokens} must not be negative")
        if self.quantize not in QUANTIZE:
            problems.append(f"quantize={self.quantize!r} must be one of {QUANTIZE}")
        try:
            kind = parse_source(self.init_from).kind
        except ValueError as e:
            problems.append(str(e))
            kind = "resume"
        if kind not in ("resume", "gpt2", "hf"):
            problems.append(f"init_from={self.init_from!r} must be 'resume' (out_dir/ckpt.pt), "
                            f"{', '.join(GPT2_NAMES)} or 'hf:<folder from save_pretrained>'")
        if self.stop == "":
            problems.append("stop='' would end every sample at once: give a string, or leave stop "
                            "out")
        if self.stop:  # typed in a shell, --stop='\n' is a backslash and an n: the newline meant
            self.stop = re.sub(r"\\([nt\\])", lambda match: ESCAPES[match[1]], self.stop)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} must be auto, float32, bfloat16 or float16")
        if self.compile and not self.kv_cache:
            problems.append("compile=True compiles the cached one-token step: not with "
                            "kv_cache=False")
        if self.seed < 0:
            problems.append(f"seed={self.seed} must not be negative")
        if problems:
            raise ValueError("; ".join(problems))


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}  # what \n, \t and \\ typed in --stop stand for


def read_prompts(start: str) -> list[str]:
    """The prompts --start gives: the text itself, FILE:path (one prompt) or LINES:path (one a
    line); the prefixes in any case."""
    kind, _, path = start.partition(":")
    kind = kind.upper()
    if kind not in ("FILE", "LINES"):
        return [start]
    if not path:
        raise UserError(f"--start={start} names no file: {kind}:path")
    text = read_text(path, "prompt file")
    if kind == "FILE":
        return [text]
    prompts = [line for line in text.splitlines() if line]
    if not prompts:
        raise UserError(f"prompt file {path} has no non-empty line: LINES: makes one prompt of "
                        f"each")
    return prompts


def encode_prompts(tok: Any, prompts: list[str], block_size: int) -> list[list[int]]:
    """Each prompt's token ids, 1 to block_size of them, else a UserError."""
    ids = [encode_prompt(tok, p) for p in prompts]
    if not all(ids):
        raise UserError("the prompt is empty: give it at least one character (--start=..., "
                        "nanoGPT's default is a newline)")
    too_long = [len(p) for p in ids if len(p) > block_size]
    if too_long:
        raise UserError(f"a prompt has {too_long[0]} tokens; it needs 1 to block_size={block_size} "
                        f"(shorten it, or train with a larger block_size)")
    return ids


def decode(model: GPT, tok: Any, idx: torch.Tensor, pad: torch.Tensor | None, cfg: SampleConfig
           ) -> tuple[list[str], int, list[tuple[float, int]]]:
    """Each row's new text (a batch of one row streams to stdout instead and keeps none), the
    number of tokens decoded, and (seconds since the start, tokens so far) after the first step,
    the longest step after it (where a step compiles) and the last: memory does not grow."""
    B = idx.size(0)
    texts = [""] * B
    n_tokens = 0
    first = ready = last = None
    longest = 0.0
    generator = torch.Generator(idx.device).manual_seed(cfg.seed)
    t0 = time.perf_counter()
    for pieces in stream_text(model, tok, idx, cfg.max_new_tokens, cfg.stop,
                              temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                              use_cache=cfg.kv_cache, pad=pad, generator=generator,
                              cuda_graph=cfg.cuda_graph, compile_step=cfg.compile):
        n_tokens += sum(p is not None for p in pieces)
        if B == 1:
            print(pieces[0] or "", end="", flush=True)
        else:
            texts = [text + (p or "") for text, p in zip(texts, pieces, strict=True)]
        now = (time.perf_counter() - t0, n_tokens)
        if last is not None and now[0] - last[0] > longest:
            longest = now[0] - last[0]
            ready = now
        first = first or now
        last = now
    return texts, n_tokens, [t for t in (first, ready, last) if t is not None]


def main(cfg: SampleConfig) -> None:
    device = resolve_device(cfg.device)
    run = load_run(parse_source(cfg.init_from), cfg.out_dir, device)
    model, tok = run.model, run.tokenizer
    del run  # the checkpoint's other tensors
    if tok.n_vocab > model.config.vocab_size:  # e.g. its dataset prepared again since
        raise UserError(f"the tokenizer has {tok.n_vocab} tokens, the model only "
                        f"{model.config.vocab_size}: not the dataset this checkpoint was trained "
                        f"on")
    compiled = cfg.compile and not cfg.quantize  # on a CPU with native bf16, auto: bf16
    if cfg.dtype == "float16":
        dtype = torch.float16
    else:
        dtype = resolve_dtype(cfg.dtype, device, compiled_decode=compiled)[0]
    model = quantize(model.to(device=device, dtype=dtype), cfg.quantize).eval()
    prompts = [p for p in read_prompts(cfg.start) for _ in range(cfg.num_samples)]
    idx, pad = left_pad(encode_prompts(tok, prompts, model.config.block_size), device=device)
    padded = bool(pad.any())
    if len(prompts) == 1:
        print(prompts[0], end="", flush=True)  # the sample streams after its prompt
    texts, n_new, times = decode(model, tok, idx, pad if padded else None, cfg)
    if len(prompts) == 1:
        print(flush=True)  # the text was streamed
    else:
        for prompt, text in zip(prompts, texts, strict=True):
            print(f"{prompt}{text}\n---------------", flush=True)
    summary(model, cfg, idx, n_new, times, dtype, compiled_step=cfg.compile and not padded)


def summary(model: GPT, cfg: SampleConfig, idx: torch.Tensor, n_new: int,
            times: list[tuple[float, int]], dtype: torch.dtype, compiled_step: bool) -> None:
    """One line on stderr: tokens, speed (after the compile, if a step compiled), the KV cache."""
    c = model.config
    B = idx.size(0)
    cached = min(c.block_size, idx.size(1) + cfg.max_new_tokens - 1)
    kv = c.kv_cache_bytes(B, cached, model.transformer.wte.weight.dtype) if cfg.kv_cache else 0
    elapsed, prefill_s = (times[-1][0], times[0][0]) if times else (0.0, 0.0)
    speed = f"{n_new / max(elapsed, 1e-9):,.0f} tok/s, prefill {prefill_s * 1000:.1f} ms"
    on_cpu = idx.device.type == "cpu"
    if compiled_step and on_cpu and cfg.kv_cache and n_new >= 4:
        ready_s, ready_n = times[1]  # the end of the longest step: the compile
        if n_new > ready_n:
            rate = (n_new - ready_n) / max(elapsed - ready_s, 1e-9)
            speed += f", compiled step ready after {ready_s:.2f} s, then {rate:,.0f} tok/s"
    print(f"{n_new} tokens in {elapsed:.2f} s ({speed}), batch {B}, {c.attention_kind} "
          f"(n_kv_head={c.n_kv_head}), KV cache {kv:,} bytes, {dtype}", file=sys.stderr)


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")
    run_cli(main, SampleConfig)
