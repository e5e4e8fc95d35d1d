"""Which tile the repacked NF4 kernel (nf4_repacked_kernel.py) runs: its config, the untimed choice per row
count, exact mode's one tile for every row count, and the candidates a GPU's tuners time
(nf4_repacked_matmul.py). Plain Python: no Triton needed to name or list a tile."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import nf4_prmt
from .nf4_repack import ROWS


DECODES = ("gather", "select", "prmt", "scaled")    # RepackedConfig.decode
REGISTER_DECODES = ("select", "prmt", "scaled")     # the tuners' candidates beside the gather tile: no shared memory


@dataclass(frozen=True)
class RepackedConfig:
    dot: bool           # False: GEMV lanes (block_m 1..16); True: tl.dot (block_m 16, 32 or 64)
    block_m: int
    block_n: int        # a multiple of 16 (the layout's row group)
    split_k: int        # programs along K (in whole groups); > 1 adds the reduce kernel
    num_warps: int = 4
    num_stages: int = 2
    prefetch: int = 0   # GEMV: groups whose words and scales are in flight while one is computed (0, 1, 2, 3;
    # the tensor-core path gets the same from Triton's pipeliner, num_stages). On the H100 one group ahead took
    # the 1-row 4096->11008 call from 33 to 20 µs, and splitting K 2, 4 or 8 ways moved it by 1 µs: a program
    # waits on its loads, not on the bytes. 1: loaded into registers a group ahead by the kernel. 2: the loop
    # pipelined by Triton (tl.range num_stages 3), its loads copied asynchronously into shared memory two groups
    # ahead. Two groups ahead in registers, as 2 was until 2026-11-29, cannot be: the loop hands the loaded
    # registers on at its end (words_next = words_after), and that copy waits for the load issued at the loop's
    # top, one group's work before, as depth 1 does (the SASS's load-to-first-use distance, sm_90). It took
    # 128 registers and measured slower than depth 1 on every shape on the H200. Pipelined, compiled for sm_90
    # (Triton 3.6, 4096->11008, one row): 96 registers, 2 barriers a group against depth 1's 120 and 8.
    # 3: the same, three groups ahead (tl.range num_stages 4). Why: on the H200 (11-29) each group more in flight
    # took the 1-row 4096->11008 call down (none 33.2 µs, 1 20.3, 2 with x 18.6), and loading alone reached 60%
    # of the copy bandwidth (kernel_ladder): a program's loads are still waited on.
    x_ahead: bool = False   # GEMV with prefetch: x's next group loaded with the words, as 8 planes in registers.
    # Without it each plane's x is loaded just before its products: compiled for sm_90, 16 to 59 instructions
    # ahead of its first use, an L1 or L2 round trip 8 times a group. At one row, with prefetch 2: 80 registers
    # (6 programs of 4 warps an SM, against depth 1's 4) at 5.9 instructions a weight against 5.6. At 2 and 4 rows
    # it costs registers and instructions (96 against 64, 127 against 106), so the tuners try it at one row.
    plane_lookup: bool = False   # tensor cores: look each plane up just before its dot, not all 8 at once.
    # Compiled for sm_90 (kernel_sass, M = 16): 8.5 instructions per weight against 9.6, 64 registers
    # against 96, 8-byte shared stores of the dequantized tile against 2-byte ones, but 33 barriers a
    # group against 19 (Triton refills the table per lookup). Which is faster is the GPU's to measure.
    whole_group: bool = False    # tensor cores: the group's 8 planes dequantized into one (BLOCK_N, G) tile and
    # multiplied in one dot (K = G), its columns in the order the words hold them (x loaded in the same order),
    # where the plane paths make 8 dots of K = G/8. Why: compiled for sm_90 each dot's operand goes through
    # shared memory with its barriers, and on the H200 (2026-11-28) the 16-row tile took 2x the one-row GEMV on
    # the same bytes (37.7 against 18.9 µs, 4096->11008), 3.6x the static issue estimate. Compiled for sm_90
    # (Triton 3.6, kernel_sass, M = 16, 4 warps): 4 barriers a group against the plane lookup's 33, at 8.8
    # instructions per weight against 7.8 and 158 registers against 56 (8 warps: 105 registers, 11.8). Which
    # is faster is the GPU's to measure. Fast mode's sums run in another order, within rounding; exact mode
    # times it only where tune_exact finds its rows exact on the GPU.
    decode: str = "gather"   # tensor cores, one plane at a time: how a code becomes its table value. "gather":
    # tl.gather from the table in shared memory. "select" and "prmt": the weight's 16 values compiled into the
    # kernel as constants (RepackedNF4.table), picked by a tree of 15 selects or, in inline PTX, by byte permutes
    # (nf4_prmt.py; NVIDIA GPUs only, not under the interpreter). Why: compiled for sm_90 (Triton 3.6, kernel_sass,
    # M = 16, 4 warps) the gather tile's loop has 33 barriers a group, 31 of them the table's refills before each
    # plane's gather, and stores each dequantized plane to shared memory to reload it in the dot's layout. With
    # only constants between the loaded word and the dot, Triton decodes the plane in the dot operand's registers
    # instead: 2 barriers and no shared stores for both, at 17.7 instructions a weight and 56 registers (select)
    # or 11.5 and 101 (prmt), against the gather tile's 7.8 and 56. The same codes in the same dots (the same bits
    # under the interpreter, prmt's assembly run by its Python model; tests/test_cuda_repacked.py checks both on
    # the GPU). Which is faster is the GPU's to measure. Only with plane_lookup: the other tiles keep barriers (9 and 2, at 144 and 96 registers
    # with the selects) and add instructions. "scaled": byte permutes over a table built in registers per row and
    # scale block, its 16 entries already code * scale cast to x's 16-bit type (nf4_prmt.py): the dot gets its
    # weights with no multiply or cast left, and the permutes look up 2 bytes a weight where prmt's look up 4.
    # Compiled the same way: 2 barriers, no shared stores, 7.4 instructions a weight at 69 registers; the same
    # bits (each entry rounded as the cast rounds). bf16 or fp16 x, and a scale block covering a word's 4 planes
    # (scaled_fits).
    serial: bool = False     # split-K: the last split of each output tile to store its partials adds them all
    # (an atomic arrival count per tile), in place of the reduce kernel: one launch where there were two, and
    # the same sum in the same order, so the same bits. The configs an H100 tuned for one row (2026-11-27) split
    # K on the three decoder shapes, so a 1-row step launched a reduce kernel after each of its ~160
    # projections; what that second launch costs, and the atomics instead, is the GPU's to measure.

    def __post_init__(self):
        if self.block_n % ROWS or self.block_m & (self.block_m - 1) or (self.dot and self.block_m < 16) \
                or (self.dot and self.prefetch) or self.prefetch not in (0, 1, 2, 3) \
                or (self.plane_lookup and not self.dot) \
                or (self.whole_group and (not self.dot or self.plane_lookup)) \
                or self.decode not in DECODES or (self.decode != "gather" and not self.plane_lookup) \
                or (self.serial and self.split_k < 2) or (self.x_ahead and not self.prefetch):
            raise ValueError(f"bad repacked config {self}: block_n a multiple of {ROWS}, block_m a power of two "
                             "(>= 16 with dot), prefetch 0 to 3 and for GEMV only, plane_lookup for dot only, "
                             f"whole_group for dot only and not with plane_lookup, decode one of {DECODES} and other "
                             "than gather with plane_lookup only, serial with split_k >= 2, x_ahead with prefetch only")
        object.__setattr__(self, "prefetch", int(self.prefetch))   # a tuning remembered as true/false reads as 1/0

    def describe(self) -> str:
        return (f"{'dot' if self.dot else 'gemv'} m{self.block_m} n{self.block_n} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}{' prefetch' if self.prefetch else ''}"
                f"{self.prefetch if self.prefetch > 1 else ''}{' x' if self.x_ahead else ''}"
                f"{' plane' if self.plane_lookup else ''}{'' if self.decode == 'gather' else ' ' + self.decode}"
                f"{' group' if self.whole_group else ''}"
                f"{' serial' if self.serial else ''}")


def next_pow2(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def row_class(m: int) -> int:
    """Row counts sharing a config: 1, 2, 4 (GEMV), 16, 32, 64 (tensor cores; more rows -> 64-row tiles)."""
    return next_pow2(m) if m <= 4 else 16 if m <= 16 else 32 if m <= 32 else 64


def split_for(n: int, groups: int, block_n: int, programs: int, min_groups: int = 4) -> int:
    """The smallest power-of-two split-K giving ``programs`` programs, each at least ``min_groups`` groups."""
    split = 1
    while -(-n // block_n) * split < programs and groups // (split * 2) >= min_groups:
        split *= 2
    return split


PREFETCH_MAX_SCALES = 4     # scale blocks per group the GEMV's prefetch splits out (1, 2 or 4)

# Block sizes below: no spills and at most 128 registers compiled for sm_90 with Triton 3.9
# (benchmarks/kernel_sass.py, GPU-less). The lane accumulators cost block_m * block_n * G/8 fp32 per program.


def exact_config(n: int, groups: int, sms: int) -> RepackedConfig:
    """Exact mode on CUDA: the tensor-core path with one 64-row tile, block_n and split for every M (a
    function of N, K and the GPU only), so every M runs the same kernel and an output row's bits do not
    depend on its position in the tile or on how many rows came with it. Measured on an H100 (2026-11-27,
    docs/perf/h100-2026-11-27): every row of M = 2..64 equals that row alone, on all four 7B shapes, at
    48 µs for 16 rows of 4096->11008 where fast mode takes 38. The GEMV exact mode before it, whose
    block_m followed M, was measured not exact there from M = 4 up (M = 2 on 4096->32000): compiled for
    another block_m, a row's sums came out in other bits, which the interpreter cannot show."""
    return RepackedConfig(True, 64, 64, split_for(n, groups, 64, 2 * sms))


