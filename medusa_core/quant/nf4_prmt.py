"""A 16-entry fp32 table looked up by byte permutes: four codes of one repacked word to four fp32 bit patterns,
as PTX for the repacked kernel (``RepackedConfig.decode == "prmt"``) and as a Python model for the tests.

Why: Triton decodes a plane in the registers its dot reads only when every operation between the loaded word
and the dot is elementwise with constant operands (inline assembly included); a ``tl.gather`` goes through
shared memory, refilled before each plane (nf4_repacked_kernel.py, RepackedConfig.decode). A tree of 15
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

**The scaled table** (``RepackedConfig.decode == "scaled"``): the same lookup over the 16 weights a scale block
can hold, already multiplied by its scale and cast to the dot's 16-bit type, built in registers per row and
block (``scaled_table_program``: 16 fp32 multiplies, 8 paired casts, 8 permutes into byte planes). The
lookup (``scaled_lookup_program``) then has 2 byte planes where the fp32 table has 4, and hands the dot its
weights with no multiply and no cast left: compiled for sm_90, 7.4 instructions a weight against the fp32
table's 11.5 at 69 registers against 101 (docs/performance.md). Each entry is rounded once from fp32 code *
scale, as the kernel's own cast rounds it, so every weight keeps bitsandbytes' bits. A scale block must cover
the 4 planes of a half (4 * G/8 columns): true of the repacked layout's group 128 over bitsandbytes' 64.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch

MASK_SELECTOR = (0xD9C8, 0xFBEA)    # per half: codes 0..3 (or 4..7) <- sign of bytes 0, 4, 1, 5 (2, 6, 3, 7)
MERGE_LUT = 0xE4                      # lop3 (a & c) | (b & ~c): a where the mask is set, b elsewhere
PAIR_LOW, PAIR_HIGH = 0x5140, 0x7362  # interleave bytes 0, 1 (2, 3) of two words: a0 b0 a1 b1 (a2 b2 a3 b3)
HALF_LOW, HALF_HIGH = 0x5410, 0x7632  # the low (high) 16 bits of two words, side by side
LOW_BYTES, HIGH_BYTES = 0x6420, 0x7531  # bytes 0, 2, 4, 6 (1, 3, 5, 7) of two words: the entries' low (high) bytes
CASTS = {torch.bfloat16: "bf16x2", torch.float16: "f16x2"}   # the scaled table's entries, two to a word


@dataclass(frozen=True)
class Op:
    op: str                 # "and", "shr", "shl", "mov", "prmt", "lop3", "mul" (fp32), "cvt.bf16x2" or
    #                         "cvt.f16x2" (two fp32 to one word: the first source to the high half), "unpack" (a
    #                         word's low and high 16 bits to operands $N and $N+1)
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
    ops = _selector(half)
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


def _selector(half: int) -> list[Op]:
    """The word in $4's codes 4*half .. 4*half+3: their low 3 bits as a prmt selector (``sel``) and their bits 3
    as a byte mask (``mask``)."""
    ops = [Op("and", "sel", ("$4",), 0x7777)] if half == 0 else \
        [Op("shr", "sel", ("$4",), 16), Op("and", "sel", ("sel",), 0x7777)]
    return ops + [Op("shl", "even", ("$4",), 4), Op("prmt", "mask", ("even", "$4"), MASK_SELECTOR[half])]


def registers(ops: list[Op]) -> list[str]:
    return sorted({name for op in ops for name in (op.dst, *op.srcs) if not name.startswith("$")})


def _is_float(name: str) -> bool:
    return name[0] == "f" and name[1:].isdigit()        # the scaled table's products: f0..f15


def ptx(ops: list[Op]) -> str:
    """The inline assembly of ``ops``: one scoped block, its own registers."""
    names = registers(ops)
    lines = ["{"] + [f".reg .{kind} {', '.join(group)};" for kind, group in
                     (("f32", [r for r in names if _is_float(r)]), ("b32", [r for r in names if not _is_float(r)]))
                     if group]
    for o in ops:
        if o.op in ("and", "shr", "shl"):
            lines.append(f"{o.op}.b32 {o.dst}, {o.srcs[0]}, {o.imm:#x};")
        elif o.op == "mov":
            lines.append(f"mov.b32 {o.dst}, {o.imm:#x};")
        elif o.op == "prmt":
            selector = o.srcs[2] if len(o.srcs) == 3 else f"{o.imm:#x}"
            lines.append(f"prmt.b32 {o.dst}, {o.srcs[0]}, {o.srcs[1]}, {selector};")
        elif o.op == "mul":       # rounded once, never contracted: the kernel's code * scale
            lines.append(f"mul.rn.f32 {o.dst}, {o.srcs[0]}, 0f{o.imm:08X};")
        elif o.op.startswith("cvt."):
            lines.append(f"cvt.rn.{o.op[4:]}.f32 {o.dst}, {o.srcs[0]}, {o.srcs[1]};")
        elif o.op == "unpack":
            lines.append(f"mov.b32 {{{o.dst}, ${int(o.dst[1:]) + 1}}}, {o.srcs[0]};")
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


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def cast_bits(a: int, b: int, cast: str) -> int:
    """PTX ``cvt.rn.{bf16x2,f16x2}.f32 d, a, b``: a rounded to nearest even in d's high half, b in its low."""
    dtype = torch.bfloat16 if cast == "bf16x2" else torch.float16
    half = torch.tensor([f32(b), f32(a)], dtype=torch.float32).to(dtype).view(torch.int16).tolist()   # RNE
    return (half[0] & 0xFFFF) | (half[1] & 0xFFFF) << 16


