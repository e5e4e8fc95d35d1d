"""The repacked NF4 kernel: ``y = x @ W.T`` for 1..64 rows against a repacked NF4 weight (nf4_repack.py), as
one Triton program. Which tile a call runs is nf4_repacked_configs.py's; launching and tuning it,
nf4_repacked_matmul.py's.

One kernel, three constexpr paths over the same step (one group of G columns of BLOCK_N rows):
- GEMV (DOT False, small M): the products x * code stay in fp32 lanes (BLOCK_M, BLOCK_N, G/8) for
  the whole K range; the scale multiplies each block's lane sums (reassociated: one multiply per 64
  values, not per value); the lanes are summed once at the end by a fixed pairwise tree (reshape and
  split, not tl.reduce, whose order depends on the tensor's layout). Split-K over programs, with a
  deterministic reduce of fp32 partials: a second kernel, or (``serial``, a tuner candidate) the last
  split of each output tile to arrive, in the same order, so in the same bits. With PREFETCH 1 the next
  group's words and scales are loaded into registers before this group is computed, so their latency hides
  behind a group's work; with PREFETCH 2 (3) Triton's pipeliner keeps the next two (three) groups' in flight,
  copied asynchronously into shared memory (it pipelines the tensor-core path's loads by itself, these only when
  the loop asks). X_AHEAD loads x's next group with them (RepackedConfig.prefetch, x_ahead).
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
"""

from __future__ import annotations

try:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.nf4_repacked_kernel needs Triton ({err}): "
                      "pip install 'triton>=3.7'") from None

from .triton_runtime import bitwise_xor, helper, unspecialized


@helper
def _x_planes(x_ptr, offs_m, stride_xm, kg, rows, K, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """The 8 planes of x's group ``kg`` (rows below ``rows``), each (BM, G/8) in x's dtype, as a tuple."""
    LANES: tl.constexpr = GROUP // 8
    lane = tl.arange(0, LANES)
    planes = ()
    for i in tl.static_range(8):
        col = kg * GROUP + i * LANES + lane
        if EVEN_K:
            ok = (offs_m < rows)[:, None]
        else:
            ok = (offs_m < rows)[:, None] & (col < K)[None, :]
        planes = planes + (tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :], mask=ok, other=0),)
    return planes


