"""Optional NF4 quantization of the Medusa heads' vocabulary projections (``--heads-quant nf4``).

Each projection is V x H, nearly all of the heads' bytes; 4-bit storage cuts them ~4x.
The heads only propose candidates and the backbone verifies them: greedy text and the exact sampler's
distribution are unchanged, and acceptance can move. Typical acceptance keeps what the backbone finds
plausible among what is proposed, so there other proposals can give another text.
"""

from __future__ import annotations

import torch

from .medusa_heads import MedusaHeads
from .files import HeadsLoadError


def quantize_projections(heads: MedusaHeads, compute_dtype: torch.dtype,
                         device: torch.device | str | None = None) -> MedusaHeads:
    """Replace each head's vocab projection (V x H, most of the heads' bytes) by an NF4
    bitsandbytes layer; residual blocks stay in ``compute_dtype`` (they are small). The heads end on ``device``
    (default: where they are). Heads built on the CPU for a GPU never have their dense projections there: each
    goes as the fp32 copy bitsandbytes quantizes from, one at a time (review: all five in bf16 first, then each
    in fp32, took 5.9 GB of a 7B's GPU where the check said 4.4)."""
    import bitsandbytes as bnb

    device = torch.device(device) if device is not None else next(heads.parameters()).device

    if not heads.config.own_projection:
        raise HeadsLoadError("--heads-quant nf4: these heads reuse the backbone's lm_head and have no projection to quantize: drop --heads-quant")
    for head in heads.heads:
        last = len(head) - 1
        dense = head[last]
        q = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=False, compute_dtype=compute_dtype,
                              compress_statistics=True, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(dense.weight.data.cpu().float(), requires_grad=False,
                                     compress_statistics=True, quant_type="nf4").to(device)
        # bitsandbytes 0.50.2's CPU path mis-scales blocks for some row widths (e.g. 32, 48, 96
        # inputs): compare with NF4 done by hand instead of decoding with silently wrong heads
        wrong = _nf4_mismatch(dense.weight.data, q.weight)
        if wrong > 0.01:
            raise HeadsLoadError(
                f"--heads-quant nf4: bitsandbytes quantized a {tuple(dense.weight.shape)} projection wrongly on "
                f"{device.type} ({wrong:.0%} of values off by more than 5% of their block's range): "
                "drop --heads-quant"
            )
        head[last] = q
    return heads.to(device)


def _nf4_mismatch(weight: torch.Tensor, packed, rows: int = 256) -> float:
    """Fraction of values where bitsandbytes' NF4 round trip differs from NF4 by definition
    (nearest of the 16 NF4 levels times the 64-value block's absmax), on the first ``rows``
    rows: enough to see a mis-scaling, without a V x H x 16 temporary on a 32k vocabulary."""
    import bitsandbytes as bnb

    state = packed.quant_state
    n = min(rows, weight.shape[0]) * weight.shape[1]                                   # 256 * H: whole blocks
    back = bnb.functional.dequantize_4bit(packed.data, state).float().flatten()[:n]
    w = weight.flatten()[:n].to(back.device).float()
    pad = (-n) % state.blocksize
    blocks = torch.nn.functional.pad(w, (0, pad)).view(-1, state.blocksize)            # (B, 64)
    absmax = blocks.abs().amax(1, keepdim=True).clamp_min(1e-12)                        # (B, 1)
    code = state.code.float().to(w.device)                                              # (16,) ascending
    levels = (blocks / absmax).unsqueeze(-1).sub(code).abs().argmin(-1)                 # (B, 64)
    ref = (code[levels] * absmax).flatten()[:n]
    tolerance = 0.05 * absmax.expand_as(blocks).flatten()[:n]
    return ((back - ref).abs() > tolerance).float().mean().item()
