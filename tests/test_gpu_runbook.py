"""The GPU runbook (medusa_core/benchmarks/gpu_runbook.py): its commands are ones the benchmarks accept,
and a stage that outruns the device call's time is stopped, with what it wrote kept."""

import importlib
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from medusa_core.benchmarks import gpu_runbook
from medusa_core.benchmarks.gpu_runbook import STAGES, command_of, run_stages

ROOT = Path(__file__).resolve().parents[1]


def test_every_stage_command_is_one_its_benchmark_accepts(tmp_path):
    # a renamed option or choice in a benchmark would otherwise surface only on a lent GPU, costing its time
    for stage in STAGES:
        args = command_of(stage, tmp_path)[3:]
        if stage.module == "pytest":     # test files and node ids
            files = [a.split("::")[0] for a in args if a.startswith("tests/")]
            assert files and all((ROOT / f).is_file() for f in files), stage
        else:
            parsed = importlib.import_module(stage.module).parser(True).parse_args(args)
            assert str(tmp_path) in str(parsed.json), stage


def _collected(args: list[str]) -> set[str]:
    picked = [a for a in args if a.startswith(("tests/", "--deselect="))]
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *picked],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return {line for line in run.stdout.splitlines() if "::" in line}


def test_the_cuda_tests_run_once_each_the_end_to_end_decodes_in_the_last_stage(tmp_path):
    # the end-to-end decodes run after the measurements, by node id: a renamed test would otherwise be deselected
    # from the first stage silently and fail to collect in the last on a lent GPU
    stages = {s.name: command_of(s, tmp_path)[3:] for s in STAGES if s.module == "pytest"}
    first, last = _collected(stages["cuda-tests"]), _collected(stages["cuda-e2e"])
    assert last == set(gpu_runbook.END_TO_END_TESTS) and not first & last
    files = [a for a in stages["cuda-tests"] if a.endswith(".py")]
    assert first | last == _collected(files)
    assert STAGES[-1].name == "cuda-e2e"


def test_a_stage_past_the_deadline_is_stopped_with_its_output_kept_and_the_rest_not_started(tmp_path):
    out = tmp_path / "out"
    grandchild = tmp_path / "grandchild.pid"
    # writes a partial result, starts a process of its own, both ignore SIGTERM, then would run for ten minutes
    stubborn = ("import json, signal, subprocess, sys, time\n"
                f"json.dump({{'partial': True}}, open({str(out / 'slow.json')!r}, 'w'))\n"
                "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; '\n"
                "                      'signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
                f"open({str(grandchild)!r}, 'w').write(str(p.pid))\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('measuring', flush=True)\n"
                "time.sleep(600)\n")
    commands = {STAGES[0].name: [sys.executable, "-c", "print('quick')"],
                STAGES[1].name: [sys.executable, "-c", stubborn],
                STAGES[2].name: [sys.executable, "-c", "print('never')"]}
    started = time.monotonic()
    results = run_stages(list(STAGES[:3]), out, started + 5, commands, min_stage_s=1, grace_s=1)
    assert time.monotonic() - started < 30
    assert [r.status for r in results] == ["done", "cut", "not started"]
    assert json.loads((out / "slow.json").read_text()) == {"partial": True}
    assert "measuring" in (out / f"{STAGES[1].name}.log").read_text()
    assert json.loads((out / "runbook.json").read_text())[1]["status"] == "cut"
    pid = int(grandchild.read_text())
    for _ in range(50):   # the whole process group was killed: the stage's own child too
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the stage's child {pid} outlived the stage")


def test_a_failing_stage_does_not_stop_the_next(tmp_path):
    commands = {STAGES[0].name: [sys.executable, "-c", "raise SystemExit(3)"],
                STAGES[1].name: [sys.executable, "-c", "print('ran')"]}
    results = run_stages(list(STAGES[:2]), tmp_path, time.monotonic() + 60, commands, min_stage_s=1, grace_s=1)
    assert [(r.status, r.returncode) for r in results] == [("failed", 3), ("done", 0)]


