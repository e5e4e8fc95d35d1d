"""The Triton programs behind nf4_matmul.py: ``y = x @ W.T`` for a few activation rows against a bitsandbytes NF4
weight as bitsandbytes stores it, and the deterministic split-K sum the repacked kernel shares.

They read the packed weight and its QuantState exactly as bitsandbytes stores them (no repacking, no second
copy) and dequantize each tile in registers right before the multiply.

Storage (bitsandbytes 0.50): ``weight.data`` uint8 [(N*K+1)//2, 1] is W[N, K] row-major,
element 2j in the high nibble, 2j+1 in the low one; ``code`` fp32 [16] the NF4 table; one scale
per ``blocksize`` (64) consecutive elements. With double quant the scales are themselves uint8:
scale[b] = code2[absmax[b]] * absmax2[b // blocksize2] + offset.
W.flat[e] = code[nibble(e)] * scale[e // blocksize] in fp32, cast to the compute dtype.

Two kernels compute the transposed product (W_tile @ x_tile.T, so the weight is the MMA's tall
operand and a tiny M only pads the narrow side), accumulate in fp32, and optionally split K over
programs with a second, deterministic reduce kernel (``reduce_kernel``): ``tile_kernel`` (any K, one
scale block at a time, loads then waits) and ``stream_kernel`` (K a multiple of its step: keeps 2-4 steps
of packed words in flight, unpacks with shifts, scales block sums instead of weights).
"""

from __future__ import annotations

try:
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.nf4_storage_kernels needs Triton ({err}): pip install 'triton>=3.7'") \
        from None

from .triton_runtime import add


