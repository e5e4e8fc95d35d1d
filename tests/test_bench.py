import json

import pytest
from tiny import tiny_checkpoint

from medusa_core import bench


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_bench_runs_end_to_end_and_writes_json(checkpoint, tmp_path, capsys):
    backbone, heads = checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\nimport sys\\n"}\n')
    out = tmp_path / "bench.json"
    code = bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(prompts), "--raw",
                       "--tree", "chain-2", "small-8", "--max-new-tokens", "12", "--warmup", "1", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    for name in ("baseline (1-node tree)", "medusa chain-2", "medusa small-8", "transformers generate()", "prompt lookup"):
        assert name in table
    data = json.loads(out.read_text())
    assert data["trees"] == {"chain-2": 3, "small-8": 9}
    assert len(data["prompts"]) == 2
    for p in data["prompts"]:
        base = p["baseline"]["tokens"]
        assert 1 <= len(base) <= 12
        for name in ("chain-2", "small-8", "hf_generate"):
            assert p[name]["tokens"] == base          # greedy: every decoder gives the same text
        assert p["small-8"]["seconds"] > 0 and len(p["small-8"]["accepted"]) == p["small-8"]["steps"]
    rows = {r["name"]: r for r in data["summary"]}
    assert rows["baseline (1-node tree)"]["speedup"] == pytest.approx(1.0)
    assert rows["medusa small-8"]["identical"] == "yes"


def test_bench_reports_bad_input_in_one_line(checkpoint, tmp_path, capsys):
    backbone, heads = checkpoint
    assert bench.main(["--model", str(backbone), "--heads", str(heads), "--tree", "nope"]) == 1
    assert "unknown tree 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="does not exist"):
        bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(tmp_path / "missing.jsonl")])
