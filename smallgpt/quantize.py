"""int8 weight-only quantization for decoding (`sample.py --quantize=int8`): every Linear of a
GPT keeps its weight as int8 with one scale per output feature (symmetric, the row's largest
magnitude maps to 127); activations, the embeddings and the norms stay in the model's dtype (on
CPU an fp32 model's products take bf16 activations: torch's int8 kernel is fast for those only).
A quarter of fp32's weight bytes, which is what a one-token step streams (docs/performance-cpu.md
"int8 weights"). MLA's kv_b, which decoding reads as a matrix, keeps the model's dtype
(quantize)."""

import torch
import torch.nn as nn
from torch.nn import functional as F

QUANTIZE = ("", "int8")  # the choices of --quantize ('' keeps the weights as they are)
# torch's CPU int8 kernel takes bf16 activations only in rows of a multiple of this many
# (Int8Linear.product_dtype)
BF16_ROW_MULTIPLE = 16


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 (out, in) times a per-row scale (out,): y = (x @ weight.T) *
    scale + bias."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = w.float().abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer(
            "weight", (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scale", scale.to(w.dtype))
        # the scale for bf16 products of fp32 activations (below), a buffer: inductor's lowering of
        # the int8 product takes its scale as it comes, and a cast inside the graph is not realized
        # for it. In the state dict too, so that loading one sets both scales.
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        self.bias = (
            None
            if linear.bias is None
            else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        )

    def product_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype activations of dtype take in torch's CPU int8 kernel: bf16 for fp32 and bf16
        ones (it is vectorised for bf16 only: docs/performance-cpu.md "int8 weights"), but fp32
        for rows that are no multiple of BF16_ROW_MULTIPLE wide, past whose end its bf16 loop
        reads (wrong products or a crash: SwiGLU's 88-wide hidden layer at n_embd 32, a
        q_lora_rank of 12)."""
        if dtype not in (torch.float32, torch.bfloat16):
            return dtype
        return torch.bfloat16 if self.in_features % BF16_ROW_MULTIPLE == 0 else torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu:  # torch's int8 weight-only kernel, no dequantized copy of the weight
            rows = x.reshape(-1, self.in_features).to(self.product_dtype(x.dtype))
            scale = self.scale_bf16 if rows.dtype == torch.bfloat16 else self.scale.to(rows.dtype)
            y = torch._weight_int8pack_mm(rows, self.weight, scale).to(x.dtype)
            y = y.view(*x.shape[:-1], -1)
        else:  # dequantize and multiply: torch.compile fuses the two on CUDA
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def quantize(model: nn.Module, kind: str) -> nn.Module:
    """model with every nn.Linear replaced by its int8 form (kind 'int8'), in place, or as it is
    (kind ''). The lm_head gets its own int8 copy: the token embedding it shares keeps its dtype,
    for the lookups. A Linear that its module names in `matrices` (MLA's kv_b:
    attention.LatentAttention) keeps its dtype too: the decode step reads its weight as a matrix
    and never calls it."""
    if kind not in QUANTIZE:
        raise ValueError(f"quantize={kind!r} must be one of {QUANTIZE}")
    if kind:
        for parent in list(model.modules()):
            # kept rather than dequantized at each step: a float copy made every step streams more
            # bytes than the float weight, and the code reading it would need the int8 layout
            kept = getattr(parent, "matrices", ())
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear) and name not in kept:
                    setattr(parent, name, Int8Linear(child))
    return model
