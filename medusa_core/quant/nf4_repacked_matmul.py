"""``y = x @ W.T`` for 1..64 rows against a repacked NF4 weight (nf4_repack.py), in Triton.

One kernel, three constexpr paths over the same step (one group of G columns of BLOCK_N rows):
- GEMV (DOT False, small M): the products x * code stay in fp32 lanes (BLOCK_M, BLOCK_N, G/8) for
  the whole K range; the scale multiplies each block's lane sums (reassociated: one multiply per 64
  values, not per value); the lanes are summed once at the end by a fixed pairwise tree (reshape and
  split, not tl.reduce, whose order depends on the tensor's layout). Split-K over programs, with a
  deterministic reduce of fp32 partials: a second kernel, or (``serial``, a tuner candidate) the last
  split of each output tile to arrive, in the same order, so in the same bits. With PREFETCH the next
  one or two groups' words and scales are loaded before this group is computed, so their latency hides behind
  a group's work (Triton pipelines the tensor-core path's loads itself, but not these, which go to registers).
- tensor cores (DOT True, M >= 5): each plane (BLOCK_N, G/8) is dequantized once, code * scale in
  fp32 cast to x's dtype as bitsandbytes casts its dequantized weight, and enters ``tl.dot`` as the
  tall operand against x.T (G/8, BLOCK_M): every weight tile is decoded once for all the rows. Or
  (WHOLE_GROUP, a tuner candidate) the group's 8 planes as one (BLOCK_N, G) tile in one dot, x's group put
  in the words' column order.
- DEQUANT_ONLY: writes code * scale (fp32) to an (N, K) buffer: the bit-exact test of the layout
  and of the lookup the two matmul paths use.
The 16-entry NF4 table is looked up with ``tl.gather``, which Triton lowers to one shared-memory load
per weight from a 64-byte table (conflict-free: 16 words in 16 banks). Compiled for sm_90 the 1-row
GEMV loop is 5.6 instructions per weight with PREFETCH (6.1 without), against 17.9 with the tree of 15
selects it replaced (``python -m medusa_core.benchmarks.kernel_sass``: a static count, not a timing).
The GEMV's accumulator puts the rows first, so one thread holds every row of a weight and looks it up once.
The tensor-core path can instead look each plane up just before its dot (PLANE_LOOKUP, a tuner choice), and
there without shared memory (DECODE, a tuner choice): by that tree of selects again, or by byte permutes in
inline PTX (nf4_prmt.py), over the table's values compiled in as constants, or over a table of the scale
block's weights already scaled and cast, built in registers; the plane is decoded in the registers its dot
reads (RepackedConfig.decode).

Exact mode: every row's result does not depend on M, because every M runs one kernel: on CUDA the
tensor-core path with one 64-row tile, block_n and split for every M (exact_config), measured row-exact
on an H100; under the interpreter the GEMV with one split, whose elementwise lanes never mix rows. So a
16-row verification gives each row the bits a 1-row step gives it. Fast mode picks GEMV or tensor
cores per M, so its rows may differ by rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.nf4_repacked_matmul needs Triton ({err}): "
                      "pip install 'triton>=3.7'") from None

from . import nf4_matmul as nm
from . import nf4_prmt
from .kernel_timing import (JitLaunch, NoConfigCompiled, compile_ahead, decode_tuning, graph_time_us, pick_fastest,
                            remembered, remembering_now, rotation_count)
from .triton_runtime import bitwise_xor, check_runnable, launchable, unspecialized
from .nf4_repack import ROWS, RepackedNF4


# the count of K groups and a split's share of them: one kernel for every shape and split. Specialized on
# divisibility by 16 and on a share of 1, a 7B load's tuners compiled 196 kernels where 95 now serve
# (benchmarks/compile_ahead.py); each of the 299 distinct launches compiles to the same registers, main loop and
# local memory either way (sm_90, Triton 3.6)
@unspecialized("KG", "groups_per_split")
def _repacked_kernel(x_ptr, w_ptr, s_ptr, code_ptr, bias_ptr, out_ptr, sum_ptr, arrivals_ptr,
                     M, N, K, KG, stride_xm, stride_om, stride_os, stride_sm, groups_per_split,
                     GROUP: tl.constexpr, BLOCKSIZE: tl.constexpr, LOG_LANES: tl.constexpr, DOT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DEQUANT_ONLY: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PREFETCH: tl.constexpr = 0, PLANE_LOOKUP: tl.constexpr = False, SERIAL: tl.constexpr = False,
                     WHOLE_GROUP: tl.constexpr = False, LADDER: tl.constexpr = 0, DECODE: tl.constexpr = "gather",
                     TABLE: tl.constexpr = None, PRMT: tl.constexpr = None, SCALED: tl.constexpr = None):
    # grid: (M tiles, N tiles, K splits): the M tiles of one weight tile are launched side by side, so
    # past the first they read it from L2. BLOCK_N is a multiple of the 16-row group.
    # LADDER (0 in every real call; benchmarks/kernel_ladder.py times the others): 1 = table-free, each code is
    # its nibble's bits under 1.0's (1 + nibble * 2**-23: the mask that extracts it sets them, one LOP3, where an
    # int-to-float conversion would be a slower instruction than the lookup it replaces); 2 = read-only, the
    # words and scales loaded as always and only folded together by XOR: no x, no lookup, no arithmetic.
    LANES: tl.constexpr = GROUP // 8                 # words per row per group = columns per plane
    PER_SCALE: tl.constexpr = BLOCKSIZE // LANES     # planes sharing one scale
    SCALES: tl.constexpr = GROUP // BLOCKSIZE
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    row = offs_n.to(tl.int64)
    slot = (row // 16) * KG * 16 + row % 16          # (BN,) index of (row, group 0) in (N/16, KG, 16)
    lane = tl.arange(0, LANES)
    # the table, once per program: tl.gather below looks it up in shared memory (64 bytes, one word per
    # bank, so no lookup pattern has a bank conflict), one load per weight and no per-element global gather
    table = tl.load(code_ptr + tl.arange(0, 16))
    # plane i's nibbles sit at bits 4*i..4*i+3 of a word; unpacked in the order i = bitreversed(t) so that
    # halving the last axis three times (tl.split takes its low index bit) lists planes 0..7 in order
    shifts = 4 * ((tl.arange(0, 8) & 1) * 4 + (tl.arange(0, 8) & 2) + (tl.arange(0, 8) & 4) // 4)   # (8,)
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)            # DOT
    lanes_acc = tl.full((BLOCK_M, BLOCK_N, LANES), 0.0, tl.float32)   # GEMV
    word_bits = tl.full((BLOCK_N, LANES), 0, tl.int32)                # LADDER 2
    scale_bits = tl.full((BLOCK_N, SCALES), 0, tl.int32)
    g_lo = pid_s * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, KG)
    # (BN, LANES) words: 16 rows x G/2 bytes contiguous per row group; row-only mask keeps 16-byte loads
    word = tl.max_contiguous(tl.multiple_of(lane, LANES), LANES)
    scale_col = tl.arange(0, SCALES)
    # PREFETCH (GEMV): the words and scales of the next PREFETCH groups are in flight while a group is computed
    # (see RepackedConfig.prefetch)
    if PREFETCH >= 1:
        first = (offs_n < tl.where(g_lo < g_hi, N, 0))[:, None]                          # (BN, 1)
        words_next = tl.load(w_ptr + ((slot + g_lo * 16) * LANES)[:, None] + word[None, :], mask=first, other=0)
        scales_next = tl.load(s_ptr + ((slot + g_lo * 16) * SCALES)[:, None] + scale_col[None, :], mask=first,
                              other=0)                                                    # (BN, SCALES)
    if PREFETCH >= 2:
        second = (offs_n < tl.where(g_lo + 1 < g_hi, N, 0))[:, None]
        words_after = tl.load(w_ptr + ((slot + (g_lo + 1) * 16) * LANES)[:, None] + word[None, :], mask=second,
                              other=0)
        scales_after = tl.load(s_ptr + ((slot + (g_lo + 1) * 16) * SCALES)[:, None] + scale_col[None, :],
                               mask=second, other=0)
    for kg in range(g_lo, g_hi):
        if PREFETCH >= 1:
            words = words_next
            scales = scales_next
            if PREFETCH >= 2:
                words_next = words_after
                scales_next = scales_after
            ahead = (offs_n < tl.where(kg + PREFETCH < g_hi, N, 0))[:, None]         # (BN, 1): not past the split
            nxt = slot + (kg + PREFETCH) * 16                                       # (BN,) that group's slots
            loaded = tl.load(w_ptr + (nxt * LANES)[:, None] + word[None, :], mask=ahead, other=0)
            loaded_scales = tl.load(s_ptr + (nxt * SCALES)[:, None] + scale_col[None, :], mask=ahead, other=0)
            if PREFETCH >= 2:
                words_after = loaded
                scales_after = loaded_scales
            else:
                words_next = loaded
                scales_next = loaded_scales
        else:
            words = tl.load(w_ptr + ((slot + kg * 16) * LANES)[:, None] + word[None, :], mask=n_ok[:, None], other=0)
        if LADDER == 2:   # the loads alone: the prefetched scales, or this group's
            if PREFETCH == 0:
                scales = tl.load(s_ptr + ((slot + kg * 16) * SCALES)[:, None] + scale_col[None, :], mask=n_ok[:, None],
                                 other=0)
            word_bits = word_bits ^ words
            scale_bits = scale_bits ^ scales.to(tl.int32, bitcast=True)
        elif WHOLE_GROUP:   # tensor cores, the whole group in one dot (see RepackedConfig.whole_group)
            # position j = l * 8 + p of the group: plane p of word l, which holds column p * LANES + l
            j = tl.arange(0, GROUP)
            spread = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_N, LANES, 8)), (BLOCK_N, GROUP))
            nibs = (spread >> (4 * (j % 8))[None, :]) & 15                                  # (BN, GROUP)
            if LADDER == 1:
                codes = (nibs | 0x3F800000).to(tl.float32, bitcast=True)
            else:
                codes = tl.reshape(tl.gather(table, tl.reshape(nibs, (BLOCK_N * GROUP,)), 0), (BLOCK_N, GROUP))
            scales = tl.load(s_ptr + ((slot + kg * 16) * SCALES)[:, None] + scale_col[None, :], mask=n_ok[:, None],
                             other=0)                                                      # (BN, SCALES)
            # plane p's scale: (BN, SCALES) spread over the group's columns in order (block, q, l: column p * LANES +
            # l), then each position j takes its plane's. A gather, not a reshape into position order: compiled
            # for sm_90 (Triton 3.6) the reshape cost 96 more shared-memory loads a group (198 against 102)
            scale_g = tl.reshape(tl.broadcast_to(scales[:, :, None, None], (BLOCK_N, SCALES, PER_SCALE, LANES)),
                                 (BLOCK_N, GROUP))
            w_g = (codes * tl.gather(scale_g, tl.broadcast_to(((j % 8) * LANES)[None, :], (BLOCK_N, GROUP)), 1)
                   ).to(x_ptr.dtype.element_ty)                                 # bitsandbytes' weight, cast
            # x's group loaded in order (contiguous, vectorized), then put in the weight's column order
            col_g = kg * GROUP + tl.arange(0, GROUP)                                         # (GROUP,)
            if EVEN_K:
                x_ok = m_ok[None, :]
            else:
                x_ok = m_ok[None, :] & (col_g < K)[:, None]
            x_n = tl.load(x_ptr + offs_m[None, :] * stride_xm + col_g[:, None], mask=x_ok, other=0)   # (GROUP, BM)
            x_g = tl.reshape(tl.permute(tl.reshape(x_n, (8, LANES, BLOCK_M)), (1, 0, 2)), (GROUP, BLOCK_M))
            acc = tl.dot(w_g, x_g, acc, input_precision=PRECISION)
        else:   # tensor cores plane by plane, or the GEMV
            if not PLANE_LOOKUP:   # every weight of the step looked up at once: one table fill per step, not per plane
                nibs = (words[:, :, None] >> shifts[None, None, :]) & 15              # (BN, LANES, 8)
                if LADDER == 1:
                    codes = (nibs | 0x3F800000).to(tl.float32, bitcast=True)
                else:
                    codes = tl.reshape(tl.gather(table, tl.reshape(nibs, (BLOCK_N * LANES * 8,)), 0),
                                       (BLOCK_N, LANES, 8))
                lo, hi = tl.split(tl.reshape(codes, (BLOCK_N, LANES, 4, 2)))           # planes 0..3, 4..7
                lo0, lo1 = tl.split(tl.reshape(lo, (BLOCK_N, LANES, 2, 2)))
                hi0, hi1 = tl.split(tl.reshape(hi, (BLOCK_N, LANES, 2, 2)))
                p0, p1 = tl.split(lo0)
                p2, p3 = tl.split(lo1)
                p4, p5 = tl.split(hi0)
                p6, p7 = tl.split(hi1)
                planes = (p0, p1, p2, p3, p4, p5, p6, p7)                            # each (BN, LANES) fp32
            if PREFETCH >= 1:    # the prefetched (BN, SCALES) tile by column, halving like the planes (no tl.sum: see
                #             triton_runtime's note on Triton's jit-decorated standard library)
                if SCALES == 1:
                    block_scales = (tl.reshape(scales, (BLOCK_N,)),)
                elif SCALES == 2:
                    block_scales = tl.split(scales)
                else:
                    even, odd = tl.split(tl.reshape(scales, (BLOCK_N, SCALES // 2, 2)))   # columns 0, 2 | 1, 3
                    s0, s2 = tl.split(even)
                    s1, s3 = tl.split(odd)
                    block_scales = (s0, s1, s2, s3)
            for i in tl.static_range(8):
                if i % PER_SCALE == 0:      # (BN,) the scale of the block planes i.. lie in
                    if PREFETCH >= 1:
                        scale = block_scales[i // PER_SCALE]
                    else:
                        scale = tl.load(s_ptr + (slot + kg * 16) * SCALES + i // PER_SCALE, mask=n_ok, other=0)
                if PLANE_LOOKUP:   # tensor cores: one plane at a time (see RepackedConfig.plane_lookup)
                    if LADDER == 1:
                        code = (((words >> (4 * i)) & 15) | 0x3F800000).to(tl.float32, bitcast=True)
                    elif DECODE == "prmt":   # the table as constants, by byte permutes: see RepackedConfig.decode
                        if i % 4 == 0:     # codes i..i+3 of each word at once (nf4_prmt.py), as fp32 bits
                            quad = tl.inline_asm_elementwise(PRMT[i // 4], "=r,=r,=r,=r,r", [words],
                                                             dtype=(tl.int32,) * 4, is_pure=True, pack=1)
                        code = quad[i % 4].to(tl.float32, bitcast=True)                  # (BN, LANES) fp32
                    elif DECODE == "scaled":   # the block's 16 weights scaled and cast, by byte permutes
                        if i % PER_SCALE == 0:     # (BN,) x 8: the table of this scale block, per row (nf4_prmt.py)
                            tab = tl.inline_asm_elementwise(SCALED[0], "=r,=r,=r,=r,=r,=r,=r,=r,r", [scale],
                                                            dtype=(tl.int32,) * 8, is_pure=True, pack=1)
                        if i % 4 == 0:
                            quad = tl.inline_asm_elementwise(
                                SCALED[1 + i // 4], "=h,=h,=h,=h,r,r,r,r,r,r,r,r,r",
                                [words, tab[0][:, None], tab[1][:, None], tab[2][:, None], tab[3][:, None],
                                 tab[4][:, None], tab[5][:, None], tab[6][:, None], tab[7][:, None]],
                                dtype=(tl.int16,) * 4, is_pure=True, pack=1)
                        code = quad[i % 4].to(x_ptr.dtype.element_ty, bitcast=True)    # (BN, LANES): the weight
                    elif DECODE == "select":   # the table as constants, a tree of 15 selects: see RepackedConfig.decode
                        nib = (words >> (4 * i)) & 15                                     # (BN, LANES) int32
                        b0 = (nib & 1) != 0
                        b1 = (nib & 2) != 0
                        q0 = tl.where(b1, tl.where(b0, TABLE[3], TABLE[2]), tl.where(b0, TABLE[1], TABLE[0]))
                        q1 = tl.where(b1, tl.where(b0, TABLE[7], TABLE[6]), tl.where(b0, TABLE[5], TABLE[4]))
                        q2 = tl.where(b1, tl.where(b0, TABLE[11], TABLE[10]), tl.where(b0, TABLE[9], TABLE[8]))
                        q3 = tl.where(b1, tl.where(b0, TABLE[15], TABLE[14]), tl.where(b0, TABLE[13], TABLE[12]))
                        b2 = (nib & 4) != 0
                        code = tl.where((nib & 8) != 0, tl.where(b2, q3, q2), tl.where(b2, q1, q0))   # fp32
                    else:
                        nib = tl.reshape((words >> (4 * i)) & 15, (BLOCK_N * LANES,))
                        code = tl.reshape(tl.gather(table, nib, 0), (BLOCK_N, LANES))  # (BN, LANES) fp32
                else:
                    code = planes[i]                                                # (BN, LANES) fp32
                col = kg * GROUP + i * LANES + lane                                 # (LANES,) plane i's columns
                k_ok = col < K
                if DEQUANT_ONLY:
                    tl.store(out_ptr + row[:, None] * stride_om + col[None, :], code * scale[:, None],
                             mask=n_ok[:, None] & k_ok[None, :])
                elif DOT:
                    if DECODE == "scaled" and LADDER != 1:
                        w_t = code                                          # cast already: see nf4_prmt.py
                    else:
                        w_t = (code * scale[:, None]).to(x_ptr.dtype.element_ty)      # bitsandbytes' weight, cast
                    if EVEN_K:
                        x_ok = m_ok[None, :]
                    else:
                        x_ok = m_ok[None, :] & k_ok[:, None]
                    x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + col[:, None], mask=x_ok, other=0)  # (LANES, BM)
                    acc = tl.dot(w_t, x_t, acc, input_precision=PRECISION)
                else:
                    if EVEN_K:
                        x_ok = m_ok[:, None]
                    else:
                        x_ok = m_ok[:, None] & k_ok[None, :]
                    xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :], mask=x_ok, other=0).to(tl.float32)
                    prod = xv[:, None, :] * code[None, :, :]                         # (BM, BN, LANES)
                    if i % PER_SCALE == 0:
                        block = prod
                    else:
                        block = block + prod
                    if i % PER_SCALE == PER_SCALE - 1:
                        lanes_acc = lanes_acc + block * scale[None, :, None]
    if not DEQUANT_ONLY:
        if LADDER == 2:   # one XOR per output row, as a float in every column (the store below as usual)
            bits = tl.reduce(word_bits, 1, bitwise_xor) ^ tl.reduce(scale_bits, 1, bitwise_xor)    # (BN,)
            acc = tl.broadcast_to(bits.to(tl.float32)[:, None], (BLOCK_N, BLOCK_M))
        elif not DOT:
            # lanes -> one sum per (row, output): adjacent pairs, halving, the same tree for every element
            red = lanes_acc
            for level in tl.static_range(LOG_LANES):
                a, b = tl.split(tl.reshape(red, (BLOCK_M, BLOCK_N, LANES >> (level + 1), 2)))
                red = a + b
            acc = tl.trans(tl.reshape(red, (BLOCK_M, BLOCK_N)))
        o_ok = n_ok[:, None] & m_ok[None, :]
        if PARTIAL:   # fp32 partials (splits, M, N), added in split order, then the bias: by the reduce kernel,
            #           or (SERIAL) here by whichever split of this tile stores its partials last
            tl.store(out_ptr + pid_s * stride_os + offs_m[None, :] * N + offs_n[:, None], acc, mask=o_ok)
            if SERIAL:
                # every thread's partials stored before the count says so (a barrier, then one thread's
                # release at GPU scope: CUTLASS's serial split-K semaphore, in Triton's words)
                tl.debug_barrier()
                tile = arrivals_ptr + pid_m * tl.num_programs(1) + pid_n
                arrived = tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu")
                if arrived == tl.num_programs(2) - 1:
                    tl.debug_barrier()    # the acquire above precedes every thread's reads below
                    total = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
                    for split in range(tl.num_programs(2)):   # the reduce kernel's order: the same bits
                        # .cg: from L2, where the other SMs' partials are, never a stale line of this SM's L1
                        total += tl.load(out_ptr + split * stride_os + offs_m[None, :] * N + offs_n[:, None],
                                         mask=o_ok, other=0, cache_modifier=".cg")
                    if HAS_BIAS:
                        total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[:, None]
                    tl.store(sum_ptr + offs_m[None, :] * stride_sm + offs_n[:, None],
                             total.to(sum_ptr.dtype.element_ty), mask=o_ok)
                    tl.store(tile, 0)     # zero again for the next call (and the next replay of a graph)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[:, None]
            tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=o_ok)


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
    prefetch: int = 0   # GEMV: groups whose words and scales are loaded before this one is computed (0, 1, 2;
    # the tensor-core path gets the same from Triton's pipeliner, num_stages). On the H100 one group ahead took
    # the 1-row 4096->11008 call from 33 to 20 µs, and splitting K 2, 4 or 8 ways moved it by 1 µs: a program
    # waits on its loads, not on the bytes. Two ahead: 137 registers a thread against 123 (sm_90, Triton 3.9; 128
    # against 120 under 3.6), so 3 programs of 4 warps fit an SM where 4 did: 1.5x the bytes in flight, not 2x.
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
                or (self.dot and self.prefetch) or self.prefetch not in (0, 1, 2) \
                or (self.plane_lookup and not self.dot) \
                or (self.whole_group and (not self.dot or self.plane_lookup)) \
                or self.decode not in DECODES or (self.decode != "gather" and not self.plane_lookup) \
                or (self.serial and self.split_k < 2):
            raise ValueError(f"bad repacked config {self}: block_n a multiple of {ROWS}, block_m a power of two "
                             "(>= 16 with dot), prefetch 0, 1 or 2 and for GEMV only, plane_lookup for dot only, "
                             f"whole_group for dot only and not with plane_lookup, decode one of {DECODES} and other "
                             "than gather with plane_lookup only, serial with split_k >= 2")
        object.__setattr__(self, "prefetch", int(self.prefetch))   # a tuning remembered as true/false reads as 1/0

    def describe(self) -> str:
        return (f"{'dot' if self.dot else 'gemv'} m{self.block_m} n{self.block_n} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}{' prefetch' if self.prefetch else ''}"
                f"{self.prefetch if self.prefetch > 1 else ''}"
                f"{' plane' if self.plane_lookup else ''}{'' if self.decode == 'gather' else ' ' + self.decode}"
                f"{' group' if self.whole_group else ''}"
                f"{' serial' if self.serial else ''}")


def _pow2(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def row_class(m: int) -> int:
    """Row counts sharing a config: 1, 2, 4 (GEMV), 16, 32, 64 (tensor cores; more rows -> 64-row tiles)."""
    return _pow2(m) if m <= 4 else 16 if m <= 16 else 32 if m <= 32 else 64


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
        out.append(dataclasses.replace(first, prefetch=2))     # two groups in flight, and with half the splits:
        out.append(dataclasses.replace(first, prefetch=2,      # each program's loop twice as long to hide them in
                                       split_k=split_for(n, groups, first.block_n, 2 * sms)))
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
    else:
        out.append(dataclasses.replace(first, plane_lookup=False))   # all 8 planes looked up at once
        for block_n, warps, waves in ((64, 4, 1), (64, 4, 4), (128, 8, 2), (32, 4, 2)):
            out.append(RepackedConfig(True, cls, block_n, split_for(n, groups, block_n, waves * sms), warps))
        # the per-plane lookup with more programs (its fewer registers fit more per SM)
        out.append(RepackedConfig(True, cls, 64, split_for(n, groups, 64, 4 * sms), plane_lookup=True))
        out += [dataclasses.replace(first, decode=d) for d in REGISTER_DECODES]   # decoded where the dot reads
        # the whole group in one dot, with 4 warps and with 8 (fewer registers a thread, more programs an SM)
        out.append(dataclasses.replace(first, plane_lookup=False, whole_group=True))
        out.append(dataclasses.replace(first, plane_lookup=False, whole_group=True, num_warps=8))
        # (a 16-row GEMV was timed here until the H100 took 4.0-5.8x the fastest tile for it on all four shapes)
    if first.split_k > 1:   # the default tile with its partials added in the same launch
        out.append(dataclasses.replace(first, serial=True))
        if not first.dot:
            out.append(dataclasses.replace(first, serial=True, prefetch=2))
        else:               # and the scaled lookup's, the tile with the fewest instructions a weight (kernel_sass)
            out.append(dataclasses.replace(first, serial=True, decode="scaled"))
    # two wave targets can give the same split
    return [c for c in dict.fromkeys(out) if scaled or c.decode != "scaled"]


def scaled_fits(w: RepackedNF4, dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """Whether decode scaled runs for ``w`` and x of ``dtype`` (on ``device``): its table holds 16-bit weights
    (bf16 or fp16 x), the 4 planes a lookup decodes share one scale block (group 128 over bitsandbytes' blocks of
    64 do), and a CUDA GPU is sm_80 or later (its paired casts, cvt.rn.bf16x2/f16x2, are not on sm_75, where the
    loader computes in fp16)."""
    return dtype in nf4_prmt.CASTS and w.blocksize >= 4 * (w.group // 8) and \
        (device is None or device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0))


_TUNED: dict[tuple, RepackedConfig] = {}
TUNING_LOG: dict[tuple, list[tuple[str, float | None]]] = {}   # key -> (config, µs or None if skipped)


def _key(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int) -> tuple:
    return torch.cuda.get_device_name(device), row_class(m), n, k, dtype, group


def tune_shape(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> RepackedConfig:
    """CUDA only: time candidates() for M's row class on a random NF4 (n, k) weight, rotating among
    copies larger than L2, each inside a CUDA graph; cache the fastest for choose_config (and, inside
    kernel_timing.remembering, across starts)."""
    key = _key(m, n, k, dtype, device, group)
    best, TUNING_LOG[key] = remembered("repacked", key, lambda: _time_candidates(m, n, k, dtype, device, group, key),
                                       lambda saved: decode_tuning(RepackedConfig, saved))
    _TUNED[key] = best
    return best


def tuning_weight(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int):
    """(a random repacked NF4 (n, k) weight, copies of it that together exceed L2, a generator for inputs)."""
    from bitsandbytes.functional import quantize_4bit

    from .nf4_repack import repack_bnb

    props = torch.cuda.get_device_properties(device)
    gen = torch.Generator(device=device).manual_seed(0)
    dense = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
    w = repack_bnb([quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4")], group)
    del dense
    copies = [w] + [dataclasses.replace(w, words=w.words.clone(), scales=w.scales.clone(),
                                        arrivals=w.arrivals.clone())
                    for _ in range(rotation_count(w.nbytes, props.L2_cache_size) - 1)]
    return w, copies, gen


def _time_candidates(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int,
                     key: tuple) -> tuple[RepackedConfig, list]:
    props = torch.cuda.get_device_properties(device)
    w, copies, gen = tuning_weight(n, k, dtype, device, group)
    x = torch.randn(row_class(m), k, device=device, dtype=dtype, generator=gen)
    configs = candidates(m, n, -(-k // group), props.multi_processor_count, scaled_fits(w, dtype, device))
    compile_candidates(configs, w, [x])
    best, log = pick_fastest(
        configs,
        run=lambda cfg: repacked_matmul(x, w, config=cfg),
        time_us=lambda cfg: graph_time_us([functools.partial(repacked_matmul, x, c, config=cfg) for c in copies],
                                             replays=3),
        where=f"repacked {n}x{k} M<={row_class(m)} on {key[0]}")
    if best is None:
        TUNING_LOG[key] = log       # the skipped configs, for the benchmark's print
        raise NoConfigCompiled(f"no repacked NF4 config compiled for {n}x{k} on {key[0]}")
    return best, log


_EXACT: dict[tuple, RepackedConfig] = {}   # exact mode's config per (GPU, N, K, dtype, group), checked row-exact
EXACT_CHECK_ROWS = (3, 17, 64)             # the calls whose rows are checked against rows alone (tiles part-filled)


def _exact_key(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int) -> tuple:
    return torch.cuda.get_device_name(device), "exact", n, k, dtype, group


def tune_exact(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> RepackedConfig:
    """CUDA only: exact mode's config for this shape on this GPU: of exact_candidates(), those whose every row of a
    3-, 17- and 64-row call has the bits that row gets alone here, the fastest over a 1-row and a 16-row call
    (kernel_timing.AUTO_ROWS); kept for choose_config and, inside kernel_timing.remembering, across starts.
    The check runs on the GPU, not on faith: on the H100 a GEMV exact mode that held under the interpreter was
    not row-exact (docs/performance.md). No candidate passing is NoConfigCompiled, naming the shape."""
    key = _exact_key(n, k, dtype, device, group)
    best, TUNING_LOG[key] = remembered("repacked-exact", key, lambda: _time_exact(n, k, dtype, device, group, key),
                                       lambda saved: decode_tuning(RepackedConfig, saved))
    _EXACT[key] = best
    return best


def exact_tuned(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> RepackedConfig:
    """Exact mode's config for this shape on this GPU, tuned first if this process has not (or inside a load, so
    that its memory counts what it used)."""
    key = _exact_key(n, k, dtype, device, group)
    return tune_exact(n, k, dtype, device, group) if key not in _EXACT or remembering_now() else _EXACT[key]


def _time_exact(n: int, k: int, dtype: torch.dtype, device: torch.device, group: int,
                key: tuple) -> tuple[RepackedConfig, list]:
    from .kernel_timing import AUTO_ROWS

    props = torch.cuda.get_device_properties(device)
    w, copies, gen = tuning_weight(n, k, dtype, device, group)
    x = torch.randn(max(EXACT_CHECK_ROWS), k, device=device, dtype=dtype, generator=gen)

    def checked(cfg: RepackedConfig) -> torch.Tensor:
        alone = torch.cat([repacked_matmul(x[i:i + 1], w, config=cfg) for i in range(x.shape[0])])
        for m in EXACT_CHECK_ROWS:
            if not torch.equal(repacked_matmul(x[:m], w, config=cfg), alone[:m]):
                raise RuntimeError(f"not row-exact: a row of a {m}-row call differs from that row alone")
        return alone

    configs = exact_candidates(n, -(-k // group), props.multi_processor_count, scaled_fits(w, dtype, device))
    # every row count the check and the timing call with: a row count is part of a compiled kernel's key
    compile_candidates(configs, w, [x[:m] for m in sorted({1, *EXACT_CHECK_ROWS, *AUTO_ROWS})])
    best, log = pick_fastest(
        configs, run=checked,
        time_us=lambda cfg: sum(graph_time_us([functools.partial(repacked_matmul, x[:m], c, config=cfg)
                                               for c in copies], replays=3) for m in AUTO_ROWS),
        where=f"repacked exact {n}x{k} on {key[0]}")
    if best is None:
        TUNING_LOG[key] = log
        raise NoConfigCompiled(f"no repacked NF4 config gave every row of {n}x{k} the bits it gets alone on {key[0]}")
    return best, log


def tuned_us(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group: int = 128) -> float:
    """µs of the fastest config timed for M's row class and this shape on this GPU (tuned first if not yet)."""
    key = _key(m, n, k, dtype, device, group)
    if key not in _TUNED or remembering_now():
        tune_shape(m, n, k, dtype, device, group)
    return min(us for _, us in TUNING_LOG[key] if us is not None)


