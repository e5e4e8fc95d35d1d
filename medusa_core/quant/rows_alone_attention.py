"""Attention in which a query row's output is a function of that row and of the keys it sees, in
order, and of nothing else: not of how many rows share the call, nor of where its keys lie in the
cache. A tree row then gets, bit for bit, what a 1-row step gets for the same token (CUDA, Triton).

Why the usual kernels cannot: a fused attention kernel walks the cache in blocks of slots and rescales
its running softmax sum at every block. A tree row sees the committed prefix and then its ancestors,
which lie among the step's tree slots; the same token decoded plainly sees the prefix and the same
tokens at consecutive slots. The blocks group those keys differently, so the sums round differently,
and in bf16 one last bit can grow through 30 layers into a different greedy token. (The CPU's int4
mode has the same problem and gathers each row's keys for one SDPA call per row: exact_attention.py,
which reads indices on the host; a CUDA graph cannot.)

Here each row's visible slots are first listed in order (``visible_slots``: a cumulative sum and a
scatter on the device, no host read, so a graph can hold it). One program then takes one row and one
query head and walks that list in fixed blocks of BLOCK_W keys: the row's
scores, max, rescales and sums depend only on the list. Same list, same bits, whatever T or slots.

It is written for exactness, not speed: no split over keys and one program per (row, head), so a
1-row step runs as many programs as heads. A GPU's figures are for a GPU session (issue 22); the tests run it under
Triton's interpreter.
"""

from __future__ import annotations


import torch

try:
    import triton
    import triton.language as tl
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core.quant.rows_alone_attention needs Triton ({err}): "
                      "pip install 'triton>=3.7'") from None

from .triton_runtime import add, check_runnable, launchable, maximum

BLOCK_W = 32      # keys per block of a row's list: fixed, so that a list is always cut at the same places


