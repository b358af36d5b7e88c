"""Where a script runs and how: device, dtype and autocast, the torchrun process group, the device's
peak FLOP/s, the CPU allocator setting, each rank's random generators, and waiting for a device
before reading a clock. train.py, sample.py, bench.py and compare.py share these.
"""

import ctypes
import gc
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from smallgpt.errors import UserError

# Dense peak FLOP/s by GPU name from datasheets, without sparsity: (bf16/fp16 tensor cores, plain
# fp32). The longest name found in torch.cuda.get_device_name() wins (gpu_peak_flops): "A100" over
# "A10", "H100 PCIe" over "H100" (the SXM).
GPU_PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "H100 PCIe": (756e12, 51e12),
    "H100 NVL": (835e12, 60e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "L40": (181e12, 90.5e12),
    "L4": (121e12, 30.3e12),
    "A10": (125e12, 31.2e12),
    "4090": (165e12, 82.6e12),
    "3090": (71e12, 35.6e12),
    "V100": (125e12, 15.7e12),
    "T4": (65e12, 8.1e12),
}


@dataclass(slots=True)
class Dist:
    """This process's place in a torchrun job (one process: rank 0 of 1)."""

    rank: int
    local_rank: int
    world_size: int
    device: str
    is_master: bool

    @property
    def device_type(self) -> str:
        return device_type(self.device)


def device_type(device: str) -> str:
    """'cuda' for 'cuda:1', 'cpu' for 'cpu': what autocast and the dtype choice go by."""
    return torch.device(device).type


def resolve_device(name: str, local_rank: int = 0) -> str:
    """'auto' (CUDA, else MPS, else CPU), 'cpu', 'cuda', 'cuda:N' or 'mps', checked against this
    machine."""
    if name == "auto":
        if torch.cuda.is_available():
            return f"cuda:{local_rank}"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
        raise UserError(f"device={name!r} must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(
            f"device={name!r} but this machine has no CUDA GPU that torch can use; use --device=cpu"
        )
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("device='mps' but MPS is not available here; use --device=cpu")
    return f"cuda:{local_rank}" if name == "cuda" else name


