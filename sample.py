"""Sample from a checkpoint with the KV cache: `python sample.py --out_dir=out-pycode-char --start="def "`.

--start=FILE:path reads the prompt from a file; --start=LINES:path makes one prompt of each line, decoded as one
left-padded batch. A single sample streams to the terminal; timings go to stderr.
"""

import codecs
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from configurator import run_cli
from dataset import data_dir, load_meta, load_tokenizer
from model import left_pad, load_checkpoint, model_from_checkpoint
from train import resolve_device


@dataclass(slots=True)
class SampleConfig:
    out_dir: str = "out"  # reads out_dir/ckpt.pt
    start: str = "\n"  # the prompt, or FILE:path, or LINES:path (one prompt per line)
    num_samples: int = 1  # samples per prompt, all decoded in one batch
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 200
    top_p: float | None = None
    stop: str | None = None  # end a sample at this string (kept in the output)
    seed: int = 1337
    device: str = "auto"
    dtype: str = "float32"  # 'float32' or 'bfloat16' (on CPU, float32 decodes faster)
    compile: bool = False
    kv_cache: bool = True  # False recomputes the whole context every token, for comparison

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.max_new_tokens < 0:
            raise ValueError(f"num_samples={self.num_samples} must be >= 1 and max_new_tokens={self.max_new_tokens} "
                             f">= 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")


def read_prompts(start: str) -> list[str]:
    kind, _, path = start.partition(":")
    if kind not in ("FILE", "LINES") or not path:
        return [start]
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    text = Path(path).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line] if kind == "LINES" else [text]


def main(cfg: SampleConfig) -> None:
    device = resolve_device(cfg.device, 0)
    ckpt = load_checkpoint(Path(cfg.out_dir) / "ckpt.pt", map_location=device)
    model = model_from_checkpoint(ckpt).to(device=device, dtype=getattr(torch, cfg.dtype)).eval()
    meta = ckpt.get("data_meta") or load_meta(data_dir(ckpt.get("config", {}).get("dataset", "?")))
    tok = load_tokenizer(meta)
    del ckpt
    prompts = [tok.encode(p) for p in read_prompts(cfg.start)]
    bs = model.config.block_size
    for p in prompts:
        if not p or len(p) > bs:
            raise ValueError(f"a prompt has {len(p)} tokens; it needs 1 to block_size={bs} (shorten it, or train "
                             f"with a larger block_size)")
    idx, pad = left_pad([p for p in prompts for _ in range(cfg.num_samples)], device=device)
    pad = pad if bool(pad.any()) else None
    if cfg.compile:
        model.forward = torch.compile(model.forward, dynamic=True)
    gen = torch.Generator(device).manual_seed(cfg.seed)
    B, stream = idx.size(0), idx.size(0) == 1
    new: list[list[int]] = [[] for _ in range(B)]
    texts, done = [""] * B, [False] * B
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if stream:
        print(tok.decode(prompts[0]), end="", flush=True)
    t0 = time.perf_counter()
    t_first = None
    for step in model.stream(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, tok.eot_token,
                             cfg.kv_cache, pad, gen):
        t_first = t_first or time.perf_counter()
        for b, t in enumerate(step.tolist()):
            if done[b] or t == tok.eot_token:
                done[b] = True
                continue
            new[b].append(t)
            piece = utf8.decode(tok.decode_bytes([t])) if stream else ""
            if cfg.stop is not None:
                texts[b] = tok.decode(new[b]) if not stream else texts[b] + piece
                done[b] = cfg.stop in texts[b]
            if stream:
                print(piece, end="", flush=True)
        if all(done):
            break
    elapsed = time.perf_counter() - t0
    n_new = sum(len(r) for r in new)
    if stream:
        print(flush=True)
    else:
        for b in range(B):
            text = tok.decode(new[b])
            if cfg.stop is not None and cfg.stop in text:
                text = text[: text.index(cfg.stop) + len(cfg.stop)]
            print(tok.decode(idx[b, int(pad[b]) if pad is not None else 0:].tolist()) + text)
            print("---------------")
    decode_s = elapsed - ((t_first or t0) - t0)
    print(f"{n_new} tokens in {elapsed:.2f} s ({n_new / max(elapsed, 1e-9):,.0f} tok/s; prefill "
          f"{((t_first or t0) - t0) * 1000:.1f} ms, then {(n_new - B) / max(decode_s, 1e-9):,.0f} tok/s), batch {B}, "
          f"{model.config.attention_kind} (n_kv_head={model.config.n_kv_head}), KV cache "
          f"{model.config.kv_cache_bytes(B, min(bs, idx.size(1) + cfg.max_new_tokens), model.lm_head.weight.dtype):,}"
          f" bytes{'' if cfg.kv_cache else ' (not used: --kv_cache=False)'}", file=sys.stderr)


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")
    run_cli(main, SampleConfig)
