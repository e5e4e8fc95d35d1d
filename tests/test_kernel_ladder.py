"""The kernel ladder (benchmarks/kernel_ladder.py): the repacked NF4 kernel with parts taken out, so that a GPU
session can say where a call's time goes. Its times are only as good as what each rung computes: under Triton's
interpreter (fp32) the table-free rung is the whole kernel with a table that maps each code to its own bits, and
the read-only rung folds every word and scale the kernel reads; compiled for sm_90 the read-only rung keeps the
kernel's 16-byte word loads and drops everything else, and the table-free rung keeps its multiplies without
the shared-memory lookup."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="the NF4 kernels need Triton: pip install triton")
from medusa_core.benchmarks import kernel_ladder as kl  # noqa: E402
from medusa_core.benchmarks import kernel_sass as ks  # noqa: E402
from medusa_core.quant import kernel_timing as kt  # noqa: E402
from medusa_core.quant import nf4_repack as rp  # noqa: E402
from medusa_core.quant import nf4_repacked_configs as rc  # noqa: E402
from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402

C = rc.RepackedConfig
# each path of the kernel: the GEMV with and without the prefetch and with the serial split-K sum, and the three
# tensor-core paths; N no multiple of the tile, K no multiple of the 128-column group
CONFIGS = [(1, C(False, 1, 32, 1, prefetch=1)), (1, C(False, 1, 32, 2, prefetch=1, serial=True)),
           (3, C(False, 4, 16, 1)), (16, C(True, 16, 32, 1, plane_lookup=True)), (16, C(True, 16, 32, 1)),
           (16, C(True, 16, 32, 2, whole_group=True))]


def weight(n: int = 40, k: int = 384, seed: int = 0) -> rp.RepackedNF4:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 64, generator=g) + 0.5
    return rp.repack(codes, scales, torch.sort(torch.randn(16, generator=g)).values, 64)


def folded(w: rp.RepackedNF4, groups: range) -> torch.Tensor:
    """(N,) fp32: the XOR of each row's words and scales (as bits) over ``groups``, as a read-only program stores it."""
    rows = torch.zeros(w.words.shape[0], rp.ROWS, dtype=torch.int32)
    for part in (w.words, w.scales.view(torch.int32)):        # (N/16, KG, 16, lanes or scales)
        for kg in groups:
            for col in range(part.shape[3]):
                rows ^= part[:, kg, :, col]
    return rows.reshape(-1)[: w.n].float()