def choose_config(m: int, w: RepackedNF4, dtype: torch.dtype, device: torch.device, exact: bool) -> RepackedConfig:
    groups = -(-w.k // w.group)
    if device.type != "cuda":      # the interpreter: fewest programs (each costs Python time), the same paths
        # exact: numpy's elementwise sums give a row the same bits whatever block_m is; only the split is
        # fixed. Not the tensor cores: numpy's matmul is position-dependent on some CPUs (AVX2 OpenBLAS)
        cfg = RepackedConfig(False, min(_pow2(m), 64), 64, 1) if exact else fast_config(m, w.n, groups, 0)
    elif exact:     # the config tune_exact checked and timed on this GPU, else the one measured exact on an H100
        cfg = _EXACT.get(_exact_key(w.n, w.k, dtype, device, w.group)) or \
            exact_config(w.n, groups, torch.cuda.get_device_properties(device).multi_processor_count)
    else:
        cfg = _TUNED.get(_key(m, w.n, w.k, dtype, device, w.group)) or \
            fast_config(m, w.n, groups, torch.cuda.get_device_properties(device).multi_processor_count)
    if cfg.prefetch and w.group // w.blocksize > PREFETCH_MAX_SCALES:
        cfg = dataclasses.replace(cfg, prefetch=False)       # a weight of small blocks: the kernel cannot
    if cfg.decode == "scaled" and not scaled_fits(w, dtype, device):
        # tuned on bitsandbytes' blocks of 64, kept for the shape: a weight of smaller blocks looks its codes up in
        # shared memory instead, into the same weights for the same dots, so the same bits
        cfg = dataclasses.replace(cfg, decode="gather")
    if cfg.serial and not serial_fits(m, w, cfg):
        # a prefill's rows (class 64's config serves any M above 64) outnumber the arrival counts: the reduce
        # kernel adds the same partials in the same order, so the result has the same bits
        cfg = dataclasses.replace(cfg, serial=False)
    return cfg


def serial_fits(m: int, w: RepackedNF4, cfg: RepackedConfig) -> bool:
    """Whether ``w``'s arrival counts cover every output tile of an M-row call with ``cfg``."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(w.n, cfg.block_n)
    return w.arrivals is not None and tiles <= w.arrivals.numel()


def repacked_matmul(x: torch.Tensor, w: RepackedNF4, bias: torch.Tensor | None = None, *, exact: bool = False,
                    config: RepackedConfig | None = None, ladder: int = 0) -> torch.Tensor:
    """x (..., K) fp16/bf16/fp32 @ W.T (+ bias) -> (..., N) in x's dtype. ``exact``: each row's bits do
    not depend on how many rows are in the call. ``ladder``: benchmarks/kernel_ladder.py's rungs only."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features but the NF4 weight is {w.n}x{w.k}: wrong layer")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the repacked NF4 kernel computes in fp16, bf16 or fp32, got {x.dtype}: cast x first")
    check_runnable(x.device)
    x2 = x.reshape(-1, w.k)                                       # (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)    # (M, N)
    if m:
        cfg = config or choose_config(m, w, x.dtype, x.device, exact)
        if cfg.decode in ("prmt", "scaled") and x.device.type == "cpu":
            raise ValueError(f"decode {cfg.decode} is inline PTX, which Triton's interpreter cannot run: use decode "
                             "select, whose values are the same, on the CPU")
        _launch(x2, w, bias, out, cfg, x.device.type == "cpu", ladder)
    return out.reshape(*x.shape[:-1], w.n)


def _constexprs(w: RepackedNF4, dot: bool, interpret: bool, cfg: RepackedConfig | None) -> dict:
    lanes = w.group // 8
    opts = {} if interpret or cfg is None else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                                "enable_fp_fusion": True}
    return dict(GROUP=w.group, BLOCKSIZE=w.blocksize, LOG_LANES=lanes.bit_length() - 1, DOT=dot,
                EVEN_K=w.k % w.group == 0, **opts)


