import itertools
import json
import random

import pytest
import torch
from torch import nn

from medusa_core import bench_synthetic
from medusa_core.benchmarks.synthetic import SHAPES, check_not_zero
from medusa_core.decoding.tree import expected_tokens_per_step
from medusa_core.decoding.tree import tree_of_size as grow_tree
from medusa_core.heads.accuracy import PUBLISHED_ACCURACIES, rank_table
from medusa_core.decoding.tree import path_value
from medusa_core.decoding.tree import build_tree_buffers


def best_by_brute_force(table, size):
    """Largest summed path value over every prefix-closed set of size - 1 paths."""
    K, top_k = len(table), len(table[0])
    every = [p for d in range(1, K + 1) for p in itertools.product(range(top_k), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(every, size - 1):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            best = max(best, sum(path_value(p, table) for p in chosen))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grown_tree_has_the_size_asked_and_the_most_expected_tokens_per_step(seed):
    rng = random.Random(seed)
    table = [[rng.random() for _ in range(3)] for _ in range(2)]   # 2 heads x top 3, not sorted by rank
    for size in range(1, 7):
        paths = grow_tree(table, size)
        assert len(paths) == size - 1 and len(set(paths)) == size - 1
        build_tree_buffers(paths, num_heads=2, top_k=3)            # prefix-closed and fillable, or it raises
        assert expected_tokens_per_step(paths, table) == pytest.approx(1 + best_by_brute_force(table, size))


def test_grown_trees_use_the_published_accuracies_sensibly():
    table = rank_table(PUBLISHED_ACCURACIES)
    assert table[0][:3] == pytest.approx([0.56, 0.196, 0.0686])   # rank i: a * 0.35**i
    assert grow_tree(table, 1) == []
    assert grow_tree(table, 4) == [(0,), (1,), (0, 0)]              # 0.56, 0.196, 0.56 * 0.32
    t64 = grow_tree(table, 64)
    assert len(t64) == 63 and max(len(p) for p in t64) <= 5
    # bigger trees never expect fewer tokens, and stay near the published 2.3-2.6 tokens per step
    accs = [expected_tokens_per_step(grow_tree(table, n), table) for n in (1, 4, 8, 16, 32, 64, 128)]
    assert accs == sorted(accs) and 2.3 < accs[5] < 2.6


def test_expected_tokens_per_step_is_one_plus_path_probabilities():
    table = [[0.5, 0.25], [0.4, 0.1]]
    assert expected_tokens_per_step([], table) == 1.0
    assert expected_tokens_per_step([(0,), (0, 0)], table) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    assert expected_tokens_per_step([(0,), (1,), (1, 1)], table) == pytest.approx(1 + 0.5 + 0.25 + 0.25 * 0.1)


def test_bad_tree_requests_are_named():
    with pytest.raises(ValueError, match="size 0"):
        grow_tree(rank_table([0.5]), 0)
    with pytest.raises(ValueError, match="lower it"):
        grow_tree(rank_table([0.5], top_k=2), 4)                   # 1 head x top 2 = 2 nodes below the root
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        grow_tree([[1.5]], 2)
    with pytest.raises(ValueError, match="rank-decay"):
        rank_table([0.8], decay=0.5)                                # ranks 0.8 + 0.4 + ... > 1


def test_all_zero_weights_are_refused():
    layer = nn.Linear(4, 4)
    nn.init.zeros_(layer.weight)
    with pytest.raises(RuntimeError, match="all zeros"):
        check_not_zero([layer])


def test_cli_runs_tiny_on_cpu_for_bf16_and_nf4_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    code = bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "nf4", "--tree-sizes", "1", "4", "8",
                           "--context", "16", "--iters", "2", "--warmup", "0", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "proj. speedup" in printed and "loop ms" in printed
    # a tiny model reads a few MB a step: its bandwidth is said in significant figures (QA: "0 GB/s (0% of it)")
    assert " 0 GB/s" not in printed and "(0% of it)" not in printed, printed
    from medusa_core.benchmarks.step_report import _figure
    assert (_figure(1616.8), _figure(54.61), _figure(0.01234)) == ("1617", "54.6", "0.0123")   # an H100's, whole
    data = json.loads(out.read_text())
    assert {"device", "torch", "transformers", "bitsandbytes"} <= set(data["env"])
    results = {r["quant"]: r for r in data["results"]}
    assert set(results) == {"none", "nf4"}
    for r in results.values():
        assert [row["size"] for row in r["rows"]] == [1, 4, 8]
        base = r["rows"][0]
        assert base["overhead"] == pytest.approx(1.0) and base["expected_acceptance"] == 1.0
        for row in r["rows"]:
            assert row["loop_ms"] > 0 and row["eager_ms"] > 0 and row["bandwidth_gbs"] > 0
            assert row["graphed_ms"] is None and row["host_ms"] is None     # graphs are CUDA only
            assert row["projected_speedup"] == pytest.approx(row["expected_acceptance"] / row["overhead"])
            assert row["bytes_read"] == r["weights_bytes"] + r["kv_bytes"] + (r["heads_bytes"] if row["size"] > 1 else 0)
        assert r["rows"][2]["expected_acceptance"] > r["rows"][1]["expected_acceptance"] > 1
    # NF4 packs the decoder layers' weights ~4x (lm_head stays bf16); the heads are the same bf16 ones
    assert results["nf4"]["weights_bytes"] < 0.5 * results["none"]["weights_bytes"]
    assert results["nf4"]["heads_bytes"] == results["none"]["heads_bytes"]
    summary = data["summary"]
    assert summary["bf16_baseline_ms"] == results["none"]["rows"][0]["loop_ms"]
    assert summary["nf4_baseline_ms"] == results["nf4"]["rows"][0]["loop_ms"]
    assert summary["bf16_tree64_ms"] is None and summary["bf16_tree16_ms"] is None   # no 16 or 64-node tree was timed
    best = max(1000 * row["expected_acceptance"] / row["loop_ms"] for row in results["nf4"]["rows"])
    assert summary["nf4_projected_tokens_per_s"] == pytest.approx(best)


def test_a_run_cut_short_keeps_every_nf4_kernel_it_finished(tmp_path, monkeypatch):
    """A device call's time limit stops the step benchmark mid-run: the JSON holds each kernel measured
    before the stop, not only whole precisions (a GPU run once lost two kernels' rows this way)."""
    measured = []
    real = bench_synthetic.measure

    def measure_then_stop(args, model, heads, label, routing, device):
        if measured:
            raise KeyboardInterrupt     # the stop, arriving while the second kernel is timed
        measured.append(label)
        return real(args, model, heads, label, routing, device)

    monkeypatch.setattr(bench_synthetic, "measure", measure_then_stop)
    out = tmp_path / "step.json"
    with pytest.raises(KeyboardInterrupt):
        bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "nf4", "--nf4-kernel", "bnb", "auto",
                              "--tree-sizes", "1", "--context", "8", "--iters", "1", "--warmup", "0", "--json", str(out)])
    assert [r["quant"] for r in json.loads(out.read_text())["results"]] == ["nf4-bnb"]


