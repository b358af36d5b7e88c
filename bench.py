r"""Benchmarks (results go in docs/, not in timed tests): one JSON line per measurement, then a
table.

    python bench.py --mode=train config/train_shakespeare_char.py --device=cpu --batch_size=8 \
        --dropout=0.0
    python bench.py --mode=decode --block_size=1024 --vocab_size=256
    python bench.py --mode=memory
    # the delta rule alone, CPU kernel against torch; a hybrid's step on each
    python bench.py --mode=delta --batch_size=4 --block_size=512 --n_head=4 --n_embd=128
    python bench.py --mode=train config/train_cpu_fast.py --layer_pattern=DDDL \
        --delta_rules=[kernel,torch]
    # on a GPU (CPU: config/train_cpu_fast.py)
    python bench.py --mode=nanogpt --nanogpt_dir=../nanoGPT config/speedrun_gpu.py
    # RUN's greedy text in llama.cpp and here
    python bench.py --mode=gguf --out_dir=RUN --llama_cpp=../llama.cpp
    # val loss and wall time, [train.py flags] for both
    python bench.py --mode=recipes --configs='[A.py,B.py]' [train.py flags]

The model, device and dtype come from train.py's config files and flags; the keys of BenchConfig
steer the bench. A flag that the mode does not read (MODES) is refused before any work: it would
change nothing (config files are train.py's, so their other keys are left alone).
"""

# configurator first: a Ctrl-C while torch imports is then one line, not a traceback
from configurator import parse_config, run_cli, split_args
from smallgpt.errors import UserError

