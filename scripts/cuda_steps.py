"""On a CUDA machine: the one-token step CUDA graphs replay (static_step.decode_static) against the
eager cached step, and greedy generation with and without CUDA graphs and on CPU, for local layers
(rings) and MLA, fp32 and bf16. Called by `bash scripts/gpu_check.sh steps`; prints one line per
check (docs/gpu.md has what it gave)."""

import torch

from conftest import lively  # tests/conftest.py: gpu_check.sh puts tests/ on PYTHONPATH
from model import GPT, GPTConfig
from smallgpt.generation import generate, left_pad
from smallgpt.static_step import decode_static

CASES = {
    "gqa SSSL w8": dict(n_kv_head=2, window=8, window_pattern="SSSL"),
    "mha-learned SL w5": dict(pos_encoding="learned", window=5, window_pattern="SL"),
    "mla": dict(kv_lora_rank=32),
    "mla SSSL w8": dict(kv_lora_rank=32, window=8, window_pattern="SSSL"),
}


def model(overrides: dict) -> GPT:
    torch.manual_seed(0)
    config = (
        dict(block_size=64, vocab_size=96, n_layer=4, n_head=4, n_embd=64, pos_encoding="rope")
        | overrides
    )
    m = lively(GPT(GPTConfig(**config)).eval())
    with torch.no_grad():  # MLA's keys as sharp as its queries (tests/test_window.py's windowed)
        for name, p in m.named_parameters():
            if name.endswith("kv_a.weight"):
                p.mul_(4.0)
    return m


@torch.inference_mode()
def static_against_eager(m: GPT, dtype: torch.dtype) -> float:
    """The largest logit difference of decode_static (whole cache, masked) and the eager step over
    60 steps."""
    m = m.to("cuda", dtype)
    idx = torch.randint(0, 96, (2, 61), device="cuda")
    ref, static = m.make_kv_cache(2), m.make_kv_cache(2)
    m(idx[:, :1], kv_cache=ref), m(idx[:, :1], kv_cache=static)
    worst = 0.0
    for t in range(1, 61):
        want, _ = m(idx[:, t : t + 1], kv_cache=ref)
        got = decode_static(m, idx[:, t : t + 1], torch.tensor([t], device="cuda"), static)
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


@torch.inference_mode()
def greedy(m: GPT, device: str, graph: bool) -> list[list[int]]:
    """Greedy tokens past block_size: batch 2 from 3 tokens, then a padded batch of prompts of 9 and
    2 tokens."""
    m = m.to(device, torch.float32)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 96, (2, 3), generator=gen).to(device)
    out = generate(m, idx, 150, temperature=0, cuda_graph=graph)[:, 3:].tolist()
    p_idx, pad = left_pad(
        [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 2)], device=device
    )
    return out + generate(m, p_idx, 100, temperature=0, pad=pad, cuda_graph=graph)[:, 9:].tolist()


def main() -> None:
    print("torch", torch.__version__, torch.cuda.get_device_name())
    for name, overrides in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            worst = static_against_eager(model(overrides), dtype)
            print(f"{name} {dtype}: static step vs eager, max |logit diff| {worst:.2e}")
        cpu, eager, graph = (
            greedy(model(overrides), "cpu", False),
            *(greedy(model(overrides), "cuda", g) for g in (False, True)),
        )

        def agree(a: list[list[int]], b: list[list[int]]) -> int:
            return sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))

        total = sum(map(len, cpu))
        print(
            f"{name} fp32 greedy, {total} tokens ({len(set(sum(cpu, [])))} distinct): "
            f"graph = eager {agree(graph, eager)}, cuda eager = cpu {agree(eager, cpu)}"
        )


if __name__ == "__main__":
    main()