def test_the_step_run_says_which_config_each_tuner_kept_and_both_split_k_sums(tmp_path, monkeypatch, capsys):
    """On a GPU the step stage shows what the tuners chose, so whether the split-K sum in one launch won is
    known without the kernels stage (the H100 run that first could time it did not reach that stage)."""
    rm = pytest.importorskip("medusa_core.quant.nf4_repacked_matmul", reason="the repacked kernel needs Triton")
    from medusa_core.quant import bnb

    monkeypatch.setattr(rm, "TUNING_LOG", {("old", 16, 4096, 4096, torch.bfloat16, 128): [("dot m16 n64 split2", 9.0)]})
    routed = bnb.use_nf4_kernel

    def route_and_tune(model, kernel):      # a CUDA load's tuners, as they log
        rm.TUNING_LOG[("H100", 1, 11008, 4096, torch.bfloat16, 128)] = [
            ("gemv m1 n64 split1 w4 s2", 30.0), ("gemv m1 n64 split4 w4 s2 prefetch", 20.5),
            ("gemv m1 n64 split4 w4 s2 prefetch serial", 19.2), ("dot m16 n64 split2 w4 s2", None)]
        rm.TUNING_LOG[("H100", 1, 32000, 4096, torch.bfloat16, 128)] = [("gemv m1 n64 split1 w4 s2", 44.0)]
        return routed(model, kernel)

    monkeypatch.setattr(bnb, "use_nf4_kernel", route_and_tune)
    out = tmp_path / "step.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "nf4", "--nf4-kernel", "bnb",
                                 "--tree-sizes", "1", "--context", "8", "--iters", "1", "--warmup", "0",
                                 "--json", str(out)]) == 0
    told = [line.strip() for line in capsys.readouterr().err.splitlines() if "] tuned " in line]
    assert told == ["[nf4] tuned repacked 4096->11008 M<=1: gemv m1 n64 split4 w4 s2 prefetch serial 19.2 µs "
                    "(split-K sum in one launch 19.2, in a second 20.5)",
                    "[nf4] tuned repacked 4096->32000 M<=1: gemv m1 n64 split1 w4 s2 44.0 µs"]   # not the old entry
    tuning = json.loads(out.read_text())["tuning"]
    assert [(t["k"], t["n"], t["row_class"]) for t in tuning] == [(4096, 4096, 16), (4096, 11008, 1), (4096, 32000, 1)]
    assert tuning[1]["timed"][3] == {"config": "dot m16 n64 split2 w4 s2", "us": None}