# isort: split
import copy
import dataclasses
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from model import GPT, LAYER_KINDS, GPTConfig
from smallgpt import bench_delta, bench_peers, delta_rule_kernel, runtime, sharding
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
    # 'train', 'decode', 'memory' (DDP vs FSDP), 'int8' (a checkpoint in out_dir with int8 weights:
    # val loss, greedy agreement, speed), or against peers (smallgpt/bench_peers.py): 'hf',
    # 'nanogpt', 'gguf' (out_dir's checkpoint as GGUF in llama.cpp: the same greedy text), 'recipes'
    # (train.py config files one after another)
    mode: str = "decode"
    # train: every combination of these, on random tokens (speed does not depend on the data)
    compiles: list[bool] = field(default_factory=lambda: [False, True])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    warmup: int = 3  # iterations left out (compilation happens here)
    iters: int = 10  # measured iterations; the median is reported
    # train: then 5 more iterations under torch.profiler, its 40 costliest ops printed
    profile: bool = False
    # train: the chunked layers' chunk (Gated DeltaNet's: tokens a step of delta_rule.chunked) at
    # each of these sizes; empty: each kind's own (LayerKind.chunk)
    chunks: list[int] = field(default_factory=list)
    # train (a model with recurrent layers): their rule on the compiled CPU kernel, on the torch
    # path, or each (smallgpt/delta_rule_kernel.py); delta: the rule alone, both always
    delta_rules: list[str] = field(default_factory=lambda: ["kernel"])
    # decode: MHA/GQA/MQA variants of the model, from a 1-token prompt, greedy
    kv_heads: list[int] = field(default_factory=list)  # empty: n_head, a middle divisor, 1
    kv_lora_ranks: list[int] = field(default_factory=list)  # and MLA with these latent widths
    new_tokens: list[int] = field(default_factory=lambda: [256, 1000])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    recompute_max_batch: int = 1  # recomputation only up to this batch size (it is slow)
    # decode: the one-token steps compiled (smallgpt/compiled_step.py: CPU only), as sample.py's
    # --compile runs them
    compile_step: bool = False
    repeats: int = 3  # cached runs per setting, the median is reported
    nanogpt_dir: str = ""  # nanogpt: a karpathy/nanoGPT checkout, outside this repository
    # hf, gguf: a llama.cpp source folder with build/bin/llama-bench (hf), llama-simple (gguf)
    llama_cpp: str = ""
    # gguf: the prompt both decode from (new_tokens[0] tokens, within block_size)
    prompt: str = "def "
    # recipes: config files, each trained from scratch in turn
    configs: list[str] = field(default_factory=list)
    # False: few-row products through nn.Linear's own path (fast_paths.Linear unsplit)
    linear_split: bool = True
    # memory: per-process bytes of weights, gradients and AdamW state of GPT-2's shapes with DDP
    # and with FSDP
    world_sizes: list[int] = field(default_factory=lambda: [2, 4, 8])

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            names = [repr(mode) for mode in MODES]
            raise ValueError(f"mode={self.mode!r} must be {', '.join(names[:-1])} or {names[-1]}")
        allowed = ["float32", "bfloat16", "float16"]
        if self.mode == "hf":
            allowed.append("int8")
        if bad := [d for d in self.dtypes if d not in allowed]:
            raise ValueError(
                f"dtypes={self.dtypes!r}: {bad[0]!r} is not one of {', '.join(allowed)} (int8: "
                f'--mode=hf only), e.g. --dtypes=\'["float32", "bfloat16"]\''
            )
        problems = self.size_problems()
        if not self.delta_rules or not set(self.delta_rules) <= {"kernel", "torch"}:
            problems.append(
                f"delta_rules={self.delta_rules} must list 'kernel' or 'torch' or both, e.g. "
                "--delta_rules=[kernel,torch]"
            )
        if self.mode == "recipes" and not self.configs:
            problems.append(
                "--mode=recipes needs --configs='[config/a.py,config/b.py]', the config files to "
                "compare"
            )
        if self.mode == "nanogpt" and not self.nanogpt_dir:
            problems.append(
                "--mode=nanogpt needs --nanogpt_dir=<a karpathy/nanoGPT checkout outside this "
                "repository>"
            )
        if problems:
            raise ValueError("; ".join(problems))

    def size_problems(self) -> list[str]:
        """Lists that need a value, and sizes and counts that must be positive (or not negative)."""
        lists = ("dtypes", "compiles", "new_tokens", "batch_sizes", "world_sizes")
        sizes = ("new_tokens", "batch_sizes", "world_sizes", "kv_heads", "kv_lora_ranks", "chunks")
        problems = [f"{k}=[] needs at least one value" for k in lists if not getattr(self, k)]
        for k in sizes:
            if min(getattr(self, k), default=1) < 1:
                problems.append(f"{k}={getattr(self, k)} must all be positive")
        for k in ("iters", "repeats"):
            if getattr(self, k) < 1:
                problems.append(f"{k}={getattr(self, k)} must be positive")
        for k in ("warmup", "recompute_max_batch"):
            if getattr(self, k) < 0:
                problems.append(f"{k}={getattr(self, k)} must not be negative")
        return problems


# GPT-2's shapes: layers, heads, width
GPT2_SHAPES = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-xl": (48, 25, 1600),
}


