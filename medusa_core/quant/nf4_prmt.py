"""A 16-entry fp32 table looked up by byte permutes: four codes of one repacked word to four fp32 bit patterns,
as PTX for the repacked kernel (``RepackedConfig.decode == "prmt"``) and as a Python model for the tests.

Why: Triton decodes a plane in the registers its dot reads only when every operation between the loaded word
and the dot is elementwise with constant operands (inline assembly included); a ``tl.gather`` goes through
shared memory, refilled before each plane (nf4_repacked_matmul.py, RepackedConfig.decode). A tree of 15
selects is elementwise but costs 14 instructions a weight. ``prmt.b32 d, a, b, c`` picks each of d's 4
bytes from the 8 bytes of (a, b) by a 3-bit index in c's 4 low nibbles, so one permute looks up one byte of
4 codes at once in 8 table entries:

- the table is kept as byte planes: ``planes[p][q]`` holds byte p of entries 4q..4q+3, entry 4q+e in byte e;
- a word's nibbles 0..3 (a half's 4 codes, each its own plane of the repacked layout) masked to their low 3
  bits are the selector: byte p of the 4 codes' entries among entries 0..7, and again among 8..15;
- each code's bit 3 picks between the two: a byte mask made by one permute in sign-replicate mode (a
  selector nibble with bit 3 set copies the sign bit of the byte it names), over the word and the word
  shifted left by 4, whose byte signs are the odd and even codes' bits 3;
- the 4 byte planes, each holding byte p of the 4 codes, are transposed into the 4 codes' words by 8 more.

Per half (4 weights): 3 or 4 instructions for the selector and the mask, 4 x 3 for the byte planes, 8 for the
transpose: about 6 instructions a weight, against 14 for the selects (sm_90 counts in docs/performance.md).
Triton's interpreter runs no assembly: tests/test_nf4_repack.py runs the kernel with ``run`` standing in for it.
The table's 16 words are immediates: ptxas keeps or rematerializes them as registers allow.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

MASK_SELECTOR = (0xD9C8, 0xFBEA)    # per half: codes 0..3 (or 4..7) <- sign of bytes 0, 4, 1, 5 (2, 6, 3, 7)
MERGE_LUT = 0xE4                      # lop3 (a & c) | (b & ~c): a where the mask is set, b elsewhere
PAIR_LOW, PAIR_HIGH = 0x5140, 0x7362  # interleave bytes 0, 1 (2, 3) of two words: a0 b0 a1 b1 (a2 b2 a3 b3)
HALF_LOW, HALF_HIGH = 0x5410, 0x7632  # the low (high) 16 bits of two words, side by side


@dataclass(frozen=True)
class Op:
    op: str                 # "and", "shr", "shl", "mov", "prmt", "lop3"
    dst: str
    srcs: tuple[str, ...]   # register names or "$N" operands of the asm statement
    imm: int = 0            # the immediate: mask, shift, constant, prmt selector (when not a register) or LUT


def fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def byte_planes(table: tuple[float, ...]) -> list[list[int]]:
    """planes[p][q]: byte p of the fp32 entries 4q..4q+3, entry 4q+e in byte e."""
    if len(table) != 16:
        raise ValueError(f"a byte-permute lookup takes a 16-entry table, got {len(table)} entries")
    bits = [fp32_bits(v) for v in table]
    return [[sum(((bits[4 * q + e] >> (8 * p)) & 255) << (8 * e) for e in range(4)) for q in range(4)]
            for p in range(4)]


def program(table: tuple[float, ...], half: int) -> list[Op]:
    """The lookup of codes 4*half .. 4*half+3 of the word in operand $4, into operands $0..$3 (fp32 bits)."""
    planes = byte_planes(table)
    ops = []
    if half == 0:
        ops.append(Op("and", "sel", ("$4",), 0x7777))
    else:
        ops += [Op("shr", "sel", ("$4",), 16), Op("and", "sel", ("sel",), 0x7777)]
    ops += [Op("shl", "even", ("$4",), 4), Op("prmt", "mask", ("even", "$4"), MASK_SELECTOR[half])]
    for p in range(4):
        ops += [Op("mov", "t0", (), planes[p][0]), Op("mov", "t1", (), planes[p][1]),
                Op("prmt", "low", ("t0", "t1", "sel")),
                Op("mov", "t0", (), planes[p][2]), Op("mov", "t1", (), planes[p][3]),
                Op("prmt", "high", ("t0", "t1", "sel")),
                Op("lop3", f"b{p}", ("high", "low", "mask"), MERGE_LUT)]
    for selector, first in ((PAIR_LOW, 0), (PAIR_HIGH, 2)):
        ops += [Op("prmt", "x", ("b0", "b1"), selector), Op("prmt", "y", ("b2", "b3"), selector),
                Op("prmt", f"${first}", ("x", "y"), HALF_LOW), Op("prmt", f"${first + 1}", ("x", "y"), HALF_HIGH)]
    return ops


def registers(ops: list[Op]) -> list[str]:
    return sorted({name for op in ops for name in (op.dst, *op.srcs) if not name.startswith("$")})


def ptx(ops: list[Op]) -> str:
    """The inline assembly of ``ops``: one scoped block, its own registers."""
    lines = ["{", f".reg .b32 {', '.join(registers(ops))};"]
    for o in ops:
        if o.op in ("and", "shr", "shl"):
            lines.append(f"{o.op}.b32 {o.dst}, {o.srcs[0]}, {o.imm:#x};")
        elif o.op == "mov":
            lines.append(f"mov.b32 {o.dst}, {o.imm:#x};")
        elif o.op == "prmt":
            selector = o.srcs[2] if len(o.srcs) == 3 else f"{o.imm:#x}"
            lines.append(f"prmt.b32 {o.dst}, {o.srcs[0]}, {o.srcs[1]}, {selector};")
        else:
            lines.append(f"lop3.b32 {o.dst}, {', '.join(o.srcs)}, {o.imm:#x};")
    lines.append("}")
    return "\n".join(lines)


def prmt_bytes(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte k of the result is byte (selector nibble k & 7) of (b:a), or,
    where that nibble's bit 3 is set, that byte's sign bit copied to all 8 bits."""
    source = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    out = 0
    for k in range(4):
        nibble = (selector >> (4 * k)) & 15
        byte = source[nibble & 7]
        if nibble & 8:
            byte = 255 if byte & 128 else 0
        out |= byte << (8 * k)
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit i of the result is bit (4a_i + 2b_i + c_i) of the LUT (a = 0xF0, b = 0xCC, c = 0xAA)."""
    out = 0
    for i in range(32):
        index = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> index) & 1) << i
    return out


def run(ops: list[Op], word: int) -> list[int]:
    """The Python model of ``ptx(ops)`` on one 32-bit word: operands $0..$3."""
    reg = {"$4": word & 0xFFFFFFFF}
    for o in ops:
        src = [reg[s] for s in o.srcs]
        if o.op == "and":
            val = src[0] & o.imm
        elif o.op == "shr":
            val = src[0] >> o.imm
        elif o.op == "shl":
            val = (src[0] << o.imm) & 0xFFFFFFFF
        elif o.op == "mov":
            val = o.imm
        elif o.op == "prmt":
            val = prmt_bytes(src[0], src[1], src[2] if len(src) == 3 else o.imm)
        else:
            val = lop3(*src, o.imm)
        reg[o.dst] = val
    return [reg[f"${i}"] for i in range(4)]


@functools.lru_cache(maxsize=8)
def halves(table: tuple[float, ...]) -> tuple[str, str]:
    """The two asm statements of a table (codes 0..3 and 4..7 of a word), as the kernel's constexpr."""
    return ptx(program(table, 0)), ptx(program(table, 1))