def test_cli_times_transformers_generate_for_the_baseline_comparison(tmp_path):
    out = tmp_path / "gpu.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                           "--context", "8", "--iters", "3", "--warmup", "0", "--hf-generate", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert set(r["hf_generate_ms"]) == {"dynamic", "static"}
    # each a positive time, or timing noise said so (a difference of two noisy times on a busy CPU can be no
    # figure); never an error (test audit: any failure passed)
    assert all((isinstance(v, float) and v > 0) or v.startswith("failed: the longer run measured no slower")
               for v in r["hf_generate_ms"].values()), r["hf_generate_ms"]
    assert r["baseline_over_best_hf"] is None or r["baseline_over_best_hf"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only torch gives")
def test_cuda_request_without_a_gpu_is_one_line_error(capsys):
    assert bench_synthetic.main(["--device", "cuda", "--quant", "none"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err
    # QA 5c: torch's traceback for an unknown device, and fold errors that named neither the file nor the fix
    assert bench_synthetic.main(["--device", "tpu"]) == 1
    assert capsys.readouterr().err == "error: --device 'tpu' is unknown: use cpu, cuda or cuda:N\n"


def test_flags_that_cannot_run_are_one_line_errors_before_the_run(tmp_path, monkeypatch, capsys):
    """QA: a CUDA-only kernel asked for on the CPU ended in a traceback, an unwritable --json in one after the
    whole run (its results lost), and a tree larger than the context was told to lower --context."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tiny = ["--device", "cpu", "--shape", "tiny", "--tree-sizes", "1", "--iters", "1"]
    assert bench_synthetic.main([*tiny, "--quant", "nf4", "--nf4-kernel", "bnb", "repacked"]) == 1
    assert capsys.readouterr().err.startswith("error: --nf4-kernel repacked: the Triton kernels need a CUDA device")
    assert bench_synthetic.main([*tiny, "--norm-kernel", "triton"]) == 1
    assert capsys.readouterr().err.startswith("error: --norm-kernel triton: the Triton norm needs a CUDA device")
    blocked = tmp_path / "a file"
    blocked.write_text("")
    assert bench_synthetic.main([*tiny, "--json", str(blocked / "step.json")]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --json {blocked / 'step.json'} cannot be written: {blocked} is a file, not a folder: give "
                   "a file path in a folder you can write\n")
    assert bench_synthetic.main([*tiny, "--json", ""]) == 1       # it ran the whole benchmark and wrote nothing
    assert capsys.readouterr().err == "error: --json is empty: give a file path in a folder you can write\n"
    assert bench_synthetic.main([*tiny, "--tree-sizes", "2000", "--context", "1", "--warmup", "0"]) == 1
    assert capsys.readouterr().err == ("error: --context 1 + the largest tree (2000 nodes) + 3 steps exceeds the "
                                       "1024-token context: lower --context or --tree-sizes\n")
    # QA: one line for three flags named none of them, and a bad decay or accuracy came back as a table
    for flags, says in ((["--context", "-1"], "--context -1 must be at least 1"),
                        (["--warmup", "-2"], "--warmup -2 must be at least 0"),
                        (["--rank-decay", "-1"], "--rank-decay -1.0: give a number in (0, 1]"),
                        (["--accuracies", "0.5", "nan"], "--accuracies nan: give each head's top-1 accuracy as a "
                                                         "number from 0 to 1")):
        assert bench_synthetic.main([*tiny, *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}") and err.count("\n") == 1, err
    out = tmp_path / "new" / "step.json"
    assert bench_synthetic.main([*tiny, "--json", str(out)]) == 0 and json.loads(out.read_text())["results"]


def test_fold_names_the_file_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    for name, says in ((str(bad), f"error: --fold {bad} is not JSON ("), ("/nope.json", "error: --fold /nope.json cannot "
                                                                                          "be read (No such file")):
        assert bench_synthetic.main(["--fold", name, "--json", str(tmp_path / "f.json")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(says) and err.rstrip().endswith("the GPU runbook") and err.count("\n") == 1, err



def test_fold_names_the_file_without_step_results_and_what_it_lacks(tmp_path, capsys):
    # QA: a first file without "results" said only "error: 'results'", and {"results": 5} was a TypeError's traceback
    for name, content, says in (
            ("none.json", {"summary": {}}, 'has no "results" list of step results: pass a bench_synthetic JSON'),
            ("five.json", {"results": 5}, 'has no "results" list of step results'),
            ("list.json", [1, 2], 'has no "results" list of step results'),
            ("entry.json", {"results": [5]}, 'holds a "results" entry that is not a bench_synthetic step result')):
        path = tmp_path / name
        path.write_text(json.dumps(content))
        assert bench_synthetic.main(["--fold", str(path), "--json", str(tmp_path / "f.json")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path} {says}") and err.count("\n") == 1, err
    empty = tmp_path / "empty.json"          # a step report with no results yet, then a later file that is no object
    empty.write_text(json.dumps({"results": []}))
    assert bench_synthetic.main(["--fold", str(empty), str(tmp_path / "list.json"), "--json", str(tmp_path / "f.json")]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'list.json'} holds no JSON object: pass a ")
    assert not (tmp_path / "f.json").exists()


def test_a_save_checkpoint_folder_that_is_a_file_is_one_line_before_the_build(tmp_path, capsys, monkeypatch):
    # QA: --save-checkpoint <a file> ended in mkdir's NotADirectoryError traceback after the model was built
    monkeypatch.setattr(bench_synthetic, "save_random_checkpoint", lambda *a, **k: pytest.fail("the model was built"))
    afile = tmp_path / "afile"
    afile.write_text("")
    for target, says in ((afile, "is a file"), (afile / "ckpt", f"lies under {afile}, a file")):
        assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none",
                                     "--save-checkpoint", str(target)]) == 1
        assert capsys.readouterr().err == f"error: --save-checkpoint {target} {says}: give a directory\n"

def test_fold_merges_the_kernel_and_demo_figures_into_one_report(tmp_path):
    step = tmp_path / "gpu.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                           "--context", "8", "--iters", "2", "--warmup", "0", "--json", str(step)]) == 0
    nf4 = tmp_path / "nf4.json"
    nf4.write_text(json.dumps({"env": {}, "summary": {"nf4_kernel_m16_us": 21.5, "bnb_m1_us": 24.0}}))
    demo = tmp_path / "demo.json"
    demo.write_text(json.dumps({"model": "demo model: assets/demo", "summary": [
        {"name": "baseline (1-node tree)", "tokens_per_s": 1000.0},
        {"name": "medusa tree.json", "tokens_per_s": 1700.0}, {"name": "medusa small-16", "tokens_per_s": 1800.0}]}))
    exact = tmp_path / "exactness.json"
    counts = {"model": "random", "max_new_tokens": 96, "exactness": [{"kernel": "repacked-exact", "identical": 24}]}
    exact.write_text(json.dumps(counts))
    out = tmp_path / "report.json"
    assert bench_synthetic.main(["--fold", str(step), str(nf4), str(demo), str(exact), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["exactness"] == {"random": counts}
    summary = json.loads(out.read_text())["summary"]
    assert summary["nf4_kernel_m16_us"] == 21.5 and summary["bnb_m1_us"] == 24.0
    assert summary["demo_cuda_tokens_per_s"] == 1000.0 and summary["demo_cuda_medusa_tokens_per_s"] == 1800.0
    assert summary["bf16_baseline_ms"] == json.loads(step.read_text())["summary"]["bf16_baseline_ms"]
    assert bench_synthetic.main(["--fold", str(step), str(nf4), str(demo), str(step), "--json", str(out)]) == 0   # a later run adds rows
    merged = json.loads(out.read_text())
    assert len(merged["results"]) == 2 * len(json.loads(step.read_text())["results"])
    assert merged["summary"]["nf4_kernel_m16_us"] == 21.5
    # a later run that did not time static generate() keeps the earlier run's figure (a refold once nulled it)
    with_generate = json.loads(step.read_text())
    with_generate["results"][0]["hf_generate_ms"] = {"static": 5.0}
    (tmp_path / "with_generate.json").write_text(json.dumps(with_generate))
    assert bench_synthetic.main(["--fold", str(tmp_path / "with_generate.json"), str(step), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["bf16_static_generate_ms"] == 5.0
    assert bench_synthetic.main(["--fold", str(out), str(nf4), str(demo), "--json", str(out)]) == 0
    # the committed report folded again with a new run keeps the demo's headline (it once dropped it)
    again = tmp_path / "again.json"
    assert bench_synthetic.main(["--fold", str(out), str(step), "--json", str(again)]) == 0
    assert json.loads(again.read_text())["summary"]["demo_cuda_medusa_tokens_per_s"] == 1800.0
    (tmp_path / "other.json").write_text(json.dumps({"something": 1}))
    assert bench_synthetic.main(["--fold", str(step), str(tmp_path / "other.json"), "--json", str(out)]) == 1


def test_fold_refuses_a_bench_run_on_the_cpu(tmp_path, capsys):
    """QA: a CPU ``bench`` JSON (SmolLM2's) was filed as the GPU report's "checkpoint" row, its tokens/s headline."""
    step = tmp_path / "gpu.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                                 "--context", "8", "--iters", "2", "--warmup", "0", "--json", str(step)]) == 0
    capsys.readouterr()
    bench = tmp_path / "smol.json"
    bench.write_text(json.dumps({"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "device": "cpu", "summary": [
        {"name": "baseline (1-node tree)", "tokens_per_s": 40.0}]}))
    out = tmp_path / "report.json"
    assert bench_synthetic.main(["--fold", str(step), str(bench), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: {bench} is a bench run on cpu, and this report is a GPU's: fold a bench run with --device "
                   "cuda, or leave it out\n") and not out.exists()
    bench.write_text(bench.read_text().replace('"cpu"', '"cuda:0"'))
    assert bench_synthetic.main(["--fold", str(step), str(bench), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["checkpoint_tokens_per_s"] == 40.0


def test_fold_adds_up_kernel_runs_split_by_shape_or_cut_short(tmp_path):
    """A GPU call has a time limit: nf4_kernel --shapes runs one shape at a time, a run cut short leaves
    its finished shapes (partial); folded, each shape's rows come from the run that measured it last."""
    step = tmp_path / "gpu.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                                 "--context", "8", "--iters", "2", "--warmup", "0", "--json", str(step)]) == 0

    def run(name, shapes, summary, partial=False):
        rows = [{"k": k, "n": n, "m": 1, "method": method, "us": us}
                for (k, n), us in shapes.items() for method, us in (("repacked", us), ("bnb", us - 7))]
        path = tmp_path / name
        path.write_text(json.dumps({"env": {}, "shapes": {f"{k}->{n}": {} for k, n in shapes}, "summary": summary,
                                    "rows": rows, "tuning": [{"kernel": "triton", "k": k, "n": n, "row_class": 1,
                                                              "timed": []} for k, n in shapes], "partial": partial}))
        return path

    first = run("a.json", {(4096, 11008): 31.0, (11008, 4096): 29.0},
                {"nf4_kernel_m1_us": 31.0, "bnb_m1_us": 24.0}, partial=True)
    again = run("b.json", {(11008, 4096): 27.0}, {"nf4_kernel_m1_us": None, "bnb_m1_us": None})
    data = json.loads(again.read_text())
    del data["partial"]                       # as an older run wrote it: a finished run is not partial
    again.write_text(json.dumps(data))
    out = tmp_path / "report.json"
    assert bench_synthetic.main(["--fold", str(step), str(first), str(again), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    # the headline figures are 4096->11008's, which only the first run measured
    assert report["summary"]["nf4_kernel_m1_us"] == 31.0 and report["summary"]["bnb_m1_us"] == 24.0
    assert report["summary"]["storage_kernel_m1_us"] is None       # no row of the kernel on bnb's storage
    kernel = report["nf4_matmul"]
    assert sorted((r["k"], r["n"], r["us"]) for r in kernel["rows"] if r["method"] == "repacked") == \
        [(4096, 11008, 31.0), (11008, 4096, 27.0)]
    assert sorted((t["k"], t["n"]) for t in kernel["tuning"]) == [(4096, 11008), (11008, 4096)]
    assert set(kernel["shapes"]) == {"4096->11008", "11008->4096"} and kernel["partial"] is False
    # folded again into that report with nothing new: the kernel figures stay
    assert bench_synthetic.main(["--fold", str(out), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["nf4_kernel_m1_us"] == 31.0


def test_fold_names_the_kernel_figures_from_the_rows_as_this_code_does(tmp_path):
    """nf4_kernel_m*_us is the kernel the app runs (the repacked one); until 2026-11-29 a kernel run named the
    kernel on bitsandbytes' storage so. A run written then, folded now, reads as a run written now."""
    step = tmp_path / "gpu.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                                 "--context", "8", "--iters", "2", "--warmup", "0", "--json", str(step)]) == 0
    rows = [{"k": 4096, "n": 11008, "m": m, "method": method, "us": us, "error": "", "variant": ""}
            for m, method, us in ((1, "triton", 30.7), (1, "repacked", 17.5), (16, "repacked", 28.2),
                                  (16, "triton", 46.4), (1, "bnb", 24.1))]
    old = tmp_path / "nf4.json"
    old.write_text(json.dumps({"env": {}, "shapes": {"4096->11008": {"floor_us": 5.6}}, "rows": rows, "tuning": [],
                               "summary": {"nf4_kernel_m1_us": 30.7, "nf4_kernel_m16_us": 46.4, "bnb_m1_us": 24.1}}))
    out = tmp_path / "report.json"
    assert bench_synthetic.main(["--fold", str(step), str(old), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert (summary["nf4_kernel_m1_us"], summary["nf4_kernel_m16_us"]) == (17.5, 28.2)
    assert (summary["storage_kernel_m1_us"], summary["storage_kernel_m16_us"]) == (30.7, 46.4)
    assert summary["bnb_m1_us"] == 24.1 and summary["floor_us"] == 5.6 and summary["nf4_kernel_m64_us"] is None


def test_a_saved_random_checkpoint_benchmarks_through_the_real_loader(tmp_path, capsys):
    """bench_synthetic --save-checkpoint writes a random model with SmolLM2's tokenizer cut to the shape's
    vocabulary; bench loads it like a download and times it (greedy Medusa = plain decoding)."""
    from medusa_core import bench

    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none",
                           "--save-checkpoint", str(tmp_path / "ckpt")]) == 0
    backbone, heads = tmp_path / "ckpt" / "backbone", tmp_path / "ckpt" / "heads"
    assert f"--model {backbone} --heads {heads}" in capsys.readouterr().out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(backbone)
    text = "What is the capital of France? Naïve café."
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < SHAPES["tiny"].vocab and tokenizer.decode(ids) == text
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n')
    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(prompts), "--tree", "chain-2",
                       "--max-new-tokens", "6", "--warmup", "0", "--no-references", "--json", str(out)]) == 0
    row = {r["name"]: r for r in json.loads(out.read_text())["summary"]}["medusa chain-2"]
    assert row["identical"] == "yes"


def test_a_vocabulary_below_the_tokenizers_bytes_is_one_line(tmp_path):
    from dataclasses import replace

    from medusa_core.benchmarks.synthetic import save_random_checkpoint

    with pytest.raises(ValueError) as err:
        save_random_checkpoint(replace(SHAPES["tiny"], vocab=200), 3, tmp_path, 0, torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message and "vocabulary of 200" in message and "use --shape 7b" in message
    assert not (tmp_path / "backbone" / "config.json").exists(), "refused before building anything"


def test_the_old_command_name_still_runs():
    """``python -m medusa_core.bench_gpu``, the name the docs of earlier runs give, runs the same benchmark."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "medusa_core.bench_gpu", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage: python -m medusa_core.bench_synthetic" in out.stdout


def test_the_step_profile_counts_kernels_once_and_charges_tritons_to_the_range_around_them():
    """On a GPU the profiler lists the module ranges as device events too (annotations spanning their
    kernels and the gaps between them), and Triton's kernels come linked to no op. An H100 run read
    100 ms for an 8 ms step, with the NF4 step's matmuls "unlinked". Here: device events of that shape."""
    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    from medusa_core.benchmarks.profile_gpu_step import attribute

    def device(name, start, end):
        return Event(name=name, device_type=DeviceType.CUDA, time_range=Interval(start, end), device_time=end - start)

    projections = Event(name="medusa:projections", device_type=DeviceType.CPU, cpu_parent=None, kernels=[],
                        self_device_time_total=0.0)
    matmul = Event(name="aten::mm", device_type=DeviceType.CPU, cpu_parent=projections, self_device_time_total=10.0,
                   kernels=[Event(name="gemm")])
    events = [projections, matmul,
              device("medusa:decoder", 0, 1000), device("medusa:projections", 100, 200),
              device("medusa:attention", 300, 600), device("medusa:projections", 400, 450),
              device("gemm", 100, 110),                   # the op's kernel
              device("_repacked_kernel", 120, 150),        # Triton's, inside a projection range
              device("_repacked_kernel", 410, 440),        # inside a projection inside attention
              device("_rows_alone_kernel", 310, 330),      # in attention, outside its projections
              device("_reduce_kernel", 2000, 2010),        # outside every range
              device("medusa:attention", 700, 800), device("medusa:projections", 700, 750),   # one start
              device("_repacked_kernel", 700, 720), device("_rows_alone_kernel", 760, 790)]
    per, unlinked, ops = attribute(events, on_cuda=True)
    assert per["projections"] == 10 + 30 + 30 + 20 and per["attention"] == 20 + 30 and per["unlinked"] == 10
    assert sum(per.values()) == 150                       # every kernel once, no range counted as one
    assert dict(unlinked) == {"_reduce_kernel": 10}
    # what inside each category costs, by op or kernel name
    assert dict(ops) == {("projections", "aten::mm"): 10, ("projections", "_repacked_kernel"): 80,
                         ("attention", "_rows_alone_kernel"): 50, ("unlinked", "_reduce_kernel"): 10}


def test_step_profile_charges_each_part_of_the_step_and_folds_into_the_report(tmp_path):
    """benchmarks.profile_gpu_step (run here on the CPU, where it counts op time): the baseline step
    spends nothing in the heads, a 16-node step does; every part of the model shows up; the profile
    lands in the docs/perf report."""
    from medusa_core.benchmarks import profile_gpu_step

    prof = tmp_path / "profile.json"
    assert profile_gpu_step.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "nf4", "--tree-sizes",
                                  "1", "16", "--context", "8", "--steps", "2", "--nf4-kernel", "auto", "bnb",
                                  "--json", str(prof)]) == 0
    profile = json.loads(prof.read_text())["step_profile"]
    assert set(profile) == {"bf16_t1", "bf16_t16", "nf4_t1", "nf4_t16", "nf4-bnb_t1", "nf4-bnb_t16"}
    for name, row in profile.items():
        parts = row["ms_per_step"]
        assert row["total_ms"] == pytest.approx(sum(parts.values()))
        for part in ("projections", "attention", "norms", "lm_head", "outside"):
            assert parts[part] > 0, (name, part)
        assert (parts["heads"] > 0) == name.endswith("t16"), name      # the baseline step runs no heads
        # each category lists its largest ops, whose times are part of it
        assert set(row["top_ops_ms"]) == {part for part, v in parts.items() if v}, name
        for part, top in row["top_ops_ms"].items():
            assert top and sum(top.values()) <= parts[part] + 1e-9, (name, part)
        assert any(op.startswith("aten::") for op in row["top_ops_ms"]["attention"]), row["top_ops_ms"]["attention"]
    step = tmp_path / "gpu.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                                 "--context", "8", "--iters", "2", "--warmup", "0", "--json", str(step)]) == 0
    out = tmp_path / "report.json"
    assert bench_synthetic.main(["--fold", str(step), str(prof), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["step_profile"] == profile


def test_each_norm_kernel_is_measured_and_named_apart_in_the_step_and_the_profile(tmp_path, monkeypatch):
    """--norm-kernel torch triton: the same step twice, told apart in the report (the app's auto unmarked)."""
    pytest.importorskip("triton", reason="the Triton norm needs Triton")
    from medusa_core.benchmarks import profile_gpu_step

    monkeypatch.setenv("TRITON_INTERPRET", "1")           # the Triton norm on CPU tensors
    out = tmp_path / "step.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--norm-kernel", "torch",
                                 "triton", "--tree-sizes", "1", "--context", "8", "--iters", "1", "--warmup", "0",
                                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["quant"] for r in data["results"]] == ["none-torch-norms", "none-triton-norms"]
    assert data["results"][0]["routing"] == "norms: transformers' own"
    assert data["results"][1]["routing"].startswith("norms: one Triton kernel for each of ")
    assert data["summary"]["bf16_triton_norms_baseline_ms"] == data["results"][1]["rows"][0]["loop_ms"]
    prof = tmp_path / "profile.json"
    assert profile_gpu_step.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                                  "--context", "8", "--steps", "1", "--norm-kernel", "torch", "triton",
                                  "--json", str(prof)]) == 0
    profile = json.loads(prof.read_text())["step_profile"]
    assert set(profile) == {"bf16-torch-norms_t1", "bf16-triton-norms_t1"}
    # a later profile of some rows, folded into a report: it replaces those rows and keeps the others
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"step_profile": {"bf16-triton-norms_t1": {"total_ms": 1.0}}}))
    report = tmp_path / "report.json"
    assert bench_synthetic.main(["--fold", str(out), str(prof), str(later), "--json", str(report)]) == 0
    folded = json.loads(report.read_text())["step_profile"]
    assert folded == {**profile, "bf16-triton-norms_t1": {"total_ms": 1.0}}


KERNEL_FLAGS = [("--rotary-kernel", "auto", "triton", "triton-rotary",
                 "rotary: one Triton kernel for the queries and keys of each layer, one for its cache write"),
                ("--attention-kernel", "auto", "split", "split-attention",
                 "attention: split over the keys in Triton, hidden key blocks skipped")]


@pytest.mark.parametrize("flag,default,choice,suffix,line", KERNEL_FLAGS)
def test_each_step_kernel_choice_is_measured_and_named_apart_in_the_step_and_the_profile(
        tmp_path, monkeypatch, flag, default, choice, suffix, line):
    """--rotary-kernel auto triton, --attention-kernel auto split: the same step twice in one run, told apart
    (auto, the app's routing, unmarked), and the model's family has transformers' rotary back after the run."""
    pytest.importorskip("triton", reason="the step's Triton kernels need Triton")
    from transformers.models.llama import modeling_llama

    from medusa_core.benchmarks import profile_gpu_step

    monkeypatch.setenv("TRITON_INTERPRET", "1")           # the kernel on CPU tensors
    original = modeling_llama.apply_rotary_pos_emb
    out = tmp_path / "step.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", flag, default, choice,
                                 "--tree-sizes", "1", "--context", "8", "--iters", "1", "--warmup", "0",
                                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["quant"] for r in data["results"]] == ["none", f"none-{suffix}"]
    assert line.split(":")[0] not in data["results"][0]["routing"]
    assert data["results"][1]["routing"].endswith(line)
    assert data["summary"][f"bf16_{suffix.replace('-', '_')}_baseline_ms"] == data["results"][1]["rows"][0]["loop_ms"]
    assert modeling_llama.apply_rotary_pos_emb is original
    prof = tmp_path / "profile.json"
    assert profile_gpu_step.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--tree-sizes", "1",
                                  "--context", "8", "--steps", "1", flag, default, choice, "--json", str(prof)]) == 0
    assert set(json.loads(prof.read_text())["step_profile"]) == {"bf16_t1", f"bf16-{suffix}_t1"}
    assert modeling_llama.apply_rotary_pos_emb is original