# Each reduction has one fixed order for every row, in one of two forms chosen by where it runs (TREE):
# - under Triton's interpreter, a pairwise tree written out (reshape and split, halving): tl.reduce takes
#   the interpreter seconds a block;
# - compiled, tl.reduce (each thread its own elements, then lanes, then warps, as the compiled layout fixes
#   them, whatever the grid). The written-out tree is not safe compiled: Triton 3.6 (the H100 image's)
#   lays its reshapes out as whole tiles in every thread, 5.9 KB of stack and 19,000 instructions a
#   program, where 3.9 kept it at 85 registers and no stack.
def _rows_alone_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, count_ptr, out_ptr,
                       stride_qh, stride_qt, stride_kh, stride_kw, stride_vh, stride_vw, stride_ot, stride_oh,
                       width, scale, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_W: tl.constexpr, LOG_D: tl.constexpr, LOG_W: tl.constexpr, TREE: tl.constexpr):
    # grid: (T rows, query heads). Heads of one GQA group read the same keys (from L2 after the first):
    # one head per program keeps every tensor 2-D (a group axis made ptxas put them on the stack).
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + h * stride_qh + t * stride_qt + d, mask=d_ok, other=0).to(tl.float32)       # (BD,)
    count = tl.load(count_ptr + t)                                                     # keys this row sees
    m = tl.full((1,), float("-inf"), tl.float32)
    total = tl.full((1,), 0.0, tl.float32)
    acc = tl.full((BLOCK_D,), 0.0, tl.float32)
    for start in range(0, count, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)                                              # (BW,) list positions
        w_ok = w < count
        slot = tl.load(slot_ptr + t * width + w, mask=w_ok, other=0)                   # (BW,) cache slots
        kv_ok = w_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kvh * stride_kh + slot[:, None] * stride_kw + d[None, :], mask=kv_ok,
                    other=0).to(tl.float32)                                            # (BW, BD)
        s = k * q[None, :]                                                             # (BW, BD)
        if TREE:
            for level in tl.static_range(LOG_D):                                       # q . k: sum over D
                lo, hi = tl.split(tl.reshape(s, (BLOCK_W, BLOCK_D >> (level + 1), 2)))
                s = lo + hi
            s = tl.reshape(s, (BLOCK_W,))
        else:
            s = tl.reduce(s, 1, add)
        s = tl.where(w_ok, s * scale, float("-inf"))                                   # (BW,)
        top = s[None, :]
        if TREE:
            for level in tl.static_range(LOG_W):                                       # the block's max
                lo, hi = tl.split(tl.reshape(top, (1, BLOCK_W >> (level + 1), 2)))
                top = tl.maximum(lo, hi)
            top = tl.reshape(top, (1,))
        else:
            top = tl.reduce(top, 1, maximum)
        m_new = tl.maximum(m, top)                                                     # (1,) finite: count >= 1
        alpha = tl.exp(m - m_new)                                                      # 0 on the first block
        p = tl.exp(s - m_new)                                                          # (BW,), 0 past count
        p_sum = p[None, :]
        v = tl.load(v_ptr + kvh * stride_vh + slot[:, None] * stride_vw + d[None, :], mask=kv_ok,
                    other=0).to(tl.float32)                                            # (BW, BD)
        pv = tl.trans(v) * p[None, :]                                                  # (BD, BW)
        if TREE:
            for level in tl.static_range(LOG_W):                                       # sums over the block
                lo, hi = tl.split(tl.reshape(p_sum, (1, BLOCK_W >> (level + 1), 2)))
                p_sum = lo + hi
                lo, hi = tl.split(tl.reshape(pv, (BLOCK_D, BLOCK_W >> (level + 1), 2)))
                pv = lo + hi
            p_sum, pv = tl.reshape(p_sum, (1,)), tl.reshape(pv, (BLOCK_D,))
        else:
            p_sum, pv = tl.reduce(p_sum, 1, add), tl.reduce(pv, 1, add)
        total = total * alpha + p_sum                                                  # (1,)
        acc = acc * alpha + pv                                                         # (BD,)
        m = m_new
    # the row's best key adds exp(0) = 1, so total >= 1 and the maximum changes nothing; a row that sees
    # no key (none does in a step) gets zeros instead of 0/0
    out = acc / tl.maximum(total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def visible_slots(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seen (T, W) bool -> (slots (T, W) int32: each row's visible slots in ascending order, then
    filler; counts (T,) int32). On the device, no host read."""
    rows, width = seen.shape
    counts = seen.sum(1, dtype=torch.int32)                                            # (T,)
    # visible slot j goes to list position (visible slots before it); the rest to a spare column
    dest = torch.where(seen, seen.cumsum(1) - 1, width)                                # (T, W)
    ids = torch.arange(width, dtype=torch.int32, device=seen.device).expand(rows, width)
    slots = torch.zeros(rows, width + 1, dtype=torch.int32, device=seen.device).scatter_(1, dest, ids)
    return slots[:, :width].contiguous(), counts


def rows_alone_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seen: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """query (1, heads, T, D), key/value (1, kv_heads, W, D), seen (T, W) bool: which slots each row
    may attend to -> (1, T, heads, D) in query's dtype, each row computed from its own visible keys alone."""
    check_shapes(query, key, seen.shape)
    return attend_listed(query, key, value, *visible_slots(seen), scale)


def attend_listed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                  counts: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """rows_alone_attention from each row's listed slots (``visible_slots``: slots (T, W), counts (T,)),
    which all the layers of a forward share."""
    check_runnable(query.device)
    check_shapes(query, key, slots.shape)
    _, heads, rows, dim = query.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty(1, rows, heads, dim, dtype=query.dtype, device=query.device)  # (1, T, heads, D)
    interpret = query.device.type == "cpu"
    _, grid, args, meta = kernel_call(q, k, v, slots, counts, out, dim ** -0.5 if scale is None else scale, interpret)
    launchable(_rows_alone_kernel, interpret)[grid](*args, **meta)
    return out


def check_shapes(query: torch.Tensor, key: torch.Tensor, rows_by_slots: torch.Size) -> None:
    """ValueError in one line unless batch 1, query heads a multiple of kv heads and a (T, W) mask."""
    _, heads, rows, _ = query.shape
    if query.shape[0] != 1 or heads % key.shape[1] or tuple(rows_by_slots) != (rows, key.shape[2]):
        raise ValueError(f"rows_alone_attention takes batch 1, query heads a multiple of kv heads and a (T, W) mask; "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}, mask {tuple(rows_by_slots)}")


def kernel_call(q, k, v, slots, counts, out, scale: float, interpret: bool) -> tuple:
    """(kernel function, grid, args, constexprs) of one launch: ``rows_alone_attention`` runs it, and
    benchmarks/kernel_sass.py compiles exactly this call for a GPU without one."""
    _, heads, rows, dim = q.shape
    block_d = triton.next_power_of_2(dim)
    args = (q, k, v, slots, counts, out, q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
            out.stride(1), out.stride(2), slots.shape[1], scale)
    # FP fusion named, not left to Triton's default (which 3.10 flips): every launch compiles alike
    opts = {} if interpret else {"num_warps": 4, "num_stages": 2, "enable_fp_fusion": True}
    meta = dict(GROUP=heads // k.shape[1], D=dim, BLOCK_D=block_d, BLOCK_W=BLOCK_W, LOG_D=block_d.bit_length() - 1,
                LOG_W=BLOCK_W.bit_length() - 1, TREE=interpret, **opts)
    return _rows_alone_kernel, (rows, heads), args, meta