def setup_distributed(device: str, alone: bool = False) -> Dist:
    """Join the torchrun process group when RANK/LOCAL_RANK/WORLD_SIZE are set (nccl on CUDA, gloo
    otherwise); alone: a process started without torchrun makes a group of its own (FSDP needs
    one)."""
    torchrun = "RANK" in os.environ
    if not torchrun and not alone:
        return Dist(0, 0, 1, resolve_device(device, 0), True)
    rank = 0
    local_rank = 0
    world = 1
    if torchrun:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        world = int(os.environ["WORLD_SIZE"])
    dev = resolve_device(device, local_rank)
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    own = {} if torchrun else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    try:
        dist.init_process_group(backend="nccl" if dev.startswith("cuda") else "gloo", **own)
    except RuntimeError as e:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise
        raise UserError(
            f"{e}; a torchrun restart can read the previous attempt's addresses (pytorch issue "
            f"135712): launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        ) from e
    return Dist(rank, local_rank, world, dev, rank == 0)


def teardown_distributed() -> None:
    """Leave the process group and end its backend's threads here, not during the interpreter's
    exit, where a gloo worker thread that still releases a collective's tensors aborts the process
    ("terminate called without an active exception"). Under FSDP, device meshes that DTensor's
    caches keep hold the group: they let go of it first, so that destroying the group frees it."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    if "torch.distributed.device_mesh" in sys.modules:
        from torch.distributed.device_mesh import DeviceMesh

        for mesh in (o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)):
            getattr(mesh, "_pg_registry", {}).clear()
    gc.collect()  # the model's DTensors and the mesh they name, in reference cycles


# bf16 products this much faster than fp32's: a whole step gains (docs/performance-cpu.md)
BF16_MIN_SPEEDUP = 1.5


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a process computes and in what precision, decided once (place) and read by the rest."""

    device: str  # 'cpu', 'cuda:0', 'mps'
    dtype: torch.dtype
    why: str  # why this dtype, for the run's header

    @property
    def device_type(self) -> str:
        return device_type(self.device)

    def autocast(self) -> AbstractContextManager:
        return autocast(self.device, self.dtype)


def place(
    device: str,
    dtype: str,
    n_embd: int | None = None,
    compiled_decode: bool = False,
    training: bool = True,
) -> Placement:
    """The device ('auto' or a name, resolve_device) and the dtype ('auto' or a name, resolve_dtype)
    to run in."""
    resolved = resolve_device(device)
    return Placement(resolved, *resolve_dtype(dtype, resolved, n_embd, compiled_decode, training))


def resolve_dtype(
    name: str,
    device: str,
    n_embd: int | None = None,
    compiled_decode: bool = False,
    training: bool = True,
) -> tuple[torch.dtype, str]:
    """The dtype to run in on device ('cpu', 'cuda:1', or its type) and why. 'float32', 'bfloat16',
    'float16' as named (float16 trains on CUDA only, where a GradScaler runs; decoding needs none);
    'auto': bf16 on CUDA GPUs that have it; on a CPU that has bf16 instructions, bf16 for the
    compiled decode step (compiled_decode) and for training a model n_embd wide when this CPU's bf16
    products of that width measure at least BF16_MIN_SPEEDUP times faster than fp32's (some CPUs
    with the instructions are slower in bf16); float32 everywhere else."""
    kind = device_type(device)
    if name == "float16" and kind != "cuda" and training:
        raise UserError(
            f"dtype='float16' needs a GradScaler, which runs on CUDA only (device is {kind}); "
            f"use bfloat16 or float32"
        )
    if name != "auto":
        return getattr(torch, name), "as asked"
    if kind == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16, "a CUDA GPU with bf16"
    if kind == "cuda":
        return torch.float32, "a CUDA GPU without bf16"
    if kind != "cpu":
        return torch.float32, kind
    if not native_bf16():
        return torch.float32, "cpu without native bf16"
    if compiled_decode:
        return torch.bfloat16, "CPU with native bf16, compiled decode step"
    if n_embd is None:
        return torch.float32, "CPU with native bf16, decoding without the compiled step"
    speedup = bf16_speedup(n_embd)
    why = f"CPU with native bf16, bf16 products {speedup:.2f}x fp32's at n_embd {n_embd}"
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, why
    return torch.float32, why


def bf16_speedup(width: int, rows: int = 1024) -> float:
    """fp32's time over bf16's for the product of a (rows x width) and a (width x 4 width) matrix on
    this CPU, the best of three 20 ms probes each, taken in turn so that a busy spell of the machine
    cannot slow one dtype's probes alone (a training step's products are of this kind)."""
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG be
    x = torch.randn(rows, width, generator=gen)
    w = torch.randn(width, 4 * width, generator=gen)
    products = {
        dtype: lambda a=x.to(dtype), b=w.to(dtype): a @ b
        for dtype in (torch.float32, torch.bfloat16)
    }
    seconds: dict[torch.dtype, list[float]] = {dtype: [] for dtype in products}
    for _ in range(3):
        for dtype, product in products.items():
            seconds[dtype].append(seconds_per_call(product, probes=1, probe_s=0.02))
    return min(seconds[torch.float32]) / min(seconds[torch.bfloat16])


def seconds_per_call(fn: Callable[[], object], probes: int, probe_s: float) -> float:
    """fn's time per call on this CPU: after one warm-up call, the fastest of `probes` probes, each
    calling it for probe_s seconds."""
    fn()
    times = []
    for _ in range(probes):
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < probe_s:
            fn()
            n += 1
        times.append((time.perf_counter() - t0) / n)
    return min(times)


def autocast(device: str, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision in dtype on device (or its type), or nothing for float32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type(device), dtype=dtype)


def peak_flops(device: str, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s in dtype: the datasheet for known GPUs, the best of five short
    matmul probes on CPU, else None (then MFU is not reported; TrainConfig.peak_flops overrides all
    of this)."""
    if device.startswith("cuda"):
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device != "cpu":
        return None
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG be
    a = torch.randn(1024, 1024, generator=gen).to(dtype)
    return 2 * 1024**3 / seconds_per_call(lambda: a @ a, probes=5, probe_s=0.05)


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak of the GPU torch names `name` ('NVIDIA H100 PCIe'), by the longest
    known model in it (an H100 PCIe is not an SXM), in dtype (tensor cores for bf16/fp16, plain
    fp32); None if unknown."""
    key = max((k for k in GPU_PEAK_FLOPS if k in name), key=len, default=None)
    return None if key is None else GPU_PEAK_FLOPS[key][dtype == torch.float32]


def device_name(device: str) -> str:
    """What a measurement ran on, by name: the GPU's, or the CPU's model (Linux's /proc/cpuinfo,
    else the platform's processor type)."""
    if device_type(device) == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    if found:
        return found[1].strip()
    return platform.processor() or platform.machine()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 autocast pays
    off."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", cpuinfo.read_text()))