def kernel_call(x2, w: RepackedNF4, bias, out, cfg: RepackedConfig, interpret: bool, ladder: int = 0) -> tuple:
    """(kernel function, grid, args, keyword args, fp32 partials or None) of one launch: ``_launch``
    runs it, and benchmarks/kernel_sass.py compiles exactly this call for a GPU without one. ``ladder``: the
    kernel with parts taken out, for benchmarks/kernel_ladder.py only (the kernel's LADDER)."""
    m = x2.shape[0]
    if cfg.prefetch and w.group // w.blocksize > PREFETCH_MAX_SCALES:
        raise ValueError(f"prefetch takes at most {PREFETCH_MAX_SCALES} scale blocks per group, and group {w.group} "
                         f"holds {w.group // w.blocksize} of {w.blocksize}: repack with group 128 or use prefetch=False")
    if cfg.decode == "scaled" and x2.dtype not in nf4_prmt.CASTS:
        raise ValueError(f"decode scaled looks up 16-bit weights and x is {x2.dtype}: use bf16 or fp16 x, or decode "
                         "gather")
    if cfg.decode == "scaled" and not scaled_fits(w, x2.dtype):
        raise ValueError(f"decode scaled needs scale blocks of at least {w.group // 2} values at group {w.group}, and "
                         f"this weight's hold {w.blocksize}: repack with group 128 over blocks of 64 or more, or use "
                         "decode gather")
    if cfg.decode != "gather" and len(w.table) != 16:
        raise ValueError(f"decode {cfg.decode} compiles the weight's 16-entry table into the kernel, and this weight "
                         f"has {len(w.table)} values on the host: make it with nf4_repack.repack, which reads them")
    groups = -(-w.k // w.group)
    splits = max(1, min(cfg.split_k, groups))
    per_split = -(-groups // splits)
    splits = -(-groups // per_split)                              # no empty split
    # partials of a split-K launch: allocated per call, so a CUDA graph keeps them in its pool
    part = torch.empty(splits, m, w.n, dtype=torch.float32, device=x2.device) if splits > 1 else None
    serial = cfg.serial and part is not None
    if serial and not serial_fits(m, w, cfg):
        raise ValueError(f"serial split-K needs an arrival count per output tile: {m} rows of {w.n} outputs with "
                         f"{cfg.describe()} are more tiles than this weight's counts (choose_config drops serial)")
    has_bias = bias is not None
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(w.n, cfg.block_n), splits)
    args = (x2, w.words, w.scales, w.code, bias if has_bias else out, part if part is not None else out, out,
            w.arrivals if serial else out, m, w.n, w.k, groups, x2.stride(0), out.stride(0), m * w.n,
            out.stride(0), per_split)
    meta = dict(HAS_BIAS=has_bias, PARTIAL=part is not None, DEQUANT_ONLY=False,
                PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, PREFETCH=cfg.prefetch, PLANE_LOOKUP=cfg.plane_lookup, SERIAL=serial,
                WHOLE_GROUP=cfg.whole_group, LADDER=ladder, DECODE=cfg.decode,
                TABLE=w.table if cfg.decode == "select" else None,
                PRMT=nf4_prmt.halves(w.table) if cfg.decode == "prmt" else None,
                SCALED=nf4_prmt.scaled(w.table, x2.dtype) if cfg.decode == "scaled" else None,
                **_constexprs(w, cfg.dot, interpret, cfg))
    return _repacked_kernel, grid, args, meta, part


def compiled_launch(x2, w: RepackedNF4, cfg: RepackedConfig) -> JitLaunch:
    """The matmul launch ``repacked_matmul(x2, w, config=cfg)`` makes on CUDA (its split-K sum aside)."""
    out = torch.empty(x2.shape[0], w.n, dtype=x2.dtype, device=x2.device)
    fn, grid, args, meta, _ = kernel_call(x2, w, None, out, cfg, interpret=False)
    return launchable(fn, False), grid, args, meta


def compile_candidates(configs: list[RepackedConfig], w: RepackedNF4, xs: list[torch.Tensor]) -> None:
    """Each config's kernel for each input in ``xs``, compiled side by side before a tuner times them
    (kernel_timing.compile_ahead)."""
    compile_ahead([functools.partial(compiled_launch, x, w, cfg) for cfg in configs for x in xs])


def _launch(x2, w: RepackedNF4, bias, out, cfg: RepackedConfig, interpret: bool, ladder: int = 0) -> None:
    _, grid, args, meta, part = kernel_call(x2, w, bias, out, cfg, interpret, ladder)
    launchable(_repacked_kernel, interpret)[grid](*args, **meta)
    if part is not None and not meta["SERIAL"]:
        nm.reduce_partials(part, bias, out, interpret)


def dequantize_repacked(w: RepackedNF4, block_n: int = 32) -> torch.Tensor:
    """(N, K) fp32 through the kernel's own lookup and scale (DEQUANT_ONLY), for bit-exact tests."""
    check_runnable(w.words.device)
    interpret = w.words.device.type == "cpu"
    out = torch.empty(w.n, w.k, dtype=torch.float32, device=w.words.device)
    groups = -(-w.k // w.group)
    launchable(_repacked_kernel, interpret)[(1, triton.cdiv(w.n, block_n), groups)](
        out, w.words, w.scales, w.code, out, out, out, out, 0, w.n, w.k, groups, 0, out.stride(0), 0, 0, 1,
        HAS_BIAS=False, PARTIAL=False, DEQUANT_ONLY=True, PRECISION="ieee", BLOCK_M=1, BLOCK_N=block_n,
        **_constexprs(w, False, interpret, None))
    return out
