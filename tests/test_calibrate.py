"""Tree calibration: accuracies, greedy growth by product of accuracies, the written tree file."""

import itertools
import json

import pytest
import torch
from tiny import random_heads, tiny_checkpoint, tiny_model

from medusa_core.training.tree_search import CalibrateConfig, accuracy_table, run
from medusa_core.loading.tree_tuning import choose, monotone_fit
from medusa_core.training.data import IGNORE
from medusa_core.training.evaluation import rank_histogram
from medusa_core.training.loss import backbone_hidden
from medusa_core.decoding.tree import build_tree_buffers, expected_tokens_per_step, grow_tree, load_tree_file, path_value

ACC = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]


def all_trees(acc, size):
    """Every prefix-closed set of ``size`` paths over the table (brute force)."""
    nodes = [p for d in range(1, len(acc) + 1) for p in itertools.product(range(len(acc[0])), repeat=d)]
    for subset in itertools.combinations(nodes, size):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            yield subset


def test_grow_tree_by_hand():
    # values: (0,)=.6 (0,0)=.3 (1,)=.2 (0,1)=.18 (1,0)=.1 (2,)=.1 ...
    assert grow_tree(ACC, 3) == [(0,), (0, 0), (1,)]
    assert grow_tree(ACC, 4) == [(0,), (0, 0), (1,), (0, 1)]
    assert path_value((0, 1), ACC) == pytest.approx(0.18)
    assert expected_tokens_per_step(grow_tree(ACC, 3), ACC) == pytest.approx(1 + 0.6 + 0.3 + 0.2)


@pytest.mark.parametrize("budget", range(1, 7))
def test_greedy_tree_is_the_best_tree_of_its_size(budget):
    acc = [[0.55, 0.25, 0.1], [0.7, 0.15, 0.05], [0.4, 0.3, 0.2]][:2]
    best = max(expected_tokens_per_step(t, acc) for t in all_trees(acc, budget))
    tree = grow_tree(acc, budget)
    assert len(tree) == budget
    assert expected_tokens_per_step(tree, acc) == pytest.approx(best)
    # every node is worth at least as much as any node left out that could have been added
    chosen = set(tree)
    frontier = [p + (i,) for p in [(), *tree] for i in range(3) if len(p) < 2 and p + (i,) not in chosen]
    assert min(path_value(p, acc) for p in tree) >= max(path_value(p, acc) for p in frontier)


def test_never_right_guesses_are_not_added():
    acc = [[0.5, 0.0], [0.0, 0.0]]
    assert grow_tree(acc, 10) == [(0,)]


def test_step_times_become_non_decreasing_keeping_real_jumps():
    # 2 CPU cores, ms per step by tree size (assets/smollm2/tree_calibration.json, 2026-11-23): a jump
    # at 4 rows (torch's fp32 sgemm changes strategy), and a 16-node dip from load
    measured = {2: 53.4, 3: 54.8, 4: 70.8, 6: 84.9, 8: 99.0, 12: 102.8, 16: 98.8}
    fitted = monotone_fit(measured)
    assert [fitted[n] for n in (2, 3, 4, 6, 8)] == [53.4, 54.8, 70.8, 84.9, 99.0]   # untouched, jump kept
    assert fitted[12] == fitted[16] == pytest.approx((102.8 + 98.8) / 2)            # the dip pooled
    assert monotone_fit({1: 3.0, 2: 2.0, 3: 1.0}) == {1: 2.0, 2: 2.0, 3: 2.0}


def test_auto_chooses_as_the_app_does_a_tree_timed_under_the_plain_step_is_not_taken(monkeypatch):
    """Load noise that slows the plain step must not write a tree: calibrate chooses with the app's tuner
    (tree_tuning.choose: no tree below the plain step's time, and MIN_SPEEDUP to gain), where it took the most
    expected tokens a second, and a head right 2% of the time won at 1.10x (review). Each size times its own
    cache, made once: a new cache per reply captured a CUDA graph inside the timed steps."""
    from types import SimpleNamespace

    import medusa_core.decoding.generate as generate_module
    from medusa_core.training.tree_search import time_sizes

    made = []
    monkeypatch.setattr(generate_module, "new_cache", lambda model, capacity: made.append(capacity) or object())

    def timed(model, ids, *, heads, tree, config, cache):      # 10 ms a plain step, 9.3 ms a tree's (noise)
        assert cache is not None
        for _ in range(config.max_new_tokens):
            yield SimpleNamespace(prefill=False, tokens=[1], seconds=0.010 if tree.size == 1 else 0.0093)

    monkeypatch.setattr(generate_module, "generate", timed)
    model = SimpleNamespace(get_output_embeddings=lambda: torch.nn.Linear(2, 2))
    heads = SimpleNamespace(config=SimpleNamespace(num_heads=2))
    timing = time_sizes(model, heads, [[0.02, 0.0], [0.0, 0.0]], [[1, 2, 3], [4, 5]], [1, 2], tokens=4, repeats=2)
    assert timing[1]["chosen"] and not timing[2]["chosen"], timing
    assert timing[2]["fitted_step_ms"] == timing[1]["step_ms"] == 10.0       # the floor: no tree below plain
    assert made == [3 + 4 + 2] * 2, "one cache per size, with room for the longest prompt, reply and tree"