@helper
def _l2_prefetch(ptrs):
    """Fetch what ``ptrs`` point at into L2 (PTX prefetch.global.L2), loading nothing into registers: an instruction
    with a side effect, which the compiler neither drops nor moves past the dependent launch's wait."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


# the count of K groups and a split's share of them: one kernel for every shape and split. Specialized on
# divisibility by 16 and on a share of 1, a 7B load's tuners compiled 196 kernels where 95 now serve
# (benchmarks/compile_ahead.py); each of the 299 distinct launches compiles to the same registers, main loop and
# local memory either way (sm_90, Triton 3.6)
@unspecialized("KG", "groups_per_split")
def repacked_kernel(x_ptr, w_ptr, s_ptr, code_ptr, bias_ptr, out_ptr, sum_ptr, arrivals_ptr,
                     M, N, K, KG, stride_xm, stride_om, stride_os, stride_sm, groups_per_split,
                     GROUP: tl.constexpr, BLOCKSIZE: tl.constexpr, LOG_LANES: tl.constexpr, DOT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DEQUANT_ONLY: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PREFETCH: tl.constexpr = 0, PLANE_LOOKUP: tl.constexpr = False, SERIAL: tl.constexpr = False,
                     WHOLE_GROUP: tl.constexpr = False, LADDER: tl.constexpr = 0, DECODE: tl.constexpr = "gather",
                     TABLE: tl.constexpr = None, PRMT: tl.constexpr = None, SCALED: tl.constexpr = None,
                     X_AHEAD: tl.constexpr = False, PDL: tl.constexpr = False):
    # grid: (M tiles, N tiles, K splits): the M tiles of one weight tile are launched side by side, so
    # past the first they read it from L2. BLOCK_N is a multiple of the 16-row group.
    # LADDER (0 in every real call; benchmarks/kernel_ladder.py times the others): 1 = table-free, each code is
    # its nibble's bits under 1.0's (1 + nibble * 2**-23: the mask that extracts it sets them, one LOP3, where an
    # int-to-float conversion would be a slower instruction than the lookup it replaces); 2 = read-only, the
    # words and scales loaded as always and only folded together by XOR: no x, no lookup, no arithmetic.
    LANES: tl.constexpr = GROUP // 8                 # words per row per group = columns per plane
    PER_SCALE: tl.constexpr = BLOCKSIZE // LANES     # planes sharing one scale
    SCALES: tl.constexpr = GROUP // BLOCKSIZE
    if PDL:     # launched as a dependent (triton_runtime.set_dependent_launch): the next kernel may start
        gdc_launch_dependents()
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
    # PREFETCH 1 (GEMV): the next group's words and scales are in flight while a group is computed; PREFETCH 2 or 3:
    # Triton's pipeliner keeps the next two or three groups' in flight instead; X_AHEAD: x's next group too (see
    # RepackedConfig.prefetch and x_ahead)
    if PREFETCH == 1:
        first = (offs_n < tl.where(g_lo < g_hi, N, 0))[:, None]                          # (BN, 1)
        words_next = tl.load(w_ptr + ((slot + g_lo * 16) * LANES)[:, None] + word[None, :], mask=first, other=0)
        scales_next = tl.load(s_ptr + ((slot + g_lo * 16) * SCALES)[:, None] + scale_col[None, :], mask=first,
                              other=0)                                                    # (BN, SCALES)
    if PDL:
        if PREFETCH != 1:   # loads that Triton's pipeliner or the loop issues, after the wait: the first two groups'
            # weights are fetched into L2 now instead, while the kernel before runs
            for ahead in tl.static_range(2):
                # a row past N points at the first word, a group past the split at the split's last group: every
                # address lies in the weight (an instruction without a mask)
                nxt = slot + tl.minimum(g_lo + ahead, g_hi - 1) * 16
                _l2_prefetch(tl.where(n_ok[:, None], w_ptr + (nxt * LANES)[:, None] + word[None, :], w_ptr))
                _l2_prefetch(tl.where(n_ok[:, None], s_ptr + (nxt * SCALES)[:, None] + scale_col[None, :], s_ptr))
        # the kernel before has ended and its writes are seen: x (and every store) only from here on; the table and
        # (prefetch 1) the first group's weights above, which no kernel writes, were loaded while it ran
        gdc_wait()
    if X_AHEAD:
        x_next = _x_planes(x_ptr, offs_m, stride_xm, g_lo, tl.where(g_lo < g_hi, M, 0), K, GROUP, EVEN_K)
    for kg in tl.range(g_lo, g_hi, num_stages=PREFETCH + 1 if PREFETCH >= 2 else None):
        if X_AHEAD:
            xs = x_next
            x_next = _x_planes(x_ptr, offs_m, stride_xm, kg + 1, tl.where(kg + 1 < g_hi, M, 0), K, GROUP, EVEN_K)
        if PREFETCH == 1:
            words = words_next
            scales = scales_next
            ahead = (offs_n < tl.where(kg + 1 < g_hi, N, 0))[:, None]                 # (BN, 1): not past the split
            nxt = slot + (kg + 1) * 16                                              # (BN,) that group's slots
            words_next = tl.load(w_ptr + (nxt * LANES)[:, None] + word[None, :], mask=ahead, other=0)
            scales_next = tl.load(s_ptr + (nxt * SCALES)[:, None] + scale_col[None, :], mask=ahead, other=0)
        else:
            words = tl.load(w_ptr + ((slot + kg * 16) * LANES)[:, None] + word[None, :], mask=n_ok[:, None], other=0)
            if PREFETCH >= 2:
                scales = tl.load(s_ptr + ((slot + kg * 16) * SCALES)[:, None] + scale_col[None, :], mask=n_ok[:, None],
                                 other=0)                                                  # (BN, SCALES)
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
                    if X_AHEAD:
                        xv = xs[i].to(tl.float32)
                    else:
                        xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :], mask=x_ok,
                                     other=0).to(tl.float32)
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

