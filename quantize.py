"""int8 weight-only quantization for decoding (`sample.py --quantize=int8`): every Linear of a GPT keeps its weight as
int8 with one scale per output feature (symmetric, the row's largest magnitude maps to 127); activations, the
embeddings and the norms stay in the model's dtype (on CPU an fp32 model's products take bf16 activations: torch's
int8 kernel is fast for those only). A quarter of fp32's weight bytes, which is what a one-token
step streams (docs/performance-cpu.md "int8 weights").
"""

import torch
import torch.nn as nn
from torch.nn import functional as F

QUANTIZE = ("", "int8")  # the choices of --quantize ('' keeps the weights as they are)


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 (out, in) times a per-row scale (out,): y = (x @ weight.T) * scale + bias."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = w.float().abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(w.dtype))
        # the scale for bf16 products of fp32 activations (below), a buffer: inductor's lowering of the int8 product
        # takes its scale as it comes, and a cast inside the graph is not realized for it. In the state dict too, so
        # that loading one sets both scales.
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu:  # torch's int8 weight-only kernel, no dequantized copy of the weight; it is vectorised for bf16
            # activations only (fp32 ones run 7-10x slower), so fp32 ones are rounded to bf16 for the product
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16 if x.dtype == torch.float32 else x.dtype)
            scale = self.scale if self.scale.dtype == rows.dtype else self.scale_bf16
            y = torch._weight_int8pack_mm(rows, self.weight, scale).to(x.dtype)
            y = y.view(*x.shape[:-1], -1)
        else:  # dequantize and multiply: torch.compile fuses the two on CUDA
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize(model: nn.Module, kind: str) -> nn.Module:
    """model with every nn.Linear replaced by its int8 form (kind 'int8'), in place, or as it is (kind ''). The
    lm_head gets its own int8 copy: the token embedding it shares keeps its dtype, for the lookups."""
    if kind not in QUANTIZE:
        raise ValueError(f"quantize={kind!r} must be one of {QUANTIZE}")
    if kind:
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child))
    return model
