import json

import pytest
from tiny import tiny_checkpoint

from medusa_core import bench
from medusa_core.decoding.kv_cache import KVCache


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
    assert "trees chain-2, small-8 (set by --tree), beside plain decoding" in table   # QA: it named chain-2 alone
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


def test_each_decoder_runs_every_prompt_on_the_step_its_first_run_made(checkpoint, tmp_path, capsys, monkeypatch):
    """A new cache per run made a new step per run, and on CUDA captured its graph again in every timed answer (an
    H200's 7B baseline read 111-117 tokens/s where its step runs 295). A chat tab keeps its caches and their steps:
    so does bench, one per decoder, the warm-up's steps reused by every prompt."""
    from medusa_core.decoding import step_store

    made = []

    class Counted(step_store.DecodeStep):
        def __init__(self, model, heads, tree, *args, **kwargs):
            made.append(tree.size)
            super().__init__(model, heads, tree, *args, **kwargs)

    monkeypatch.setattr(step_store, "DecodeStep", Counted)
    kept = []       # how much of each prompt a run found cached: none, each run a conversation of its own
    reuse = KVCache.reuse_prefix
    monkeypatch.setattr(KVCache, "reuse_prefix", lambda cache, ids: kept.append(reuse(cache, ids)) or kept[-1])
    backbone, heads = checkpoint
    prompts = tmp_path / "p.jsonl"
    # the last prompt (312 characters: a char tokenizer) needs a bigger cache than the warm-up's first 64 tokens
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                  ("def add(a, b):", "import os\nimport sys\n", "def f(x):\n    return x\n" * 13)))
    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(prompts), "--raw",
                       "--tree", "chain-2", "small-8", "--max-new-tokens", "12", "--warmup", "1", "--json", str(out)]) == 0
    assert sorted(made) == [1, 3, 9]          # the baseline, chain-2 and small-8: once each, in the warm-up
    assert len(kept) == 3 * 4 and set(kept) == {0}      # 3 decoders, a warm-up and 3 prompts: each from its start
    assert "warm-up done" in capsys.readouterr().err
    data = json.loads(out.read_text())
    for p in data["prompts"]:     # a reused cache decodes each prompt from its start: transformers' tokens (fp32)
        assert p["chain-2"]["tokens"] == p["small-8"]["tokens"] == p["baseline"]["tokens"] == p["hf_generate"]["tokens"]


def test_a_run_beside_other_programs_says_its_speedups_are_skewed(checkpoint, tmp_path, capsys):
    """QA: bench printed speedups measured on a busy CPU as the machine's, without a word (the tree tuner in the same
    process said the CPU was busy). One busy loop per core here, as a build or a test run would be."""
    import os
    import subprocess
    import sys

    backbone, heads = checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "bench.json"
    # each loop says when it spins: a run shorter than the loops' interpreter start-up measured an idle CPU
    loops = [subprocess.Popen([sys.executable, "-c", "print(flush=True)\nwhile True: pass"], stdout=subprocess.PIPE)
             for _ in range(len(os.sched_getaffinity(0)))]
    try:
        for loop in loops:
            loop.stdout.readline()
        code = bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(prompts), "--raw",
                           "--tree", "chain-2", "--max-new-tokens", "24", "--warmup", "1", "--no-references",
                           "--json", str(out)])
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
            loop.stdout.close()
    assert code == 0
    share = json.loads(out.read_text())["cpu_share"]
    assert share < 0.75
    assert f"warning: other programs used the CPU while this ran (the benchmark got {share:.0%} of it): the speedups " \
           "above are skewed; run again with the machine otherwise idle" in capsys.readouterr().out


def test_bench_reports_bad_input_in_one_line(checkpoint, tmp_path, capsys):
    backbone, heads = checkpoint
    assert bench.main(["--model", str(backbone), "--heads", str(heads), "--tree", "nope"]) == 1
    assert "unknown tree 'nope'" in capsys.readouterr().err
    for folder in ("a", "b"):                   # two files one name: one would silently replace the other
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "tree.json").write_text("[[0]]")
    assert bench.main(["--model", str(backbone), "--heads", str(heads), "--tree", str(tmp_path / "a" / "tree.json"),
                       str(tmp_path / "b" / "tree.json")]) == 1
    assert "would both be named 'tree' in the table: rename one" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="does not exist"):
        bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit) as stopped:     # QA16 NIT-2: a folder was said not to exist
        bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(tmp_path)])
    assert str(stopped.value) == (f"error: prompts file {tmp_path} is a directory: give a .jsonl file with one "
                                  '{"prompt": ...} per line')
    # QA: --json the prompts file wrote the report over the prompts
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(prompts),
                       "--json", str(tmp_path / "." / "p.jsonl")]) == 1
    assert capsys.readouterr().err == (f"error: --json {tmp_path / '.' / 'p.jsonl'} is the --prompts file this run "
                                       "reads, and the report would replace it: give another file\n")
    assert prompts.read_text() == '{"prompt": "hi"}\n'


