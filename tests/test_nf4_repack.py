"""The repacked NF4 kernel on CPU, under Triton's interpreter (fp32: its bf16 math is broken): the
repacked layout dequantizes to bitsandbytes' bits and rebuilds bitsandbytes' bytes, fits in +10%,
multiplies within rounding for 1..64 rows, gives each row the same bits whatever M in exact mode,
fuses q/k/v and gate/up without changing a projection, and decodes bitsandbytes' greedy text."""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="the NF4 kernels need Triton: pip install triton")
import bitsandbytes.functional as bnbf  # noqa: E402
from tiny import copied_heads, tiny_model  # noqa: E402

from medusa_core.benchmarks import nf4_kernel as bench  # noqa: E402
from medusa_core.decoding.config import DecodeConfig  # noqa: E402
from medusa_core.decoding.generate import generate  # noqa: E402
from medusa_core.decoding.step import ROW_EXACT_ATTENTION  # noqa: E402
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree  # noqa: E402
from medusa_core.quant import kernel_timing as kt  # noqa: E402
from medusa_core.quant import nf4_fused  # noqa: E402
from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402
from medusa_core.quant import nf4_repack as rp  # noqa: E402
from medusa_core.quant import nf4_repacked_configs as rc  # noqa: E402
from medusa_core.quant import nf4_repacked_matmul as rm  # noqa: E402
from medusa_core.heads.quantize import quantize_projections  # noqa: E402
from medusa_core.quant.bnb import quantize_linear_nf4_, use_nf4_heads, use_nf4_kernel  # noqa: E402
from medusa_core.quant.formats import weights_format  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


def quantized(n: int, k: int, nested: bool = True, seed: int = 0, blocksize: int = 64):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return bnbf.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


# N no multiple of the 16-row group or of a 32/64-row tile; K no multiple of the group (padded)
SHAPES = [(200, 192, 128), (40, 320, 256)]


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_repacked_weight_dequantizes_to_bitsandbytes_bits_and_rebuilds_its_bytes(nested, n, k, group):
    packed, state = quantized(n, k, nested)
    theirs = bnbf.dequantize_4bit(packed, state)
    assert theirs.dtype == torch.float32
    w = rp.repack_bnb([(packed, state)], group)
    assert w.words.dtype == torch.int32 and w.scales.dtype == torch.float32
    assert torch.equal(rm.dequantize_repacked(w), theirs)        # the kernel's own lookup and scale
    assert torch.equal(rp.dequantize_reference(w), theirs)       # the layout as documented
    assert torch.equal(rp.bitsandbytes_bytes(w), packed)        # and back, byte for byte


def test_repacked_size_within_ten_percent_of_bitsandbytes():
    for n, k in ((11008, 4096), (4096, 11008), (4096, 4096), (32000, 4096), (3 * 4096, 4096), (2 * 11008, 4096)):
        assert rp.repacked_nbytes(n, k) <= 1.10 * rp.bnb_nbytes(n, k)
        assert rp.repacked_nbytes(n, k) <= rp.bnb_nbytes(n, k, nested=False)   # single quant: no larger at all
    packed, state = quantized(64, 1024)
    ours = rp.repack_bnb([(packed, state)])
    theirs = packed.numel() + 4 * state.code.numel() + state.absmax.numel() + \
        4 * (state.state2.absmax.numel() + state.state2.code.numel() + 1)
    assert theirs == rp.bnb_nbytes(64, 1024) and ours.nbytes == rp.repacked_nbytes(64, 1024)
    assert ours.nbytes <= 1.10 * theirs
    assert ours.words.numel() * 4 == 64 * 1024 // 2                # 4 bits a weight: no 16/32-bit copy


def reference(x: torch.Tensor, packed, state, bias=None) -> torch.Tensor:
    return x.double() @ bnbf.dequantize_4bit(packed, state).double().T + (0 if bias is None else bias.double())


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 33, 64])
def test_matmul_within_rounding_of_dequantized_reference(m):
    n, k, group = SHAPES[0]
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)], group)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        for exact in (False, True):
            y = rm.repacked_matmul(x, w, b, exact=exact)
            assert y.shape == (m, n) and y.dtype == torch.float32
            torch.testing.assert_close(y.double(), reference(x, packed, state, b), rtol=1e-5, atol=1e-4)
    assert rm.choose_config(m, w, x.dtype, x.device, exact=False).dot == (m >= 5)   # GEMV, then tensor cores


@pytest.mark.parametrize("cfg", [rc.RepackedConfig(False, 4, 32, 2), rc.RepackedConfig(True, 16, 64, 3),
                                 rc.RepackedConfig(False, 1, 16, 2), rc.RepackedConfig(True, 32, 16, 1),
                                 rc.RepackedConfig(False, 2, 16, 3, prefetch=True)])
def test_split_k_tiles_and_3d_input(cfg):
    n, k, group = SHAPES[1]
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)], group)
    x = torch.randn(2, 3, k)[:, 1:]          # (2, 2, K): rows at strides, not a contiguous block
    bias = torch.randn(n)
    y = rm.repacked_matmul(x, w, bias, config=cfg)
    assert y.shape == (2, 2, n)
    torch.testing.assert_close(y.double(), reference(x, packed, state, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n,k,group,blocksize", [(*shape, 64) for shape in SHAPES] + [(40, 256, 128, 128),
                                                                                      (24, 960, 128, 64)])
def test_prefetching_groups_ahead_changes_no_bit(n, k, group, blocksize):
    # the same products and sums, only loaded one, two or three groups earlier, x with them or not: a tuner may pick
    # any. 1, 2 and 4 scale blocks per group; splits of one group (nothing to prefetch past it), of two, and of
    # three (8 groups, K cut short in the last), so the lookaheads reach past a split's end, masked; 5 rows, so
    # x's lookahead masks rows too
    packed, state = quantized(n, k, blocksize=blocksize)
    w = rp.repack_bnb([(packed, state)], group)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    for block_m, block_n, split in ((1, 16, 1), (4, 32, 2), (8, 16, 3)):
        plain = rm.repacked_matmul(x, w, config=rc.RepackedConfig(False, block_m, block_n, split))
        for depth, x_ahead in ((1, False), (2, False), (3, False), (1, True), (2, True), (3, True)):
            cfg = rc.RepackedConfig(False, block_m, block_n, split, prefetch=depth, x_ahead=x_ahead)
            ahead = rm.repacked_matmul(x, w, config=cfg)
            assert torch.equal(plain, ahead), cfg.describe()
    torch.testing.assert_close(ahead.double(), reference(x, packed, state), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="prefetch 0 to 3 and for GEMV only"):
        rc.RepackedConfig(True, 16, 64, 1, prefetch=1)
    with pytest.raises(ValueError, match="prefetch 0 to 3 and for GEMV only"):
        rc.RepackedConfig(False, 1, 64, 1, prefetch=4)
    # the GPU tuner times three groups ahead at one row (each group more took the H200's call down), summed in one
    # launch too where K is split
    deeper = [c for c in rc.candidates(1, 11008, 32, 132) if c.prefetch == 3]
    assert {(c.x_ahead, c.serial) for c in deeper} == {(True, False), (True, True)}
    assert deeper[0].describe() == "gemv m1 n64 split4 w4 s2 prefetch3 x"
    with pytest.raises(ValueError, match="x_ahead with prefetch only"):
        rc.RepackedConfig(False, 1, 64, 1, x_ahead=True)


