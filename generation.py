"""Generation from a GPT (model.py): sampling, left padding of unequal prompts, the streaming decode loop with its
sliding window, and the two faster one-token steps: a CUDA graph replayed (CUDA), and one compiled ahead of time by
AOTInductor (CPU). GPT.generate and GPT.stream call these.
"""

import hashlib
import io
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
from torch._inductor.runtime.cache_dir_utils import cache_dir

from atomic import atomic_open
from fast_paths import Linear, prepare_splits


def sample_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from logits (B, V): temperature 0 is argmax; top_k and top_p (nucleus) restrict the
    candidates to the k most likely, and to the fewest whose probability sums to at least top_p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: list[list[int]], pad_token: int = 0, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists of unequal length into idx (B, max_len) and pad (B,), the pad count of each row."""
    width = max(len(p) for p in prompts)
    idx = torch.tensor([[pad_token] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long, device=device)
    return idx, pad


class CUDAGraphStep:
    """GPT.decode_static captured once as a CUDA graph and replayed for each token, which removes the step's kernel
    launches from Python (README "On a GPU"). Bound to one KVCache (its tensors' addresses); the inputs are copied
    into the graph's own."""

    def __init__(self, model: nn.Module, kv_cache: object, batch_size: int) -> None:
        device, self.cache = kv_cache.k.device, kv_cache
        self.idx = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.pos = torch.full((1,), kv_cache.pos, dtype=torch.long, device=device)  # warm-up writes the next slot
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels are chosen and workspaces allocated outside the capture
                model.decode_static(self.idx, self.pos, kv_cache)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.decode_static(self.idx, self.pos, kv_cache)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, 1, vocab) of idx (B, 1) at the cache's position, which advances by one, as in GPT.forward."""
        self.idx.copy_(idx)
        self.pos.fill_(self.cache.pos)
        self.graph.replay()
        self.cache.pos += 1
        return self.logits