def test_what_the_flags_show_wrong_is_said_before_the_model_loads(checkpoint, tmp_path, capsys, monkeypatch):
    """QA: --max-new-tokens 0 was refused after the load and a 10-minute tree tuning, and named the field."""
    backbone, heads = checkpoint
    real_load, loads = bench.load, []
    monkeypatch.setattr(bench, "load", lambda spec, *a, **kw: (loads.append(spec), real_load(spec, *a, **kw))[1])
    base = ["--model", str(backbone), "--heads", str(heads)]
    assert bench.main([*base, "--max-new-tokens", "0"]) == 1
    assert capsys.readouterr().err.strip() == "error: --max-new-tokens 0 must be at least 1"
    assert bench.main([*base, "--tree", "chain-2", str(tmp_path / "no.json")]) == 1
    assert "tree file" in capsys.readouterr().err
    (tmp_path / "latin1.json").write_bytes(b"[[0]] \xe9")
    assert bench.main([*base, "--tree", str(tmp_path / "latin1.json")]) == 1
    assert "is not UTF-8 text" in capsys.readouterr().err
    assert bench.main([*base, "--json", str(tmp_path)]) == 1                        # not after the whole run
    assert f"error: --json {tmp_path} cannot be written" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bench.main([*base, "--device", "cpu", "--norm-kernel", "triton"]) == 1
    assert capsys.readouterr().err.startswith("error: --norm-kernel triton: the Triton norm needs a CUDA device")
    assert bench.main([*base, "--quant", "nf4", "--nf4-kernel", "repacked-exact", "--norm-kernel", "torch"]) == 1
    assert "brings its own row-exact norms: drop --norm-kernel" in capsys.readouterr().err
    # launch.py's line, from the same check (QA16: bench loaded int4 and ignored the flag without a word)
    assert bench.main([*base, "--device", "cpu", "--nf4-kernel", "triton"]) == 1
    assert capsys.readouterr().err.strip() == ("error: --nf4-kernel triton picks the kernel of NF4 weights, and --quant "
                                               "auto on cpu makes none: add --quant nf4, or drop --nf4-kernel")
    assert bench.main([*base, "--device", "cpu", "--quant", "nf4", "--nf4-kernel", "repacked"]) == 1
    assert capsys.readouterr().err.startswith("error: --nf4-kernel repacked: the Triton kernels need a CUDA device")
    # what the OpenAI API refuses, and a negative warm-up (QA: both ran)
    assert bench.main([*base, "--mode", "greedy", "--temperature", "0.7"]) == 1
    assert capsys.readouterr().err.strip() == ("error: --temperature 0.7 with --mode greedy: greedy decoding draws "
                                               "nothing, so the temperature would do nothing: drop --temperature, or "
                                               "use --mode sample or typical")
    # NaN passes every range check: it sampled token 0 for every token of the whole run (review)
    assert bench.main([*base, "--mode", "sample", "--temperature", "nan"]) == 1
    assert capsys.readouterr().err.strip() == ("error: --temperature nan is not a finite number: use a value from 0 "
                                               "(greedy) to 2")
    assert bench.main([*base, "--warmup", "-1"]) == 1
    assert capsys.readouterr().err.strip() == "error: --warmup -1 must be at least 0"
    assert bench.main([*base, "--tree", "nope"]) == 1           # the help offers 'default': so does the error
    assert "unknown tree 'nope': use default (the model's default tree), " in capsys.readouterr().err
    assert loads == []
    # only presets asked: the default tree is not tuned (a tuning took 6 minutes on a busy machine before the first prompt)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    assert bench.main([*base, "--prompts", str(prompts), "--raw", "--tree", "chain-2", "baseline", "--max-new-tokens", "4",
                       "--warmup", "0", "--no-references"]) == 0
    assert [spec.tree for spec in loads] == ["chain-2"]


def test_a_fixed_tree_deeper_than_the_heads_fails_without_tuning_another_first(checkpoint, capsys, monkeypatch,
                                                                                tmp_path):
    """Review: --tree chain-9 over 5 heads tuned the default tree (minutes on a busy machine) and then failed."""
    import shutil

    from medusa_core.heads.accuracy import CALIBRATION_FILE
    from medusa_core.loading import policy
    backbone, heads = checkpoint
    calibrated = tmp_path / "heads"            # heads with accuracies: their default tree is tuned on loading
    shutil.copytree(heads, calibrated)
    (calibrated / CALIBRATION_FILE).write_text(json.dumps({"accuracy": [[0.5, 0.2]] * 5}))
    tunings = []
    monkeypatch.setattr(policy, "tuned_tree", lambda *a, **kw: tunings.append(a) or pytest.fail("tuned a tree"))
    for trees in (["chain-9"], ["default", "chain-9"]):      # beside the default too (a review: it tuned first)
        assert bench.main(["--model", str(backbone), "--heads", str(calibrated), "--tree", *trees]) == 1
        assert "error: tree chain-9 cannot run with these heads: tree depth 9 is more than" in capsys.readouterr().err
    assert tunings == []


def test_bench_runs_plain_decoding_alone_without_heads(checkpoint, tmp_path, capsys):
    backbone, _ = checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(backbone), "--prompts", str(prompts), "--raw", "--tree", "baseline",
                       "--max-new-tokens", "8", "--warmup", "0", "--no-references", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "baseline (1-node tree)" in captured.out and "medusa" not in captured.out
    assert "prompt 1/1 done" in captured.err                     # progress while it runs
    assert json.loads(out.read_text())["trees"] == {}
    assert bench.main(["--model", str(backbone), "--tree", "chain-2"]) == 1
    assert "need Medusa heads" in capsys.readouterr().err


def test_module_time_counts_a_nested_module_once():
    """Shared-projection heads call the lm_head inside their own forward; counting it twice made
    bench's host time (wall minus module time) negative."""
    import time

    from torch import nn

    class Sleep(nn.Module):
        def __init__(self, seconds, inner=None):
            super().__init__()
            self.seconds, self.inner = seconds, inner

        def forward(self):
            time.sleep(self.seconds)
            return self.inner() if self.inner is not None else None

    lm_head = Sleep(0.05)
    heads = Sleep(0.02, lm_head)
    timer = bench.ModuleTimer([heads, lm_head])
    t0 = time.perf_counter()
    heads()
    lm_head()
    wall = time.perf_counter() - t0
    timer.remove()
    assert 0.12 <= timer.total <= wall      # 0.07 + 0.05, not 0.07 + 0.05 + the nested 0.05


def test_the_module_timer_counts_the_heads_guesses():
    """The step asks the heads for their guesses, never calls their forward: a hook on it counted nothing, and
    the heads' work was reported as time outside the model (review)."""
    from tiny import copied_heads, tiny_model

    from medusa_core.decoding.config import DecodeConfig
    from medusa_core.decoding.generate import generate
    from medusa_core.decoding.tree import build_tree_buffers, resolve_tree

    model = tiny_model()
    heads = copied_heads(model, num_heads=2)
    timer = bench.ModuleTimer([heads])
    list(generate(model, [1, 5, 7], heads=heads, tree=build_tree_buffers(resolve_tree("chain-2"), 2),
                  config=DecodeConfig(max_new_tokens=6)))
    counted, timer.total = timer.total, 0.0
    timer.remove()
    assert counted > 0 and "guesses" not in vars(heads), "the heads' guesses were not timed, or stayed wrapped"
    list(generate(model, [1, 5, 7], heads=heads, tree=build_tree_buffers(resolve_tree("chain-2"), 2),
                  config=DecodeConfig(max_new_tokens=6)))
    assert timer.total == 0.0


def test_bench_defaults_to_the_held_out_chat_prompts(checkpoint, tmp_path):
    from medusa_core.loading.assets import CPU_DEFAULT_PROMPTS
    from medusa_core.training.data import read_prompts

    backbone, _ = checkpoint
    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(backbone), "--tree", "baseline", "--max-new-tokens", "2", "--warmup", "0",
                       "--no-references", "--json", str(out)]) == 0
    shown = [p["prompt"] for p in json.loads(out.read_text())["prompts"]]
    assert shown == read_prompts(CPU_DEFAULT_PROMPTS) and len(shown) >= 12


def test_profile_cpu_step_refuses_counts_before_loading(capsys, monkeypatch):
    # QA 5c: --prompts 0 failed with a traceback after a 10-minute load and tuning; -1 profiled 23 prompts
    from medusa_core.benchmarks import profile_cpu_step as profile

    monkeypatch.setattr(profile, "load", lambda *args, **kwargs: pytest.fail("the model loaded first"))
    for args, says in ((["--count", "0"], "--count 0 must be from 1 to "), (["--count", "-1"], "--count -1"),
                       (["--steps", "0"], "--steps 0 must be at least 1")):
        with pytest.raises(SystemExit) as stopped:
            profile.main(args)
        assert stopped.value.code == 2 and says in capsys.readouterr().err
    assert profile.main(["--tree", "default", "bogus"]) == 1     # QA: after the load, "default" not among the names
    err = capsys.readouterr().err
    assert err.startswith("error: unknown tree 'bogus'") and err.endswith(" (or 'default', the model's own tree)\n")


def test_the_cpu_profile_counts_an_int4_heads_kernel_as_the_lm_head_not_a_projection():
    from torch import nn
    from tiny import tiny_model

    from medusa_core.benchmarks import profile_cpu_step as profile
    from medusa_core.quant import cpu_int4

    model = tiny_model(hidden=64)
    head = cpu_int4.Int4Head(model.lm_head)
    model.set_output_embeddings(head)
    assert profile.category(head, model) == "lm_head" and profile.category(head.int4, model) is None
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.Linear)
    assert profile.category(model.model.layers[0].mlp.down_proj, model) == profile.ORDER[0]


def test_ctrl_c_in_bench_is_one_line(monkeypatch, capsys):
    """CLI QA: Ctrl-C during bench printed KeyboardInterrupt's traceback."""
    def pressed(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "prepare", pressed)
    assert bench.main([]) == 130
    assert capsys.readouterr().err == "stopped (Ctrl-C)\n"