def test_accuracy_table_from_rank_counts():
    counts = torch.tensor([[6, 2, 2], [1, 1, 8]])   # ranks 0, 1, then "not in top 2"
    table = accuracy_table(counts)
    assert table[0] == pytest.approx([0.6, 0.2]) and table[1] == pytest.approx([0.1, 0.1])


def test_rank_histogram_matches_sorting():
    model = tiny_model()
    heads = random_heads(model, 2)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    targets = ids.clone()
    targets[:, :3] = IGNORE
    counts = rank_histogram(heads, model, [(ids, targets)], top_k=4)
    expected = torch.zeros(2, 5, dtype=torch.long)
    logits = heads(backbone_hidden(model, ids), model.lm_head)            # (K, B, S, V)
    for k in range(2):
        for b in range(2):
            for t in range(12 - k - 2):
                target = targets[b, t + k + 2].item()
                if target == IGNORE:
                    continue
                rank = (logits[k, b, t] > logits[k, b, t, target]).sum().item()
                expected[k, min(rank, 4)] += 1
    assert torch.equal(counts, expected)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    backbone, heads = tiny_checkpoint(root, steps=60)
    prompts = root / "cal.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"x = {i} + y{i}"}) + "\n" for i in range(4)))
    return backbone, heads, prompts


def test_written_tree_is_valid_and_respects_the_budget(checkpoint, tmp_path):
    backbone, heads, prompts = checkpoint
    out = tmp_path / "tree.json"
    report = run(CalibrateConfig(model=str(backbone), heads=str(heads), out=str(out), prompts=str(prompts),
                                 raw_prompts=True, budget="6", top_k=4, answer_tokens=24))
    paths = load_tree_file(out)
    assert 1 <= len(paths) <= 6
    buffers = build_tree_buffers(paths, num_heads=5, top_k=4)
    assert buffers.size == len(paths) + 1
    assert paths == grow_tree(report["accuracy"], 6)
    assert len(report["accuracy"]) == 5 and all(len(row) == 4 for row in report["accuracy"])


def test_auto_times_sizes_and_writes_the_chosen_one(checkpoint, tmp_path, capsys):
    backbone, heads, prompts = checkpoint
    out = tmp_path / "auto.json"
    report = run(CalibrateConfig(model=str(backbone), heads=str(heads), out=str(out), prompts=str(prompts),
                                 raw_prompts=True, budget="auto", max_budget=3, top_k=4, answer_tokens=16,
                                 timing_tokens=8, repeats=1, timing_count=2))
    total = len(prompts.read_text().splitlines())
    assert f"timing tree sizes on 2 of the {total} prompts" in capsys.readouterr().out   # never silently a subset
    assert set(report["timing"]) == {"1", "2", "3", "4"}
    assert all(t["step_ms"] > 0 for t in report["timing"].values())
    best = next(n for n, t in report["timing"].items() if t["chosen"])
    assert report["auto_size"] == int(best)
    chosen, *_ = choose(report["accuracy"], {int(n): t["step_ms"] for n, t in report["timing"].items()})
    assert chosen == int(best), "calibrate chooses as the app's tuner does"
    if int(best) > 1:
        assert len(load_tree_file(out)) <= int(best) - 1
    else:       # plain decoding, where no tree pays on this machine: no tree file (one of no paths is refused)
        assert not out.exists()