def execute(ops: list[Op], operands: dict[str, int]) -> dict[str, int]:
    """The Python model of ``ptx(ops)``: every register and operand after it, from the input ``operands``."""
    reg = {name: value & 0xFFFFFFFF for name, value in operands.items()}
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
        elif o.op == "mul":
            val = fp32_bits(f32(src[0]) * f32(o.imm))   # exact in a double, then rounded once to fp32
        elif o.op.startswith("cvt."):
            val = cast_bits(src[0], src[1], o.op[4:])
        elif o.op == "unpack":
            reg[f"${int(o.dst[1:]) + 1}"] = src[0] >> 16
            val = src[0] & 0xFFFF
        else:
            val = lop3(*src, o.imm)
        reg[o.dst] = val
    return reg


def run(ops: list[Op], word: int) -> list[int]:
    """The Python model of a ``program`` lookup on one 32-bit word: operands $0..$3."""
    reg = execute(ops, {"$4": word})
    return [reg[f"${i}"] for i in range(4)]


def scaled_table_program(table: tuple[float, ...], cast: str) -> list[Op]:
    """$8 (a scale block's fp32 scale) -> the block's 16 weights cast to 16 bits as byte planes: $q holds the low
    bytes of entries 4q..4q+3 (entry 4q+e in byte e), $(4+q) their high bytes."""
    if len(table) != 16:
        raise ValueError(f"a byte-permute lookup takes a 16-entry table, got {len(table)} entries")
    ops = [Op("mul", f"f{c}", ("$8",), fp32_bits(v)) for c, v in enumerate(table)]
    ops += [Op(f"cvt.{cast}", f"p{j}", (f"f{2 * j + 1}", f"f{2 * j}")) for j in range(8)]   # entry 2j low, 2j+1 high
    for q in range(4):
        ops += [Op("prmt", f"${q}", (f"p{2 * q}", f"p{2 * q + 1}"), LOW_BYTES),
                Op("prmt", f"${4 + q}", (f"p{2 * q}", f"p{2 * q + 1}"), HIGH_BYTES)]
    return ops


def scaled_lookup_program(half: int) -> list[Op]:
    """Codes 4*half .. 4*half+3 of the word in $4, looked up in a scaled table ($5..$8 its low bytes, $9..$12 its
    high bytes, as ``scaled_table_program`` writes them), into $0..$3: 16-bit weights."""
    ops = _selector(half)
    for p, first in ((0, 5), (1, 9)):
        ops += [Op("prmt", "low", (f"${first}", f"${first + 1}", "sel")),
                Op("prmt", "high", (f"${first + 2}", f"${first + 3}", "sel")),
                Op("lop3", f"b{p}", ("high", "low", "mask"), MERGE_LUT)]
    ops += [Op("prmt", "x", ("b0", "b1"), PAIR_LOW), Op("prmt", "y", ("b0", "b1"), PAIR_HIGH),
            Op("unpack", "$0", ("x",)), Op("unpack", "$2", ("y",))]
    return ops


@functools.lru_cache(maxsize=8)
def halves(table: tuple[float, ...]) -> tuple[str, str]:
    """The two asm statements of a table (codes 0..3 and 4..7 of a word), as the kernel's constexpr."""
    return ptx(program(table, 0)), ptx(program(table, 1))


@functools.lru_cache(maxsize=8)
def scaled(table: tuple[float, ...], dtype: torch.dtype) -> tuple[str, str, str]:
    """The scaled decode's asm statements as the kernel's constexpr, for weights cast to ``dtype`` (one of CASTS):
    the table, then the lookups of codes 0..3 and 4..7 of a word."""
    return (ptx(scaled_table_program(table, CASTS[dtype])), ptx(scaled_lookup_program(0)),
            ptx(scaled_lookup_program(1)))
