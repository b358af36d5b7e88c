"""Benchmarks (results go in docs/, not in timed tests): one JSON line per measurement, then a table.

    python bench.py --mode=train config/train_shakespeare_char.py --device=cpu --batch_size=8 --dropout=0.0
    python bench.py --mode=decode --block_size=1024 --vocab_size=256
    python bench.py --mode=memory
    python bench.py --mode=nanogpt --nanogpt_dir=../nanoGPT config/speedrun_gpu.py   (on a GPU; CPU: train_cpu_fast.py)
    python bench.py --mode=gguf --out_dir=RUN --llama_cpp=../llama.cpp   (RUN's greedy text in llama.cpp and here)
    python bench.py --mode=recipes --configs='[A.py,B.py]' [train.py flags for both]   (val loss and wall time)

The model, device and dtype come from train.py's config files and flags; the keys of BenchConfig steer the bench.
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import parse_config, run_cli, split_args
from smallgpt.errors import UserError

# isort: split
import copy
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from model import GPT, GPTConfig
from smallgpt import bench_peers, runtime, sharding
from smallgpt.checkpoint import Source, load_run
from smallgpt.configs import TrainConfig
from smallgpt.data import Batches, data_dir, vocab_size_of
from smallgpt.fast_paths import Linear
from smallgpt.generation import generate
from smallgpt.measure import default_kv_heads, step_ms, table, timed_decode
from smallgpt.quantize import quantize
from smallgpt.runtime import (
    Dist,
    autocast,
    keep_freed_memory,
    peak_flops,
    resolve_device,
    resolve_dtype,
)
from train import train_step


@dataclass(slots=True)
class BenchConfig:
    # 'train', 'decode', 'memory' (DDP vs FSDP), 'int8' (a checkpoint in out_dir with int8 weights: val loss,
    # greedy agreement, speed), or against peers (smallgpt/bench_peers.py): 'hf', 'nanogpt', 'gguf'
    # (out_dir's checkpoint as
    # GGUF in llama.cpp: the same greedy text), 'recipes' (train.py config files one after another)
    mode: str = "decode"
    # train: every combination of these, on random tokens (speed does not depend on the data)
    compiles: list[bool] = field(default_factory=lambda: [False, True])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    warmup: int = 3  # iterations left out (compilation happens here)
    iters: int = 10  # measured iterations; the median is reported
    profile: bool = (
        False  # train: then 5 more iterations under torch.profiler, its 25 costliest ops printed
    )
    # decode: MHA/GQA/MQA variants of the model, from a 1-token prompt, greedy
    kv_heads: list[int] = field(default_factory=list)  # empty: n_head, a middle divisor, 1
    kv_lora_ranks: list[int] = field(
        default_factory=list
    )  # and MLA with each of these latent widths
    new_tokens: list[int] = field(default_factory=lambda: [256, 1000])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    recompute_max_batch: int = 1  # recomputation only up to this batch size (it is slow)
    repeats: int = 3  # cached runs per setting, the median is reported
    nanogpt_dir: str = ""  # nanogpt: a karpathy/nanoGPT checkout, outside this repository
    llama_cpp: str = ""  # hf, gguf: a llama.cpp source folder with build/bin/llama-bench (hf), llama-simple (gguf)
    prompt: str = (
        "def "  # gguf: the prompt both decode from (new_tokens[0] tokens, within block_size)
    )
    configs: list[str] = field(
        default_factory=list
    )  # recipes: config files, each trained from scratch in turn
    linear_split: bool = (
        True  # False: few-row products through nn.Linear's own path (fast_paths.Linear unsplit)
    )
    # memory: per-process bytes of weights, gradients and AdamW state of GPT-2's shapes with DDP and with FSDP
    world_sizes: list[int] = field(default_factory=lambda: [2, 4, 8])

    def __post_init__(self) -> None:
        if self.mode not in (
            "train",
            "decode",
            "memory",
            "int8",
            "hf",
            "nanogpt",
            "gguf",
            "recipes",
        ):
            raise ValueError(
                f"mode={self.mode!r} must be 'train', 'decode', 'memory', 'int8', 'hf', 'nanogpt', "
                f"'gguf' or 'recipes'"
            )
        allowed = ("float32", "bfloat16", "float16") + ("int8",) * (self.mode == "hf")
        if bad := [d for d in self.dtypes if d not in allowed]:
            raise ValueError(
                f"dtypes={self.dtypes!r}: {bad[0]!r} is not one of {', '.join(allowed)} (int8: --mode=hf "
                f'only), e.g. --dtypes=\'["float32", "bfloat16"]\''
            )
        lists = {
            k: getattr(self, k)
            for k in ("dtypes", "compiles", "new_tokens", "batch_sizes", "world_sizes")
        }
        problems = [f"{k}=[] needs at least one value" for k, v in lists.items() if not v]
        sizes = {
            k: getattr(self, k)
            for k in ("new_tokens", "batch_sizes", "world_sizes", "kv_heads", "kv_lora_ranks")
        }
        problems += [
            f"{k}={v} must all be positive" for k, v in sizes.items() if min(v, default=1) < 1
        ]
        problems += [
            f"{k}={getattr(self, k)} must be positive"
            for k in ("iters", "repeats")
            if getattr(self, k) < 1
        ]
        problems += [
            f"{k}={getattr(self, k)} must not be negative"
            for k in ("warmup", "recompute_max_batch")
            if getattr(self, k) < 0
        ]
        if self.mode == "recipes" and not self.configs:
            problems.append(
                "--mode=recipes needs --configs='[config/a.py,config/b.py]', the config files to compare"
            )
        if self.mode == "nanogpt" and not self.nanogpt_dir:
            problems.append(
                "--mode=nanogpt needs --nanogpt_dir=<a karpathy/nanoGPT checkout outside this repository>"
            )
        if problems:
            raise ValueError("; ".join(problems))


GPT2_SHAPES = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-xl": (48, 25, 1600),
}  # layers, heads, width


class RandomBatches:
    def __init__(self, base: TrainConfig, vocab_size: int, device: str) -> None:
        self.shape, self.vocab_size, self.device = (
            (base.batch_size, base.block_size + 1),
            vocab_size,
            device,
        )

    def train(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.randint(0, self.vocab_size, self.shape, device=self.device)
        return buf[:, :-1], buf[:, 1:]


def bench_train(cfg: BenchConfig, base: TrainConfig, mcfg: GPTConfig, device: str) -> list[dict]:
    rows, device_type = [], runtime.device_type(device)
    d = Dist(0, 0, 1, device, True)
    batches = RandomBatches(base, mcfg.vocab_size, device)
    tokens_per_iter = base.gradient_accumulation_steps * base.batch_size * base.block_size
    if device_type == "cpu":
        keep_freed_memory()  # as train.py does
    for dtype_name in cfg.dtypes:
        dtype = resolve_dtype(dtype_name, device_type, mcfg.n_embd)[0]
        peak = base.peak_flops or peak_flops(device, dtype)
        for compiled in cfg.compiles:
            torch.manual_seed(base.seed)
            raw = GPT(mcfg).to(device)
            opt = raw.configure_optimizers(
                base.weight_decay, base.learning_rate, (base.beta1, base.beta2), device_type
            )
            scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
            model = torch.compile(raw) if compiled else raw
            times = []
            for it in range(cfg.warmup + cfg.iters):
                t0 = time.perf_counter()
                loss = train_step(
                    model,
                    raw,
                    opt,
                    scaler,
                    batches,
                    it,
                    d,
                    base.gradient_accumulation_steps,
                    autocast(device_type, dtype),
                    base.grad_clip,
                )[0].item()
                runtime.synchronize(device)
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times[cfg.warmup :])
            if cfg.profile:
                activities = [torch.profiler.ProfilerActivity.CPU] + [
                    torch.profiler.ProfilerActivity.CUDA
                ] * (device_type == "cuda")
                with torch.profiler.profile(activities=activities) as prof:
                    for it in range(5):
                        train_step(
                            model,
                            raw,
                            opt,
                            scaler,
                            batches,
                            it,
                            d,
                            base.gradient_accumulation_steps,
                            autocast(device_type, dtype),
                            base.grad_clip,
                        )
                    runtime.synchronize(device)
                sort = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
                print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
            mfu = raw.estimate_mfu(tokens_per_iter, dt, peak, base.block_size) if peak else None
            row = {
                "mode": "train",
                "device": device,
                "dtype": dtype_name,
                "compile": compiled,
                "ms_per_iter": 1000 * dt,
                "tokens_per_s": tokens_per_iter / dt,
                "flops_per_token": raw.flops_per_token(base.block_size),
                "peak_flops": peak,
                "mfu": mfu,
                "loss": loss,
                "peak_tflops": peak / 1e12 if peak else None,
                "mfu_pct": 100 * mfu if peak else None,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def bench_decode(cfg: BenchConfig, base: GPTConfig, device: str, dtype: torch.dtype) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    shapes = [
        dataclasses.replace(base, n_kv_head=g)
        for g in cfg.kv_heads or default_kv_heads(base.n_head)
    ]
    for mcfg in shapes + [dataclasses.replace(base, kv_lora_rank=r) for r in cfg.kv_lora_ranks]:
        model = GPT(mcfg).to(device=device, dtype=dtype).eval()
        for m in model.modules():
            if isinstance(m, Linear) and not cfg.linear_split:
                m.split_max_rows = 0
        weight_bytes = sum(
            m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear)
        )
        timed_decode(model, 1, 16, True, gen)  # warm-up
        for batch in cfg.batch_sizes:
            for n in cfg.new_tokens:
                ctx = min(n, mcfg.block_size)  # positions cached at the end
                row = {
                    "mode": "decode",
                    "attention": mcfg.attention_kind,
                    "n_kv_head": mcfg.n_kv_head,
                    "kv_lora_rank": mcfg.kv_lora_rank,
                    "batch": batch,
                    "new_tokens": n,
                    "kv_cache_bytes": mcfg.kv_cache_bytes(batch, ctx, dtype),
                    "weight_bytes": weight_bytes,
                }
                runs = [timed_decode(model, batch, n, True, gen) for _ in range(cfg.repeats)]
                stamps = sorted(runs, key=lambda s: s[-1])[len(runs) // 2]
                row |= {
                    "cache_tok_s": batch * n / stamps[-1],
                    "prefill_ms": 1000 * stamps[0],
                    "step_ms_at_100": step_ms(stamps, 100) if n > 100 else None,
                    "step_ms_at_end": step_ms(stamps, n),
                }
                # a step at the end reads every weight once and the whole cache once
                row["gb_s_at_end"] = (
                    (weight_bytes + row["kv_cache_bytes"]) / row["step_ms_at_end"] / 1e6
                )
                if batch <= cfg.recompute_max_batch:
                    row["recompute_tok_s"] = (
                        batch * n / timed_decode(model, batch, n, False, gen)[-1]
                    )
                    row["speedup"] = row["cache_tok_s"] / row["recompute_tok_s"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def bench_memory(world_sizes: list[int]) -> list[dict]:
    """GiB one process holds for fp32 weights, gradients and AdamW's moments: DDP's whole copy, and FSDP's shards
    at each world size (sharding.per_rank_bytes: fully_shard on the meta device, no memory or GPU needed)."""
    rows = []
    for name, (layers, heads, width) in GPT2_SHAPES.items():
        mcfg = GPTConfig(
            n_layer=layers,
            n_head=heads,
            n_embd=width,
            block_size=1024,
            vocab_size=50304,
            bias=False,
        )
        row = {"mode": "memory", "model": name}
        for world in world_sizes:
            b = sharding.per_rank_bytes(mcfg, world)
            row |= {
                "params": b["params"],
                "ddp_gib": b["ddp_bytes"] / 2**30,
                f"fsdp_{world}_gib": b["fsdp_bytes"] / 2**30,
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def header(mode: str, device: str, mcfg: GPTConfig) -> None:
    print(
        f"# {mode} benchmark on {device} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
        f"{mcfg.n_layer} layers, {mcfg.n_head} heads, {mcfg.n_embd} wide, vocab {mcfg.vocab_size}"
        + (f", window {mcfg.window} in layers {mcfg.window_pattern}" if mcfg.window else ""),
        file=sys.stderr,
    )


def bench_int8(cfg: BenchConfig, base: TrainConfig) -> list[dict]:
    """The trained checkpoint in base.out_dir in fp32 and with int8 weights (smallgpt/quantize.py):
    val loss over eval_iters
    batches of its dataset, the share of positions where the two predict the same next token (on those batches),
    greedy continuations of 4 val prompts (the share of tokens equal to fp32's), and batch-1 decoding tokens/s."""
    loaded = load_run(Source("resume"), base.out_dir, tokenizer=False)
    models = {"float32": loaded.model.eval()}
    models["int8"] = quantize(copy.deepcopy(models["float32"]), "int8")
    header("int8", "cpu", models["float32"].config)
    batches = Batches(
        data_dir(loaded.config.get("dataset", base.dataset)),
        models["int8"].config.block_size,
        base.batch_size,
        base.seed,
        "cpu",
    )
    n, gen, rows, greedy, picks = cfg.new_tokens[0], torch.Generator().manual_seed(0), [], {}, {}
    val = [batches.eval("val", k) for k in range(base.eval_iters)]  # read once, for both models
    with torch.inference_mode():
        for name, m in models.items():
            # one pass: each position's next token and the val loss (logits are not kept: vocab-sized)
            outs = [(logits.argmax(-1), loss.item()) for logits, loss in (m(x, y) for x, y in val)]
            picks[name] = torch.stack([pick for pick, _ in outs])
            greedy[name] = generate(m, val[0][0][:4, :16], n, temperature=0)[:, 16:]
            timed_decode(m, 1, 16, True, gen, compile_step=True)  # compiles
            rows.append(
                {
                    "mode": "int8",
                    "weights": name,
                    "val_loss": sum(loss for _, loss in outs) / len(outs),
                    "weight_bytes": sum(t.nbytes for t in [*m.parameters(), *m.buffers()]),
                    "eager_tok_s": n / timed_decode(m, 1, n, True, gen)[-1],
                    "compiled_tok_s": n / timed_decode(m, 1, n, True, gen, compile_step=True)[-1],
                }
            )
    rows[1] |= {
        "top1_agreement": (picks["float32"] == picks["int8"]).float().mean().item(),
        "greedy_agreement": (greedy["float32"] == greedy["int8"]).float().mean().item(),
    }
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def parse(argv: list[str]) -> tuple[BenchConfig, TrainConfig, list[str]]:
    ours, train_args = split_args(argv, BenchConfig)
    return parse_config(BenchConfig, ours), parse_config(TrainConfig, train_args), train_args


def main(config: tuple[BenchConfig, TrainConfig, list[str]]) -> None:
    cfg, base, train_args = config
    device = resolve_device(base.device, 0)
    mcfg = base.model_config(vocab_size=vocab_size_of(base.dataset) or 50304)
    if bad := [k for k in cfg.kv_heads if mcfg.n_head % k]:
        raise UserError(
            f"kv_heads={cfg.kv_heads}: n_head={mcfg.n_head} is not divisible by n_kv_head={bad[0]}"
        )
    if (
        cfg.mode == "hf" and max(cfg.new_tokens) >= mcfg.block_size
    ):  # Hugging Face's GPT-2 cannot slide its window
        raise UserError(
            f"new_tokens={cfg.new_tokens}: --mode=hf decodes up to block_size={mcfg.block_size} "
            f"positions (a 1-token prompt), so each must be below it"
        )
    if cfg.mode not in (
        "int8",
        "gguf",
        "recipes",
    ):  # which read their model from a checkpoint or config files
        header(cfg.mode, device, mcfg)
    if cfg.mode == "recipes":
        rows = bench_peers.bench_recipes(cfg.configs, train_args)
        print(
            table(
                rows,
                {
                    "config": "config",
                    "iters": "iterations",
                    "val_loss": "final val loss",
                    "eval_iters": "eval batches",
                    "wall_s": "wall s (whole process)",
                    "vs_first": "vs first",
                },
            )
        )
    elif cfg.mode == "gguf":
        rows = bench_peers.bench_gguf(base.out_dir, cfg.llama_cpp, cfg.prompt, cfg.new_tokens[0])
        if rows and not rows[0]["same_text"]:
            raise SystemExit(
                f"error: llama.cpp's greedy text differs from ours after {rows[0]['chars_agreeing']} "
                f"characters"
            )
        print(table(rows) if rows else "")
    elif cfg.mode == "hf":
        rows = bench_peers.bench_hf(
            mcfg, cfg.new_tokens, cfg.dtypes, cfg.repeats, device, cfg.llama_cpp
        )
        print(
            table(
                rows,
                {
                    "dtype": "dtype",
                    "new_tokens": "new tokens",
                    "hf_tok_s": "Hugging Face tok/s",
                    "llama_cpp_tok_s": "llama.cpp tok/s",
                    "ours_tok_s": "ours tok/s",
                    "compiled_tok_s": "ours compiled tok/s",
                    "speedup": "vs Hugging Face",
                    "vs_llama_cpp": "vs llama.cpp",
                    "same_tokens": "same tokens",
                    "agreement": "tokens as HF fp32",
                },
            )
        )
    elif cfg.mode == "nanogpt":
        step = parse_config(
            TrainConfig, [*bench_peers.STEP_SHAPE, f"--device={device}", "--vocab_size=65"]
        )
        dtype = str(resolve_dtype("auto", device, step.n_embd)[0]).removeprefix("torch.")
        rows = bench_peers.bench_nanogpt(
            cfg.nanogpt_dir,
            base.dataset,
            train_args,
            device,
            lambda: {
                r["compile"]: r["ms_per_iter"]
                for r in bench_train(
                    dataclasses.replace(cfg, dtypes=[dtype]), step, step.model_config(65), device
                )
            },
        )
        print(f"(ours: the 6x384 step in {dtype} autocast)")
        print(table(rows[:1]) + "\n\n" + table(rows[1:]))
    elif cfg.mode == "int8":
        rows = bench_int8(cfg, base)
        print(
            table(
                rows,
                {
                    "weights": "weights",
                    "weight_bytes": "bytes",
                    "val_loss": "val loss",
                    "top1_agreement": "next-token agreement",
                    "greedy_agreement": "greedy tokens as fp32",
                    "eager_tok_s": "eager tok/s",
                    "compiled_tok_s": "compiled tok/s",
                },
            )
        )
    elif cfg.mode == "memory":
        rows = bench_memory(cfg.world_sizes)
        print(
            table(
                rows,
                {"model": "model", "params": "parameters", "ddp_gib": "DDP GiB / process"}
                | {f"fsdp_{w}_gib": f"FSDP x{w} GiB / process" for w in cfg.world_sizes},
            )
        )
    elif cfg.mode == "train":
        rows = bench_train(cfg, base, mcfg, device)
        print(
            table(
                rows,
                {
                    "dtype": "dtype",
                    "compile": "compile",
                    "ms_per_iter": "ms/iter",
                    "tokens_per_s": "tokens/s",
                    "mfu_pct": "MFU %",
                    "peak_tflops": "peak TFLOP/s",
                    "loss": "loss",
                },
            )
        )
    else:
        dtype = resolve_dtype(base.dtype, device, training=False)[0]
        rows = bench_decode(cfg, mcfg, device, dtype)
        columns = {
            "attention": "attention",
            "n_kv_head": "n_kv_head",
            "kv_lora_rank": "kv_lora_rank",
            "batch": "batch",
            "new_tokens": "new tokens",
            "kv_cache_bytes": "KV cache bytes",
            "cache_tok_s": "cache tok/s",
            "recompute_tok_s": "recompute tok/s",
            "speedup": "speedup",
            "step_ms_at_100": "step ms @100",
            "step_ms_at_end": "step ms @end",
            "gb_s_at_end": "GB/s @end",
        }
        print(table(rows, columns))


if __name__ == "__main__":
    run_cli(main, parse, keys=(BenchConfig, TrainConfig))