def keep_freed_memory() -> None:
    """With glibc, keep freed memory in the process instead of returning it to the system: a CPU
    training step frees its activations and allocates them again the next step, and returned memory
    comes back as fresh pages, one fault per 4 KiB (docs/performance-cpu.md). The cost: the process
    keeps its peak memory. A no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    # mallopt's parameters (malloc.h)
    m_trim_threshold = -1
    m_mmap_threshold = -3
    # blocks up to 32 MiB (glibc's maximum) come from the heap ...
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    # ... and the heap is not shrunk until 1 GiB of it is free
    libc.mallopt(m_trim_threshold, 2**30)


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on device (CUDA, MPS) before reading a clock; nothing to wait for on
    CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def seed_rank(seed: int, rank: int) -> None:
    """Seed torch's generators (dropout's) for a rank: each rank draws masks of its own, as one
    process draws new ones for each micro-batch. Weights (GPT.init_weights) and batches (Batches)
    have generators of their own."""
    torch.manual_seed(seed + rank)


def rng_states(d: Dist) -> list[dict]:
    """Every rank's random generator states (dropout), by rank, for an exact resume: a collective
    under torchrun (every rank calls it, rank 0 saves the list); batches need none (seeded per
    iteration)."""
    own = {"torch": torch.get_rng_state()}
    if d.device_type == "cuda":
        own["cuda"] = torch.cuda.get_rng_state_all()
    if d.world_size == 1:
        return [own]
    states: list = [None] * d.world_size
    dist.all_gather_object(states, own)
    return states


def set_rng_states(states: list[dict] | dict, d: Dist, seed: int) -> None:
    """This rank's generators as rng_states() left them in a checkpoint (CUDA's only on CUDA).
    Resumed on more processes, a rank the checkpoint has no states for starts as in a new run
    (seed_rank); a checkpoint from before per-rank states holds one dict, rank 0's."""
    states = [states] if isinstance(states, dict) else states
    if d.rank >= len(states):
        seed_rank(seed, d.rank)
        return
    own = states[d.rank]
    torch.set_rng_state(own["torch"].cpu())
    if "cuda" in own and d.device_type == "cuda":
        torch.cuda.set_rng_state_all([s.cpu() for s in own["cuda"]])


def stop_requested(signals: list[int], d: Dist, at_log: bool) -> bool:
    """Whether a signal asked the run to stop; under torchrun the ranks agree on it at log steps, so
    all stop together."""
    if d.world_size == 1:
        return bool(signals)
    if not at_log:
        return False
    flag = torch.tensor(float(bool(signals)), device=d.device)
    dist.all_reduce(flag)
    return flag.item() > 0
