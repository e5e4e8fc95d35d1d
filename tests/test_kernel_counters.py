"""benchmarks/kernel_counters.py without a GPU: what it profiles, how it reads ncu's tables, and its one-line
refusals. The counters themselves need a GPU and ncu (the runbook's counters stage)."""

import pytest
import torch

from medusa_core.benchmarks import gpu_runbook
from medusa_core.benchmarks import kernel_counters as kc
from medusa_core.quant import nf4_repacked_configs as rc


def test_it_profiles_each_row_counts_default_the_h200s_pick_and_the_default_loading_only():
    calls = kc.calls(11008, 4096, 132)
    assert [c.label for c in calls] == list(kc.LABELS)
    assert [(c.m, c.ladder) for c in calls] == [(1, 0), (1, 0), (1, 2), (16, 0), (16, 0), (16, 2)]
    described = [c.config.describe() for c in calls]
    # the configs the H200's tuner kept on 4096->11008 (docs/perf/h200-2026-11-29/step.log)
    assert described[1] == "gemv m1 n64 split4 w4 s2 prefetch2 x serial"
    assert described[4] == "dot m16 n64 split2 w4 s3 plane scaled"
    assert described[0] == described[2] and described[3] == described[5]      # the loading-only rung's own call
    # each is a config the tuner times, so the counters describe what a GPU can run
    for c in calls:
        assert c.config in rc.candidates(c.m, 11008, 4096 // 128, 132), c.label


def test_ncus_details_and_raw_pages_read_per_launch():
    details = ('==PROF== Connected to process 1\n'
               '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
               '"0","1","repacked_kernel","GPU Speed Of Light Throughput","Duration","us","17.31"\n'
               '"0","1","repacked_kernel","GPU Speed Of Light Throughput","DRAM Throughput","%","58.20"\n'
               '"0","1","repacked_kernel","WarpStateStats","","",""\n'
               '"1","1","repacked_kernel","Occupancy","Achieved Occupancy","%","37.5"\n')
    assert kc.details_by_launch(kc.read_csv(details)) == {
        0: {"GPU Speed Of Light Throughput": {"Duration (us)": "17.31", "DRAM Throughput (%)": "58.20"}},
        1: {"Occupancy": {"Achieved Occupancy (%)": "37.5"}}}
    raw = ('"ID","Kernel Name","dram__bytes_read.sum","smsp__average_warps_issue_stalled_long_scoreboard_per_issue'
           '_active.ratio","l1tex__data_bank_conflicts_pipe_lsu.sum"\n'
           '"","","Mbyte","inst",""\n'
           '"0","repacked_kernel","25.4","3.2","0"\n')
    assert kc.raw_by_launch(kc.read_csv(raw)) == {0: {      # each value with its unit, which ncu scales per metric
        "dram__bytes_read.sum (Mbyte)": "25.4",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio (inst)": "3.2"}}
    assert kc.read_csv("==PROF== No kernels were profiled.\n") == []


def test_without_a_gpu_or_without_ncu_it_says_so_in_one_line(capsys, monkeypatch, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the counters would be read")
    assert kc.main(["--json", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "CUDA GPU" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kc, "find_ncu", lambda: None)
    assert kc.main(["--json", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ncu (Nsight Compute) is not on this machine" in err
    assert not (tmp_path / "c.json").exists()


def test_the_runbook_reads_the_counters_after_the_ladder():
    names = list(gpu_runbook.STAGE_NAMES)
    assert names.index("counters") == names.index("ladder") + 1
    stage = next(s for s in gpu_runbook.STAGES if s.name == "counters")
    command = gpu_runbook.command_of(stage, gpu_runbook.Path("/out"))
    assert command[1:] == ["-m", "medusa_core.benchmarks.kernel_counters", "--json", "/out/counters.json"]
