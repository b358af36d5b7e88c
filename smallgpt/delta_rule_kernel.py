"""The gated delta rule as one compiled CPU kernel, forward and backward (delta_rule_kernel.cpp
beside this file): the custom op `smallgpt::delta_rule` that Gated DeltaNet and Kimi Delta
Attention train and prefill with on a CPU (smallgpt/delta_rule.py's `sequence` picks it), so
that torch.compile traces it as one opaque call with its own autograd formula; an eager call runs
the same C++ through a plain autograd Function (`EagerRule`), which skips the op's Python
dispatch. Beside it, the same build holds the op of the short convolution both kinds run before
the rule (`smallgpt::short_convolution`, gated_deltanet.py's `short_convolution` picks it; eager
calls through `EagerConvolution`): one pass each way where the torch path takes seven, the
costliest elementwise work of the eager layer.

No maintained library trains the delta rule on a CPU (docs/performance-cpu.md "The delta-rule
kernel"). The kernel is built once, on first use, by torch's extension builder (g++, which
torch.compile on a CPU needs anyway) into a folder of torch's extension cache named by a hash of
its source and flags; a machine that cannot build it trains on the torch path, saying so once.
SMALLGPT_DELTA_RULE=torch in the environment chooses the torch path (delta_rule.chunked) always.

The op's outputs: the outputs (B, H, T, d_v), the final state (B, H, d_k, d_v), and the state
before every CHECKPOINT-th token (B, H, ceil(T / CHECKPOINT), d_k, d_v), which the backward
recomputes each span of tokens from: O(T / CHECKPOINT x d_k x d_v) memory a head."""

import hashlib
import importlib.util
import math
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("delta_rule_kernel.cpp")
# -march=native: the build is this machine's own (torch's extension cache is per machine); GCC
# keeps to 256-bit vectors on Intel unless asked: 512 made the forward 15-20% faster on AVX-512
# (docs/performance-cpu.md), and asks nothing of a processor without it
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
CHECKPOINT = 64  # tokens between the states the forward keeps for the backward
# 'torch' chooses the torch path; anything else (or unset) the kernel where it builds
CHOICE = os.environ.get("SMALLGPT_DELTA_RULE", "")


class Build:
    """The kernel's module once built or loaded (None before), or why it could not be; off: the
    torch path chosen in this process (bench.py's --delta_rules compares the two)."""

    module: ModuleType | None = None
    failed: str = ""
    off: bool = False


def build_folder() -> tuple[Path, str]:
    """Where the kernel is built: torch's extension cache (TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions), in a folder named by a hash of the source, the flags and torch's
    version, so that an edit or another torch builds anew; and the module's name."""
    from torch.utils.cpp_extension import _get_build_directory

    # -march=native builds for this processor: its flags are in the key too, so that a cache
    # carried to another processor (one without AVX-512) builds anew rather than crash
    machine = [torch.__version__, platform.machine(), *FLAGS, *processor_flags()]
    key = hashlib.sha1(SOURCE.read_bytes() + " ".join(machine).encode())
    name = f"smallgpt_delta_rule_{key.hexdigest()[:12]}"
    return Path(_get_build_directory(name, verbose=False)), name


def processor_flags() -> list[str]:
    """The processor's instruction-set flags (Linux's /proc/cpuinfo; none elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return sorted(line.partition(":")[2].split())


def kernel() -> ModuleType | None:
    """The built kernel (built on the first call, a line on stderr while it builds), or None where
    it cannot be built (said once on stderr) or SMALLGPT_DELTA_RULE=torch chooses the torch
    path."""
    if CHOICE == "torch" or Build.failed or Build.off:
        return None
    if Build.module is not None:
        return Build.module
    folder, name = build_folder()
    built = folder / f"{name}.so"
    try:
        if built.is_file():  # built before: loaded as it is, without asking the builder
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            print(
                f"building the delta-rule CPU kernel into {folder} (once, about a minute)",
                file=sys.stderr,
                flush=True,
            )
            from torch.utils.cpp_extension import load

            module = load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as e:  # no compiler, a failed build: the torch path, said once
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        Build.failed = reason
        print(
            f"note: the delta-rule CPU kernel could not be built ({reason}): training on the torch "
            "path (delta_rule.chunked), slower",
            file=sys.stderr,
            flush=True,
        )
        return None
    Build.module = module
    return module


def available() -> bool:
    """Whether the kernel runs here (built now if it was not): False where SMALLGPT_DELTA_RULE=torch
    or the build failed."""
    return kernel() is not None


# torch.compile asks once, as it traces, and keeps the answer (it would otherwise trace into the
# build). The mark torch.compiler.assume_constant_result sets, set without it: that function imports
# torch._dynamo, 1.2 s of every process that imports the model and never compiles (sample.py, every
# script the tests start). test_delta_rule_kernel checks that torch.compile still keeps it.
available._dynamo_marked_constant = True


def kernel_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
    q_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's forward: q, k (B, H, T, d_k), v (B, H, T, d_v), g (B, H, T, 1 or d_k), b
    (B, H, T), state (B, H, d_k, d_v), of one float type. The outputs are laid out (B, T, H, d_v)
    (what the layers read next), the final state and checkpoints contiguous. q, k, v and g may be
    views of a (B, T, H, d) layout (the layers' products): the kernel steps over their tokens as
    they lie. It takes the decays exp(g), exponentiated here by torch (vectorised: one exp a
    channel and token in the kernel's loop cost as much as the rest of it). q_scale > 0: q and k
    come before their L2 norm, which the kernel applies, q then times q_scale (0: as they are)."""
    q, k, v, g = (features_contiguous(x) for x in (q, k, v, g.exp()))
    return tuple(kernel().forward(q, k, v, g, b, state.contiguous(), CHECKPOINT, q_scale))


