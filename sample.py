"""Sample from a checkpoint with the KV cache:
`python sample.py --out_dir=out-pycode-char --start="def "`.

--start=FILE:path reads the prompt from a file; --start=LINES:path makes one prompt of each line,
decoded as one left-padded batch. A single sample streams to the terminal; timings go to stderr.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import run_cli
from smallgpt.errors import UserError

# isort: split
import sys
import time
from typing import Any

import torch

from model import GPT
from smallgpt import runtime
from smallgpt.checkpoint import load_run, parse_source
from smallgpt.configs import SampleConfig
from smallgpt.generation import left_pad, stream_text
from smallgpt.prompts import encode_prompts, read_prompts
from smallgpt.quantize import quantize


def decode(
    model: GPT, tok: Any, idx: torch.Tensor, pad: torch.Tensor | None, cfg: SampleConfig
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
    for pieces in stream_text(
        model,
        tok,
        idx,
        cfg.max_new_tokens,
        cfg.stop,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        use_cache=cfg.kv_cache,
        pad=pad,
        generator=generator,
        cuda_graph=cfg.cuda_graph,
        compile_step=cfg.compile,
    ):
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
    compiled = cfg.compile and not cfg.quantize  # on a CPU with native bf16, auto: bf16
    place = runtime.place(cfg.device, cfg.dtype, compiled_decode=compiled, training=False)
    device, dtype = place.device, place.dtype
    run = load_run(parse_source(cfg.init_from), cfg.out_dir, device)
    model, tok = run.model, run.tokenizer
    del run  # the checkpoint's other tensors
    if tok.n_vocab > model.config.vocab_size:  # e.g. its dataset prepared again since
        raise UserError(
            f"the tokenizer has {tok.n_vocab} tokens, the model only "
            f"{model.config.vocab_size}: not the dataset this checkpoint was trained "
            f"on"
        )
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


def summary(
    model: GPT,
    cfg: SampleConfig,
    idx: torch.Tensor,
    n_new: int,
    times: list[tuple[float, int]],
    dtype: torch.dtype,
    compiled_step: bool,
) -> None:
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
    print(
        f"{n_new} tokens in {elapsed:.2f} s ({speed}), batch {B}, {c.attention_kind} "
        f"({c.kv_sizes}), KV cache {kv:,} bytes, {dtype}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")
    run_cli(main, SampleConfig)