def test_a_tuning_remembered_before_prefetch_depths_reads_as_depth_one():
    # kernel_timing remembers configs as JSON across starts; one saved when prefetch was a bool says true
    best, _ = kt.decode_tuning(rc.RepackedConfig, [{"dot": False, "block_m": 1, "block_n": 64, "split_k": 4,
                                                     "num_warps": 4, "num_stages": 2, "prefetch": True}, []])
    assert best.prefetch == 1 and type(best.prefetch) is int
    assert best.describe() == "gemv m1 n64 split4 w4 s2 prefetch"
    assert rc.RepackedConfig(False, 1, 64, 4, prefetch=2).describe() == "gemv m1 n64 split4 w4 s2 prefetch2"
    assert rc.RepackedConfig(False, 1, 64, 4, prefetch=2, x_ahead=True).describe() == \
        "gemv m1 n64 split4 w4 s2 prefetch2 x"


@pytest.mark.parametrize("n,k,group,blocksize", [(*shape, 64) for shape in SHAPES] + [(40, 256, 128, 128),
                                                                                      (24, 960, 128, 64)])
def test_the_whole_group_in_one_dot_multiplies_within_rounding(n, k, group, blocksize):
    # the group's 8 planes as one tile, its columns in the words' order and x's put in the same order: the same
    # weights (bitsandbytes' bits) summed in another order. 1, 2 and 4 scale blocks a group, K cut short, splits
    packed, state = quantized(n, k, blocksize=blocksize)
    w = rp.repack_bnb([(packed, state)], group)
    gen = torch.Generator().manual_seed(7)
    for m, cfg in ((1, rc.RepackedConfig(True, 16, 64, 1, whole_group=True)),
                   (20, rc.RepackedConfig(True, 16, 32, 2, whole_group=True)),
                   (33, rc.RepackedConfig(True, 32, 16, 3, whole_group=True))):
        # x's rows inside wider ones holding NaN past K: a group cut short must not read past its row's end
        wide = torch.full((m, k + 64), float("nan"))
        wide[:, :k] = torch.randn(m, k, generator=gen)
        x = wide[:, :k]
        bias = torch.randn(n, generator=gen)
        y = rm.repacked_matmul(x, w, bias, config=cfg)
        torch.testing.assert_close(y.double(), reference(x, packed, state, bias), rtol=1e-5, atol=1e-4)
    assert any(c.whole_group for c in rc.candidates(16, 11008, 32, 132))       # the GPU tuner times it,
    assert any(c.whole_group for c in rc.exact_candidates(11008, 32, 132))      # exact mode's where rows are exact
    assert rc.RepackedConfig(True, 16, 64, 2, whole_group=True).describe() == "dot m16 n64 split2 w4 s2 group"
    for bad in (dict(dot=False, block_m=1), dict(dot=True, block_m=16, plane_lookup=True)):
        with pytest.raises(ValueError, match="whole_group for dot only and not with plane_lookup"):
            rc.RepackedConfig(block_n=16, split_k=1, whole_group=True, **bad)


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_looking_up_one_plane_at_a_time_changes_no_bit(n, k, group):
    # the tensor-core path's two lookups (all planes of a group at once, or each before its dot) give the
    # same codes to the same dots: a tuner may pick either
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)], group)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(3))
    for block_m, block_n, split in ((16, 64, 1), (32, 16, 2)):
        cfg = rc.RepackedConfig(True, block_m, block_n, split)
        plane = rm.repacked_matmul(x, w, config=dataclasses.replace(cfg, plane_lookup=True))
        assert torch.equal(rm.repacked_matmul(x, w, config=cfg), plane), cfg
    torch.testing.assert_close(plane.double(), reference(x, packed, state), rtol=1e-5, atol=1e-4)
    assert any(c.plane_lookup for c in rc.candidates(16, 11008, 32, 132))     # the GPU tuner times it
    with pytest.raises(ValueError, match="plane_lookup for dot only"):
        rc.RepackedConfig(False, 1, 16, 1, plane_lookup=True)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_the_table_compiled_in_as_selects_gives_every_weight_bitsandbytes_bits_and_changes_no_product(nested, n, k,
                                                                                                      group):
    # decode "select", a tuner candidate: the plane tile with the 16 values as constants. Identity rows make each
    # output one weight times 1 (plus zeros), so the dot hands back the dequantized weight itself, bit for bit
    packed, state = quantized(n, k, nested)
    w = rp.repack_bnb([(packed, state)], group)
    assert w.table == tuple(state.code.tolist())          # read once at repack, for the compiler
    plane = rc.RepackedConfig(True, 64, 64, 1, plane_lookup=True)
    select = dataclasses.replace(plane, decode="select")
    assert select.describe() == "dot m64 n64 split1 w4 s2 plane select"
    assert torch.equal(rm.repacked_matmul(torch.eye(k), w, config=select).T, bnbf.dequantize_4bit(packed, state))
    gen = torch.Generator().manual_seed(5)
    for m, cfg in ((5, plane), (16, dataclasses.replace(plane, block_m=16, block_n=32, split_k=2)),
                   (33, dataclasses.replace(plane, block_m=32, block_n=16, split_k=3, serial=True))):
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        got = rm.repacked_matmul(x, w, bias, config=dataclasses.replace(cfg, decode="select"))
        assert torch.equal(got, rm.repacked_matmul(x, w, bias, config=cfg)), cfg    # the same codes, the same dots
    with pytest.raises(ValueError, match="has 0 values on the host: make it with nf4_repack.repack"):
        rm.repacked_matmul(x, dataclasses.replace(w, table=()), config=select)


def test_the_byte_permute_lookup_gives_every_code_its_bits_in_every_position_and_is_what_the_kernel_runs():
    # decode "prmt" is inline PTX, which the interpreter cannot run: its program is checked here through a Python
    # model of PTX's prmt and lop3, on bitsandbytes' table, every code in each of a word's 8 positions beside
    # varied neighbours; the kernel's assembly is that program's text. The CUDA tests check it on a GPU.
    from medusa_core.quant import nf4_prmt as pm

    table = tuple(bnbf.get_4bit_type("nf4", device="cpu").tolist())
    bits = [pm.fp32_bits(v) for v in table]
    gen = torch.Generator().manual_seed(0)
    words = [sum(((code + step * pos) % 16) << (4 * pos) for pos in range(8))
             for code in range(16) for step in range(16)]
    words += torch.randint(0, 2**32, (1000,), generator=gen, dtype=torch.int64).tolist()
    for half in (0, 1):
        ops = pm.program(table, half)
        for word in words:
            assert pm.run(ops, word) == [bits[(word >> (4 * (4 * half + i))) & 15] for i in range(4)], (half, hex(word))
        assert pm.halves(table)[half] == pm.ptx(ops)
    asm = pm.halves(table)[0]
    assert asm.count("prmt.b32") == 1 + 4 * 2 + 8 and asm.count("lop3.b32") == 4 and "$4" in asm and "$3," in asm
    # the model's prmt is PTX's: bytes by index, and a selector's bit 3 copies the named byte's sign
    assert pm.prmt_bytes(0x44332211, 0x88776655, 0x3210) == 0x44332211
    assert pm.prmt_bytes(0x44332211, 0x88776655, 0x7654) == 0x88776655
    assert pm.prmt_bytes(0x00008000, 0, 0x0099) == 0x0000FFFF
    # and its lop3 is PTX's: the look-up table's operands are a = 0xF0, b = 0xCC, c = 0xAA
    a, b, c = 0x12345678, 0x9ABCDEF0, 0x0F0F00FF
    assert (pm.lop3(a, b, c, 0xF0), pm.lop3(a, b, c, 0xCC), pm.lop3(a, b, c, 0xAA)) == (a, b, c)
    assert pm.lop3(a, b, c, pm.MERGE_LUT) == (a & c) | (b & ~c & 0xFFFFFFFF)
    with pytest.raises(ValueError, match="16-entry table, got 4"):
        pm.program(table[:4], 0)


def asm_model(programs: dict):
    """Triton's interpreter runs no assembly: a stand-in for its inline-asm builder that runs each statement's
    program (``programs``: asm text -> nf4_prmt ops) in nf4_prmt's Python model of PTX, element by element."""
    import numpy as np
    from triton.runtime import interpreter

    from medusa_core.quant import nf4_prmt as pm

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        ins = [a.view(np.uint32) for a in np.broadcast_arrays(*[v.data for v in values])]   # 32-bit operands
        outs = [np.empty(ins[0].size, dtype=np.uint32 if t.scalar.primitive_bitwidth == 32 else np.uint16)
                for t in types]
        for i in range(ins[0].size):
            reg = pm.execute(programs[asm], {f"${len(types) + j}": int(a.flat[i]) for j, a in enumerate(ins)})
            for o, out in enumerate(outs):
                out[i] = reg[f"${o}"]
        handles = [interpreter.TensorHandle(out.view(np.int32 if out.itemsize == 4 else np.int16).reshape(ins[0].shape),
                                            t.scalar) for out, t in zip(outs, types)]
        return SimpleNamespace(get_result=lambda i: handles[i])
    return create_inline_asm


def test_the_kernel_wires_the_byte_permutes_to_its_planes_as_the_gather_tile_looks_them_up(monkeypatch):
    # the prmt tile run whole under the interpreter, its two assembly statements run by the Python model (the one
    # piece the interpreter lacks): which half feeds which plane, the order of a statement's four results, the
    # word each reads. The same products as the gather tile, bit for bit (and a model that swaps the halves,
    # as a kernel passing them in the wrong order would, is caught)
    from triton.runtime import interpreter

    from medusa_core.quant import nf4_prmt as pm

    packed, state = quantized(40, 256)
    w = rp.repack_bnb([(packed, state)], 128)
    asm = pm.halves(w.table)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    gather = rc.RepackedConfig(True, 16, 32, 2, plane_lookup=True)
    want = rm.repacked_matmul(x, w, config=gather)

    def prmt_tile() -> torch.Tensor:
        out = torch.empty(16, 40)
        rm._launch(x, w, None, out, dataclasses.replace(gather, decode="prmt"), True)
        return out

    for half, swapped in ((0, False), (1, True)):
        programs = {asm[0]: pm.program(w.table, half), asm[1]: pm.program(w.table, 1 - half)}
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", asm_model(programs), raising=True)
        assert torch.equal(prmt_tile(), want) != swapped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_scaled_table_gives_every_weight_bitsandbytes_bits_cast_in_every_position(dtype):
    # decode "scaled" builds each row's table of a scale block's 16 weights, code * scale cast to 16 bits, and
    # looks codes up in it by byte permutes (inline PTX, run here in nf4_prmt's Python model of PTX): every weight
    # of a quantized matrix, with and without double quant, must come out as bitsandbytes' fp32 weight cast as
    # bitsandbytes casts it; so must every code in each of a word's 8 positions, at scales from tiny to large
    from medusa_core.quant import nf4_prmt as pm

    table_ops = pm.scaled_table_program(tuple(bnbf.get_4bit_type("nf4", device="cpu").tolist()), pm.CASTS[dtype])
    lookups = [pm.scaled_lookup_program(half) for half in (0, 1)]

    def decoded(word: int, scale: float) -> list[int]:      # the word's 8 weights, as 16-bit patterns
        tables = pm.execute(table_ops, {"$8": pm.fp32_bits(scale)})
        operands = {"$4": word, **{f"${5 + j}": tables[f"${j}"] for j in range(8)}}
        weights = []
        for ops in lookups:
            reg = pm.execute(ops, operands)
            weights += [reg[f"${i}"] for i in range(4)]
        return weights

    def bits(values: torch.Tensor) -> list[int]:
        return [b & 0xFFFF for b in values.to(dtype).view(torch.int16).tolist()]

    for nested in (False, True):
        packed, state = quantized(48, 256, nested, seed=4)
        w = rp.repack_bnb([(packed, state)], 128)
        theirs = bnbf.dequantize_4bit(packed, state)                        # (N, K) fp32: code * scale
        for rg, kg, r, j in ((rg, kg, r, j) for rg in range(3) for kg in range(2) for r in range(16) for j in range(16)):
            word = int(w.words[rg, kg, r, j]) & 0xFFFFFFFF
            scales = w.scales[rg, kg, r].tolist()                          # the group's two blocks, 4 planes each
            got = decoded(word, scales[0])[:4] + decoded(word, scales[1])[4:]
            assert got == bits(theirs[rg * 16 + r, kg * 128 + j::16][:8]), (nested, rg, kg, r, j)
    code = torch.tensor(bnbf.get_4bit_type("nf4", device="cpu").tolist())
    words = [sum(((c + step * pos) % 16) << (4 * pos) for pos in range(8)) for c in range(16) for step in range(16)]
    for scale in (0.0, 1e-30, 3.1e-3, 0.07, 1.0, 5.5e4):
        want = bits(code * torch.tensor(scale))
        for word in words:
            assert decoded(word, scale) == [want[(word >> (4 * pos)) & 15] for pos in range(8)], (scale, hex(word))
    asm = pm.scaled(tuple(code.tolist()), dtype)
    assert asm[0].count("mul.rn.f32") == 16 and asm[0].count("cvt.rn.") == 8 and asm[0].count("prmt.b32") == 8
    assert all(a.count("prmt.b32") == 1 + 2 * 2 + 2 and a.count("lop3.b32") == 2 for a in asm[1:])


def test_the_kernel_wires_the_scaled_table_to_its_planes_and_hands_the_dot_bitsandbytes_weights(monkeypatch):
    # the scaled tile run whole under the interpreter in fp16 (numpy's, exact), its three assembly statements run
    # by the Python model: each scale block's table from its own scale, each half's codes to its planes. Identity
    # rows hand back bitsandbytes' fp16 weights; other rows the gather tile's products bit for bit, with split K
    # summed in a second launch and in the same one; a model that swaps the halves is caught
    from triton.runtime import interpreter

    from medusa_core.quant import nf4_prmt as pm

    packed, state = quantized(40, 256)
    w = rp.repack_bnb([(packed, state)], 128)
    asm = pm.scaled(w.table, torch.float16)
    table = pm.scaled_table_program(w.table, pm.CASTS[torch.float16])
    gather = rc.RepackedConfig(True, 16, 32, 2, plane_lookup=True)

    def scaled_tile(x: torch.Tensor, cfg: rc.RepackedConfig) -> torch.Tensor:
        out = torch.empty(x.shape[0], 40, dtype=x.dtype)
        rm._launch(x, w, None, out, dataclasses.replace(cfg, decode="scaled"), True)
        return out

    for half, swapped in ((0, False), (1, True)):
        programs = {asm[0]: table, asm[1]: pm.scaled_lookup_program(half), asm[2]: pm.scaled_lookup_program(1 - half)}
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", asm_model(programs), raising=True)
        eye = torch.eye(256, dtype=torch.float16)
        assert torch.equal(scaled_tile(eye, dataclasses.replace(gather, block_m=64)).T,
                           bnbf.dequantize_4bit(packed, state).to(torch.float16)) != swapped
        if not swapped:
            gen = torch.Generator().manual_seed(2)
            for m, cfg in ((5, gather), (16, dataclasses.replace(gather, block_n=16, split_k=1)),
                           (33, dataclasses.replace(gather, block_m=32, serial=True))):
                x = torch.randn(m, 256, generator=gen).to(torch.float16)
                assert torch.equal(scaled_tile(x, cfg), rm.repacked_matmul(x, w, config=cfg)), cfg


def test_the_scaled_table_runs_where_its_lookups_fit_and_says_what_to_use_elsewhere(monkeypatch):
    # 16-bit weights, 4 planes to a scale block, sm_80 or later: the tuners time it for bf16 and fp16 at group 128
    # over blocks of 64 (what the loader makes), not for fp32, group 256, blocks of 32 or a pre-Ampere GPU; a config
    # asking for it elsewhere is one line naming the fix, and on the CPU the interpreter cannot run it
    w128 = rp.repack_bnb([quantized(200, 256)], 128)
    w256 = rp.repack_bnb([quantized(200, 256)], 256)
    small = rp.repack_bnb([quantized(200, 256, blocksize=32)], 128)
    assert rc.scaled_fits(64, 128, torch.bfloat16) and rc.scaled_fits(64, 128, torch.float16)
    assert not rc.scaled_fits(64, 128, torch.float32) and not rc.scaled_fits(64, 256, torch.bfloat16)
    assert not rc.scaled_fits(32, 128, torch.bfloat16)
    for capability, fits in (((7, 5), False), ((8, 6), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert rc.scaled_fits(64, 128, torch.float16, torch.device("cuda")) == fits, capability
    for m in (1, 16, 64):
        assert "scaled" in {c.decode for c in rc.candidates(m, 11008, 32, 132)}
        assert "scaled" not in {c.decode for c in rc.candidates(m, 11008, 32, 132, scaled=False)}
    assert any(c.decode == "scaled" and c.serial for c in rc.candidates(16, 11008, 32, 132))   # split K summed in it
    # the three-stage tile the H200 kept at 16 rows is timed at 2 and 4 rows too: with it at 16 only, 4 rows cost
    # more than 8 there (31.6 against 27.6 µs a 4096->11008 call), so a 4-node tree's step would cost more than an
    # 8-node one's
    three = {c for c in rc.candidates(16, 11008, 32, 132) if c.decode == "scaled" and c.num_stages == 3}
    assert three and all(three <= set(rc.candidates(m, 11008, 32, 132)) for m in (2, 4))
    # and with its split's partials summed in its own launch: the H200's 16-node step launched the reduce kernel
    # after 96 projections, where that tile split K
    assert {c.serial for c in three} == {False, True}
    assert "scaled" in {c.decode for c in rc.exact_candidates(11008, 32, 132)}
    assert "scaled" not in {c.decode for c in rc.exact_candidates(11008, 32, 132, scaled=False)}
    cfg = rc.RepackedConfig(True, 16, 64, 1, plane_lookup=True, decode="scaled")
    assert cfg.describe() == "dot m16 n64 split1 w4 s2 plane scaled"
    for w, dtype, what in ((w128, torch.float32, "x is torch.float32: use bf16 or fp16 x, or decode gather"),
                           (w256, torch.float16, "at least 128 values at group 256, and this weight's hold 64: "
                                                 "repack with group 128 over blocks of 64 or more, or use decode gather"),
                           (small, torch.bfloat16, "at least 64 values at group 128, and this weight's hold 32")):
        out = torch.empty(16, 200, dtype=dtype)
        with pytest.raises(ValueError, match=f"^decode scaled .*{what}"):
            rm.kernel_call(torch.randn(16, 256).to(dtype), w, None, out, cfg, interpret=True)
    with pytest.raises(ValueError, match="decode scaled is inline PTX.*use decode select"):
        rm.repacked_matmul(torch.randn(16, 256, dtype=torch.float16), w128, config=cfg)
    # a GPU's tuner kept the scaled tile for a shape (timed on blocks of 64): a weight of that shape in blocks of 32,
    # or the same on a pre-Ampere GPU, runs the gather tile, whose dots get the same weights
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    monkeypatch.setitem(rm._TUNED, rm._key(16, 200, 256, torch.bfloat16, gpu, 128), cfg)
    for blocksize, capability, decode in ((64, (9, 0), "scaled"), (32, (9, 0), "gather"), (64, (7, 5), "gather")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        weight = SimpleNamespace(n=200, k=256, group=128, blocksize=blocksize, arrivals=None)
        assert rm.choose_config(16, weight, torch.bfloat16, gpu, exact=False) == dataclasses.replace(cfg, decode=decode)


def test_the_tuners_time_the_table_compiled_in_and_a_config_says_which_lookup_it_runs():
    # the GPU tuners time both constant lookups at every row class, and exact mode's where its rows are exact
    for m in (1, 2, 4, 16, 32, 64):
        assert {c.decode for c in rc.candidates(m, 11008, 32, 132)} == {"gather", *rc.REGISTER_DECODES}, m
    assert {c.decode for c in rc.exact_candidates(11008, 32, 132)} == {"gather", "select", "prmt", "scaled"}
    assert rc.RepackedConfig(True, 16, 64, 1, plane_lookup=True, decode="prmt").describe() == \
        "dot m16 n64 split1 w4 s2 plane prmt"
    for bad in (dict(decode="select"), dict(decode="table", plane_lookup=True)):
        with pytest.raises(ValueError, match="decode one of .* and other than gather with plane_lookup only"):
            rc.RepackedConfig(True, 16, 64, 1, **bad)
    # under the interpreter, prmt says what to run instead (its values are select's)
    packed, state = quantized(200, 192)
    w = rp.repack_bnb([(packed, state)], 128)
    with pytest.raises(ValueError, match="interpreter cannot run: use decode select"):
        rm.repacked_matmul(torch.randn(16, 192), w, config=rc.RepackedConfig(True, 16, 64, 1, plane_lookup=True,
                                                                             decode="prmt"))


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 33, 64])
def test_split_k_summed_by_the_last_split_in_the_same_launch_gives_the_reduce_kernels_bits(m):
    # the same partials added in the same order, then the bias: a tuner may pick either; the arrival counts
    # are back at zero after every call, so the next call (or graph replay) starts right
    n, k, group = SHAPES[0]
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)], group)
    gen = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    block_m = rc.row_class(m) if m <= 4 else 16
    for cfg in (rc.RepackedConfig(m >= 5, block_m, 16, 2, prefetch=m < 5), rc.RepackedConfig(m >= 5, block_m, 32, 3)):
        two_launches = rm.repacked_matmul(x, w, bias, config=cfg)
        serial = dataclasses.replace(cfg, serial=True)
        assert rm.serial_fits(m, w, serial), "the counts cover 64 rows in tiles of 16"
        for _ in range(2):
            assert torch.equal(rm.repacked_matmul(x, w, bias, config=serial), two_launches), cfg
            assert not w.arrivals.any(), "every tile's count is zero again"
    torch.testing.assert_close(two_launches.double(), reference(x, packed, state, bias), rtol=1e-5, atol=1e-4)


def test_the_serial_reduce_is_timed_beside_its_tile_and_left_where_its_counts_cannot_cover_the_rows(monkeypatch):
    assert any(c.serial for c in rc.candidates(1, 11008, 32, 132))         # the GPU tuner times it
    assert any(c.serial for c in rc.candidates(16, 11008, 32, 132))
    assert not any(c.serial for c in rc.candidates(1, 32000, 1, 132)), "one group: no split to sum"
    with pytest.raises(ValueError, match="serial with split_k >= 2"):
        rc.RepackedConfig(False, 1, 16, 1, serial=True)
    n, k, group = SHAPES[0]
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)], group)
    assert w.arrivals.shape == (rp.ROW_TILES * 208 // 16,) and w.arrivals.dtype == torch.int32
    serial = rc.RepackedConfig(True, 16, 16, 2, serial=True)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(7))          # a prefill: 5 row tiles of 16
    with pytest.raises(ValueError, match="more tiles than this weight's counts"):
        rm.repacked_matmul(x, w, config=serial)
    monkeypatch.setattr(rm, "fast_config", lambda *args: serial)               # as a GPU's tuner may choose
    assert not rm.choose_config(70, w, x.dtype, x.device, exact=False).serial
    assert rm.choose_config(16, w, x.dtype, x.device, exact=False).serial
    torch.testing.assert_close(rm.repacked_matmul(x, w).double(), reference(x, packed, state), rtol=1e-5, atol=1e-4)


def test_a_weight_of_eight_scale_blocks_a_group_runs_without_the_prefetch(monkeypatch):
    packed, state = quantized(40, 256, blocksize=32)
    w = rp.repack_bnb([(packed, state)], 256)                  # 8 blocks of 32 in a group of 256
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    assert rc.fast_config(2, 40, 1, 0).prefetch and not rm.choose_config(2, w, x.dtype, x.device, False).prefetch
    torch.testing.assert_close(rm.repacked_matmul(x, w).double(), reference(x, packed, state), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"^prefetch takes at most 4 scale blocks per group, and group 256 holds 8"):
        rm.repacked_matmul(x, w, config=rc.RepackedConfig(False, 2, 16, 1, prefetch=True))
    # a GPU's tuner kept the pipelined GEMV with x ahead for the shape: such a weight runs it without either
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    tuned = rc.RepackedConfig(False, 1, 16, 1, prefetch=2, x_ahead=True)
    monkeypatch.setitem(rm._TUNED, rm._key(1, 40, 256, torch.bfloat16, gpu, 256), tuned)
    assert rm.choose_config(1, w, torch.bfloat16, gpu, False) == dataclasses.replace(tuned, prefetch=0, x_ahead=False)


@pytest.mark.parametrize("m", [1, 33, 70])
def test_cuda_exact_modes_one_tensor_core_tile_computes_the_product_for_any_m(m):
    # exact mode's config on CUDA (its row exactness is the GPU's to show: tests/test_cuda_repacked.py)
    cfg = rc.exact_config(11008, 32, 132)
    assert cfg.dot and cfg.block_m == 64          # no M argument: one tile for 1 row or 64
    n, k, group = SHAPES[1]
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)], group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = rm.repacked_matmul(x, w, config=rc.exact_config(n, -(-k // group), 4))
    torch.testing.assert_close(y.double(), reference(x, packed, state), rtol=1e-5, atol=1e-4)


def test_exact_mode_gives_every_row_the_bits_it_gets_alone():
    n, k, group = 40, 192, 128
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)], group)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n)
    alone = torch.cat([rm.repacked_matmul(x[i:i + 1], w, bias, exact=True) for i in range(64)])
    for m in (2, 3, 8, 16, 33, 64):
        assert torch.equal(rm.repacked_matmul(x[:m], w, bias, exact=True), alone[:m]), f"M={m}"
    # the GPU's tiles (block_n 16, block_m <= 8) and split-K: one split for every M is what makes it
    # hold, whatever the block sizes
    split = [rc.RepackedConfig(False, bm, 16, 2) for bm in (1, 4, 8)]
    rows = [rm.repacked_matmul(x[:33], w, bias, config=cfg) for cfg in split]
    assert all(torch.equal(r, rows[0]) for r in rows[1:])
    assert torch.equal(rm.repacked_matmul(x[5:6], w, bias, config=split[0])[0], rows[0][5])


def nf4_model(arch: str = "llama"):
    model = tiny_model(arch, hidden=64, vocab=64)     # widths 64/128: bitsandbytes' CPU NF4 is right there
    quantize_linear_nf4_(model, torch.float32)
    return model


@pytest.mark.parametrize("exact", [False, True])
def test_fused_qkv_and_gate_up_equal_the_separate_projections(exact):
    model = nf4_model("qwen2")                       # q/k/v with biases
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    names = [(attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))]
    x = torch.randn(3, 5, 64)
    x2 = torch.randn(3, 5, 64)

    def separate(parent, name, inp):   # the projection alone on the same kernel, from bitsandbytes' weight
        layer = getattr(parent, name)
        w = rp.repack_bnb([(layer.weight.data, layer.weight.quant_state)])
        return rm.repacked_matmul(inp, w, layer.bias, exact=exact)

    before = {(id(p), nme): (separate(p, nme, x), separate(p, nme, x2)) for p, group in names for nme in group}
    bytes_before = {(id(p), nme): getattr(p, nme).weight.data.clone() for p, group in names for nme in group}
    described = use_nf4_kernel(model, "repacked-exact" if exact else "repacked")
    assert "for 14 NF4 layers as 8 matmuls (4 fused" in described
    assert isinstance(attn.q_proj, nf4_fused.FusedSlice) and attn.q_proj.fused is attn.v_proj.fused
    for parent, group in names:
        for order in (group[::-1], group):        # any call order; a second input recomputes
            for inp, which in ((x, 0), (x2, 1)):
                for name in order:
                    got, want = getattr(parent, name)(inp), before[(id(parent), name)][which]
                    if exact:
                        assert torch.equal(got, want), name
                    else:
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert getattr(parent, group[0]).fused._pending is None      # nothing kept once all slices are taken
    assert attn.q_proj.fused.out_features == 64 + 32 + 32 and attn.q_proj.out_features == 64   # one (Nq+Nk+Nv) weight
    fused = attn.q_proj.fused.packed            # rebuilt from the module's buffers at each call: its table too
    assert fused.table == tuple(fused.code.tolist()) and len(fused.table) == 16
    assert "bitsandbytes for all 14" in use_nf4_kernel(model, "bnb")      # back, byte for byte
    for parent, group in names:
        for name in group:
            assert torch.equal(getattr(parent, name).weight.data, bytes_before[(id(parent), name)])


def test_greedy_generation_through_the_repacked_kernel_equals_bitsandbytes():
    prompt = [5, 9, 13, 7, 21]

    def run(model, **kw):
        return [t for s in generate(model, prompt, config=DecodeConfig(max_new_tokens=12), **kw) for t in s.tokens]

    reference_model = nf4_model()
    with_bnb = run(reference_model)
    model = nf4_model()                                # the same seed: the same NF4 weights
    heads = copied_heads(model, num_heads=3)
    tree = build_tree_buffers(resolve_tree("cartesian-2x2x2"), 3)
    assert "for 14 NF4 layers" in use_nf4_kernel(model, "repacked")
    assert run(model) == with_bnb
    assert run(model, heads=heads, tree=tree) == with_bnb     # tree verification (multi-row) too
    assert "exact mode" in use_nf4_kernel(model, "repacked-exact")
    assert run(model, heads=heads, tree=tree) == with_bnb
    assert len(with_bnb) == 12


def test_nf4_heads_go_on_the_kernel_the_nf4_kernel_names_and_propose_what_bitsandbytes_proposes():
    """--heads-quant nf4 with --nf4-kernel repacked: each head's vocabulary projection on the repacked kernel (on
    the H200, 38.6 µs a 4096->32000 head at one row against 59.8 on bitsandbytes), its logits bitsandbytes' within
    rounding, and the decode plain decoding's; bnb, triton and (off CUDA) auto put bitsandbytes' modules back, their
    bytes exact."""
    import bitsandbytes as bnb

    model = nf4_model()
    reference = quantize_projections(copied_heads(model, num_heads=3), torch.float32)
    heads = quantize_projections(copied_heads(model, num_heads=3), torch.float32)
    before = [head[-1].weight.data.clone() for head in heads.heads]
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference.logits(hidden, model.lm_head)
        assert use_nf4_heads(heads, "repacked") == "heads: repacked Triton kernel for 3 NF4 projections"
        assert all(type(head[-1]) is nf4_fused.RepackedNF4Linear for head in heads.heads)
        torch.testing.assert_close(heads.logits(hidden, model.lm_head), want, rtol=1e-5, atol=1e-5)
        tree = build_tree_buffers(resolve_tree("cartesian-2x2x2"), 3)
        use_nf4_kernel(model, "repacked-exact")       # a tree's rows get a row's bits alone on any CPU
        plain = [t for s in generate(model, [5, 9, 13, 7], config=DecodeConfig(max_new_tokens=10)) for t in s.tokens]
        assert [t for s in generate(model, [5, 9, 13, 7], heads=heads, tree=tree,
                                    config=DecodeConfig(max_new_tokens=10)) for t in s.tokens] == plain
        for choice in ("bnb", "triton", "auto"):
            assert use_nf4_heads(heads, choice) == "heads: bitsandbytes for their 3 NF4 projections"
            assert all(type(head[-1]) is bnb.nn.Linear4bit for head in heads.heads)
            assert all(torch.equal(head[-1].weight.data, b) for head, b in zip(heads.heads, before, strict=True))
            assert torch.equal(heads.logits(hidden, model.lm_head), want)
            use_nf4_heads(heads, "repacked")
    assert use_nf4_heads(copied_heads(model, num_heads=3), "repacked") == ""     # no NF4 layers: nothing to route


def test_nf4_heads_forced_onto_a_triton_kernel_off_cuda_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "0")
    heads = quantize_projections(copied_heads(nf4_model(), num_heads=2), torch.float32)
    with pytest.raises(ValueError, match=r"^--nf4-kernel repacked-exact for the heads' NF4 projections: the Triton "
                                         r"kernels .* need a CUDA device; .* or use --nf4-kernel bnb$"):
        use_nf4_heads(heads, "repacked-exact")
    assert use_nf4_heads(heads, "auto") == "heads: bitsandbytes for their 2 NF4 projections"


def test_an_nf4_kernel_beside_nf4_heads_alone_is_not_refused_as_applying_to_nothing():
    from medusa_core.quant.bnb import flag_error

    assert "makes none: add --quant nf4, or drop --nf4-kernel" in flag_error("bnb", "cuda:0", "none")
    assert flag_error("bnb", "cuda:0", "none", heads_quant="nf4") is None      # the heads' NF4 projections
    # but exact mode is the backbone's: with NF4 heads alone it would make nothing exact
    assert flag_error("repacked-exact", "cuda:0", "none", heads_quant="nf4").startswith(
        "--nf4-kernel repacked-exact makes an NF4 backbone's steps row-exact, and --quant none on cuda:0 makes none")


def test_exact_mode_takes_the_row_exact_attention_and_says_what_else_this_machine_keeps_row_invariant():
    model = nf4_model()
    before = model.config._attn_implementation
    text = use_nf4_kernel(model, "repacked-exact")
    assert model.config._attn_implementation == ROW_EXACT_ATTENTION and "row-exact attention, norms and lm_head" in text
    assert type(model.get_output_embeddings()).__name__ == "RowsAloneHead"
    assert nf4_fused.row_invariance(model) == {}      # every norm and the head replaced: nothing to measure
    assert sum(type(m).__name__ == "LlamaRMSNorm" for m in model.modules()) == 0
    checks = nf4_fused.row_invariance(nf4_model())    # pieces left as they are: measured, per machine
    assert set(checks) == {"LlamaRMSNorm", "lm_head"} and all(isinstance(ok, bool) for ok in checks.values())
    assert "greedy trees give plain decoding's tokens" in text and weights_format(model) == "NF4-exact"
    assert "exact" not in use_nf4_kernel(model, "repacked")           # fast mode: its attention back
    assert model.config._attn_implementation == before and weights_format(model) == "NF4"
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    assert sum(type(m).__name__ == "LlamaRMSNorm" for m in model.modules()) == 2 * 2 + 1     # 2 layers: back
    use_nf4_kernel(model, "bnb")
    assert model.config._attn_implementation == before and weights_format(model) == "NF4"


def test_exact_mode_names_a_piece_it_could_not_make_row_exact(monkeypatch):
    model = nf4_model()
    # as if this machine's norm rounded a row differently among others: exact mode must not be claimed
    monkeypatch.setattr(nf4_fused, "row_invariance", lambda m: {"GemmaRMSNorm": False})
    text = use_nf4_kernel(model, "repacked-exact")
    assert "GemmaRMSNorm not row-invariant on this cpu, so trees may differ from plain decoding" in text
    assert weights_format(model) == "NF4"


def nf4_bytes(model) -> dict[str, torch.Tensor]:
    return {name: m.weight.data.clone() for name, m in model.named_modules()
            if type(m).__name__ in ("Linear4bit", "TritonNF4Linear")}


def greedy(model, tokens: int = 6) -> list[int]:
    return [t for s in generate(model, [5, 9, 13], config=DecodeConfig(max_new_tokens=tokens)) for t in s.tokens]


class GpuStandIn:
    """auto's CUDA path (bnb._use_measured) run here: a device that says "cuda", and the GPU's timings
    stood in (``repacked_us(m, n)``; bitsandbytes' storage: bnb 2 µs at one row, Triton 10 µs at 16).
    ``alive_while_triton_tuned`` records, each time the Triton routing tunes a layer, how many
    repacked modules are still alive: a second copy of the weights on a GPU."""

    def __init__(self, monkeypatch, repacked_us):
        from medusa_core.quant import bnb as qb
        from medusa_core.quant import nf4_matmul as nm

        self.qb, self.timed, self.alive_while_triton_tuned, self.made = qb, [], [], []
        monkeypatch.setattr(qb, "_one_row_us", lambda layer, dtype: (3.0, 2.0))
        monkeypatch.setattr(qb, "_timed_us", lambda layer, dtype, rows, kernel: 7.0)
        monkeypatch.setattr(nm, "tuned_us", lambda m, n, k, dtype, device, blocksize=64: 10.0)
        real_choose = nm.choose_config

        def choose(m, n, k, dtype, device, blocksize=64):
            if isinstance(device, torch.device):        # a forward here, on the CPU
                return real_choose(m, n, k, dtype, device, blocksize)
            self.alive_while_triton_tuned.append(sum(ref() is not None for ref in self.made))

        monkeypatch.setattr(nm, "choose_config", choose)

        def timed(m, n, k, dtype, device, group=128):
            self.timed.append(m)
            return repacked_us(m, n)

        monkeypatch.setattr(rm, "tuned_us", timed)
        real = nf4_fused.repack_layers

        def repack(*args, **kw):
            made, kept = real(*args, **kw)
            self.made += [weakref.ref(f) for f in made]
            return made, kept

        monkeypatch.setattr(nf4_fused, "repack_layers", repack)

    def auto(self, model) -> str:
        from types import SimpleNamespace

        return self.qb._use_measured(model, self.qb._plain(list(self.qb._nf4_layers(model))),
                                     SimpleNamespace(type="cuda"))


@pytest.mark.parametrize("repacked_us", [1.0, 100.0])
def test_auto_on_a_gpu_keeps_whichever_kernel_the_gpus_timings_say_is_faster(monkeypatch, repacked_us):
    """On bitsandbytes' storage a layer costs the faster of bnb and the Triton kernel at one row plus the
    tuned kernel at 16 rows; repacked, each fused matmul its tuned cost at 1 and 16 rows. The cheaper
    routing is kept, the other one's bytes come back exactly (and its copy of the weights is gone before
    the Triton routing tunes), only the winner's other row classes are tuned, and the line gives both
    sums. (On an H100, 2026-11-27: 57.5 against 70.4 µs for a 4096->11008 projection.)"""
    model = nf4_model()
    want, before = greedy(model), nf4_bytes(model)
    gpu = GpuStandIn(monkeypatch, lambda m, n: repacked_us)
    text = gpu.auto(model)
    # 14 layers at 2 + 10 µs on the storage; 8 matmuls (q/k/v and gate/up fused) at 2 x repacked_us
    assert text.endswith(f"(auto measured {16 * repacked_us:.0f} µs against 168 µs on bitsandbytes' storage for "
                         "the projections of a 1-row and a 16-row step)"), text
    if repacked_us < 10:
        assert text.startswith("nf4 kernel: repacked Triton kernel for 14 NF4 layers as 8 matmuls (4 fused")
        assert isinstance(model.model.layers[0].self_attn.q_proj, nf4_fused.FusedSlice)
        assert sorted(set(gpu.timed)) == [1, 2, 4, 16, 32, 64]
    else:
        assert text.startswith("nf4 kernel: Triton for 14 NF4 layers")
        assert sorted(set(gpu.timed)) == [1, 16]
        assert gpu.alive_while_triton_tuned and not any(gpu.alive_while_triton_tuned)
        assert {name: b.shape for name, b in nf4_bytes(model).items()} == {name: b.shape for name, b in before.items()}
        assert all(torch.equal(b, before[name]) for name, b in nf4_bytes(model).items())
    assert greedy(model) == want


def test_auto_on_a_gpu_fuses_a_group_only_where_one_matmul_times_faster_than_its_projections_apart(monkeypatch):
    """The issue's "one matmul where it measures faster": the H100 timed fused gate/up slower than apart at
    8-32 rows. Here the fused gate/up weight (N = 2 x 128) is made slow: q/k/v stays fused, gate/up apart,
    and the line says why; the model still decodes what bitsandbytes decodes."""
    model = nf4_model()
    want = greedy(model)
    text = GpuStandIn(monkeypatch, lambda m, n: 50.0 if n == 256 else 1.0).auto(model)
    # per layer: q/k/v as one matmul, o, gate, up, down; gate/up apart 2 x 2 x 1 µs, fused 2 x 50, in 2 layers
    assert "as 10 matmuls (2 fused q/k/v or gate/up, gate/up apart (8 µs against 200 fused))" in text, text
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert type(mlp.gate_proj) is nf4_fused.RepackedNF4Linear and isinstance(attn.q_proj, nf4_fused.FusedSlice)
    assert greedy(model) == want


def test_auto_charges_a_layer_the_repacking_leaves_on_bitsandbytes_what_bitsandbytes_costs(monkeypatch):
    # such a layer runs bitsandbytes' own matmul at every row count in the repacked routing (7 µs stood in
    # per call), not the Triton kernel's 16-row time: charging that would favour the repacked side
    real = nf4_fused.check_bnb_nf4

    def refuse_down_proj(packed, state):
        if tuple(state.shape) == (64, 128):
            raise ValueError("a layout the repacking does not take")
        return real(packed, state)

    monkeypatch.setattr(nf4_fused, "check_bnb_nf4", refuse_down_proj)
    text = GpuStandIn(monkeypatch, lambda m, n: 1.0).auto(nf4_model())
    # 3 matmuls per layer at 2 x 1 µs, and down_proj on bitsandbytes at 2 x 7, in 2 layers
    assert "(auto measured 40 µs against 168 µs" in text and "2 layer(s) kept on bitsandbytes (down_proj: a layout" in text


@pytest.mark.parametrize("fails_at", [1, 32])
def test_auto_on_a_gpu_the_repacked_kernel_cannot_compile_for_keeps_the_triton_kernel_and_says_so(monkeypatch,
                                                                                                   fails_at):
    """Whether the repacked kernel compiles nowhere for the rows auto weighs (1) or only fails at a row class
    tuned after it won (32): the Triton routing, the reason in the line, bitsandbytes' bytes back exactly,
    and no repacked copy of the weights left alive (a review found both a traceback and a second copy)."""
    model = nf4_model()
    before = nf4_bytes(model)

    def repacked_us(m, n):
        if m == fails_at:
            raise rm.NoConfigCompiled(f"no repacked NF4 config compiled for {n}x64 on an old GPU")
        return 1.0

    gpu = GpuStandIn(monkeypatch, repacked_us)
    text = gpu.auto(model)
    assert text.startswith("nf4 kernel: Triton for 14 NF4 layers") and "\n" not in text, text
    assert text.endswith("on an old GPU)") and "(auto: no repacked NF4 config compiled for " in text
    assert all(torch.equal(b, before[name]) for name, b in nf4_bytes(model).items())
    assert not any(isinstance(m, nf4_fused.RepackedNF4Linear) for m in model.modules())
    assert gpu.alive_while_triton_tuned and not any(gpu.alive_while_triton_tuned)


def test_a_kernel_forced_by_name_that_compiles_nowhere_is_one_line_and_leaves_bitsandbytes(monkeypatch):
    from medusa_core.quant import bnb as qb

    model = nf4_model()
    before = nf4_bytes(model)
    real = qb._use_repacked

    def repack_then_fail(*args, **kw):
        real(*args, **kw)
        raise rm.NoConfigCompiled("no repacked NF4 config compiled for 192x64 on an old GPU")

    monkeypatch.setattr(qb, "_use_repacked", repack_then_fail)
    with pytest.raises(ValueError, match=r"^--nf4-kernel repacked-exact: no repacked NF4 config compiled for 192x64 "
                                         r"on an old GPU: use --nf4-kernel bnb$"):
        use_nf4_kernel(model, "repacked-exact")
    assert all(torch.equal(b, before[name]) for name, b in nf4_bytes(model).items())
    assert weights_format(model) == "NF4" and model.config._attn_implementation != ROW_EXACT_ATTENTION


def test_a_tuned_trees_cache_entry_names_the_kernel_routed_not_the_word_auto():
    # auto now picks a kernel by timing on the GPU; a tree tuned while auto meant the Triton kernel must not be
    # reused once it means the repacked one. A model without NF4 keeps the old entry (the CPU default's cache)
    import json

    from medusa_core.loading.policy import tuning_mode
    from medusa_core.loading.spec import LoadSpec

    spec, model = LoadSpec(), nf4_model()
    for kernel in ("bnb", "triton", "repacked", "repacked-exact"):
        use_nf4_kernel(model, kernel)
        assert json.loads(tuning_mode(spec, model, "cuda", "nf4", torch.bfloat16))["nf4_kernel"] == kernel
    plain = json.loads(tuning_mode(spec, tiny_model("llama", hidden=64, vocab=64), "cpu", "none", torch.float32))
    assert plain == {"device": "cpu", "quant": "none", "dtype": "torch.float32", "heads_quant": "none",
                     "nf4_kernel": "auto"}


def test_auto_off_cuda_never_picks_a_triton_kernel_and_errors_are_one_line(monkeypatch):
    model = nf4_model()
    assert "repacked" not in use_nf4_kernel(model, "auto")
    with pytest.raises(ValueError, match=r"^nf4 kernel 'fast' is unknown: use one of auto, triton, bnb, repacked, "
                                         r"repacked-exact$"):
        use_nf4_kernel(model, "fast")
    monkeypatch.delenv(INTERPRET_ENV)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as err:
        use_nf4_kernel(model, "repacked")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^group 64 does not fit blocksize 64: use one of \(128, 256\)"):
        rp.repack(torch.zeros(16, 128, dtype=torch.uint8), torch.zeros(16, 2), torch.zeros(16), 64, group=64)


def test_benchmark_without_cuda_is_one_line(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    assert bench.main(["--json", str(tmp_path / "nf4.json")]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "needs a CUDA GPU" in out and not (tmp_path / "nf4.json").exists()


def test_the_fusion_benchmark_times_each_side_in_its_tuned_config(monkeypatch):
    """The H200 of 11-29 timed fused gate/up at 74.1 µs a 16-row call against 56.6 apart: the benchmark tuned the
    separate projections' shapes and ran the fused one in its default tile, which its tuner timed at 49.2. Each
    shape is now tuned for the row class before that class is timed (the projections' own shapes were tuned for
    the main table), and each row says its configs."""
    events = []
    monkeypatch.setattr(bench, "FUSED", {"gate/up": (128, (64, 64))})
    monkeypatch.setattr(bench, "ROWS", (1, 16))
    monkeypatch.setattr(rm, "tune_shape", lambda m, n, k, *a, **kw: events.append(("tune", n, rm.row_class(m))))
    # the separate projections' shape was tuned for the main table (its row classes): not tuned again
    monkeypatch.setattr(rm, "tuned_config", lambda m, n, k, *a, **kw: "tuned" if n == 64 else None)

    def timed(calls):
        rows = {rm.row_class(c.args[0].shape[0]) for c in calls}
        events.append(("time", {c.args[1].n for c in calls}, rows))
        return 1.0

    monkeypatch.setattr(bench, "graph_time_us", timed)
    out = bench.bench_fusion(torch.device("cpu"), l2=1)
    assert [(f["m"], f["mode"]) for f in out] == [(1, "fused"), (1, "separate"), (16, "fused"), (16, "separate")]
    assert [e for e in events if e[0] == "tune"] == [("tune", 128, 1), ("tune", 128, 16)]
    for cls in (1, 16):     # the fused shape tuned for the class before either side is timed in it
        first_time = events.index(next(e for e in events if e[0] == "time" and e[2] == {cls}))
        assert ("tune", 128, cls) in events[:first_time]
    assert all(len(f["configs"]) == (1 if f["mode"] == "fused" else 2) for f in out)


def test_the_exactness_count_routes_each_kernel_and_counts_identical_answers():
    """benchmarks.nf4_exactness on a tiny fp32 NF4 model (where greedy Medusa equals plain decoding
    by construction): every answer counts as identical on every kernel, and the model goes back to
    bitsandbytes' own layers afterwards. On a GPU it counts what bf16 rounding changes."""
    from medusa_core.benchmarks import nf4_exactness

    model = nf4_model()
    heads = copied_heads(model, num_heads=3)
    tree = build_tree_buffers(resolve_tree("cartesian-2x2x2"), 3)
    prompts = [[5, 9, 13, 7, 21], [3, 4, 5]]
    seen = []   # what a run cut short by the device call's limit has written: the counts after each kernel
    counts = nf4_exactness.count_identical(model, heads, tree, prompts, 8, ["bnb", "repacked-exact"],
                                           on_count=lambda so_far: seen.append([c.kernel for c in so_far]))
    assert [(c.kernel, c.identical, c.prompts) for c in counts] == [("bnb", 2, 2), ("repacked-exact", 2, 2)]
    assert seen == [["bnb"], ["bnb", "repacked-exact"]]
    assert counts[1].first_divergence == [None, None] and "exact mode" in counts[1].routing
    assert not any(isinstance(m, nf4_fused.RepackedNF4Linear) for m in model.modules())


def test_the_exactness_count_on_a_cpu_is_one_line(capsys):
    from medusa_core.benchmarks import nf4_exactness

    assert nf4_exactness.main(["--device", "cpu"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_smollm2_exactness_count_loads_smollm2_and_its_heads_on_a_gpu_too(monkeypatch):
    """On CUDA the loader's defaults are Vicuna-7B from the hub: the count named none, so on the GPU it would
    have fetched Vicuna (unreachable there) instead of SmolLM2."""
    from medusa_core.benchmarks import nf4_exactness
    from medusa_core.loading import load as load_module
    from medusa_core.loading.assets import CPU_DEFAULT_HEADS, CPU_DEFAULT_TREE

    asked = []

    def stop(spec, **kw):
        asked.append(spec)
        raise RuntimeError("stop here")

    monkeypatch.setattr("medusa_core.loading.assets.cpu_default_backbone", lambda: CPU_DEFAULT_HEADS.parent / "smol")
    monkeypatch.setattr(load_module, "load", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        nf4_exactness.smollm2_setup("cuda", 2)
    spec = asked[0]
    assert (spec.model, spec.heads, spec.device) == (str(CPU_DEFAULT_HEADS.parent / "smol"), str(CPU_DEFAULT_HEADS), "cuda")
    assert (spec.quant, spec.heads_quant, spec.tree) == ("nf4", "nf4", str(CPU_DEFAULT_TREE))
