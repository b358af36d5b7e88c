"""Optimizers and the learning-rate schedule for train.py. --optimizer: 'adamw'
(GPT.configure_optimizers) or 'muon': Muon for the blocks' matrices, AdamW for the rest (embeddings
and the tied lm_head, norms, biases), held as one optimizer.

Muon (https://kellerjordan.github.io/posts/muon/) follows torch.optim.Muon's update, but computes
the Newton-Schulz orthogonalisation in a dtype the device is fast in: torch's always uses bf16,
which is many times slower on a CPU without native bf16 (docs/training.md "Config files and flags").
"""

import math
from collections.abc import Callable
from typing import Any

import torch

from model import GPT
from smallgpt.runtime import device_type, native_bf16

# torch.optim.Muon's (and Keller Jordan's) quintic iteration
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def lr_at(
    it: int,
    learning_rate: float,
    min_lr: float,
    warmup_iters: int,
    lr_decay_iters: int,
    decay: bool = True,
) -> float:
    """Linear warm-up to learning_rate, then cosine decay to min_lr at lr_decay_iters (or constant
    if not decay)."""
    if not decay:
        return learning_rate
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def orthogonalised(
    grad: torch.Tensor, dtype: torch.dtype, steps: int = 5, eps: float = 1e-7
) -> torch.Tensor:
    """grad, one matrix (rows, cols) or a stack of same-shaped ones (n, rows, cols), each with its
    singular values pushed towards 1 by a Newton-Schulz iteration in dtype; a stack runs as batched
    products."""
    a, b, c = NS_COEFFICIENTS
    x = grad.to(dtype)
    x = x[None] if grad.dim() == 2 else x
    tall = x.size(1) > x.size(2)
    x = x.mT if tall else x
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # each matrix's spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.mT if tall else x
    return (x[0] if grad.dim() == 2 else x).to(grad.dtype)


class Muon(torch.optim.Optimizer):
    """Momentum (Nesterov) whose update is orthogonalised, each matrix's step scaled by sqrt(max(1,
    rows / cols)) as torch.optim.Muon's default; decoupled weight decay. The matrices of one shape
    are orthogonalised as one stack (modded-nanogpt's and nanochat's batching), momentum and updates
    with foreach kernels: a step runs a few batched products per shape instead of each matrix's
    (docs/performance-cpu.md "Training")."""

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.ns_dtype = ns_dtype
        # by the params stepped: where each shape's matrices are among them (same_shapes)
        self.shapes: dict[tuple[int, ...], dict[tuple[int, ...], list[int]]] = {}

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = []  # each parameter's momentum, made at its first step
            for p in params:
                bufs.append(self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)))
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            nesterov = torch._foreach_lerp(grads, bufs, group["momentum"])
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            for (rows, cols), at in self.same_shapes(params).items():
                stack = torch.stack([nesterov[i] for i in at])  # (len(at), rows, cols)
                updates = orthogonalised(stack, self.ns_dtype).unbind(0)
                scale = group["lr"] * math.sqrt(max(1.0, rows / cols))
                torch._foreach_add_([params[i] for i in at], updates, alpha=-scale)

    def same_shapes(self, params: list[torch.Tensor]) -> dict[tuple[int, ...], list[int]]:
        """Where in params each shape's matrices are, kept for the next steps over the same
        params."""
        key = tuple(map(id, params))
        if key not in self.shapes:
            self.shapes[key] = {}
            for i, p in enumerate(params):
                self.shapes[key].setdefault(tuple(p.shape), []).append(i)
        return self.shapes[key]


class Chain(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters as one: one step, one zero_grad, one state_dict,
    and param_groups listing all of theirs (train.py sets each group's lr from the schedule times
    its lr_scale)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    def step(self, closure: Callable | None = None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"chain": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        for o, s in zip(self.optimizers, state_dict["chain"], strict=True):
            o.load_state_dict(s)
        # loading made new group dicts
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the state the optimizer will hold once it has stepped: AdamW two moments a
    parameter, Muon one momentum (for the checkpoint's size, before the first step)."""
    if isinstance(optimizer, Chain):
        return sum(state_bytes(o) for o in optimizer.optimizers)
    slots = 1 if isinstance(optimizer, Muon) else 2
    return sum(slots * p.nbytes for group in optimizer.param_groups for p in group["params"])


def muon_takes(model: GPT, name: str) -> bool:
    """Whether Muon takes the block matrix `name`: all but those of the Linears a mixer leaves to
    AdamW (its `adamw_matrices`, as a kind of layer may declare)."""
    owner = name.rpartition(".")[0]
    parent, _, linear = owner.rpartition(".")
    return linear not in getattr(model.get_submodule(parent), "adamw_matrices", ())


def make_optimizer(
    model: GPT,
    kind: str,
    weight_decay: float,
    learning_rate: float,
    betas: tuple[float, float],
    device: str,
    muon_lr: float,
) -> torch.optim.Optimizer:
    """'adamw': GPT.configure_optimizers; 'muon': Muon (at muon_lr, no weight decay; orthogonalising
    in bf16 where that is fast, else fp32) for the 2-D weights inside the blocks and that AdamW for
    every other parameter. Each group has an lr_scale: its peak lr over learning_rate."""
    if kind == "adamw":
        opt = model.configure_optimizers(weight_decay, learning_rate, betas, device_type(device))
    else:
        inner = []  # the blocks' matrices: Muon's
        rest = []  # AdamW's
        for name, p in model.named_parameters():
            if not p.requires_grad:  # frozen (train.py --distill=layers): no optimizer's
                continue
            # matrices only: a depthwise convolution's filters (3-D) are per-channel, not one map,
            # and trained worse under Muon (docs/performance-cpu.md "Which parameters Muon takes")
            if p.dim() == 2 and name.startswith("transformer.h.") and muon_takes(model, name):
                inner.append(p)
            else:
                rest.append(p)
        adamw = model.configure_optimizers(
            weight_decay, learning_rate, betas, device_type(device), params=rest
        )
        fast_bf16 = device.startswith("cuda") or (device == "cpu" and native_bf16())
        ns_dtype = torch.bfloat16 if fast_bf16 else torch.float32
        opt = Chain(Muon(inner, lr=muon_lr, ns_dtype=ns_dtype), adamw)
    for group in opt.param_groups:
        group["lr_scale"] = group["lr"] / learning_rate if learning_rate else 1.0
    return opt
