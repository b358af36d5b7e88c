"""Generation from a GPT (model.py): sampling, left padding of unequal prompts, the streaming
decode loop with its sliding context (a row's tokens the model sees, at most block_size), and the
faster one-token step on CUDA, a CUDA graph replayed (the one on CPU, compiled ahead of time by
AOTInductor, is compiled_step.py's). The engine imports the model, never the reverse:
generate(model, idx, n). It reads and writes the cache only through KVCache's methods.
"""

import codecs
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from kv_cache import KVCache
from smallgpt.errors import UserError
from smallgpt.static_step import decode_static


def sample_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row from logits (B, V): temperature 0 is argmax; top_k and top_p
    (nucleus) restrict the candidates to the k most likely, and to the fewest whose probability
    sums to at least top_p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    logits = (
        logits - logits.amax(dim=-1, keepdim=True)
    ) / temperature  # the top one 0: no inf/inf at a tiny one
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # mass before this token already reaches top_p
        outside = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(
    prompts: list[list[int]], pad_token: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists of unequal length into idx (B, max_len) and pad (B,), the pad count
    of each row."""
    width = max(len(p) for p in prompts)
    idx = torch.tensor(
        [[pad_token] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device
    )
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long, device=device)
    return idx, pad


class CUDAGraphStep:
    """static_step.decode_static captured once as a CUDA graph and replayed for each token, which
    removes the step's kernel launches from Python (docs/gpu.md). Bound to one KVCache (its
    tensors' addresses); the inputs are copied into the graph's own."""

    def __init__(self, model: nn.Module, kv_cache: KVCache, batch_size: int) -> None:
        device = kv_cache.device
        self.cache = kv_cache
        self.idx = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.pos = torch.full(
            (1,), kv_cache.pos, dtype=torch.long, device=device
        )  # warm-up writes the next slot
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels are chosen and workspaces allocated outside the capture
                decode_static(model, self.idx, self.pos, kv_cache)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decode_static(model, self.idx, self.pos, kv_cache)

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Logits (B, 1, vocab) of idx (B, 1) at the cache's position, which advances by one, as
        in GPT.forward (and no greedy tokens: CompiledStep's are computed inside its step)."""
        self.idx.copy_(idx)
        self.pos.fill_(self.cache.pos)
        self.graph.replay()
        self.cache.pos += 1
        return self.logits, None


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError for sampling settings that mean nothing: temperature < 0, top_k < 1, top_p
    outside (0, 1]."""
    problems = [f"temperature={temperature} must be >= 0 (0 is greedy)"] * (temperature < 0)
    problems += [f"top_k={top_k} must be >= 1 (or None)"] * (top_k is not None and top_k < 1)
    problems += [f"top_p={top_p} must be in (0, 1] (or None)"] * (
        top_p is not None and not 0 < top_p <= 1
    )
    if problems:
        raise ValueError("; ".join(problems))


def context(
    tokens: torch.Tensor, start: list[int], n: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every row's context tokens[b, start[b]:n] (what the model sees of it) as one left-padded
    batch: idx (B, width) and pad (B,) (None: none)."""
    first = min(start)
    pad = [s - first for s in start]
    return tokens[:, first:n], torch.tensor(pad, device=tokens.device) if any(pad) else None


def refill_rows(
    model: nn.Module,
    kv_cache: KVCache,
    tokens: torch.Tensor,
    rows: list[int],
    n: int,
    keep: int,
    pad: torch.Tensor | None,
) -> torch.Tensor:
    """The rows whose context slid get their new context but its newest token (tokens[b, n -
    keep:n - 1]) prefilled on their own and written into the batch's cache right-aligned at its
    position, the slots before it hidden by pad; the next one-token step appends token n - 1 to
    every row; a local layer's ring gets the newest of them at their slots (the older ones that
    slots still hold are before the pad). Returns the new pad."""
    pos = kv_cache.pos
    w = keep - 1
    if pad is None:
        pad = torch.zeros(tokens.size(0), dtype=torch.long, device=tokens.device)
    else:
        pad = pad.clone()
    if w > 0:  # the rows' own context, prefilled alone, then written into the batch's cache
        own = model.make_kv_cache(len(rows), w)
        at = torch.tensor(rows, device=tokens.device)
        model(tokens[at, n - keep : n - 1], kv_cache=own)
        kv_cache.refill(rows, own)
    else:  # nothing kept before the next token: the rows start again (a recurrent state too)
        kv_cache.refill(rows, None)
    pad[rows] = pos - w
    return pad


def compact(kv_cache: KVCache, pad: torch.Tensor | None) -> torch.Tensor | None:
    """A full cache moved left by the pad every row has (slots no row sees), making room for the
    next position (KVCache.shift)."""
    shift = 0 if pad is None else int(pad.min())
    assert shift > 0, "a row's context fills the cache: it should have slid"
    kv_cache.shift(shift)
    pad = pad - shift
    return pad if bool(pad.any()) else None


@torch.inference_mode()
def stream(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos: int | None = None,
    use_cache: bool = True,
    pad: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    cuda_graph: bool = True,
    compile_step: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), up to max_new_tokens times, from a GPT; see
    generate()."""
    check_sampling(temperature, top_k, top_p)
    B, T0 = idx.shape
    bs = model.config.block_size
    keep = max(1, bs // 2)
    # the tokens so far, moved left when full (to what the contexts reach, at most bs + 1):
    # bounded however many are asked
    tokens = torch.empty(
        B, T0 + min(max_new_tokens, 2 * bs + 1), dtype=idx.dtype, device=idx.device
    )
    tokens[:, :T0] = idx
    # row b's context, what the model sees of it, is tokens[b, start[b]:n]: its newest real
    # tokens, at most bs
    start = [max(p, T0 - bs) for p in ([0] * B if pad is None else pad.tolist())]
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    cached = CachedSteps(model, T0 + max_new_tokens - 1, cuda_graph, compile_step)
    n = T0
    for _ in range(max_new_tokens):
        if n == tokens.size(1):  # full: keep what a context still reaches
            drop = min(start)
            tokens[:, : n - drop] = tokens[:, drop:n].clone()
            start = [s - drop for s in start]
            n -= drop
        # a context past block_size keeps its newest `keep` tokens, prefilled again
        slid = [b for b in range(B) if n - start[b] > bs]
        for b in slid:
            start[b] = n - keep
        greedy = None  # the greedy tokens, where the step computed them
        if use_cache:
            logits, greedy = cached(tokens, start, n, slid, keep)
        else:
            x, x_pad = context(tokens, start, n)
            logits, _ = model(x, pad=x_pad)
        if greedy is not None and temperature == 0:
            nxt = greedy
        else:
            nxt = sample_logits(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        if eos is not None:
            nxt = torch.where(done, eos, nxt)
            done |= nxt == eos
        tokens[:, n] = nxt
        n += 1
        yield nxt
        if eos is not None and bool(done.all()):
            return


class CachedSteps:
    """stream()'s steps through a KV cache: a prefill of every row's context (the first step, or
    when every row slid), then one token a row, after the rows that slid are refilled and a full
    cache compacted, on the faster step (fast_step) while no row is padded."""

    def __init__(
        self, model: nn.Module, longest: int, cuda_graph: bool, compile_step: bool
    ) -> None:
        self.model = model
        self.longest = longest  # positions a row can reach
        self.cuda_graph = cuda_graph
        self.compile_step = compile_step
        self.kv_cache: KVCache | None = None
        self.pad: torch.Tensor | None = None  # the cache's left padding of each row
        self.fast: Callable | None = None
        # whether fast_step was asked: once, since its answer (None on a CPU without compile)
        # holds for this cache, and asking reads every layer's kind
        self.fast_asked = False

    def __call__(
        self, tokens: torch.Tensor, start: list[int], n: int, slid: list[int], keep: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of the next token of every row, and the greedy tokens where the step
        computed them (None elsewhere)."""
        model = self.model
        bs = model.config.block_size
        if self.kv_cache is None or len(slid) == tokens.size(0):
            if self.kv_cache is None:
                length = min(bs, self.longest - min(start))
                self.kv_cache = model.make_kv_cache(tokens.size(0), length)
            self.kv_cache.pos = 0
            x, self.pad = context(tokens, start, n)
            return model(x, kv_cache=self.kv_cache, pad=self.pad)[0], None
        kv_cache = self.kv_cache
        if slid:
            self.pad = refill_rows(model, kv_cache, tokens, slid, n, keep, self.pad)
        if kv_cache.pos == kv_cache.max_len:
            self.pad = compact(kv_cache, self.pad)
        if self.pad is None and not self.fast_asked:
            self.fast = fast_step(model, kv_cache, self.cuda_graph, self.compile_step)
            self.fast_asked = True
        last = tokens[:, n - 1 : n]
        if self.pad is None and self.fast is not None:
            return self.fast(last)
        return model(last, kv_cache=kv_cache, pad=self.pad)[0], None


def fast_step(
    model: nn.Module, kv_cache: KVCache, cuda_graph: bool, compile_step: bool
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None:
    """The faster one-token step for an unpadded batch, where there is one: a CUDA graph on CUDA
    (unless cuda_graph=False), the compiled step on CPU (if compile_step), else None."""
    # a kind of layer the fixed-shape step cannot run, as that kind says
    cannot = {kind.name: kind.static_step for kind in model.config.layer_kinds if kind.static_step}
    if cannot and compile_step:
        name, why = next(iter(cannot.items()))
        raise UserError(
            f"the compiled decode step cannot run {name} layers ({why}): decode without compile"
        )
    if cannot:
        return None
    if cuda_graph and kv_cache.device.type == "cuda":
        return CUDAGraphStep(model, kv_cache, kv_cache.batch_size)
    if compile_step and kv_cache.device.type == "cpu":
        from smallgpt import compiled_step  # inductor's import (a second of CPU) only when asked

        return compiled_step.CompiledStep(model, kv_cache)
    return None


def stream_text(
    model: nn.Module,
    tok: object,
    idx: torch.Tensor,
    max_new_tokens: int,
    stop: str | None = None,
    **options: object,
) -> Iterator[list[str | None]]:
    """stream() as text: each step's new text of every row, None for a row that had ended. A row
    ends at the tokenizer's end-of-text token (tok.eot_token) or just after the stop string
    (kept); its tokens decode as one UTF-8 stream (tok.decode_bytes), as a BPE token can end
    inside a character."""
    B = idx.size(0)
    # each row's last len(stop) - 1 characters: memory does not grow
    tails, done = ([""] * B, [False] * B)
    utf8 = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(B)]
    for step in stream(model, idx, max_new_tokens, eos=tok.eot_token, **options):
        pieces: list[str | None] = [None] * B
        for b, t in enumerate(step.tolist()):
            done[b] = done[b] or t == tok.eot_token
            if done[b]:
                continue
            piece = utf8[b].decode(tok.decode_bytes([t]))
            if stop is not None:
                text = tails[b] + piece  # the stop string may begin in the pieces before
                if stop in text:
                    piece = piece[: text.index(stop) + len(stop) - len(tails[b])]
                    done[b] = True
                tails[b] = text[len(text) - len(stop) + 1 :] if len(stop) > 1 else ""
            pieces[b] = piece
        yield pieces
        if all(done):
            return


def generate(
    model: nn.Module, idx: torch.Tensor, max_new_tokens: int, **options: object
) -> torch.Tensor:
    """Continue idx (B, T) by up to max_new_tokens tokens from a GPT; returns (B, T + new tokens).

    The cache is prefilled once and then fed one token per step; use_cache=False recomputes the
    whole context every step (same tokens, slower). Rows of unequal length are left-padded, pad
    (B,) counting each row's pad tokens (see left_pad). temperature 0 is greedy; top_k, top_p and
    generator as in sample_logits. A row that emits eos keeps emitting eos; generation stops when
    every row has. When a row's context reaches block_size it slides: its newest block_size // 2
    tokens are kept and prefilled again, so every row of a batch gets exactly what it would
    alone. On CUDA each one-token step replays a CUDA graph of decode_static (unless
    cuda_graph=False) while no row is padded; on CPU, compile_step=True runs it compiled
    (CompiledStep); a padded batch takes the eager step."""
    new = list(stream(model, idx, max_new_tokens, **options))
    return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx
