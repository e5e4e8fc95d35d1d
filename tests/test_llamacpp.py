"""benchmarks.llamacpp: what its flags show wrong is said in one line before either engine loads (llama-cpp-python
is no requirement of the app or its tests: these never reach it)."""

import json
import os

import pytest

from medusa_core.benchmarks import llamacpp


@pytest.fixture
def no_engines(monkeypatch):
    monkeypatch.setattr(llamacpp, "load", lambda *args, **kwargs: pytest.fail("our engine loaded first"))
    monkeypatch.setattr(llamacpp, "load_llama", lambda *args, **kwargs: pytest.fail("llama.cpp loaded first"))


def test_flags_are_refused_in_one_line_before_the_engines_load(tmp_path, capsys, no_engines):
    # QA: --json <a folder> failed with IsADirectoryError after the whole run, its results lost
    cores = os.cpu_count() or 1
    for args, says in ((["--json", str(tmp_path)], f"error: --json {tmp_path} cannot be written"),
                       (["--threads", "0"], f"error: --threads 0 must be from 1 to {cores} (this machine's cores)"),
                       (["--threads", str(cores + 1)], f"error: --threads {cores + 1} must be from 1 to {cores}"),
                       (["--count", "0"], "error: --count 0 must be at least 1")):
        with pytest.raises(SystemExit) as stopped:
            llamacpp.main(args)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and says in err and err.count("error:") == 1, err


def test_the_prompts_are_read_before_the_engines_load(tmp_path, no_engines):
    with pytest.raises(SystemExit, match=f"prompts file {tmp_path / 'nope.jsonl'} does not exist"):
        llamacpp.main(["--prompts", str(tmp_path / "nope.jsonl")])
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a", "b")))
    with pytest.raises(SystemExit, match=f"--count 3 is more than the 2 prompts in {two}: give at most 2"):
        llamacpp.main(["--prompts", str(two), "--count", "3"])