def test_cli_errors_are_one_line(checkpoint, tmp_path, capsys):
    """Bad values are refused in one line before any answer is generated (--top-k 0 used to crash
    after them), and the tree written is counted as the app counts it, root included."""
    from medusa_core.calibrate import main

    backbone, heads, prompts = checkpoint
    common = ["--model", str(backbone), "--heads", str(heads), "--prompts", str(prompts), "--raw-prompts",
              "--out", str(tmp_path / "t.json")]
    for extra, why in ((["--budget", "abc"], "budget 'abc' must be"), (["--budget", "3", "--top-k", "0"], "top_k 0"),
                       # QA: a tree of 1,219 nodes was written, which every loader then refused
                       (["--budget", "100000"], "--budget '100000' must be a node count from 1 to 1023 (the root not "
                                                "counted), or 'auto'"),
                       # QA: the tree was written over the prompts file it had read
                       (["--budget", "3", "--out", str(prompts)], f"--out {prompts} is the --prompts file this run "
                                                                   "reads"),
                       # QA: a missing folder was said to hold "no heads"
                       (["--budget", "3", "--heads", str(tmp_path / "nope")], f"--heads {tmp_path / 'nope'} is not "
                                                                               "there: give the folder"),
                       # a tree using rank 10 or more is one no loader runs (review: written, then refused by all)
                       (["--budget", "3", "--top-k", "11"], "top_k 11: measure from rank 1 to a tree's most, 10,"),
                       (["--max-budget", "0"], "max_budget 0"),
                       (["--budget", "3", "--device", "tpu"], "device 'tpu' is unknown"),
                       # QA 5c: a ZeroDivisionError after the measuring, and a traceback
                       (["--timing-count", "0"], "--timing-count 0 must be at least 1"),
                       # an answer of 1 or 2 tokens scores no head past the first
                       (["--budget", "3", "--answer-tokens", "2"], "--answer-tokens 2 must be at least 3: shorter"),
                       (["--threads", "-2"], "--threads -2: give 0 (torch's choice) or a count up to this machine's"),
                       # a folder as --out was refused only after the load and the measuring
                       (["--budget", "3", "--out", str(tmp_path)], f"--out {tmp_path} cannot be written"),
                       # QA: the tree was written over the heads' config.json, and the heads no longer loaded
                       (["--budget", "3", "--out", str(heads / "config.json")],
                        f"--out {heads / 'config.json'} is one of the heads' own files: give a tree file, such as "
                        f"{heads / 'tree.json'}")):
        assert main([*common, *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and err.count("\n") == 1, err
    assert not (tmp_path / "t_calibration_answers.jsonl").exists()
    # CLI QA: the timing flags were taken without a word beside a tree size given
    for extra in (["--max-budget", "8"], ["--timing-prompts", str(tmp_path / "missing.jsonl")],
                  ["--timing-count", "2"]):
        with pytest.raises(SystemExit) as exited:
            main([*common, "--budget", "3", *extra])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith(f"error: {extra[0]} changes nothing with --budget 3 (it is "
                                                         "for --budget auto"), err
    # answers made with another model's tokenizer: ids past this vocabulary (an IndexError in the embedding)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"prompt_ids": [1, 2], "answer_ids": [3, 10000000]}\n')
    data = [arg for arg in common if arg not in ("--prompts", str(prompts))]
    assert main([*data, "--data", str(foreign), "--budget", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]     # after the load's progress bar
    assert err.startswith(f"error: {foreign}:1 holds token id 10000000, not one of this model's"), err
    assert main([*common, "--budget", "3", "--top-k", "4", "--answer-tokens", "8"]) == 0
    written = len(load_tree_file(tmp_path / "t.json"))
    said = capsys.readouterr().out
    assert f"wrote {tmp_path / 't.json'}: {written + 1} nodes (root included" in said
    # the accuracies written away from the heads are never read by the app: said (review: nothing said it)
    assert f"the heads' accuracies are in {tmp_path / 't_calibration.json'}; the app reads them from " \
           f"{heads / 'tree_calibration.json'} to tune their tree on each machine: give --out {heads / 'tree.json'}" \
           in said, said


def test_where_no_tree_pays_no_tree_file_is_left(checkpoint, tmp_path, capsys, monkeypatch):
    """A tree of no paths is refused by every loader (it ran plain decoding under a tree's name): calibrate wrote
    one where no tree paid, and the file it had written before would have stood for a measurement it no longer
    made. Neither is left; the line says so and names plain decoding."""
    from medusa_core import calibrate
    from medusa_core.training import tree_search

    backbone, heads, prompts = checkpoint
    out = tmp_path / "tree.json"
    out.write_text("[[0]]\n")
    monkeypatch.setattr(tree_search, "grow_tree", lambda table, budget: [])
    assert calibrate.main(["--model", str(backbone), "--heads", str(heads), "--prompts", str(prompts), "--raw-prompts",
                           "--out", str(out), "--budget", "3", "--top-k", "4", "--answer-tokens", "8"]) == 0
    said = capsys.readouterr().out
    assert not out.exists() and (tmp_path / "tree_calibration.json").is_file()
    assert f"no tree file written (removed the {out} an earlier run wrote): plain decoding, --tree baseline" in said