delta_rule_op = torch.library.custom_op("smallgpt::delta_rule", kernel_forward, mutates_args=())


def features_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy where a token's features (its last dimension) are not side by side, which is
    all the kernel asks of a layout."""
    return x if x.size(-1) == 1 or x.stride(-1) == 1 else x.contiguous()


@delta_rule_op.register_fake
def _(q, k, v, g, b, state, q_scale):  # noqa: ANN001, ANN202
    B, H, T, d_k = q.shape
    n = math.ceil(T / CHECKPOINT)
    out = q.new_empty(B, T, H, v.shape[-1]).transpose(1, 2)
    return out, state.new_empty(state.shape), q.new_empty(B, H, n, d_k, v.shape[-1])


def kernel_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
    checkpoints: torch.Tensor,
    d_out: torch.Tensor,
    d_final: torch.Tensor,
    q_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward: the gradients of q, k, v, g, b and the initial state, each laid out
    as its input is (as torch.compile's fake implementation below says they are); q_scale as the
    forward had it."""
    inputs = (q, k, v, g, b, state)
    q_, k_, v_, a, d_out = (features_contiguous(x) for x in (q, k, v, g.exp(), d_out))
    states = checkpoints.contiguous()
    d_final = d_final.contiguous()
    grads = kernel().backward(q_, k_, v_, a, b, states, d_out, d_final, CHECKPOINT, q_scale)
    return tuple(laid_out_as(x, grad) for x, grad in zip(inputs, grads, strict=True))


delta_rule_backward_op = torch.library.custom_op(
    "smallgpt::delta_rule_backward", kernel_backward, mutates_args=()
)