def read_only_result(w: rp.RepackedNF4, split_k: int) -> torch.Tensor:
    """(N,) what the read-only rung returns: each K split's fold, the splits added in order in fp32 (as the
    kernel's split-K sum adds its partials), as kernel_call divides K into splits."""
    groups = w.words.shape[1]
    per_split = -(-groups // max(1, min(split_k, groups)))
    total = torch.zeros(w.n)
    for start in range(0, groups, per_split):
        total = total + folded(w, range(start, min(start + per_split, groups)))
    return total


@pytest.mark.parametrize("m,cfg", CONFIGS, ids=[c.describe() for _, c in CONFIGS])
def test_the_rungs_compute_what_they_name(monkeypatch, m, cfg):
    monkeypatch.setenv(INTERPRET_ENV, "1")
    w = weight()
    x = torch.randn(m, w.k, generator=torch.Generator().manual_seed(1))
    # table-free: each code is 1 + nibble * 2**-23, so it is the whole kernel with that table, bit for bit
    own_bits = dataclasses.replace(w, code=(torch.arange(16, dtype=torch.int32) | 0x3F800000).view(torch.float32))
    table_free = kl.run_rung(x, w, cfg, "table-free")
    assert torch.equal(table_free, kl.run_rung(x, own_bits, cfg, "full"))
    full = kl.run_rung(x, w, cfg, "full")
    assert torch.allclose(full, x @ rp.dequantize_reference(w).T, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(table_free, full)              # the table did matter
    # read-only: every word and scale of a row read and folded, in every output row, through the split-K sum
    assert torch.equal(kl.run_rung(x, w, cfg, "read-only"), read_only_result(w, cfg.split_k)[None, :].expand(m, w.n))


@pytest.fixture
def _fp_fusion(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")     # the launch passes it explicitly; silences a warning


@pytest.mark.parametrize("m", [1, 16])
def test_compiled_for_sm90_the_rungs_keep_the_loads_and_drop_what_they_name(tmp_path, _fp_fusion, m):
    k, n = 4096, 11008
    for cfg in kl.configs(m, n, k, ks.H100.sms):
        if cfg.decode != "gather":    # timed full only (its other rungs are the plane tile's): no shared table
            r = ks.report(ks.repacked_launch(k, n, m, cfg), ks.H100, tmp_path)
            assert r.local_bytes == 0 and r.shared_loads_per_weight < 1, r
            continue
        got = {rung: ks.report(ks.repacked_launch(k, n, m, cfg, ladder=level), ks.H100, tmp_path)
               for rung, level in kl.RUNGS.items()}
        full, table_free, read_only = got["full"], got["table-free"], got["read-only"]
        assert full.shared_loads_per_weight >= 1, full                  # the lookup is a shared-memory load
        assert table_free.shared_loads_per_weight < 1, table_free      # not in the table-free rung
        assert read_only.shared_loads_per_weight == 0 and read_only.shared_us == 0, read_only   # none in the loop
        for r in got.values():
            assert r.local_bytes == 0, r
        # the words still arrive 16 bytes at a time where nothing uses them but an XOR
        assert read_only.global_loads.get("LDG.E.128", 0) >= 1, read_only.global_loads
        assert read_only.instructions_per_weight < table_free.instructions_per_weight, got
        if not cfg.dot:       # the GEMV's multiply-adds stay, one per weight, without their table
            assert table_free.opcodes.get("FFMA") == full.opcodes.get("FFMA") > 0, (table_free, full)


def test_a_row_takes_its_fast_config_apart_with_the_split_sum_in_the_launch_and_sixteen_other_lookups_too():
    (one,) = kl.configs(1, 11008, 4096, 132)
    assert not one.dot and one.serial == (one.split_k > 1) and one.split_k > 1
    sixteen = kl.configs(16, 11008, 4096, 132)
    assert [(c.decode, c.whole_group) for c in sixteen] == \
        [("gather", False), ("select", False), ("prmt", False), ("scaled", False), ("gather", True)]
    assert all(c.dot for c in sixteen)


def test_a_shape_is_timed_at_every_rung_with_the_full_one_checked(monkeypatch):
    # the benchmark's own loop on CPU (fp32: the interpreter's bf16 is broken): CUDA's properties and the graph
    # timer stood in for, each call run once
    monkeypatch.setenv(INTERPRET_ENV, "1")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(L2_cache_size=1 << 10, multi_processor_count=4))
    ran = []
    monkeypatch.setattr(kt, "graph_time_us", lambda calls, replays=5: ran.append(calls[0]()) or 2.5)
    rows = kl.bench_shape(192, 40, (1, 16), torch.device("cpu"), bandwidth=1e9, dtype=torch.float32)
    # the whole group's read-only rung, and the select tile's other rungs, are the plane tile's kernels: not
    # timed twice; prmt (inline PTX) is left out where the interpreter runs the loop
    lookup = {(False, False): "table", (True, False): "select", (False, True): "group"}
    assert [(r.m, lookup[" select" in r.config, r.config.endswith(" group")], r.rung) for r in rows] == \
        [(1, "table", "full"), (1, "table", "table-free"), (1, "table", "read-only"), (16, "table", "full"),
         (16, "table", "table-free"), (16, "table", "read-only"), (16, "select", "full"), (16, "group", "full"),
         (16, "group", "table-free")], rows
    assert all(r.us == 2.5 and r.error == "" for r in rows), rows
    assert len(ran) == len(rows)
    assert rows[0].floor_us == pytest.approx(rp.repacked_nbytes(40, 192) / 1e9 * 1e6, rel=1e-2)
    lines = kl.table(rows)
    assert len(lines) == 1 + 4 and "192->40" in lines[1] and lines[4].rstrip().endswith("-")
    assert f"{2.5 / rows[0].floor_us:4.1f}x" in lines[1]


def test_a_rung_that_fails_is_one_line_and_the_rest_still_run(monkeypatch, capsys):
    monkeypatch.setenv(INTERPRET_ENV, "1")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(L2_cache_size=1 << 10, multi_processor_count=4))
    monkeypatch.setattr(kt, "graph_time_us", lambda calls, replays=5: calls[0]() is None or 1.0)
    real = kl.run_rung
    monkeypatch.setattr(kl, "run_rung", lambda x, w, cfg, rung: (_ for _ in ()).throw(RuntimeError("no such tile\nmore"))
                        if rung == "table-free" else real(x, w, cfg, rung))
    rows = kl.bench_shape(192, 40, (1,), torch.device("cpu"), bandwidth=1e9, dtype=torch.float32)
    assert [r.us for r in rows] == [1.0, None, 1.0] and rows[1].error == "no such tile", rows
    assert "table-free: FAILED (RuntimeError: no such tile)" in capsys.readouterr().out


def test_without_cuda_or_with_bad_rows_it_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kl.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA GPU" in err and "GPU machine" in err
    with pytest.raises(SystemExit):
        kl.main(["--rows", "0"])
    assert "0 is below 1: give a row count" in capsys.readouterr().err
