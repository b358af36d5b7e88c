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
    # one seeded generator: the same samples on every run
    generator = torch.Generator(idx.device).manual_seed(cfg.seed)
    t0 = time.perf_counter()
    # each step gives every row's new text (None: the row has stopped)
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
        # stream a single sample; keep a batch's rows to print whole
        if B == 1:
            print(pieces[0] or "", end="", flush=True)
        else:
            pairs = zip(texts, pieces, strict=True)
            texts = [text + (p or "") for text, p in pairs]
        # time the step, remembering the longest (a compile)
        now = (time.perf_counter() - t0, n_tokens)
        if last is not None and now[0] - last[0] > longest:
            longest = now[0] - last[0]
            ready = now
        first = first or now
        last = now
    return texts, n_tokens, [t for t in (first, ready, last) if t is not None]


def main(cfg: SampleConfig) -> None:
    # pick the device and dtype (on a CPU with native bf16, auto: bf16)
    compiled = cfg.compile and not cfg.quantize
    place = runtime.place(cfg.device, cfg.dtype, compiled_decode=compiled, training=False)
    device = place.device
    dtype = place.dtype
    # load the model and the tokenizer its dataset was made with
    run = load_run(parse_source(cfg.init_from), cfg.out_dir, device)
    model = run.model
    tok = run.tokenizer
    del run  # the checkpoint's other tensors
    vocab_size = model.config.vocab_size
    if tok.n_vocab > vocab_size:  # e.g. its dataset prepared again since
        raise UserError(
            f"the tokenizer has {tok.n_vocab} tokens, the model only {vocab_size}: "
            "not the dataset this checkpoint was trained on"
        )
    model = model.to(device=device, dtype=dtype)
    model = quantize(model, cfg.quantize).eval()
    # encode the prompts, num_samples rows each, left-padded into one batch
    prompts = [p for p in read_prompts(cfg.start) for _ in range(cfg.num_samples)]
    ids = encode_prompts(tok, prompts, model.config.block_size)
    idx, pad = left_pad(ids, device=device)
    padded = bool(pad.any())
    if not padded:
        pad = None
    # decode: a single sample streams after its prompt
    if len(prompts) == 1:
        print(prompts[0], end="", flush=True)
    texts, n_new, times = decode(model, tok, idx, pad, cfg)
    # print a batch's samples, each after its prompt
    if len(prompts) == 1:
        print(flush=True)  # the text was streamed
    else:
        for prompt, text in zip(prompts, texts, strict=True):
            print(f"{prompt}{text}\n---------------", flush=True)
    # one line of speed and cache size on stderr
    compiled_step = cfg.compile and not padded
    summary(model, cfg, idx, n_new, times, dtype, compiled_step)


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
    elapsed = 0.0
    prefill_s = 0.0
    if times:
        elapsed = times[-1][0]
        prefill_s = times[0][0]
    tok_s = n_new / max(elapsed, 1e-9)
    speed = f"{tok_s:,.0f} tok/s, prefill {prefill_s * 1000:.1f} ms"
    on_cpu = idx.device.type == "cpu"
    if compiled_step and on_cpu and cfg.kv_cache and n_new >= 4:
        ready_s, ready_n = times[1]  # the end of the longest step: the compile
        if n_new > ready_n:
            rate = (n_new - ready_n) / max(elapsed - ready_s, 1e-9)
            speed += f", compiled step ready after {ready_s:.2f} s, then {rate:,.0f} tok/s"
    print(
        f"{n_new} tokens in {elapsed:.2f} s ({speed}), batch {B}, {c.describe()}, "
        f"KV cache {kv:,} bytes, {dtype}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")
    run_cli(main, SampleConfig)