class RandomBatches:
    """train.py's batches, of random tokens: a training step's speed does not depend on them."""

    def __init__(self, base: TrainConfig, vocab_size: int, device: str) -> None:
        self.shape = (base.batch_size, base.block_size + 1)
        self.vocab_size = vocab_size
        self.device = device

    def train(self, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.randint(0, self.vocab_size, self.shape, device=self.device)
        return buf[:, :-1], buf[:, 1:]


def bench_train(cfg: BenchConfig, base: TrainConfig, mcfg: GPTConfig, device: str) -> list[dict]:
    """train.py's training step for each dtype x compile: ms/iter (the median after the warm-up),
    tokens/s and MFU, on random tokens."""
    device_type = runtime.device_type(device)
    batches = RandomBatches(base, mcfg.vocab_size, device)
    if device_type == "cpu":
        keep_freed_memory()  # as train.py does
    rows = []
    for dtype_name in cfg.dtypes:
        dtype = resolve_dtype(dtype_name, device_type, mcfg.n_embd)[0]
        peak = base.peak_flops or peak_flops(device, dtype)
        rules = cfg.delta_rules if mcfg.recurrent_layers else [None]
        settings = itertools.product(cfg.compiles, cfg.chunks or [None], rules)
        for compiled, chunk, rule in settings:
            # the recurrent layers' rule on the kernel or the torch path, traced anew (where
            # something compiled before: importing torch._dynamo to reset nothing is 1.2 s)
            delta_rule_kernel.Build.off = rule == "torch"
            if "torch._dynamo" in sys.modules:
                torch._dynamo.reset()
            # a fresh model and its optimizer, as train.py makes them
            torch.manual_seed(base.seed)
            raw = GPT(mcfg).to(device)
            for block, kind in zip(raw.transformer.h, mcfg.layer_kinds, strict=True):
                if chunk and kind.chunk:
                    block.attn.chunk = chunk
            step = training_step(raw, base, batches, device, dtype, compiled)
            # the timed iterations, the warm-up ones (where compilation happens) left out
            times, loss = timed_steps(step, cfg.warmup + cfg.iters, device)
            dt = statistics.median(times[cfg.warmup :])
            if cfg.profile:
                profile_steps(step, device)
            row = train_row(raw, base, device, dtype_name, compiled, dt, loss, peak)
            if chunked(mcfg):
                row["chunk"] = chunk or max(kind.chunk or 0 for kind in mcfg.layer_kinds)
            if rule is not None:
                row["delta_rule"] = rule if delta_rule_kernel.available() else "torch"
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def training_step(
    raw: GPT,
    base: TrainConfig,
    batches: RandomBatches,
    device: str,
    dtype: torch.dtype,
    compiled: bool,
) -> Callable[[int], torch.Tensor]:
    """train.py's train_step on raw (compiled, if asked) with its optimizer and gradient scaler:
    a function of the iteration that returns its loss."""
    device_type = runtime.device_type(device)
    betas = (base.beta1, base.beta2)
    opt = raw.configure_optimizers(base.weight_decay, base.learning_rate, betas, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    model = torch.compile(raw) if compiled else raw
    dist = Dist(0, 0, 1, device, True)

    def step(it: int) -> torch.Tensor:
        amp = autocast(device_type, dtype)
        accumulation = base.gradient_accumulation_steps
        return train_step(
            model, raw, opt, scaler, batches, it, dist, accumulation, amp, base.grad_clip
        )[0]

    return step


def timed_steps(
    step: Callable[[int], torch.Tensor], iters: int, device: str
) -> tuple[list[float], float]:
    """Each of iters steps' seconds (its loss read back, the device synchronized), and the last
    step's loss."""
    times = []
    for it in range(iters):
        t0 = time.perf_counter()
        loss = step(it).item()
        runtime.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times, loss


def profile_steps(step: Callable[[int], torch.Tensor], device: str) -> None:
    """5 more steps under torch.profiler, its 40 costliest ops (by input shape) printed."""
    device_type = runtime.device_type(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for it in range(5):
            step(it)
        runtime.synchronize(device)
    sort = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    # by input shape: which of an op's calls cost (a layer's products apart from Muon's)
    ops = prof.key_averages(group_by_input_shape=True)
    print(ops.table(sort_by=sort, row_limit=40, max_shapes_column_width=70), flush=True)


def train_row(
    raw: GPT,
    base: TrainConfig,
    device: str,
    dtype_name: str,
    compiled: bool,
    dt: float,
    loss: float,
    peak: float | None,
) -> dict:
    """A training setting's row: dt seconds a step, its tokens/s, FLOPs and MFU against peak, the
    last step's loss."""
    tokens_per_iter = base.gradient_accumulation_steps * base.batch_size * base.block_size
    mfu = raw.estimate_mfu(tokens_per_iter, dt, peak, base.block_size) if peak else None
    return {
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


def bench_decode(cfg: BenchConfig, base: GPTConfig, device: str, dtype: torch.dtype) -> list[dict]:
    """Greedy decoding from a 1-token prompt, with the KV cache and (up to recompute_max_batch)
    without: tokens/s, prefill and step times, for each variant x batch x new_tokens."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    # a model with no attention layer has no K/V heads to vary (main refuses kv_heads for it)
    kv_heads = (cfg.kv_heads or default_kv_heads(base.n_head)) if base.attends else [base.n_head]
    shapes = [dataclasses.replace(base, n_kv_head=g) for g in kv_heads]
    shapes += [dataclasses.replace(base, kv_lora_rank=r) for r in cfg.kv_lora_ranks]
    for mcfg in shapes:
        model = GPT(mcfg).to(device=device, dtype=dtype).eval()
        for m in model.modules():
            if isinstance(m, Linear) and not cfg.linear_split:
                m.split_max_rows = 0
        weight_bytes = sum(
            m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear)
        )
        for batch in cfg.batch_sizes:
            # warm-up (with compile_step, its compilation for this batch size)
            timed_decode(model, batch, 16, True, gen, cfg.compile_step)
            for n in cfg.new_tokens:
                row = decode_row(cfg, model, batch, n, weight_bytes, dtype, gen)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def decode_row(
    cfg: BenchConfig,
    model: GPT,
    batch: int,
    n: int,
    weight_bytes: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> dict:
    """One setting's row: n new tokens for batch rows, the median of cfg.repeats cached runs, and
    one recomputing run where batch <= cfg.recompute_max_batch."""
    mcfg = model.config
    ctx = min(n, mcfg.block_size)  # positions cached at the end
    row = {
        "mode": "decode",
        "attention": mcfg.attention_label,  # none where every layer is recurrent
        "layers": mcfg.layer_letters,  # L global, S local, D Gated DeltaNet
        "n_kv_head": mcfg.n_kv_head,
        "kv_lora_rank": mcfg.kv_lora_rank,
        "batch": batch,
        "compile_step": cfg.compile_step,
        "new_tokens": n,
        "kv_cache_bytes": mcfg.kv_cache_bytes(batch, ctx, dtype),
        "weight_bytes": weight_bytes,
    }
    # the cached run that ended in the median time
    runs = [timed_decode(model, batch, n, True, gen, cfg.compile_step) for _ in range(cfg.repeats)]
    stamps = sorted(runs, key=lambda s: s[-1])[len(runs) // 2]
    row |= {
        "cache_tok_s": batch * n / stamps[-1],
        "prefill_ms": 1000 * stamps[0],
        "step_ms_at_100": step_ms(stamps, 100) if n > 100 else None,
        "step_ms_at_end": step_ms(stamps, n),
    }
    # a step at the end reads every weight once and the whole cache once
    read = weight_bytes + row["kv_cache_bytes"]
    row["gb_s_at_end"] = read / row["step_ms_at_end"] / 1e6
    if batch <= cfg.recompute_max_batch:
        recompute_s = timed_decode(model, batch, n, False, gen)[-1]
        row["recompute_tok_s"] = batch * n / recompute_s
        row["speedup"] = row["cache_tok_s"] / row["recompute_tok_s"]
    return row


def bench_memory(world_sizes: list[int]) -> list[dict]:
    """GiB one process holds for fp32 weights, gradients and AdamW's moments: DDP's whole copy, and
    FSDP's shards at each world size (sharding.per_rank_bytes: fully_shard on the meta device, no
    memory or GPU needed)."""
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
    """The benchmark's machine and model, on stderr."""
    line = (
        f"# {mode} benchmark on {device} ({torch.get_num_threads()} threads), torch "
        f"{torch.__version__}, {mcfg.n_layer} layers, {mcfg.n_head} heads, {mcfg.n_embd} wide, "
        f"vocab {mcfg.vocab_size}"
    )
    if mcfg.window:
        line += f", window {mcfg.window} in layers {mcfg.local_layers}"
    print(line, file=sys.stderr)


def bench_int8(cfg: BenchConfig, base: TrainConfig) -> list[dict]:
    """The trained checkpoint in base.out_dir in fp32 and with int8 weights (smallgpt/quantize.py):
    val loss over eval_iters batches of its dataset, the share of positions where the two predict
    the same next token (on those batches), greedy continuations of 4 val prompts (the share of
    tokens equal to fp32's), and batch-1 decoding tokens/s."""
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
    n = cfg.new_tokens[0]
    gen = torch.Generator().manual_seed(0)
    rows = []
    greedy = {}  # each model's greedy tokens
    picks = {}  # each model's top token at each position of the val batches
    val = [batches.eval("val", k) for k in range(base.eval_iters)]  # read once, for both models
    with torch.inference_mode():
        for name, m in models.items():
            # one pass: each position's next token and the val loss (logits are not kept:
            # vocab-sized)
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
    cfg = parse_config(BenchConfig, ours)
    base = parse_config(TrainConfig, train_args)
    # the flags given, bench.py's and train.py's: each must be one the mode reads
    flags = ours + [arg for arg in train_args if arg.startswith("--")]
    if problems := unread_flags(cfg.mode, flags):
        raise UserError("; ".join(problems))
    return cfg, base, train_args


def unread_flags(mode: str, flags: list[str]) -> list[str]:
    """A line for each --key=value flag that mode does not read (MODES), naming what it measures
    and the key it reads instead or the modes that read this one."""
    problems = []
    reads = MODES[mode].reads
    for flag in flags:
        key = flag[2:].split("=", 1)[0]
        if key == "mode" or key in reads:
            continue
        if INSTEAD.get(key) in reads:
            hint = f"it reads --{INSTEAD[key]}"
        else:
            readers = [name for name, other in MODES.items() if key in other.reads]
            if len(readers) > 1:  # 'train, decode or hf'
                readers = [", ".join(readers[:-1]), readers[-1]]
            hint = f"--mode={' or '.join(readers)} reads it"
        problems.append(
            f"{flag} is not read by --mode={mode}, which measures {MODES[mode].measures} "
            f"({hint}): leave it out"
        )
    return problems


# each mode's benchmark and its table, called with (cfg, base, train_args, device, mcfg): the
# bench's keys, train.py's, train.py's flags as given, the device, and the model they describe


def chunked(mcfg: GPTConfig) -> bool:
    """Whether some layer's kind runs in chunks (LayerKind.chunk)."""
    return any(kind.chunk for kind in mcfg.layer_kinds)


def run_train(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    if cfg.chunks and not chunked(mcfg):
        kinds = [kind for kind in LAYER_KINDS.values() if kind.chunk]
        names = " or ".join(kind.name for kind in kinds)
        letter = kinds[0].letter
        raise UserError(
            f"chunks={cfg.chunks} sizes {names} layers' chunks and this model has none: give "
            f"--layer_pattern with {letter} (e.g. {3 * letter}L), or leave chunks out"
        )
    rows = bench_train(cfg, base, mcfg, device)
    columns = {
        "dtype": "dtype",
        "compile": "compile",
        **({"chunk": "chunk"} if chunked(mcfg) else {}),
        **({"delta_rule": "delta rule"} if mcfg.recurrent_layers else {}),
        "ms_per_iter": "ms/iter",
        "tokens_per_s": "tokens/s",
        "mfu_pct": "MFU %",
        "peak_tflops": "peak TFLOP/s",
        "loss": "loss",
    }
    print(table(rows, columns))


def run_delta(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    if not delta_rule_kernel.available():
        raise UserError(
            "--mode=delta times the delta-rule CPU kernel against the torch path, and the kernel "
            "does not run here (SMALLGPT_DELTA_RULE=torch, or it could not be built: see above)"
        )
    B, T, H = base.batch_size, base.block_size, mcfg.n_head
    rows = bench_delta.bench_rule(B, H, T, mcfg.head_dim, cfg.warmup, cfg.iters, base.seed)
    for row in rows:
        print(json.dumps(row), flush=True)
    columns = {
        "shape": "T x B",
        "decay": "decay",
        "path": "path",
        "fwd_ms": "fwd ms",
        "fwd_bwd_ms": "fwd+bwd ms",
        "fwd_speedup": "fwd speed-up",
        "fwd_bwd_speedup": "fwd+bwd speed-up",
    }
    print(table(rows, columns))


def run_decode(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    dtype = resolve_dtype(base.dtype, device, training=False)[0]
    rows = bench_decode(cfg, mcfg, device, dtype)
    columns = {
        "attention": "attention",
        **({"layers": "layers"} if mcfg.recurrent_layers else {}),
        "n_kv_head": "n_kv_head",
        "kv_lora_rank": "kv_lora_rank",
        "batch": "batch",
        **({"compile_step": "compiled step"} if cfg.compile_step else {}),
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


def run_memory(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    rows = bench_memory(cfg.world_sizes)
    columns = {"model": "model", "params": "parameters", "ddp_gib": "DDP GiB / process"}
    for world in cfg.world_sizes:
        columns[f"fsdp_{world}_gib"] = f"FSDP x{world} GiB / process"
    print(table(rows, columns))


def run_int8(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    rows = bench_int8(cfg, base)
    columns = {
        "weights": "weights",
        "weight_bytes": "bytes",
        "val_loss": "val loss",
        "top1_agreement": "next-token agreement",
        "greedy_agreement": "greedy tokens as fp32",
        "eager_tok_s": "eager tok/s",
        "compiled_tok_s": "compiled tok/s",
    }
    print(table(rows, columns))


def run_hf(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    rows = bench_peers.bench_hf(
        mcfg, cfg.new_tokens, cfg.dtypes, cfg.repeats, device, cfg.llama_cpp
    )
    columns = {
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
    }
    print(table(rows, columns))


def run_nanogpt(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    # our step at nanoGPT's 6x384 shape, in the dtype autocast picks on this device
    step = parse_config(
        TrainConfig, [*bench_peers.STEP_SHAPE, f"--device={device}", "--vocab_size=65"]
    )
    dtype = str(resolve_dtype("auto", device, step.n_embd)[0]).removeprefix("torch.")

    def our_step_ms() -> dict[bool, float]:
        step_cfg = dataclasses.replace(cfg, dtypes=[dtype])
        rows = bench_train(step_cfg, step, step.model_config(65), device)
        return {r["compile"]: r["ms_per_iter"] for r in rows}

    rows = bench_peers.bench_nanogpt(cfg.nanogpt_dir, base.dataset, train_args, device, our_step_ms)
    print(f"(ours: the 6x384 step in {dtype} autocast)")
    print(table(rows[:1]) + "\n\n" + table(rows[1:]))


def run_gguf(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    rows = bench_peers.bench_gguf(base.out_dir, cfg.llama_cpp, cfg.prompt, cfg.new_tokens[0])
    if rows and not rows[0]["same_text"]:
        raise SystemExit(
            f"error: llama.cpp's greedy text differs from ours after "
            f"{rows[0]['chars_agreeing']} characters"
        )
    print(table(rows) if rows else "")


def run_recipes(
    cfg: BenchConfig, base: TrainConfig, train_args: list[str], device: str, mcfg: GPTConfig
) -> None:
    rows = bench_peers.bench_recipes(cfg.configs, train_args)
    columns = {
        "config": "config",
        "iters": "iterations",
        "val_loss": "final val loss",
        "eval_iters": "eval batches",
        "wall_s": "wall s (whole process)",
        "vs_first": "vs first",
    }
    print(table(rows, columns))


class Mode(NamedTuple):
    """A mode: its benchmark and table, what it measures (as a refusal says it), and the keys it
    reads, bench.py's and train.py's (a flag of any other is refused)."""

    run: Callable[[BenchConfig, TrainConfig, list[str], str, GPTConfig], None]
    measures: str
    reads: frozenset[str]


# the keys of a fresh model of train.py's keys (random weights) on its device
MODEL = frozenset(GPTConfig.__dataclass_fields__) | {"dataset", "device"}
# and of train.py's step with AdamW on random batches
STEP = MODEL | {
    "batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "seed",
    "peak_flops",
}
# train.py's keys that a mode running train.py passes on (in an out_dir of its own)
TRAIN_FLAGS = frozenset(TrainConfig.__dataclass_fields__) - {"out_dir"}
# train.py's keys and the lists that other modes time each of, one for the other: a refusal
# names the one the mode reads
PAIRS = {
    "compile": "compiles",
    "dtype": "dtypes",
    "n_kv_head": "kv_heads",
    "kv_lora_rank": "kv_lora_ranks",
}
INSTEAD = PAIRS | {many: one for one, many in PAIRS.items()}
# decode's own keys, and train.py's dtype: the models it times are in the one dtype
DECODE_KEYS = {
    "compile_step",
    "kv_heads",
    "kv_lora_ranks",
    "new_tokens",
    "batch_sizes",
    "recompute_max_batch",
    "repeats",
    "linear_split",
    "dtype",
}
MODES = {
    "train": Mode(
        run_train,
        "train.py's step on a fresh model of train.py's keys",
        STEP | {"compiles", "dtypes", "warmup", "iters", "profile", "chunks", "delta_rules"},
    ),
    "delta": Mode(
        run_delta,
        "the delta rule alone, the CPU kernel against the torch path",
        frozenset({"batch_size", "block_size", "n_head", "n_embd", "seed", "warmup", "iters"}),
    ),
    "decode": Mode(
        run_decode,
        "decoding by fresh models of train.py's keys, not a run",
        (MODEL - {"n_kv_head", "kv_lora_rank"}) | DECODE_KEYS,
    ),
    "memory": Mode(run_memory, "the bytes of GPT-2's shapes", frozenset({"world_sizes"})),
    "int8": Mode(
        run_int8,
        "out_dir's run with int8 weights",
        frozenset({"out_dir", "dataset", "batch_size", "eval_iters", "seed", "new_tokens"}),
    ),
    "hf": Mode(
        run_hf,
        "a fresh GPT-2 of train.py's sizes against Hugging Face's",
        frozenset({"n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dataset", "device"})
        | {"new_tokens", "dtypes", "repeats", "llama_cpp"},
    ),
    "nanogpt": Mode(
        run_nanogpt,
        "train.py runs against nanoGPT's",
        TRAIN_FLAGS | {"nanogpt_dir", "compiles", "warmup", "iters", "profile"},
    ),
    "gguf": Mode(
        run_gguf,
        "out_dir's run in llama.cpp",
        frozenset({"out_dir", "llama_cpp", "prompt", "new_tokens"}),
    ),
    "recipes": Mode(run_recipes, "train.py runs of the configs", TRAIN_FLAGS | {"configs"}),
}
# the modes that read their model from a checkpoint or config files, not from train.py's keys
OWN_MODEL = ("int8", "gguf", "recipes")


def main(config: tuple[BenchConfig, TrainConfig, list[str]]) -> None:
    cfg, base, train_args = config
    device = resolve_device(base.device, 0)
    mcfg = base.model_config(vocab_size=vocab_size_of(base.dataset) or 50304)
    if not mcfg.attends and (cfg.kv_heads or cfg.kv_lora_ranks):
        raise UserError(
            f"kv_heads={cfg.kv_heads}, kv_lora_ranks={cfg.kv_lora_ranks} vary the attention "
            f"layers' K/V and {mcfg.pattern_key}={getattr(mcfg, mcfg.pattern_key)!r} on "
            f"n_layer={mcfg.n_layer} has none: leave them out"
        )
    if bad := [k for k in cfg.kv_heads if mcfg.n_head % k]:
        raise UserError(
            f"kv_heads={cfg.kv_heads}: n_head={mcfg.n_head} is not divisible by n_kv_head={bad[0]}"
        )
    # Hugging Face's GPT-2 cannot slide its window
    if cfg.mode == "hf" and max(cfg.new_tokens) >= mcfg.block_size:
        raise UserError(
            f"new_tokens={cfg.new_tokens}: --mode=hf decodes up to block_size={mcfg.block_size} "
            f"positions (a 1-token prompt), so each must be below it"
        )
    if cfg.mode not in OWN_MODEL:
        header(cfg.mode, device, mcfg)
    MODES[cfg.mode].run(cfg, base, train_args, device, mcfg)


if __name__ == "__main__":
    run_cli(main, parse, keys=(BenchConfig, TrainConfig))