def test_a_stage_that_cannot_finish_in_the_time_left_is_left_for_the_next_call_and_a_shorter_one_runs(
        tmp_path, capsys, monkeypatch):
    """first-start writes nothing until it ends (125 s on the H200): started with 65 s left it would be cut, its
    time lost. It is not started; the stages after it that fit still run, and the end says what the next call
    takes."""
    import torch

    assert {s.name: s.least_s for s in STAGES if s.least_s} == {"nf4-heads": 70, "dependent-launch": 70, "profile": 60,
                                                                "first-start": 140, "cuda-e2e": 120}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setattr(gpu_runbook, "command_of", lambda stage, out: [sys.executable, "-c", "print('ran')"])
    assert gpu_runbook.main(["--out", str(tmp_path / "OUT"), "--budget-s", "100"]) == 1
    statuses = {r["name"]: r["status"] for r in json.loads((tmp_path / "OUT" / "runbook.json").read_text())}
    assert statuses.pop("first-start") == statuses.pop("cuda-e2e") == "not started"
    assert set(statuses.values()) == {"done"}       # exactness, after first-start, ran
    assert "not done: the next call takes --stages first-start cuda-e2e" in capsys.readouterr().out


def test_without_a_gpu_it_says_where_to_run_it(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_runbook.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "device tool" in err and len(err.strip().splitlines()) == 1


def test_out_gets_one_archive_of_every_stage_output_and_the_manifest(tmp_path, monkeypatch):
    # the device tool brings back at most 8 files from $OUT: the GPU session of 2026-11-27 (third run) lost
    # step.json, profile.json and four more of the 14 the stages wrote, and spent 200 s of its 900 measuring again
    import tarfile

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # bitsandbytes imported with CUDA stood in reaches for a CUDA torch: its presence is all main checks
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    writes = ("import sys, pathlib; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); "
              "p.write_text('{\"measured\": 1}'); print('wrote', p)")
    monkeypatch.setattr(gpu_runbook, "command_of", lambda stage, out: [
        sys.executable, "-c", writes, str(out / f"{stage.name}.json")])
    out = tmp_path / "OUT"
    assert gpu_runbook.main(["--out", str(out), "--budget-s", "300"]) == 0      # room for every stage's least_s
    assert sorted(p.name for p in out.iterdir()) == ["runbook.json", "runbook.tar.gz"]
    with tarfile.open(out / "runbook.tar.gz") as tar:
        names = set(tar.getnames())
        stage_json = tar.extractfile(f"{STAGES[-1].name}.json").read()
    assert names == {f"{s.name}.{ext}" for s in STAGES for ext in ("json", "log")} | {"runbook.json"}
    assert json.loads(stage_json) == {"measured": 1}
    assert [r["status"] for r in json.loads((out / "runbook.json").read_text())] == ["done"] * len(STAGES)


def test_flags_that_cannot_run_are_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    # QA: --budget-s nan ran with no deadline, -5 marked every stage "not started" without an error, --from beside
    # --stages was ignored, and --out <a file> ended in a FileExistsError traceback
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("the flags were not checked first"))
    monkeypatch.setattr(gpu_runbook, "run_stages", lambda *a, **k: pytest.fail("a stage ran"))
    afile = tmp_path / "afile"
    afile.write_text("")
    least = gpu_runbook.MIN_STAGE_S + gpu_runbook.STOP_GRACE_S
    for args, says in (
            (["--budget-s", "nan"], "error: --budget-s nan is not a finite number of seconds: give one, e.g. 570"),
            (["--budget-s", "inf"], "error: --budget-s inf is not a finite number of seconds"),
            (["--budget-s", "-5"], f"error: --budget-s -5 leaves no stage time to run: give at least {least} seconds"),
            (["--budget-s", str(least - 1)], f"error: --budget-s {least - 1} leaves no stage time to run"),
            (["--stages", "ladder", "--from", "step"], "error: --from step with --stages: give --stages for those "
                                                       "stages only, or --from for step and the ones after it, not both"),
            (["--out", str(afile)], f"error: --out {afile} is a file: give a directory")):
        with pytest.raises(SystemExit) as stopped:
            gpu_runbook.main(["--out", str(tmp_path / "OUT"), *args])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and says in err and err.count("error:") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