def tile_kernel(x_ptr, w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, bias_ptr, out_ptr,
                M, N, K, stride_xm, stride_om, stride_os, k_per_split,
                BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, ALIGNED: tl.constexpr,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DEQUANT_ONLY: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # grid: (N tiles, K splits, M tiles). A program owns W[BLOCK_N rows, its K range] and, unless
    # DEQUANT_ONLY (which writes the fp32 tile to out[N, K] instead), BLOCK_M rows of x.
    # BLOCK_M == 1: broadcast-multiply, reduced once at the end; BLOCK_M >= 16: tl.dot (an MMA).
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    HALF: tl.constexpr = BLOCKSIZE // 2            # packed bytes (= element pairs) per scale block
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    row = offs_n.to(tl.int64)                      # N*K passes 2**31 for vocab projections
    pair = tl.arange(0, HALF)
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    acc1 = tl.full((BLOCK_N, HALF), 0.0, tl.float32)     # BLOCK_M == 1: per-lane partial sums
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for kb in range(k_lo, k_hi, BLOCKSIZE):
        # one scale block (BLOCKSIZE columns) of BLOCK_N rows per step; 2D tiles only
        col = kb + 2 * pair                                               # (HALF,) even columns
        if ALIGNED:
            # the whole block lies inside [k_lo, k_hi): a row-only mask keeps the loads vectorized
            ok = n_ok[:, None]                                            # (BN, 1)
            x_kok = pair >= 0
        else:
            ok = n_ok[:, None] & (col < k_hi)[None, :]                    # (BN, HALF); K even: col+1 < K too
            x_kok = col < k_hi
        # byte offsets written as kb/2 + pair (not col // 2) so Triton sees them contiguous and loads
        # 16 bytes per thread along K; masked lanes read nothing, so the packed buffer is never read past
        byte = tl.max_contiguous(tl.multiple_of(kb // 2 + pair, HALF), HALF)
        packed = tl.load(w_ptr + row[:, None] * (K // 2) + byte[None, :], mask=ok, other=0)
        # the 16-entry table sits in one cache line: each gather costs one load
        code_even = tl.load(code_ptr + (packed >> 4).to(tl.int32))
        code_odd = tl.load(code_ptr + (packed & 15).to(tl.int32))
        if ALIGNED:   # K % BLOCKSIZE == 0: a scale block never straddles rows; one scale per row
            blk = row * (K // BLOCKSIZE) + kb // BLOCKSIZE                           # (BN,)
            blk_ok = n_ok
        else:         # blocks straddle rows: one scale per element pair (blocksize is even)
            blk = (row[:, None] * K + col[None, :]) // BLOCKSIZE                     # (BN, HALF)
            blk_ok = ok
        scale = tl.load(absmax_ptr + blk, mask=blk_ok, other=0)
        if NESTED:
            # bitsandbytes rounds the product before adding the offset (no FMA: see enable_fp_fusion)
            scale = (tl.load(code2_ptr + scale.to(tl.int32))
                     * tl.load(absmax2_ptr + blk // BLOCKSIZE2, mask=blk_ok, other=0)) + tl.load(offset_ptr)
        if ALIGNED:
            scale = scale[:, None]
        w_even = code_even * scale                                    # (BN, HALF) fp32
        w_odd = code_odd * scale
        if DEQUANT_ONLY:
            dst = out_ptr + row[:, None] * stride_om + col[None, :]
            tl.store(dst, w_even, mask=ok)
            tl.store(dst + 1, w_odd, mask=ok)
        else:
            # cast to the compute dtype as bitsandbytes does before its GEMM
            we = w_even.to(x_ptr.dtype.element_ty)
            wo = w_odd.to(x_ptr.dtype.element_ty)
            if BLOCK_M == 1:
                xe = tl.load(x_ptr + offs_m * stride_xm + col, mask=x_kok & m_ok, other=0)   # (HALF,)
                xo = tl.load(x_ptr + offs_m * stride_xm + col + 1, mask=x_kok & m_ok, other=0)
                acc1 += we.to(tl.float32) * xe.to(tl.float32)[None, :]
                acc1 += wo.to(tl.float32) * xo.to(tl.float32)[None, :]
            else:
                x_src = x_ptr + offs_m[None, :] * stride_xm + col[:, None]      # (HALF, BM): x.T
                x_ok = x_kok[:, None] & m_ok[None, :]
                xe = tl.load(x_src, mask=x_ok, other=0)
                xo = tl.load(x_src + 1, mask=x_ok, other=0)
                acc = tl.dot(we, xe, acc, input_precision=PRECISION)
                acc = tl.dot(wo, xo, acc, input_precision=PRECISION)
    if not DEQUANT_ONLY:
        if BLOCK_M == 1:
            acc += tl.reduce(acc1, 1, add)[:, None]
        o_ok = n_ok[:, None] & m_ok[None, :]
        if PARTIAL:   # fp32 partial sums (splits, M, N); the reduce kernel adds bias and casts
            tl.store(out_ptr + pid_s * stride_os + offs_m[None, :] * N + offs_n[:, None], acc, mask=o_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[:, None]
            dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


def stream_kernel(x_ptr, w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, bias_ptr, out_ptr,
                  M, N, K, row_words, stride_xm, stride_om, stride_os, k_per_split,
                  BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                  HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, SLOTS: tl.constexpr,
                  X_WORDS: tl.constexpr):
    # The streaming variant: same grid and output as tile_kernel, for K and k_per_split multiples of
    # SLOTS * SUB * BLOCKSIZE (no K mask at all). What differs is how much weight is in flight:
    # - a step takes SUB scale blocks of BLOCK_N rows, SUB * BLOCKSIZE/2 contiguous bytes per row, as a
    #   (BLOCK_N, SUB, WORDS) tile of 32-bit words (4 bytes a register, unpacked with shifts only when
    #   multiplied) whose per-block scale broadcasts along the last axis (no gather);
    # - SLOTS raw tiles (words + scale bytes) are in flight: the loop body is unrolled over the slots;
    #   each step multiplies the oldest slot, fetches the step SLOTS ahead and shifts the slots. The shift
    #   renames values inside the unrolled body and comes full circle at the loop's end, so no register
    #   copy ever waits on a load (a ring carried by moves would wait on every refill); the loop starts
    #   one group early, and that group only fills the slots;
    # - row_words (= K/8) is an argument, so Triton specializes it as a multiple of 16 and proves every
    #   row's words 16-byte aligned (the launcher checks the weight's own pointer is 4-byte aligned);
    # - the scale multiplies per-block sums, not weights, where it can: BLOCK_M == 1 sums code*x per
    #   block, then scales; SUB == 1 with an MMA scales the (BLOCK_N, BLOCK_M) dot of the raw codes
    #   (s * sum_k code*x: reassociated, within rounding);
    # - X_WORDS (16-bit x, 4-byte aligned rows): x is read as 32-bit words, each the (even, odd) column
    #   pair the two nibbles of a byte multiply: one contiguous load per pair instead of two strided ones.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    HALF: tl.constexpr = BLOCKSIZE // 2
    STEP: tl.constexpr = SUB * BLOCKSIZE
    GROUP: tl.constexpr = SLOTS * STEP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    row = offs_n.to(tl.int64)
    sub = tl.arange(0, SUB)
    q = tl.arange(0, SUB * HALF)                                  # element pairs of a step, block-major
    WORDS: tl.constexpr = HALF // 4                              # 32-bit words of packed weight per block
    w_row = (w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + row * row_words)[:, None, None]   # (BN, 1, 1)
    blk_row = (row * (K // BLOCKSIZE))[:, None]                  # (BN, 1) first scale block of each row
    in_step = sub[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # (SUB, WORDS) word offsets within a step
    byte_shift = (tl.arange(0, 4) * 8)[None, None, None, :]
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    cdt = x_ptr.dtype.element_ty
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)   # X_WORDS: x as (even, odd) column pairs
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    w0 = tl.full((BLOCK_N, SUB, WORDS), 0, tl.int32)              # the slots, oldest first: packed words,
    s0 = tl.full((BLOCK_N, SUB), 0, absmax_ptr.dtype.element_ty)  # raw scales
    w1, s1, w2, s2, w3, s3 = w0, s0, w0, s0, w0, s0               # (unused past SLOTS: dropped by the compiler)
    for kb0 in range(k_lo - GROUP, k_hi, GROUP):
        for ph in tl.static_range(SLOTS):
            packed, raw = w0, s0
            kb = kb0 + ph * STEP
            if kb0 >= k_lo:
                if NESTED:   # (BN, SUB)
                    scale = tl.load(code2_ptr + raw.to(tl.int32)) * tl.load(
                        absmax2_ptr + (blk_row + kb // BLOCKSIZE + sub[None, :]) // BLOCKSIZE2,
                        mask=n_ok[:, None], other=0) + tl.load(offset_ptr)
                else:
                    scale = raw.to(tl.float32)
                # word >> 8b puts byte b (little endian) in the low 8 bits: (BN, SUB, HALF), column-pair order
                low = tl.reshape(packed[:, :, :, None] >> byte_shift, (BLOCK_N, SUB, HALF))
                code_even = tl.load(code_ptr + ((low >> 4) & 15))                        # (BN, SUB, HALF) fp32
                code_odd = tl.load(code_ptr + (low & 15))
                # x.T at this step's (even, odd) columns: (SUB*HALF, BM)
                if X_WORDS:
                    pairs = tl.load(x_pairs + offs_m[None, :] * (stride_xm // 2) + (kb // 2 + q)[:, None],
                                    mask=m_ok[None, :], other=0)
                    xe = (pairs & 0xFFFF).to(tl.uint16).to(cdt, bitcast=True)           # little endian: even
                    xo = (pairs >> 16).to(tl.uint16).to(cdt, bitcast=True)
                else:
                    x_src = x_ptr + offs_m[None, :] * stride_xm + (kb + 2 * q)[:, None]
                    xe = tl.load(x_src, mask=m_ok[None, :], other=0)
                    xo = tl.load(x_src + 1, mask=m_ok[None, :], other=0)
                if BLOCK_M == 1:
                    xe = tl.reshape(xe.to(tl.float32), (1, SUB, HALF))
                    xo = tl.reshape(xo.to(tl.float32), (1, SUB, HALF))
                    acc += tl.reduce(tl.reduce(code_even * xe + code_odd * xo, 2, add) * scale, 1, add)[:, None]
                else:
                    if SUB == 1:
                        we = tl.reshape(code_even, (BLOCK_N, HALF)).to(cdt)
                        wo = tl.reshape(code_odd, (BLOCK_N, HALF)).to(cdt)
                        part = tl.dot(wo, xo, tl.dot(we, xe, input_precision=PRECISION), input_precision=PRECISION)
                        acc += part * tl.reshape(scale, (BLOCK_N, 1))
                    else:
                        we = tl.reshape((code_even * scale[:, :, None]).to(cdt), (BLOCK_N, SUB * HALF))
                        wo = tl.reshape((code_odd * scale[:, :, None]).to(cdt), (BLOCK_N, SUB * HALF))
                        acc = tl.dot(wo, xo, tl.dot(we, xe, acc, input_precision=PRECISION),
                                     input_precision=PRECISION)
            # fetch the step one group ahead. Row-only mask (the loads stay 16 bytes wide), all-false past
            # k_hi: one compare, not n_ok & scalar (an int32 mask in the interpreter)
            fetch = kb + GROUP
            live = (offs_n < tl.where(fetch < k_hi, N, 0))[:, None]                   # (BN, 1)
            word = tl.max_contiguous(tl.multiple_of(fetch // 8 + in_step, [WORDS, WORDS]), [1, WORDS])
            packed = tl.load(w_row + word[None, :, :], mask=live[:, :, None], other=0)
            raw = tl.load(absmax_ptr + blk_row + fetch // BLOCKSIZE + sub[None, :], mask=live, other=0)
            if SLOTS == 1:
                w0, s0 = packed, raw
            if SLOTS == 2:
                w0, s0, w1, s1 = w1, s1, packed, raw
            if SLOTS == 4:
                w0, s0, w1, s1, w2, s2, w3, s3 = w1, s1, w2, s2, w3, s3, packed, raw
    if PARTIAL:   # fp32 partial sums (splits, M, N) for the reduce kernel
        dst = out_ptr + pid_s * stride_os + offs_m[None, :] * N + offs_n[:, None]
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0).to(tl.float32)[:, None]
        dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, splits, stride_om,
                  HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # out[m, n] = sum_s part[s, m, n] (+ bias[n]), summed in a fixed order: deterministic
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)
