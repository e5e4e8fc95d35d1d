"""torch's own int4 matmul ("tinygemm", ``_weight_int4pack_mm``, the kernel gpt-fast decodes with) over a
model's decoder Linears: the anchor issue 22 sets beside NF4, per projection (benchmarks/nf4_kernel.py)
and in a graphed 7B step (``bench_synthetic --quant tinygemm``).

Not a product path, and not NF4: asymmetric int4 as gpt-fast makes it, with one bf16 scale and zero per
group of 64 or 128 input columns, W ~ (q - 8) * scale + zero. On CUDA the codes are packed into
tinygemm's tiled layout; on a CPU into torch's CPU int4 layout with the same operands, so the path runs
(slowly, and says nothing about GPU speed) in the CPU tests.
"""

from __future__ import annotations

import torch
from torch import nn

GROUPS = (32, 64, 128, 256)          # what _weight_int4pack_mm takes
INNER_K_TILES = 8                    # gpt-fast's choice on CUDA; K must be a multiple of 16 * it


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-fast's asymmetric group int4: (q int32 (N, K) in 0..15, scales_and_zeros bf16 (K/group, N, 2))."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-6) / 15
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    return q, torch.cat([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()


def dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """(N, K) fp32 that the kernel multiplies by."""
    n, k = q.shape
    scale, zero = (scales_and_zeros[..., i].float().T[:, :, None] for i in (0, 1))    # (N, K/group, 1)
    return ((q.reshape(n, k // group, group).float() - 8) * scale + zero).reshape(n, k)


def pack(q: torch.Tensor) -> torch.Tensor:
    """The kernel's layout for q (N, K) on q's device: CUDA's tiles (two codes a byte, even column in
    the high nibble), or the CPU kernel's own."""
    if q.device.type == "cuda":
        return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)     # the CPU packing ignores the tiles


def check_shape(n: int, k: int, group: int, device: torch.device) -> None:
    """One-line error where tinygemm cannot take an (n, k) weight."""
    if group not in GROUPS:
        raise ValueError(f"tinygemm group {group} is not one of {GROUPS}: pick one of those")
    tile = 16 * INNER_K_TILES if device.type == "cuda" else group
    if k % group or k % tile or n % 16:
        raise ValueError(f"tinygemm cannot take a {n}x{k} weight at group {group}: it needs the input size a multiple "
                         f"of {max(group, tile)} and the output size of 16; use another --tinygemm-group or --quant")


class TinygemmLinear(nn.Module):
    """y = x W^T + b with W in tinygemm's int4; x is multiplied in bf16, y returns in x's dtype."""

    def __init__(self, dense: nn.Linear, group: int):
        super().__init__()
        self.out_features, self.in_features, self.group = dense.out_features, dense.in_features, group
        check_shape(self.out_features, self.in_features, group, dense.weight.device)
        q, scales_and_zeros = quantize(dense.weight.data, group)
        self.register_buffer("packed", pack(q), persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        self.bias = None if dense.bias is None else nn.Parameter(dense.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()              # (M, K)
        mm = torch.ops.aten._weight_int4pack_mm if x.device.type == "cuda" else \
            torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(rows, self.packed, self.group, self.scales_and_zeros).to(x.dtype)           # (M, N)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


@torch.no_grad()
def quantize_linear_tinygemm_(model: nn.Module, group: int = 128) -> int:
    """Every Linear of the decoder layers -> TinygemmLinear (lm_head and embeddings stay, as for NF4);
    returns how many were replaced. Every shape is checked before any layer changes."""
    linears = [(parent, name, child) for layer in model.get_decoder().layers for parent in list(layer.modules())
               for name, child in list(parent.named_children()) if type(child) is nn.Linear]
    for _, _, dense in linears:
        check_shape(dense.out_features, dense.in_features, group, dense.weight.device)
    for parent, name, dense in linears:
        setattr(parent, name, TinygemmLinear(dense, group))
    return len(linears)