@pytest.mark.parametrize("flag,default,choice,suffix,line", KERNEL_FLAGS)
def test_a_step_kernel_on_a_cpu_without_the_interpreter_is_one_line_before_a_build(
        capsys, monkeypatch, flag, default, choice, suffix, line):
    from medusa_core.benchmarks import profile_gpu_step

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for main in (bench_synthetic.main, profile_gpu_step.main):
        assert main(["--device", "cpu", flag, choice]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{flag} {default}" in err and "TRITON_INTERPRET=1" in err, err


def test_a_cpu_run_says_first_that_it_is_a_smoke_check_and_which_nf4_flags_it_skips(capsys):
    """QA16: the step benchmarks ran tiny shapes on a CPU machine and printed speedups (and wrote out/h100.json)
    with no word that they are no speed claims, and dropped --nf4-kernel without a word."""
    from medusa_core.benchmarks import profile_gpu_step

    runs = ((bench_synthetic.main, ["--iters", "1", "--warmup", "0"]), (profile_gpu_step.main, ["--steps", "1"]))
    for main, extra in runs:
        assert main(["--device", "cpu", "--tree-sizes", "1", "--context", "8", "--nf4-kernel", "bnb", "auto", *extra]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "tiny shapes on the CPU, a smoke check of the code path; its figures are not speed claims (run it on " \
               "a CUDA machine for the 7B shapes)" in lines[0], lines[:2]
        assert lines[1] == ("--nf4-kernel bnb auto skipped: it picks the kernel of NF4 weights, and --quant none builds "
                            "none (NF4 is a default only on CUDA): add --quant nf4 to run it here"), lines[:2]
        assert not any(line.startswith("nf4") or "[nf4" in line for line in lines)


def test_nf4_heads_are_measured_on_the_kernel_each_nf4_kernel_choice_names(tmp_path, monkeypatch):
    """--heads-quant nf4: each --nf4-kernel choice's step runs the heads where the app's loader puts them beside it
    (quant/bnb.py use_nf4_heads), and its routing says so; with none too, bf16 heads beside the same routing of the
    backbone, in the same process (review: the runbook read them against another process's routing)."""
    pytest.importorskip("triton", reason="the repacked kernel needs Triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")           # the kernel on CPU tensors
    out = tmp_path / "step.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "nf4", "--nf4-kernel", "bnb",
                                 "repacked", "--heads-quant", "none", "nf4", "--tree-sizes", "1", "4", "--context", "8",
                                 "--iters", "1", "--warmup", "0", "--json", str(out)]) == 0
    routing = {r["quant"]: r["routing"] for r in json.loads(out.read_text())["results"]}
    heads = len(PUBLISHED_ACCURACIES)
    assert f"heads: bitsandbytes for their {heads} NF4 projections" in routing["nf4-bnb-nf4-heads"], routing
    assert f"heads: repacked Triton kernel for {heads} NF4 projections" in routing["nf4-repacked-nf4-heads"], routing
    # named apart from a run with bf16 heads alone: a fold keeps both
    assert list(routing) == ["nf4-bnb-bf16-heads", "nf4-bnb-nf4-heads", "nf4-repacked-bf16-heads",
                             "nf4-repacked-nf4-heads"], routing
    for kernel in ("bnb", "repacked"):
        bf16 = routing[f"nf4-{kernel}-bf16-heads"]
        assert "heads:" not in bf16 and routing[f"nf4-{kernel}-nf4-heads"].startswith(bf16.split("; ")[0]), routing
