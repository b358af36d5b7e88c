"""Sample from a checkpoint with the KV cache: `python sample.py --out_dir=out-pycode-char --start="def "`.

--start=FILE:path reads the prompt from a file; --start=LINES:path makes one prompt of each line, decoded as one
left-padded batch. A single sample streams to the terminal; timings go to stderr.
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
    init_from: str = "resume"  # 'resume' (out_dir/ckpt.pt), or GPT-2: 'gpt2' ... 'gpt2-xl', 'hf:<local folder>'
    out_dir: str = "out"
    start: str = "\n"  # the prompt, or FILE:path, or LINES:path (one prompt per line)
    num_samples: int = 1  # samples per prompt, all decoded in one batch
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 200
    top_p: float | None = None
    stop: str | None = None  # end a sample at this string (kept); \n and \t in it are a newline and a tab
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # float32, bfloat16, float16 or auto: bf16 where it decodes faster (runtime.resolve_dtype)
    kv_cache: bool = True  # False recomputes the whole context every token, for comparison
    cuda_graph: bool = True  # on CUDA, replay each one-token step as a CUDA graph (docs/gpu.md)
    compile: bool = False  # on CPU, torch.compile the one-token step (faster decoding after ~10-60 s of compiling)
    quantize: str = ""  # 'int8': int8 weights, one scale per output feature (quantize.py; docs/performance-cpu.md)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)  # a ValueError, one line through parse_config
        problems = [f"num_samples={self.num_samples} must be at least 1"] * (self.num_samples < 1)
        problems += [f"max_new_tokens={self.max_new_tokens} must not be negative"] * (self.max_new_tokens < 0)
        problems += [f"quantize={self.quantize!r} must be one of {QUANTIZE}"] * (self.quantize not in QUANTIZE)
        try:
            kind = parse_source(self.init_from).kind
        except ValueError as e:
            problems.append(str(e))
            kind = "resume"
        if kind not in ("resume", "gpt2", "hf"):
            problems.append(f"init_from={self.init_from!r} must be 'resume' (out_dir/ckpt.pt), "
                            f"{', '.join(GPT2_NAMES)} or 'hf:<folder from save_pretrained>'")
        problems += ["stop='' would end every sample at once: give a string, or leave stop out"] * (self.stop == "")
        if self.stop:  # typed on a command line, --stop='\n' is a backslash and an n: take it as the newline meant
            self.stop = re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m[1]], self.stop)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} must be auto, float32, bfloat16 or float16")
        problems += ["compile=True compiles the cached one-token step: not with kv_cache=False"] * (
            self.compile and not self.kv_cache)
        problems += [f"seed={self.seed} must not be negative"] * (self.seed < 0)
        if problems:
            raise ValueError("; ".join(problems))


def read_prompts(start: str) -> list[str]:
    """The prompts --start gives: the text itself, FILE:path (one prompt) or LINES:path (one a line); the prefixes in
    any case."""
    kind, _, path = start.partition(":")
    kind = kind.upper()
    if kind not in ("FILE", "LINES"):
        return [start]
    if not path:
        raise UserError(f"--start={start} names no file: {kind}:path")
    text = read_text(path, "prompt file")
    prompts = [line for line in text.splitlines() if line] if kind == "LINES" else [text]
    if not prompts:
        raise UserError(f"prompt file {path} has no non-empty line: LINES: makes one prompt of each")
    return prompts


def decode(model: GPT, tok: Any, idx: torch.Tensor, pad: torch.Tensor | None, cfg: SampleConfig
           ) -> tuple[list[str], int, list[tuple[float, int]]]:
    """Each row's new text (generation.stream_text; a batch of one row streams to stdout instead and keeps none),
    the number of tokens decoded, and the seconds since the start and the tokens so far after the first step, the
    longest step after it (where a step compiles) and the last (memory does not grow with max_new_tokens)."""
    B, texts, n_tokens, t0 = idx.size(0), [""] * idx.size(0), 0, time.perf_counter()
    first = ready = last = None  # (seconds, tokens so far) after the first step, the longest after it, the last
    longest = 0.0
    gen = torch.Generator(idx.device).manual_seed(cfg.seed)
    for pieces in stream_text(model, tok, idx, cfg.max_new_tokens, cfg.stop, temperature=cfg.temperature,
                              top_k=cfg.top_k, top_p=cfg.top_p, use_cache=cfg.kv_cache, pad=pad, generator=gen,
                              cuda_graph=cfg.cuda_graph, compile_step=cfg.compile):
        n_tokens += sum(p is not None for p in pieces)
        if B == 1:
            print(pieces[0] or "", end="", flush=True)
        else:
            texts = [text + (p or "") for text, p in zip(texts, pieces, strict=True)]
        now = (time.perf_counter() - t0, n_tokens)
        if last is not None and now[0] - last[0] > longest:
            longest, ready = now[0] - last[0], now
        first, last = first or now, now
    return texts, n_tokens, [t for t in (first, ready, last) if t is not None]


def main(cfg: SampleConfig) -> None:
    device = resolve_device(cfg.device)
    run = load_run(parse_source(cfg.init_from), cfg.out_dir, device)
    model, tok = run.model, run.tokenizer
    del run  # the checkpoint's other tensors
    if tok.n_vocab > model.config.vocab_size:  # e.g. a checkpoint without data_meta, its dataset prepared again
        raise UserError(f"the tokenizer has {tok.n_vocab} tokens, the model only {model.config.vocab_size}: not the "
                        f"dataset this checkpoint was trained on")
    compiled = cfg.compile and not cfg.quantize  # on a CPU with native bf16, 'auto' decodes these in bf16
    dtype = torch.float16 if cfg.dtype == "float16" else resolve_dtype(cfg.dtype, device,
                                                                       compiled_decode=compiled)[0]
    model = quantize(model.to(device=device, dtype=dtype), cfg.quantize).eval()
    prompts = [p for p in read_prompts(cfg.start) for _ in range(cfg.num_samples)]
    ids, bs, B = [encode_prompt(tok, p) for p in prompts], model.config.block_size, len(prompts)
    if not all(ids):
        raise UserError("the prompt is empty: give it at least one character (--start=..., nanoGPT's default is a "
                        "newline)")
    if bad := [len(p) for p in ids if len(p) > bs]:
        raise UserError(f"a prompt has {bad[0]} tokens; it needs 1 to block_size={bs} (shorten it, or train with a "
                        f"larger block_size)")
    idx, pad = left_pad(ids, device=device)
    print(prompts[0] if B == 1 else "", end="", flush=True)  # a single sample streams after its prompt
    texts, n_new, times = decode(model, tok, idx, pad if bool(pad.any()) else None, cfg)
    if B == 1:
        print(flush=True)  # the text was streamed
    else:
        for prompt, text in zip(prompts, texts, strict=True):
            print(f"{prompt}{text}\n---------------", flush=True)
    mc = model.config
    kv = mc.kv_cache_bytes(B, min(bs, idx.size(1) + cfg.max_new_tokens - 1), model.transformer.wte.weight.dtype)
    elapsed, prefill_s = (times[-1][0], times[0][0]) if times else (0.0, 0.0)
    speed = f"{n_new / max(elapsed, 1e-9):,.0f} tok/s, prefill {prefill_s * 1000:.1f} ms"
    if cfg.compile and device == "cpu" and cfg.kv_cache and not pad.any() and n_new >= 4:  # step 2 compiles
        ready_s, ready_n = times[1]  # the end of the longest step: the compile
        if n_new > ready_n:
            rate = (n_new - ready_n) / max(elapsed - ready_s, 1e-9)
            speed += f", compiled step ready after {ready_s:.2f} s, then {rate:,.0f} tok/s"
    print(f"{n_new} tokens in {elapsed:.2f} s ({speed}), batch {B}, {mc.attention_kind} (n_kv_head={mc.n_kv_head}), "
          f"KV cache {kv * cfg.kv_cache:,} bytes, {dtype}", file=sys.stderr)


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")
    run_cli(main, SampleConfig)
