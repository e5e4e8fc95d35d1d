"""benchmarks.first_start: the app's loading path started twice on a saved random checkpoint, in processes of
their own sharing one new cache (on a GPU, the first start times the kernels and the second reads them).
Here on the CPU with the tiny shape: the plumbing, the report and its fold into docs/perf, no speed claims."""

import json
import tempfile

import pytest
import torch

from medusa_core import bench_synthetic
from medusa_core.benchmarks import first_start


def test_two_starts_are_timed_reported_and_folded_and_the_checkpoint_is_removed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))        # where the checkpoint goes, to see it removed
    out = tmp_path / "first_start.json"
    assert first_start.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--max-new-tokens", "4",
                             "--json", str(out)]) == 0
    report = json.loads(out.read_text())["first_start"]
    assert [row["start"] for row in report["starts"]] == ["first", "second"]
    for row in report["starts"]:
        assert row["returncode"] == 0 and 0 < row["load_seconds"] < row["process_seconds"], row
        assert "medusa-chat heads" in row["model"], row["model"]        # the load line, as the app's
        names = [r["name"] for r in row["bench"]["summary"]]
        assert names[0] == "baseline (1-node tree)" and "transformers generate()" in names, names
    assert set(report["summary"]) == {"first_start_load_s", "second_start_load_s"}
    printed = capsys.readouterr().out
    assert "first start: loaded in " in printed and "second start: loaded in " in printed
    assert not list(tmp_path.glob("first-start-*")), "the checkpoint (13.5 GB at 7B) is left on disk"
    # folded into a GPU report beside a step run: the load seconds and the bench row become headline figures
    step = tmp_path / "step.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                                 "--context", "8", "--iters", "2", "--warmup", "0", "--json", str(step)]) == 0
    folded = tmp_path / "report.json"
    assert bench_synthetic.main(["--fold", str(step), str(out), "--json", str(folded)]) == 0
    merged = json.loads(folded.read_text())
    assert merged["summary"]["second_start_load_s"] == report["summary"]["second_start_load_s"]
    assert merged["summary"]["checkpoint_tokens_per_s"] > 0 and merged["first_start"] == report


def test_an_unwritable_json_is_one_line_before_anything_is_built(tmp_path, monkeypatch, capsys):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert first_start.main(["--device", "cpu", "--json", str(blocker / "out.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(blocker) in err, err
    assert not list(temp.iterdir()), "a checkpoint was saved before the error"


def test_flags_bench_would_refuse_are_one_line_before_the_checkpoint_is_written(tmp_path, monkeypatch, capsys):
    # QA: --device bogus and --device cuda without CUDA were tracebacks; --tree nope, --quant bogus and
    # --max-new-tokens 0 failed only in the first start's bench, after a random checkpoint was written
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(first_start, "save_random_checkpoint", lambda *a, **k: pytest.fail("the checkpoint was written"))
    cases = [(["--device", "bogus"], "error: --device 'bogus' is unknown: use auto, cpu, cuda or cuda:N"),
             # torch's other device types: meta loaded a model of no weights, xpu ended in an AssertionError
             (["--device", "meta"], "error: --device 'meta' is not one this app runs on: use auto, cpu, cuda or "
                                    "cuda:N"),
             (["--tree", "nope"], "error: --tree nope: unknown tree 'nope': use default (the model's default tree), "),
             (["--tree", "chain-9"], "error: --tree chain-9: tree depth 9 is more than the model's 5 Medusa heads"),
             (["--quant", "bogus"], "error: --quant 'bogus' is unknown: use one of auto, nf4, int8, int4, none"),
             (["--max-new-tokens", "0"], "error: --max-new-tokens 0 must be at least 1")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "error: --device 'cuda' was asked for but torch sees no CUDA GPU: use "
                                            "--device cpu"))
    for args, says in cases:
        with pytest.raises(SystemExit) as stopped:
            first_start.main(["--device", "cpu", "--quant", "none", *args, "--json", str(tmp_path / "f.json")])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and says in err and err.count("error:") == 1, err
    assert not list(tmp_path.iterdir()), "something was written before the error"