class SplitStep(nn.Module):
    """GPT.decode_static of idx at the last of positions (arange(length)), attending over all of them in the K/V
    tensors k and v. The split weights that fast_paths.Linear made for this thread count (prepare_splits first) are
    buffers here, so that export sees them as weights of the step, as it sees the model's parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.linears = [m for m in model.modules() if isinstance(m, Linear) and m.split is not None]
        for i, m in enumerate(self.linears):
            rest = m.split.rest or (None, None)
            for name, t in zip("wbrs", (m.split.weight, m.split.bias, *rest)):
                if t is not None:  # (export miscounts buffers that are None)
                    self.register_buffer(f"split{i}_{name}", t, persistent=False)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits (B, 1, vocab) and each row's greedy token (B,)."""
        made = [m.split for m in self.linears]
        try:
            for i, m in enumerate(self.linears):
                w, b, rw, rb = (getattr(self, f"split{i}_{name}", None) for name in "wbrs")
                m.split = m.split._replace(weight=w, bias=b, rest=None if rw is None else (rw, rb))
            logits = self.model.decode_static(idx, positions[-1:], SimpleNamespace(k=k, v=v), positions.size(0))
            return logits, logits[:, -1].argmax(dim=-1)  # inside the graph: ~10x faster than ATen's CPU argmax
        finally:
            for m, split in zip(self.linears, made):
                m.split = split

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor the step reads besides its inputs, by name (a tied weight under each of its names)."""
        return dict(self.named_parameters(remove_duplicate=False)) | dict(self.named_buffers(remove_duplicate=False))


def compile_step(step: SplitStep, idx: torch.Tensor, k: torch.Tensor, block_size: int) -> Any:
    """step exported for inputs shaped as idx and as the K/V cache k, with any number of filled positions and of
    cache positions in [2, block_size] (the first at most the second), compiled by AOTInductor with its weights left
    out (the caller lends it the model's own: CompiledStep), loaded. The package is kept in inductor's cache folder
    under a hash of the exported program, for later processes."""
    top = max(block_size, 3)
    length, cache = torch.export.Dim("length", min=2, max=top), torch.export.Dim("cache", min=2, max=top)
    # exported on a small cache of its own, 2 of its 3 positions filled: sizes that can tell the two apart
    example = (idx, torch.arange(2, device=idx.device), *[k.new_zeros(*k.shape[:3], 3, k.size(4)) for _ in "kv"])
    program = torch.export.export(step, example, dynamic_shapes=(None, {0: length}, {3: cache}, {3: cache}),
                                  strict=False)
    what = f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} {torch.get_num_threads()} threads\n{program}"
    path = Path(cache_dir()) / "smallgpt" / f"step-{hashlib.sha256(what.encode()).hexdigest()[:40]}.pt2"
    if path.exists():
        try:
            return torch._inductor.aoti_load_package(str(path))
        except RuntimeError:  # unreadable: compiled again below
            pass
    package = io.BytesIO()
    with warnings.catch_warnings():  # torch pickling the program's tree specs: nothing the user can act on
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)`", FutureWarning)
        torch._inductor.aoti_compile_and_package(program, package_path=package,
                                                 inductor_configs={"aot_inductor.package_constants_in_so": False})
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path) as f:
        f.write(package.getvalue())
    return torch._inductor.aoti_load_package(package)


# Each model's compiled steps by what else their code depends on (CompiledStep.__call__), with the tensors last lent
STEPS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, tuple[Any, dict]]]" = weakref.WeakKeyDictionary()


class CompiledStep:
    """GPT.decode_static exported (torch.export) and compiled ahead of time by AOTInductor for the one-token steps on
    CPU: the step's ~300 small ops become a few fused C++ loops around fast_paths.Linear's split products, run from
    C++ with no Python or dynamo guards in between. Attention reads the filled cache positions only; their count and
    the cache's length are the dynamic sizes, so one compiled step serves every length and cache of a model at one
    batch size and thread count. It holds no weights: each CompiledStep lends it the model's tensors (no copies), so
    it reads them as they are at each step (README "Decoding (CPU)")."""

    def __init__(self, model: nn.Module, kv_cache: object) -> None:
        self.model, self.cache = model, kv_cache
        self.positions = torch.arange(kv_cache.max_len, device=kv_cache.k.device)
        self.idx = torch.zeros(kv_cache.k.size(1), 1, dtype=torch.long, device=kv_cache.k.device)
        prepare_splits(model)
        self.step = SplitStep(model)
        self.run: Callable | None = None

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, 1, vocab) of idx (B, 1) at the cache's position, which advances by one, as in GPT.forward, and
        each row's greedy token (B,) where the compiled step computed it (None after an eager step)."""
        length = self.cache.pos + 1
        if length < 2:  # the one length export cannot leave dynamic (it specializes sizes 0 and 1): eager
            return self.model(idx, kv_cache=self.cache)[0], None
        if self.run is None:  # the step's code depends on these besides the model: compiled once for each
            weights = self.step.weights()
            key = (tuple(self.idx.shape), self.cache.k.dtype, torch.get_num_threads(),
                   tuple((name, t.shape, t.stride(), t.dtype) for name, t in weights.items()))
            steps = STEPS.setdefault(self.model, {})
            package = steps[key][0] if key in steps else compile_step(self.step, self.idx, self.cache.k,
                                                                         self.model.config.block_size)
            package.load_constants({name: weights[name] for name in package.get_constant_fqns()},
                                   check_full_update=True, user_managed=True)
            steps[key] = (package, weights)  # the step points into these tensors: kept while it may run
            self.run = package.loader.boxed_run
        logits, greedy = self.run([self.idx.copy_(idx), self.positions[:length], self.cache.k, self.cache.v])
        self.cache.pos += 1
        return logits, greedy


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError for sampling settings that mean nothing: temperature < 0, top_k < 1, top_p outside (0, 1]."""
    problems = [f"temperature={temperature} must be >= 0 (0 is greedy)"] * (temperature < 0)
    problems += [f"top_k={top_k} must be >= 1 (or None)"] * (top_k is not None and top_k < 1)
    problems += [f"top_p={top_p} must be in (0, 1] (or None)"] * (top_p is not None and not 0 < top_p <= 1)
    if problems:
        raise ValueError("; ".join(problems))


def window(tokens: torch.Tensor, start: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every row's window tokens[b, start[b]:n] as one left-padded batch: idx (B, width) and pad (B,) (None: none)."""
    first = min(start)
    pad = [s - first for s in start]
    return tokens[:, first:n], torch.tensor(pad, device=tokens.device) if any(pad) else None


def refill_rows(model: nn.Module, kv_cache: object, tokens: torch.Tensor, rows: list[int], n: int, keep: int,
                pad: torch.Tensor | None) -> torch.Tensor:
    """The rows whose window slid get their new window but its newest token (tokens[b, n - keep:n - 1]) prefilled on
    their own and written into the batch's cache right-aligned at its position, the slots before it hidden by pad;
    the next one-token step appends token n - 1 to every row. Returns the new pad."""
    pos, w = kv_cache.pos, keep - 1
    pad = torch.zeros(tokens.size(0), dtype=torch.long, device=tokens.device) if pad is None else pad.clone()
    at = torch.tensor(rows, device=tokens.device)
    if w > 0:
        own = model.make_kv_cache(len(rows), w)
        model(tokens[at, n - keep:n - 1], kv_cache=own)
        kv_cache.k[:, at, :, pos - w:pos] = own.k
        kv_cache.v[:, at, :, pos - w:pos] = own.v
    pad[at] = pos - w
    return pad


def compact(kv_cache: object, pad: torch.Tensor | None) -> torch.Tensor | None:
    """A full cache moved left by the pad every row has (slots no row sees), making room for the next position."""
    shift = 0 if pad is None else int(pad.min())
    assert shift > 0, "a row's window fills the cache: it should have slid"
    end = kv_cache.pos
    for t in (kv_cache.k, kv_cache.v):
        t[..., :end - shift, :] = t[..., shift:end, :].clone()
    kv_cache.pos -= shift
    pad = pad - shift
    return pad if bool(pad.any()) else None


@torch.inference_mode()
def stream(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, eos: int | None = None, use_cache: bool = True,
           pad: torch.Tensor | None = None, generator: torch.Generator | None = None, cuda_graph: bool = True,
           compile_step: bool = False) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), up to max_new_tokens times, from a GPT; see generate()."""
    check_sampling(temperature, top_k, top_p)
    B, T0 = idx.shape
    bs = model.config.block_size
    keep = max(1, bs // 2)
    tokens = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)
    tokens[:, :T0] = idx
    # row b's window, what the model sees of it, is tokens[b, start[b]:n]: its newest real tokens, at most bs
    start = [max(p, T0 - bs) for p in ([0] * B if pad is None else pad.tolist())]
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    kv_cache, cache_pad, graph = None, None, None
    for n in range(T0, T0 + max_new_tokens):
        greedy = None  # the greedy tokens, where the step computed them
        slid = [b for b in range(B) if n - start[b] > bs]  # full: keep the newest `keep` tokens, prefill them again
        for b in slid:
            start[b] = n - keep
        if not use_cache:
            x, x_pad = window(tokens, start, n)
            logits, _ = model(x, pad=x_pad)
        elif kv_cache is None or len(slid) == B:  # the first step, or every row slid: one prefill for all
            kv_cache = kv_cache or model.make_kv_cache(B, min(bs, T0 + max_new_tokens - 1 - min(start)))
            kv_cache.pos = 0
            x, cache_pad = window(tokens, start, n)
            logits, _ = model(x, kv_cache=kv_cache, pad=cache_pad)
        else:
            if slid:
                cache_pad = refill_rows(model, kv_cache, tokens, slid, n, keep, cache_pad)
            if kv_cache.pos == kv_cache.max_len:
                cache_pad = compact(kv_cache, cache_pad)
            if cuda_graph and idx.is_cuda and cache_pad is None:
                graph = graph or CUDAGraphStep(model, kv_cache, B)
                logits = graph(tokens[:, n - 1:n])
            elif compile_step and not idx.is_cuda and cache_pad is None:
                graph = graph or CompiledStep(model, kv_cache)
                logits, greedy = graph(tokens[:, n - 1:n])
            else:
                logits, _ = model(tokens[:, n - 1:n], kv_cache=kv_cache, pad=cache_pad)
        nxt = greedy if greedy is not None and temperature == 0 else \
            sample_logits(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        if eos is not None:
            nxt = torch.where(done, eos, nxt)
            done |= nxt == eos
        tokens[:, n] = nxt
        yield nxt
        if eos is not None and bool(done.all()):
            return


def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, **options: object) -> torch.Tensor:
    """Continue idx (B, T) by up to max_new_tokens tokens from a GPT; returns (B, T + new tokens).

    The cache is prefilled once and then fed one token per step; use_cache=False recomputes the whole window every
    step (same tokens, slower). Rows of unequal length are left-padded, pad (B,) counting each row's pad tokens (see
    left_pad). temperature 0 is greedy; top_k, top_p and generator as in sample_logits. A row that emits eos keeps
    emitting eos; generation stops when every row has. When a row's context reaches block_size its window slides:
    its newest block_size // 2 tokens are kept and prefilled again, so every row of a batch gets exactly what it
    would alone. On CUDA each one-token step replays a CUDA graph of decode_static (unless cuda_graph=False) while
    no row is padded; on CPU, compile_step=True runs it compiled (CompiledStep); a padded batch takes the eager step.
    """
    new = list(stream(model, idx, max_new_tokens, **options))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx
