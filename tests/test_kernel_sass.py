"""The repacked NF4 kernel compiled for an H100 (sm_90) on this GPU-less machine, and read back.

What a GPU session relies on before it times anything: every config compiles for the target, the
weight words arrive in 16-byte loads, nothing spills, and the NF4 table is one shared-memory lookup
per weight (not a chain of selects, and not repeated for every row of a multi-row GEMV).
"""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from medusa_core.benchmarks import kernel_sass as ks
from medusa_core.quant import nf4_repacked_configs as rc
from medusa_core.quant import nf4_repacked_kernel as rk
from medusa_core.quant import nf4_repacked_matmul as rm


@pytest.fixture(autouse=True)
def _fp_fusion(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")     # the launch passes it explicitly; silences a warning


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_loads_words_16_bytes_at_a_time_and_looks_each_weight_up_once(tmp_path, m):
    k, n = 4096, 11008
    cfg = rc.fast_config(m, n, k // 128, ks.H100.sms)
    assert not cfg.dot
    r = ks.report(ks.repacked_launch(k, n, m, cfg), ks.H100, tmp_path)
    assert r.registers > 0 and r.local_bytes == 0, r
    assert r.global_loads.get("LDG.E.128", 0) >= 1, r.global_loads       # words: 16-byte vectors
    # one table lookup per weight, whatever the row count (rows share a weight's code)
    assert 1 <= r.shared_loads_per_weight < 1.5, r
    assert r.issue_us > 0 and r.shared_us > 0 and r.floor_us > 0


@pytest.mark.parametrize("m", [1, 2])
def test_two_groups_ahead_the_gemv_copies_its_words_to_shared_memory_asynchronously(tmp_path, m):
    # why prefetch 2 is Triton's pipeliner: two groups held in registers are handed on at the loop's end by a copy
    # that waits for the load issued at its top, so they were never two groups ahead. Pipelined, the words and
    # scales come by asynchronous copies into shared memory, none into registers, with fewer barriers a group
    k, n = 4096, 11008
    one = rc.fast_config(m, n, k // 128, ks.H100.sms)
    assert one.prefetch == 1 and not one.dot
    ahead = ks.report(ks.repacked_launch(k, n, m, one), ks.H100, tmp_path)
    deep = ks.report(ks.repacked_launch(k, n, m, dataclasses.replace(one, prefetch=2)), ks.H100, tmp_path)
    assert deep.local_bytes == 0, deep
    assert deep.global_loads.get("LDGSTS.E.BYPASS.128", 0) >= 1 and "LDG.E.128" not in deep.global_loads, deep
    assert "LDGSTS" not in ahead.opcodes and ahead.global_loads.get("LDG.E.128", 0) >= 1, ahead
    assert deep.opcodes["BAR"] < ahead.opcodes["BAR"], (deep.opcodes, ahead.opcodes)


def test_three_groups_ahead_the_one_row_gemv_holds_the_third_in_shared_memory_not_registers(tmp_path):
    # why the one-row tuner times it: a third group in flight (a fourth pipeline stage) costs shared memory and a
    # few registers, not spills, so about as many programs fit an SM with more bytes in flight each
    k, n = 4096, 11008
    two = dataclasses.replace(rc.fast_config(1, n, k // 128, ks.H100.sms), prefetch=2, x_ahead=True)
    three = dataclasses.replace(two, prefetch=3)
    r2, r3 = (ks.report(ks.repacked_launch(k, n, 1, cfg), ks.H100, tmp_path) for cfg in (two, three))
    assert r3.local_bytes == 0 and r3.registers <= 128, r3
    assert r3.global_loads.get("LDGSTS.E.BYPASS.128", 0) >= 1 and "LDG.E.128" not in r3.global_loads, r3
    shared2, shared3 = (ks.compile_launch(ks.repacked_launch(k, n, 1, cfg), 90).metadata.shared for cfg in (two, three))
    assert shared2 < shared3 <= 2 * shared2, (shared2, shared3)


@pytest.mark.parametrize("plane_lookup,whole_group", [(False, False), (True, False), (False, True)])
def test_tensor_core_path_compiles_without_spills(tmp_path, plane_lookup, whole_group):
    k, n = 4096, 4096
    cfg = dataclasses.replace(rc.fast_config(16, n, k // 128, ks.H100.sms), plane_lookup=plane_lookup,
                              whole_group=whole_group)
    assert cfg.dot
    r = ks.report(ks.repacked_launch(k, n, 16, cfg), ks.H100, tmp_path)
    assert r.local_bytes == 0 and r.shared_bytes > 0, r
    assert "HGMMA" in r.opcodes or "HMMA" in r.opcodes, r.opcodes     # the weight tile meets the tensor cores


@pytest.mark.parametrize("decode", ["select", "prmt", "scaled"])
def test_a_lookup_without_shared_memory_decodes_each_plane_in_the_registers_of_its_dot(tmp_path, decode):
    # why these lookups are timed: with only the word, constants and the row's scale between the load and the dot,
    # Triton decodes the plane where the dot reads it, not through shared memory. The gather tile refills its table
    # before each plane's gather and stores each decoded plane to shared memory; these tiles' loops have neither
    k, n = 4096, 11008
    plane = rc.fast_config(16, n, k // 128, ks.H100.sms)
    assert plane.plane_lookup and plane.decode == "gather"
    table, register = (ks.report(ks.repacked_launch(k, n, 16, cfg), ks.H100, tmp_path)
                       for cfg in (plane, dataclasses.replace(plane, decode=decode)))
    assert register.local_bytes == 0 and ("HGMMA" in register.opcodes or "HMMA" in register.opcodes), register
    assert register.opcodes.get("BAR", 0) <= 2, register.opcodes
    assert table.opcodes["BAR"] > 16, table.opcodes                 # two a plane at least: its table refilled
    assert "STS" not in register.opcodes and table.opcodes.get("STS", 0) >= 8, (register.opcodes, table.opcodes)
    assert register.shared_loads_per_weight < 0.5 and table.shared_loads_per_weight >= 1, (register, table)
    # the lookup itself, per weight: the tree's selects, or a word's permutes (34 for its 8 codes; 14 and a share of
    # the table's 8 in the scaled table of 2-byte entries)
    op, least = {"select": ("FSEL", 8), "prmt": ("PRMT", 4), "scaled": ("PRMT", 2)}[decode]
    assert register.opcodes.get(op, 0) >= least * register.weights_per_thread, register.opcodes


def test_the_scaled_table_decodes_in_fewer_instructions_and_registers_than_the_fp32_table(tmp_path):
    # what decode scaled is for: its lookups permute 2 bytes a weight where prmt's permute 4, and its table, built
    # per row and scale block, hands the dot cast weights: no multiply or cast per weight, no rematerialized
    # constants. Compiled for sm_90 at 16 and 64 rows, against prmt on the same tile
    k, n = 4096, 11008
    for m in (16, 64):
        plane = rc.fast_config(m, n, k // 128, ks.H100.sms)
        prmt, scaled = (ks.report(ks.repacked_launch(k, n, m, dataclasses.replace(plane, decode=d)), ks.H100, tmp_path)
                        for d in ("prmt", "scaled"))
        assert scaled.instructions_per_weight < 0.8 * prmt.instructions_per_weight, (m, scaled, prmt)
        assert scaled.registers < prmt.registers and scaled.local_bytes == 0, (m, scaled, prmt)


def test_the_scaled_tile_three_stages_deep_holds_a_second_group_in_shared_memory_not_registers(tmp_path):
    # why the 16-row tuner times it: a third stage doubles the loads in flight at the registers of two, so as many
    # programs fit an SM (shared memory allowing)
    k, n = 4096, 11008
    two = dataclasses.replace(rc.fast_config(16, n, k // 128, ks.H100.sms), decode="scaled")
    three = dataclasses.replace(two, num_stages=3)
    assert three in rc.candidates(16, n, k // 128, ks.H100.sms)
    r2, r3 = (ks.report(ks.repacked_launch(k, n, 16, cfg), ks.H100, tmp_path) for cfg in (two, three))
    allocated = [-(-r.registers // 8) * 8 for r in (r2, r3)]      # an SM hands registers out 8 a thread at a time
    assert allocated[0] == allocated[1] and r3.local_bytes == 0 and r3.opcodes.get("BAR", 0) <= 2, (r2, r3)
    shared2, shared3 = (ks.compile_launch(ks.repacked_launch(k, n, 16, cfg), 90).metadata.shared
                        for cfg in (two, three))
    assert shared2 < shared3 < 2 * shared2 and 7 * shared3 <= 227 * 1024, (shared2, shared3)


def _instructions(cubin) -> int:
    return sum(not line.endswith(":") for line in ks.disassemble(cubin))


# Both kernels' reductions are tl.reduce when compiled: written-out halving trees (reshape and split) made
# Triton 3.6, the H100 image's, give every thread the whole row (14,000 instructions and 1.2 KB of stack
# for a 4096 norm; the H100 timed it at 39 µs a call), and 3.9 up to 1,700 instructions for wider rows.
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 32, 128), (9, 3, 64)])     # Llama-2-7B; SmolLM2 (GQA)
def test_exact_modes_attention_compiles_with_nothing_in_local_memory(tmp_path, heads, kv_heads, dim):
    cubin = tmp_path / "attention.cubin"
    cubin.write_bytes(ks.compile_launch(ks.attention_launch(heads, kv_heads, dim, rows=16), ks.H100.arch).asm["cubin"])
    res = ks.resources(cubin)
    assert res["REG"] > 0 and res["LOCAL"] == 0 and res["STACK"] == 0, res     # a group axis once cost 73 KB of stack
    assert _instructions(cubin) < 800          # a block of keys shared out over the threads, not copied to each


@pytest.mark.parametrize("hidden", [4096, 576, 8192])      # Llama-2-7B; SmolLM2; a 70B's rows
def test_the_norm_compiles_to_a_share_of_the_row_per_thread_with_nothing_in_local_memory(tmp_path, hidden):
    cubin = tmp_path / "norm.cubin"
    cubin.write_bytes(ks.compile_launch(ks.norm_launch(hidden), ks.H100.arch).asm["cubin"])
    res = ks.resources(cubin)
    assert res["REG"] > 0 and res["LOCAL"] == 0 and res["STACK"] == 0, res
    assert _instructions(cubin) < 600          # 16-32 elements a thread, whatever the row's width


@pytest.mark.parametrize("k,n", [(4096, 32000), (576, 49152)])     # Llama-2-7B's head; SmolLM2's
def test_exact_modes_head_compiles_with_nothing_in_local_memory(tmp_path, k, n):
    r = ks.report(ks.head_launch(k, n, rows=8), ks.H100, tmp_path)
    assert r.registers > 0 and r.local_bytes == 0, r
    assert r.opcodes.get("FFMA", 0) > 0, r.opcodes                 # CUDA cores: one FMA per weight per row


def test_shared_memory_clocks_follow_the_width():
    assert [ks.shared_clocks_of(op) for op in ("LDS", "LDS.U16", "LDS.64", "STS.128", "LDSM.16.M88.4", "FFMA")] == \
        [1, 1, 2, 4, 4, 0]


def test_main_loop_is_the_largest_backward_branch():
    lines = ["MOV R1, c[0x0][0x28]", ".L_x_0:", "LDG.E.128 R4, desc[UR4][R2.64]", "@P0 LDS R6, [R5]",
             "FFMA R8, R6, R7, R8", "@P1 BRA `(.L_x_0)", "EXIT", ".L_x_1:", "BRA `(.L_x_1)"]
    loop = ks.main_loop(lines)
    assert [ks.opcode(ins) for ins in loop] == ["LDG.E.128", "LDS", "FFMA", "BRA"]
    with pytest.raises(ValueError, match="no loop"):
        ks.main_loop(["MOV R1, R2", "EXIT"])


def test_a_loads_lead_is_counted_to_the_first_instruction_naming_what_it_loaded_around_the_loop():
    words = ["@!P1 LDG.E.128 R12, desc[UR12][R2.64]",           # R12..R15
             "FFMA R8, R6, R7, R8",
             "LDGSTS.E.BYPASS.128 [R40], desc[UR14][R24.64]",   # an asynchronous copy: no register loaded
             "IMAD.MOV.U32 R35, RZ, RZ, R15"]                   # R15, third on
    assert ks.load_ahead(words) == 3
    x = ["IADD3 R51, R51, 0x1, RZ",                             # R51 in the next pass: third on, around the loop
         "LDG.E.U16 R50, desc[UR12][R64.64]",                   # R50: second on, the nearest
         "LDG.E.U16 R51, desc[UR12][R66.64]",
         "FADD R9, R50, R9",
         "FFMA R8, R6, R7, R8"]
    assert ks.load_ahead(x) == 2
    assert ks.load_ahead(["FFMA R8, R6, R7, R8", "BRA `(.L_x_0)"]) is None
    assert ks._named_registers("LDG.E R5, desc[UR4][R2.64+0x10]") == {5, 2, 3}
    assert ks._named_registers("IADD3 R1, RZ, R10.reuse, -R11") == {1, 10, 11}


def test_x_a_group_ahead_gives_every_load_of_the_one_row_gemv_most_of_a_pass_to_arrive(tmp_path):
    # why x_ahead is timed at one row: each plane's x is otherwise loaded a few instructions before its products,
    # a cache round trip 8 times a group; loaded with the group before, it is first needed a pass later
    k, n = 4096, 11008
    one = rc.fast_config(1, n, k // 128, ks.H100.sms)
    plain = ks.report(ks.repacked_launch(k, n, 1, dataclasses.replace(one, prefetch=2)), ks.H100, tmp_path)
    ahead = ks.report(ks.repacked_launch(k, n, 1, dataclasses.replace(one, prefetch=2, x_ahead=True)), ks.H100,
                      tmp_path)
    assert plain.load_ahead < 0.5 * plain.loop_instructions, plain
    assert ahead.load_ahead > 0.75 * ahead.loop_instructions, ahead
    assert ahead.local_bytes == 0, ahead


def test_cli_reports_fast_and_exact_configs_as_json(tmp_path, capsys):
    out = tmp_path / "sass.json"
    assert ks.main(["--shape", "4096x4096", "--rows", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["fast", "exact"]
    assert [r["config"].split()[0] for r in rows] == ["gemv", "dot"]     # exact: one tensor-core tile for any M
    assert all((r["m"], r["n"], r["k"]) == (1, 4096, 4096) for r in rows)
    assert "not timings" in capsys.readouterr().out


def test_a_malformed_shape_is_one_line(capsys):
    with pytest.raises(SystemExit):
        ks.main(["--shape", "4096"])
    assert "shape '4096' is not KxN" in capsys.readouterr().err


@pytest.mark.parametrize("args,says", [(["--shape", "0x11008"], "shape '0x11008' has a side below 1"),
                                       (["--rows", "0"], "argument --rows: 0 is below 1: give a row count"),
                                       (["--arch", "0"], "argument --arch: 0 is below 75")])
def test_numbers_it_cannot_compile_for_are_one_line(args, says, capsys):
    # QA: a traceback, rows of zeros or FAILED rows with exit 0, and 10,000 lines of PTX dump
    with pytest.raises(SystemExit) as stop:
        ks.main(args)
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_a_json_it_could_not_write_is_one_line_before_compiling(tmp_path, capsys, monkeypatch):
    # QA: it compiled every config first, then failed writing with a traceback, the results lost
    monkeypatch.setattr(ks, "report", lambda *a, **kw: pytest.fail("compiled before checking --json"))
    # a folder; and a path no one can write, not even root, whom os.access lets through (QA)
    for path in (str(tmp_path), "/proc/medusa-sass.json", "/proc/medusa/new/sass.json"):
        assert ks.main(["--json", path, "--shape", "64x64", "--rows", "1"]) == 2
        assert f"--json {path} cannot be written" in capsys.readouterr().err


def test_compiles_the_launch_repacked_matmul_makes():
    # the same arguments as a real launch, on meta tensors: a change to the launch reaches the report
    meta = torch.device("meta")
    from medusa_core.quant.nf4_repack import RepackedNF4

    w = RepackedNF4(torch.empty(2, 1, 16, 16, dtype=torch.int32, device=meta), torch.empty(2, 1, 16, 2, device=meta),
                    torch.empty(16, device=meta), 32, 128, 64, 128)
    x = torch.empty(3, 128, dtype=torch.bfloat16, device=meta)
    fn, grid, args, kw, part = rm.kernel_call(x, w, None, torch.empty(3, 32, dtype=torch.bfloat16, device=meta),
                                          rc.RepackedConfig(False, 4, 16, 1), interpret=False)
    assert fn is rk.repacked_kernel and grid == (1, 2, 1) and part is None and kw["BLOCK_M"] == 4 and args[8:12] == (3, 32, 128, 1)


def test_calibration_sets_the_committed_kernel_estimate_beside_its_measured_time(tmp_path, capsys):
    # the shape of benchmarks.nf4_kernel's rows, as docs/perf/h100.json keeps them
    rows = [{"k": 4096, "n": 4096, "m": 1, "method": "triton", "us": 17.16,
             "variant": "stream sub1 slots2 m1 n128 split8 w4 s1"},
            {"k": 4096, "n": 4096, "m": 64, "method": "triton", "us": 24.65, "variant": "tile m64 n64 split2 w4 s1"},
            {"k": 4096, "n": 4096, "m": 1, "method": "bnb", "us": 11.0, "variant": ""}]
    report = tmp_path / "h100.json"
    report.write_text(json.dumps({"nf4_matmul": {"rows": rows}}))
    got = ks.calibrate(report, ks.H100, tmp_path)
    assert [(r["m"], r["config"]) for r in got] == [(1, rows[0]["variant"]), (64, rows[1]["variant"])]
    for r, row in zip(got, rows):
        assert r["measured_us"] == row["us"] and r["measured_over_issue"] == pytest.approx(row["us"] / r["issue_us"], rel=0.01)
        assert r["local_bytes"] == 0
    assert ks.parse_bnb_storage_config("tile m64 n64 split2 w4 s1").sub == 0
    with pytest.raises(ValueError, match="is not a KernelConfig description"):
        ks.parse_bnb_storage_config("gemv m1 n64")
    report.write_text(json.dumps({"rows": []}))
    assert ks.main(["--calibrate", str(report)]) == 1
    assert "no timed nf4_matmul rows" in capsys.readouterr().err
    assert ks.main(["--calibrate", str(tmp_path / "none.json")]) == 1      # QA: "[Errno 2] ..." with no fix
    assert capsys.readouterr().err == (f"error: --calibrate {tmp_path / 'none.json'} is not a file: give a GPU run's "
                                       "report with the kernel's timings, such as docs/perf/h100.json\n")


def test_kernels_imported_under_the_interpreter_still_compile_for_the_gpu(tmp_path):
    # a test that imports a kernel module under TRITON_INTERPRET=1 first (test_bench_synthetic's Triton norm on
    # CPU tensors) made the helpers the kernels call the interpreter's, and every norm check after it failed
    import subprocess
    import sys

    code = ("from medusa_core.quant import nf4_matmul, rows_alone_attention, rows_alone_norm, split_attention\n"
            "from medusa_core.benchmarks import kernel_sass as ks\n"
            "for launch in (ks.norm_launch(4096), ks.attention_launch(9, 3, 64, rows=16),\n"
            "               ks.split_attention_launch(9, 3, 64, rows=16)):\n"
            "    assert ks.compile_launch(launch, ks.H100.arch).asm['cubin']\n"
            "print('compiled')\n")
    # an empty cache: a kernel compiled earlier in good form would be found there and not compiled again
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1", "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_rotary_kernel_compiles_without_local_memory_or_a_fused_multiply_add(tmp_path, dtype):
    # quant/rotary_kernel.py: bit for bit transformers' rotary only if x * cos + r * sin is not contracted to an FMA
    cubin = tmp_path / "rotary.cubin"
    cubin.write_bytes(ks.compile_launch(ks.rotary_launch(32, 8, 128, dtype=dtype), ks.H100.arch).asm["cubin"])
    res = ks.resources(cubin)
    assert res["REG"] > 0 and res["LOCAL"] == 0 and res["STACK"] == 0, res
    assert _instructions(cubin) < 300
    if dtype == torch.float32:      # in bf16 the compiler multiplies and adds in bf16, each rounded once: the same
        #                             bits, since a bf16 product is exact in fp32; the GPU test checks them
        opcodes = [line.split()[0] for line in ks.disassemble(cubin) if not line.endswith(":") and line.split()]
        assert not any(op.startswith("FFMA") for op in opcodes), sorted(set(opcodes))


@pytest.mark.parametrize("kv_heads,dim", [(32, 128), (3, 64)])                  # Llama-2-7B; SmolLM2 (GQA)
def test_the_cache_write_compiles_to_one_load_and_one_store_a_row_with_nothing_in_local_memory(tmp_path, kv_heads,
                                                                                                 dim):
    # quant/cache_write_kernel.py: one program a (token, head) row of keys or values, a vector load and store a
    # thread; the position read once
    cubin = tmp_path / "cache_write.cubin"
    cubin.write_bytes(ks.compile_launch(ks.cache_write_launch(kv_heads, dim), ks.H100.arch).asm["cubin"])
    res = ks.resources(cubin)
    assert res["REG"] > 0 and res["LOCAL"] == 0 and res["STACK"] == 0, res
    opcodes = [ks.opcode(line) for line in ks.disassemble(cubin) if not line.endswith(":")]
    loads = [op for op in opcodes if op.startswith("LDG")]
    stores = [op for op in opcodes if op.startswith("STG")]
    assert len(loads) == 2 and len(stores) == 1, (loads, stores)      # the position, the row; the row


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 32, 128), (9, 3, 64)])     # Llama-2-7B; SmolLM2 (GQA)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_the_split_attention_compiles_to_tensor_cores_with_nothing_in_local_memory(tmp_path, heads, kv_heads, dim, rows):
    # quant/split_attention.py: the rows padded to 16 so that scores and values go through tl.dot; 64 rows at
    # 4 warps took 205 registers a thread (8 warps: 162); fp32 spilled at every size, and goes to SDPA on a GPU
    for merge, serial in ((False, False), (True, False), (False, True)):
        cubin = tmp_path / f"split{merge}{serial}.cubin"
        launch = ks.split_attention_launch(heads, kv_heads, dim, rows, merge=merge, serial=serial)
        cubin.write_bytes(ks.compile_launch(launch, ks.H100.arch).asm["cubin"])
        res = ks.resources(cubin)
        assert res["REG"] > 0 and res["LOCAL"] == 0 and res["STACK"] == 0, res
        opcodes = [ks.opcode(line) for line in ks.disassemble(cubin) if not line.endswith(":")]
        # HMMA (mma.sync), or at 64 rows Hopper's HGMMA (wgmma)
        assert merge or any(op.startswith(("HMMA", "HGMMA")) for op in opcodes), sorted(set(opcodes))
        if not merge:
            # a block's values are loaded with its keys, not after its softmax: between the first exponential and
            # the tensor-core op after it (the values' product) at most a mask block's load (a compiler may put the
            # next block's there), where the values took 4 (dim 64) or 8 (dim 128) loads a thread
            first_exp = opcodes.index(next(op for op in opcodes if op.startswith("MUFU.EX2")))
            product = next(i for i in range(first_exp, len(opcodes)) if opcodes[i].startswith(("HMMA", "HGMMA")))
            loads = [op for op in opcodes[first_exp:product] if op.startswith("LDG")]
            assert len(loads) <= 2, opcodes[first_exp:product]
        if serial:
            # the merge in the launch reads the other programs' partials only after they are published: every
            # thread's stores, a barrier, a GPU-scope fence and atomic, the L1 invalidated, a barrier, then
            # loads from L2 (what the interpreter, one program at a time, cannot show)
            assert _in_order(opcodes, ("BAR.SYNC", "MEMBAR.ALL.GPU", "ATOMG.E.ADD.STRONG.GPU", "CCTL.IVALL",
                                       "BAR.SYNC", "LDG.E.STRONG.GPU")), opcodes


def _in_order(opcodes: list[str], wanted: tuple[str, ...]) -> bool:
    """Whether ``wanted`` occur in ``opcodes`` in that order (each a prefix of an opcode, others between)."""
    found = iter(opcodes)
    return all(any(op.startswith(w) for op in found) for w in wanted)