def exact_candidates(n: int, groups: int, sms: int, scaled: bool = True) -> list[RepackedConfig]:
    """Exact mode's configs worth timing on a GPU, each one tile, block_n and split for every M: the measured
    one-tile config first (the reference), then 16-row tiles. A 16-row tile dequantizes the weight once per 16
    rows, so a 1-row call reads and unpacks what fast mode's 16-row path does: on the H100 that path took 37 µs
    on 4096->11008 at 16 rows, where the 64-row tile took 46 at one row (2026-11-27, third run). Exact mode's trees
    are small (its default is the 16-node NF4 tree), and the tile is timed, not assumed: its rows are checked
    equal to rows alone on the GPU before it is timed (``tune_exact``). ``scaled``: whether the weight and dtype
    can run decode scaled (scaled_fits)."""
    first = exact_config(n, groups, sms)
    out = [first, dataclasses.replace(first, plane_lookup=True)]
    for waves, plane in ((2, False), (2, True), (4, True)):
        out.append(RepackedConfig(True, 16, 64, split_for(n, groups, 64, waves * sms), plane_lookup=plane))
    plane = RepackedConfig(True, 16, 64, split_for(n, groups, 64, 2 * sms), plane_lookup=True)
    out += [dataclasses.replace(plane, decode=d) for d in REGISTER_DECODES]     # decoded where its dot reads
    out.append(RepackedConfig(True, 16, 64, split_for(n, groups, 64, 2 * sms), whole_group=True))
    return [c for c in dict.fromkeys(out) if scaled or c.decode != "scaled"]