def laid_out_as(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """grad (contiguous) with x's strides: itself where x is contiguous too, else a copy."""
    if grad.stride() == x.stride():
        return grad
    return torch.empty_like(x).copy_(grad)


@delta_rule_backward_op.register_fake
def _(q, k, v, g, b, state, checkpoints, d_out, d_final, q_scale):  # noqa: ANN001, ANN202
    return tuple(torch.empty_like(x) for x in (q, k, v, g, b, state))


def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    *tensors, ctx.q_scale = inputs
    ctx.save_for_backward(*tensors, output[2])  # the inputs, and the states kept every CHECKPOINT


def gradients(
    saved: tuple[torch.Tensor, ...],
    d_out: torch.Tensor | None,
    d_final: torch.Tensor | None,
    backward: Callable[..., tuple[torch.Tensor, ...]],
    q_scale: float,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of q, k, v, g, b and the initial state by `backward` (the op, or the plain
    function it is made of), from what the forward saved: its inputs and checkpoints; and None
    for q_scale."""
    q, k, v, g, b, state, checkpoints = saved
    # an output the loss did not read has no gradient
    if d_out is None:
        d_out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    if d_final is None:
        d_final = state.new_zeros(state.shape)
    return (*backward(q, k, v, g, b, state, checkpoints, d_out, d_final, q_scale), None)


def backward(ctx, d_out, d_final, d_checkpoints):  # noqa: ANN001, ANN201
    return gradients(ctx.saved_tensors, d_out, d_final, delta_rule_backward_op, ctx.q_scale)


delta_rule_op.register_autograd(backward, setup_context=setup_context)


class EagerRule(torch.autograd.Function):
    """The same forward and backward as the op's, for eager calls: a custom op's Python dispatch
    and autograd wrapper cost 0.4-0.9 ms of a forward and backward (3.75 against 3.32 ms at
    64 x 24, 4 heads of 32: docs/performance-cpu.md), and its first call imports torch._dynamo.
    torch.compile, torch.export and AOTAutograd's fake tensors take the op (`run` chooses), which
    they see as one call."""

    @staticmethod
    def forward(ctx, q, k, v, g, b, state, q_scale):  # noqa: ANN001, ANN205
        out, final, checkpoints = kernel_forward(q, k, v, g, b, state, q_scale)
        ctx.save_for_backward(q, k, v, g, b, state, checkpoints)
        ctx.q_scale = q_scale
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_final):  # noqa: ANN001, ANN205
        return gradients(ctx.saved_tensors, d_out, d_final, kernel_backward, ctx.q_scale)


PLAIN = (torch.Tensor, torch.nn.Parameter)  # the types of tensors run, not traced


def traced(inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether these inputs are being traced rather than run: under torch.compile (dynamo), or as
    tensors of a subclass (the fake and functional tensors of AOTAutograd and torch.export)."""
    return torch.compiler.is_compiling() or any(type(x) not in PLAIN for x in inputs)


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor | None,
    q_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule.recurrent's outputs and final state through the kernel: the inputs in float32
    (float64 stays float64), contiguous, g as (B, H, T, 1) for a decay a head. With q_scale, q and
    k come before their L2 norm (delta_rule.l2_normalised), which the kernel applies, q then times
    q_scale."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, T, d_k = k.shape
    if state is None:
        state = q.new_zeros(B, H, d_k, v.shape[-1], dtype=dtype)
    per_head = g.dim() == 3
    if per_head:
        g = g[..., None]
    inputs = tuple(x.to(dtype) for x in (q, k, v, g, b, state))
    scale = 0.0 if q_scale is None else float(q_scale)  # 0: the kernel normalises nothing
    if traced(inputs):
        out, final, _ = delta_rule_op(*inputs, scale)
        return out, final
    return EagerRule.apply(*inputs, scale)


def kernel_convolve(x: torch.Tensor, before: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The short causal depthwise convolution (before its SiLU) of x (B, T, W) after `before`
    (B, K - 1, W), its last inputs, with taps (K, W), of one float type: (B, T, W), contiguous."""
    return kernel().convolve(x.contiguous(), before.contiguous(), taps.contiguous())


convolution_op = torch.library.custom_op(
    "smallgpt::short_convolution", kernel_convolve, mutates_args=()
)


@convolution_op.register_fake
def _(x, before, taps):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)


def kernel_convolve_backward(
    x: torch.Tensor, before: torch.Tensor, taps: torch.Tensor, d_y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, before and the taps, each laid out as its input is."""
    inputs = (x, before, taps)
    flat = (t.contiguous() for t in (x, before, taps, d_y))
    grads = kernel().convolve_backward(*flat)
    return tuple(laid_out_as(t, grad) for t, grad in zip(inputs, grads, strict=True))


convolution_backward_op = torch.library.custom_op(
    "smallgpt::short_convolution_backward", kernel_convolve_backward, mutates_args=()
)


@convolution_backward_op.register_fake
def _(x, before, taps, d_y):  # noqa: ANN001, ANN202
    return tuple(torch.empty_like(t) for t in (x, before, taps))


def convolution_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def convolution_backward(ctx, d_y):  # noqa: ANN001, ANN201
    return convolution_backward_op(*ctx.saved_tensors, d_y)


convolution_op.register_autograd(convolution_backward, setup_context=convolution_context)


class EagerConvolution(torch.autograd.Function):
    """The convolution op's forward and backward for eager calls (as EagerRule is the rule's)."""

    @staticmethod
    def forward(ctx, x, before, taps):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, before, taps)
        return kernel_convolve(x, before, taps)

    @staticmethod
    def backward(ctx, d_y):  # noqa: ANN001, ANN205
        return kernel_convolve_backward(*ctx.saved_tensors, d_y)


def convolve(x: torch.Tensor, before: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The convolution (before its SiLU) through the kernel, in float32 whatever x's type (float64
    stays float64): x (B, T, W), before (B, K - 1, W), taps (K, W)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inputs = tuple(t.to(dtype) for t in (x, before, taps))
    return convolution_op(*inputs) if traced(inputs) else EagerConvolution.apply(*inputs)
