"""NF4 weights repacked once at load for the kernel in nf4_repacked_kernel.py, and back.

Why repack: bitsandbytes stores W[N, K] row-major with element 2j in the high nibble and 2j+1 in the
low one, and (double quant) each 64-value block's scale as a uint8 index into a second table times a
second-level absmax plus an offset. A kernel reading that as is needs strided x loads (even and odd
columns) and two dependent gathers per scale. This layout needs neither, and its bytes stay within
+10% of bitsandbytes' (fp32 scales: 4 bytes per 64 values against ~1.02), with no 16-bit copy.

Layout (R = 16 rows per row group, G = group columns: 128 or 256, B = bitsandbytes' blocksize, 64):
- ``words`` int32 (N_pad/R, K_pad/G, R, G/8). Row n = rg*R + r, column k = kg*G + i*(G/8) + j: word
  [rg, kg, r, j] holds the code of W[n, k] in bits 4i..4i+3 ("plane" i). So one program's step over
  row group rg and group kg reads R*G/2 contiguous bytes; plane i is one shift and one mask of the
  words it loaded, and covers G/8 consecutive columns, so x is read in natural order, 16 bytes at a
  time; and every plane lies inside one scale block (G/8 divides B), so a plane has one scale per row.
- ``scales`` fp32 (N_pad/R, K_pad/G, R, G/B), tiled like the words: the scale bitsandbytes'
  ``dequantize_4bit`` multiplies by, computed by bitsandbytes' own ``dequantize_blockwise`` (+ offset)
  so every weight dequantizes to the same fp32 bits (code[nibble] * scale, one rounding).
- N is padded to R and K to G with code 0 and scale 0 (padded weights are 0 and never stored).
Checkpoints and the loader stay bitsandbytes': this is built in memory after load, and
``bitsandbytes_bytes`` rebuilds bitsandbytes' packed bytes exactly (to switch kernels back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 16                      # rows per row group: the kernel's BLOCK_N is a multiple of this
GROUPS = (128, 256)            # columns per group: G/8 >= 16 so a plane can be an MMA's K
ROW_TILES = 4                  # row tiles the arrival counts cover: 64 rows in tiles of 16 or more


@dataclass(frozen=True, eq=False)
class RepackedNF4:
    words: torch.Tensor        # int32 (N_pad/16, K_pad/G, 16, G/8), see the module docstring
    scales: torch.Tensor       # fp32 (N_pad/16, K_pad/G, 16, G/B)
    code: torch.Tensor         # fp32 (16,) the NF4 table
    n: int
    k: int
    blocksize: int             # B
    group: int                 # G
    # int32 (ROW_TILES * N_pad/16,) zeros between calls: how many split-K programs of each output tile have
    # stored their partials, for the kernel's serial reduce (nf4_repacked_kernel); each call sets them back
    arrivals: torch.Tensor | None = None
    # the 16 values of ``code`` on the host, read once at repack: the select lookup compiles them into the kernel
    # (nf4_repacked_configs.RepackedConfig.decode), where reading them from the device would sync each call
    table: tuple[float, ...] = ()

    @property
    def nbytes(self) -> int:
        """The weight's bytes; the arrival counts are the kernel's workspace, as its split-K partials are
        (N bytes a weight, 2/K of its codes' bytes)."""
        return self.words.numel() * 4 + self.scales.numel() * 4 + self.code.numel() * 4


def check_bnb_nf4(weight: torch.Tensor, state) -> tuple[int, int]:
    """(N, K) of a bitsandbytes NF4 weight this layout can hold; else a one-line error."""
    if state is None or getattr(state, "quant_type", None) != "nf4":
        raise ValueError(f"repacking reads NF4 weights only, got quant_type {getattr(state, 'quant_type', None)!r}: "
                         "use --nf4-kernel bnb for this model")
    if getattr(state, "packing_format_for_cpu", False):
        raise ValueError("this NF4 weight was repacked by bitsandbytes' CPU path (packing_format_for_cpu): "
                         "route kernels before the model's first forward")
    n, k = (int(s) for s in state.shape)
    if k % state.blocksize:
        raise ValueError(f"repacking needs K a multiple of the blocksize (scale blocks inside rows), got K={k}, "
                         f"blocksize={state.blocksize}: keep this layer on bitsandbytes")
    if weight.dtype != torch.uint8 or weight.numel() != n * k // 2:
        raise ValueError(f"NF4 weight holds {weight.numel()} {weight.dtype} values, expected {n * k // 2} uint8 "
                         f"for {n}x{k}: not bitsandbytes' packed layout")
    return n, k


def bnb_codes_and_scales(weight: torch.Tensor, state) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 (N, K), scales fp32 (N, K/B)) of a bitsandbytes NF4 weight."""
    n, k = check_bnb_nf4(weight, state)
    packed = weight.reshape(-1)                                             # (N*K/2,)
    codes = torch.stack((packed >> 4, packed & 15), dim=1).reshape(n, k)   # element 2j: high nibble
    if state.nested:
        # exactly what dequantize_4bit does before its kernel, on this device
        from bitsandbytes.functional import dequantize_blockwise

        scales = dequantize_blockwise(state.absmax, state.state2)
        scales += state.offset
    else:
        scales = state.absmax
    return codes, scales.float().reshape(n, k // state.blocksize)


def repack(codes: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, blocksize: int,
           group: int = 128) -> RepackedNF4:
    """The layout above from codes (N, K) uint8 and scales (N, K/B) fp32 (the rows of several weights
    concatenated make one fused weight)."""
    n, k = codes.shape
    if group not in GROUPS or group % blocksize or group > 8 * blocksize:
        raise ValueError(f"group {group} does not fit blocksize {blocksize}: use one of {GROUPS}, a multiple of the "
                         f"blocksize and at most 8x it")
    if scales.shape != (n, k // blocksize) or k % blocksize:
        raise ValueError(f"scales {tuple(scales.shape)} do not match codes {n}x{k} at blocksize {blocksize}")
    lanes, per_group = group // 8, group // blocksize
    n_pad, k_pad = -(-n // ROWS) * ROWS, -(-k // group) * group
    padded = torch.zeros(n_pad, k_pad, dtype=torch.uint8, device=codes.device)
    padded[:n, :k] = codes
    # (rg, r, kg, i, j) -> (rg, kg, r, j, i): plane i of word j
    planes = padded.reshape(n_pad // ROWS, ROWS, k_pad // group, 8, lanes).permute(0, 2, 1, 4, 3)
    words = torch.zeros(planes.shape[:-1], dtype=torch.int64, device=codes.device)
    for i in range(8):      # one plane at a time: a temporary of N*K bytes, not 8x that
        words |= planes[..., i].to(torch.int64) << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)   # bit 31 is the sign
    tiled = torch.zeros(n_pad, k_pad // blocksize, dtype=torch.float32, device=codes.device)
    tiled[:n, : k // blocksize] = scales
    tiled = tiled.reshape(n_pad // ROWS, ROWS, k_pad // group, per_group).permute(0, 2, 1, 3).contiguous()
    arrivals = torch.zeros(ROW_TILES * n_pad // ROWS, dtype=torch.int32, device=codes.device)
    code = code.float().contiguous()
    return RepackedNF4(words.contiguous(), tiled, code, n, k, blocksize, group, arrivals, tuple(code.tolist()))


def repack_bnb(weights: list[tuple[torch.Tensor, object]], group: int = 128) -> RepackedNF4:
    """One repacked weight from bitsandbytes NF4 (packed, QuantState) pairs sharing K, blocksize and
    table, rows stacked in order (q, k, v -> one (Nq+Nk+Nv, K) weight)."""
    states = [s for _, s in weights]
    first = states[0]
    for s in states[1:]:
        same = int(s.shape[1]) == int(first.shape[1]) and s.blocksize == first.blocksize
        if not same or not torch.equal(s.code, first.code):
            raise ValueError(f"cannot fuse NF4 weights {tuple(first.shape)} and {tuple(s.shape)}: K, blocksize and "
                             "table must match")
    parts = [bnb_codes_and_scales(w, s) for w, s in weights]
    codes = torch.cat([c for c, _ in parts]) if len(parts) > 1 else parts[0][0]
    scales = torch.cat([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
    return repack(codes, scales, first.code, first.blocksize, group)


def codes_of(w: RepackedNF4) -> torch.Tensor:
    """(N, K) uint8 codes back from the words (the inverse of repack's permutation)."""
    wide = w.words.to(torch.int64) & 0xFFFFFFFF
    planes = torch.stack([(wide >> (4 * i)) & 15 for i in range(8)], dim=-1)   # (rg, kg, r, j, i)
    rg, kg, rows, lanes, _ = planes.shape
    return planes.permute(0, 2, 1, 4, 3).reshape(rg * rows, kg * 8 * lanes)[: w.n, : w.k].to(torch.uint8)


def bitsandbytes_bytes(w: RepackedNF4, rows: slice = slice(None)) -> torch.Tensor:
    """bitsandbytes' packed uint8 (N'*K/2, 1) for ``rows`` of the weight, byte for byte as it stored them."""
    codes = codes_of(w)[rows]
    return (codes[:, 0::2] << 4 | codes[:, 1::2]).reshape(-1, 1)


def dequantize_reference(w: RepackedNF4) -> torch.Tensor:
    """(N, K) fp32 in plain torch: code[nibble] * scale, the product dequantize_4bit computes."""
    scales = w.scales.permute(0, 2, 1, 3).reshape(w.words.shape[0] * ROWS, -1)[: w.n, : w.k // w.blocksize]
    return w.code[codes_of(w).long()] * scales.repeat_interleave(w.blocksize, dim=1)


def bnb_nbytes(n: int, k: int, blocksize: int = 64, nested: bool = True) -> int:
    """Bytes bitsandbytes keeps for an (n, k) NF4 weight: packed codes, the 16-entry table, absmax, and
    with double quant the second level (absmax2 per 256 blocks, its 256-entry table, the offset)."""
    blocks = -(-n * k // blocksize)
    if not nested:
        return n * k // 2 + 4 * 16 + 4 * blocks
    return n * k // 2 + 4 * 16 + blocks + 4 * -(-blocks // 256) + 4 * 256 + 4


def repacked_nbytes(n: int, k: int, blocksize: int = 64, group: int = 128) -> int:
    """Bytes of ``repack``'s output for an (n, k) weight (words, scales, table: RepackedNF4.nbytes)."""
    n_pad, k_pad = -(-n // ROWS) * ROWS, -(-k // group) * group
    return n_pad * k_pad // 2 + 4 * n_pad * k_pad // blocksize + 4 * 16