def fast_config(m: int, n: int, groups: int, sms: int) -> RepackedConfig:
    """Untimed per-M choice: GEMV up to 4 rows, tensor cores from 5, ~2-4 waves of programs. A GPU
    session's tune_shape() replaces it per (GPU, shape, row class). The tensor cores look each plane up
    before its dot: on the H100 (third run, docs/perf/h100-2026-11-27c/kernels.log) that was the fastest
    tile, or within 5% of it, in all 12 (shape, row class) pairs from 16 rows, where the same tile looking
    all planes up at once took 1.07-1.44x as long."""
    cls = row_class(m)
    if cls <= 4:
        block_n = 64 if cls == 1 else 32
        return RepackedConfig(False, cls, block_n, split_for(n, groups, block_n, 4 * sms), prefetch=1)
    return RepackedConfig(True, cls, 64, split_for(n, groups, 64, 2 * sms), plane_lookup=True)


def candidates(m: int, n: int, groups: int, sms: int, scaled: bool = True) -> list[RepackedConfig]:
    """Configs worth timing for one row class on a GPU: the untimed default first (the reference the
    others must match in pick_fastest), then other tiles, splits and the other path. ``scaled``: whether the
    weight and dtype can run decode scaled (scaled_fits)."""
    cls = row_class(m)
    first = fast_config(m, n, groups, sms)
    out = [first]
    if cls <= 4:
        out.append(dataclasses.replace(first, prefetch=0))     # what the prefetch's registers cost
        # two groups in flight (at one row with x a group ahead: the fewest registers, sm_90), and with half the
        # splits: each program's loop twice as long to hide them in
        deep = dataclasses.replace(first, prefetch=2, x_ahead=cls == 1)
        out += [deep, dataclasses.replace(deep, split_k=split_for(n, groups, first.block_n, 2 * sms))]
        if cls == 1:
            out.append(dataclasses.replace(first, x_ahead=True))
            # three groups in flight: each group more took the H200's 1-row call down (see prefetch), and its
            # serial sum, the pick at two
            deeper = dataclasses.replace(deep, prefetch=3)
            out += [deeper, *([dataclasses.replace(deeper, serial=True)] if deeper.split_k > 1 else [])]
        for block_n, warps, waves in ((first.block_n, 4, 2), (first.block_n, 4, 8), (2 * first.block_n, 8, 4),
                                      (16, 4, 4)):
            out.append(RepackedConfig(False, cls, block_n, split_for(n, groups, block_n, waves * sms), warps,
                                      prefetch=1))
        out.append(RepackedConfig(True, 16, 64, split_for(n, groups, 64, 2 * sms)))
        # and the 16-row tiles whose decode needs no shared memory: on the H200 the
        # GEMV took 24-36 µs at 2 and 4 rows where the gather tile took 35-38 at 16, so a faster 16-row tile would
        # serve them too
        plane = RepackedConfig(True, 16, 64, split_for(n, groups, 64, 2 * sms), plane_lookup=True)
        out += [dataclasses.replace(plane, decode=d) for d in REGISTER_DECODES]
        if cls > 1:     # and the 16-row class's pick on the H200 (11-29): with it only there, 4 rows took 31.6 µs on
            # 4096->11008 and 8 rows 27.6: a 4-node tree's projections cost more than an 8-node tree's
            three = dataclasses.replace(plane, decode="scaled", num_stages=3)
            out += [three, *([dataclasses.replace(three, serial=True)] if three.split_k > 1 else [])]
    else:
        out.append(dataclasses.replace(first, plane_lookup=False))   # all 8 planes looked up at once
        for block_n, warps, waves in ((64, 4, 1), (64, 4, 4), (128, 8, 2), (32, 4, 2)):
            out.append(RepackedConfig(True, cls, block_n, split_for(n, groups, block_n, waves * sms), warps))
        # the per-plane lookup with more programs (its fewer registers fit more per SM)
        out.append(RepackedConfig(True, cls, 64, split_for(n, groups, 64, 4 * sms), plane_lookup=True))
        out += [dataclasses.replace(first, decode=d) for d in REGISTER_DECODES]   # decoded where the dot reads
        if cls == 16:   # the scaled tile with two groups in flight: compiled for sm_90 (Triton 3.6), three stages
            # hold the same 69 registers as two, in 21.5 KB of shared memory against 12.8, so 7 programs an SM still
            # fit (at 64 rows the 58 KB of three stages would let 3 fit where registers let 5); whether the tile's
            # loads wait is the GPU's to say
            out.append(dataclasses.replace(first, decode="scaled", num_stages=3))
        # the whole group in one dot, with 4 warps and with 8 (fewer registers a thread, more programs an SM)
        out.append(dataclasses.replace(first, plane_lookup=False, whole_group=True))
        out.append(dataclasses.replace(first, plane_lookup=False, whole_group=True, num_warps=8))
        # (a 16-row GEMV was timed here until the H100 took 4.0-5.8x the fastest tile for it on all four shapes)
    if first.split_k > 1:   # the default tile with its partials added in the same launch
        out.append(dataclasses.replace(first, serial=True))
        if not first.dot:
            out.append(dataclasses.replace(deep, serial=True))
        else:               # and the scaled lookup's, the tile with the fewest instructions a weight (kernel_sass)
            out.append(dataclasses.replace(first, serial=True, decode="scaled"))
            if cls == 16:   # and three stages deep: the H200 (11-29) kept that tile on every 7B shape at 16 rows,
                # with a split of 2 or 8 there, so its 16-node step launched the reduce kernel after 96 of its
                # projections (0.113 ms of its 5.06, profile.log); the sum in the same launch is the same bits
                out.append(dataclasses.replace(first, serial=True, decode="scaled", num_stages=3))
    # two wave targets can give the same split
    return [c for c in dict.fromkeys(out) if scaled or c.decode != "scaled"]


def scaled_fits(blocksize: int, group: int, dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """Whether decode scaled runs for a weight of scale blocks of ``blocksize`` repacked in groups of ``group``, and
    x of ``dtype`` (on ``device``): its table holds 16-bit weights (bf16 or fp16 x), the 4 planes a lookup decodes
    share one scale block (group 128 over bitsandbytes' blocks of 64 do), and a CUDA GPU is sm_80 or later (its
    paired casts, cvt.rn.bf16x2/f16x2, are not on sm_75, where the loader computes in fp16)."""
    return dtype in nf4_prmt.CASTS and blocksize >= 4 * (group // 8) and \
        (device is None or device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0))

