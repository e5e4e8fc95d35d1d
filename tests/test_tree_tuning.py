"""The tree tuned on the machine that runs it (medusa_core/loading/tree_tuning.py): measured at the first
load of a (model, heads, machine, mode), remembered in the user's cache, read back by later loads,
measured again when what decides it changes or --retune asks; --tree overrides it; where no tree
pays, plain decoding runs and the page says so. Tiny checkpoints whose heads carry a calibration
report; the cache lives in a temporary directory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from machine import AVX2_ENV, needs_avx2
from tiny import tiny_checkpoint

from app.engine import MEDUSA, NO_SPEEDUP, ChatEngine
from app.session import Session
from app.settings import Settings
from app.models import ModelSlot
from medusa_core.loading import this_machine, tree_tuning
from medusa_core.errors import LoadError
from medusa_core.heads.accuracy import CALIBRATION_FILE
from medusa_core.loading.load import load
from medusa_core.loading.spec import LoadSpec
from medusa_core.decoding.tree import expected_tokens_per_step, grow_tree, resolve_tree

ACCURACY = [[0.6, 0.1, 0.05], [0.4, 0.1, 0.05], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05], [0.1, 0.05, 0.02]]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    backbone, heads = tiny_checkpoint(tmp_path_factory.mktemp("tuned"), steps=20)
    (heads / CALIBRATION_FILE).write_text(json.dumps({"accuracy": ACCURACY}))
    return backbone, heads


@pytest.fixture
def measured(monkeypatch, tmp_path) -> list[int]:
    """A fresh cache directory; the list grows by one per measurement the loads make."""
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    calls: list[int] = []
    real = tree_tuning.measure_step_seconds

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tree_tuning, "measure_step_seconds", counting)
    # a quiet machine, whatever else runs beside the tests (test_a_busy_cpu_... covers the other case)
    monkeypatch.setattr(tree_tuning, "with_cpu_share", lambda run: (run(), 1.0))
    monkeypatch.setattr(tree_tuning, "_NOT_CACHED", {})       # no choice an earlier test's loads measured
    return calls


def spec(checkpoint, **kw) -> LoadSpec:
    backbone, heads = checkpoint
    return LoadSpec(model=str(backbone), heads=str(heads), device="cpu", **kw)


def test_the_first_load_measures_and_later_loads_read_the_cache(checkpoint, measured, tmp_path):
    lines: list[str] = []
    first = load(spec(checkpoint), progress=lines.append)
    assert len(measured) == 1 and first.tuned is not None and not first.tuned.cached
    assert any("tuning the tree for this machine" in line for line in lines)
    assert first.tree_note == first.tuned.line() and "measured in" in first.tree_note
    entry = list((tmp_path / "cache" / "tuned-trees").glob("*/choice.json"))
    assert len(entry) == 1, "one cache entry, in the user's cache directory"
    if first.tuned.pays:
        assert Path(first.default_tree) == entry[0].with_name("tuned.json")
        assert json.loads(Path(first.default_tree).read_text()) == first.tuned.paths
    else:
        assert first.default_tree == "baseline"
    # the choice is the best expected speedup over the measured (fitted) step times
    fitted = {int(n): ms for n, ms in first.tuned.step_ms.items()}
    speedup = {n: expected_tokens_per_step(grow_tree(ACCURACY, n - 1), ACCURACY) * fitted[1] / fitted[n] for n in fitted}
    # step_ms is kept to the µs: a ratio of two such times is off by up to 1 µs over the shorter one (this tiny
    # model's steps take a fraction of a ms: 1e-3 flat failed CI at 1.0e-3 off), and best_speedup to 4 digits
    rel = 1e-3 / min(fitted.values()) + 1e-4
    assert speedup[first.tuned.best_nodes] == pytest.approx(max(speedup[n] for n in fitted if n > 1), rel=rel)
    assert first.tuned.best_speedup == pytest.approx(speedup[first.tuned.best_nodes], rel=rel)

    again = load(spec(checkpoint), progress=lines.append)
    assert len(measured) == 1, "the second load read the cached choice instead of measuring"
    assert again.tuned.cached and again.default_tree == first.default_tree
    assert "read from the cache" in again.tree_note
    # the cached choice values other trees as the measured one did (the page's outlook for a picked tree)
    assert again.tuned.speedup_of([(0,), (0, 0)])[0] == pytest.approx(first.tuned.speedup_of([(0,), (0, 0)])[0], rel=1e-5)
    # an entry written before the table was kept beside the choice values trees from the key's table
    saved = json.loads(entry[0].read_text())
    del saved["result"]["accuracy"]
    entry[0].write_text(json.dumps(saved))
    older = load(spec(checkpoint), progress=lines.append)
    assert len(measured) == 1 and older.tuned.cached and older.tuned.accuracy == saved["key"]["accuracy"]
    assert older.tuned.speedup_of([(0,), (0, 0)])[0] == pytest.approx(first.tuned.speedup_of([(0,), (0, 0)])[0], rel=1e-5)


def test_another_tree_is_valued_from_the_same_measurements():
    """What a picked or typed tree is expected to give, from the tuner's step times (ms by size) and the
    heads' accuracies: linear between timed sizes, an upper bound past the largest (it costs at least
    that much), nothing for a tree deeper than the accuracies."""
    tuned = tree_tuning.TunedTree(paths=[[0]], nodes=2, expected_tokens_per_step=1.5, expected_speedup=1.36,
                                  best_speedup=1.36, best_nodes=2, step_ms={"1": 10.0, "2": 11.0, "4": 14.0, "16": 40.0},
                                  seconds=5, accuracy_source="test", machine="test", accuracy=[[0.5, 0.2], [0.3, 0.1]])
    assert tuned.speedup_of([(0,)]) == pytest.approx((1.5 * 10 / 11, False))
    # 3 nodes: halfway between the 2- and 4-node steps' 11 and 14 ms
    assert tuned.speedup_of([(0,), (1,)]) == pytest.approx((1.7 * 10 / 12.5, False))
    assert tuned.speedup_of([(0,), (0, 0), (0, 1)]) == pytest.approx(((1.5 + 0.15 + 0.05) * 10 / 14, False))
    # 21 nodes: more than any timed size, so at best the 16-node step's cost; the rank past the table's two
    # columns is worth nothing
    wide = [(rank,) for rank in range(20)]
    assert tuned.speedup_of(wide) == pytest.approx(((1 + 0.5 + 0.2) * 10 / 40, True))
    assert tuned.speedup_of([(0,), (0, 0), (0, 0, 0)]) is None       # deeper than the two heads' table
    assert dataclasses.replace(tuned, accuracy=None).speedup_of([(0,)]) is None


def test_a_tuning_measured_on_a_busy_cpu_is_used_once_and_not_remembered(checkpoint, measured, monkeypatch,
                                                                          tmp_path):
    """Other programs' work distorts the step times (a test run beside the app made the CPU default
    choose plain decoding instead of 2 nodes at 1.23x): such a choice runs this start only, from a
    file of its own, says so, and leaves the cache as it was."""
    monkeypatch.setattr(tree_tuning, "MIN_SPEEDUP", 0.0)          # some tree pays: there is a tree file
    monkeypatch.setattr(tree_tuning, "with_cpu_share", lambda run: (run(), 0.5))
    monkeypatch.setattr(tree_tuning, "_OWN_TREES", [])   # this test's tree files only: other tests' loads keep theirs
    busy = load(spec(checkpoint))
    assert busy.tuned.cpu_share == 0.5 and busy.tuned.contended and busy.tuned.pays
    assert busy.tree_note.endswith("while other programs were using the CPU (this app got 50% of it), so it is "
                                   "not kept in the cache)")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.json"))
    assert json.loads(Path(busy.default_tree).read_text()) == busy.tuned.paths   # this start runs what it measured
    # and its file goes when the app exits (209 folders were left in /tmp): what the exit handler runs
    # (test_app's test_what_a_process_writes_to_tmp_goes_when_the_app_ends ends a process to see it run)
    tree_tuning.remove_own_tree_files()
    assert not Path(busy.default_tree).parent.exists()
    monkeypatch.setattr(tree_tuning, "with_cpu_share", lambda run: (run(), 0.9))
    quiet = load(spec(checkpoint))
    assert len(measured) == 2 and not quiet.tuned.contended and "not kept" not in quiet.tree_note
    entry = next((tmp_path / "cache" / "tuned-trees").glob("*/choice.json"))
    kept = entry.read_text(), entry.with_name("tuned.json").read_text()
    monkeypatch.setattr(tree_tuning, "with_cpu_share", lambda run: (run(), 0.5))
    load(spec(checkpoint, retune=True))                                         # a busy --retune
    assert len(measured) == 3 and (entry.read_text(), entry.with_name("tuned.json").read_text()) == kept
    again = load(spec(checkpoint))
    assert len(measured) == 3 and again.tuned.cached and again.tuned.paths == quiet.tuned.paths
    tree_tuning.remove_own_tree_files()     # the busy --retune's file: the list the exit handler reads is restored


def test_a_busy_tuning_is_reused_by_a_later_load_in_the_same_process(checkpoint, measured, monkeypatch, tmp_path):
    """QA: Unload then Load of the same model on a busy machine tuned the tree again (105 s) that the same
    process had measured 25 minutes before. A later load in the process runs the earlier choice while the CPU
    is still busy, and says where it came from; on a quiet CPU, or under --retune, it measures again. The cache
    keeps only a quiet measurement."""
    monkeypatch.setattr(tree_tuning, "MIN_SPEEDUP", 0.0)          # some tree pays: there is a tree file
    monkeypatch.setattr(tree_tuning, "with_cpu_share", lambda run: (run(), 0.5))
    monkeypatch.setattr(tree_tuning, "cpu_share_now", lambda: 0.5)
    busy = load(spec(checkpoint))
    again = load(spec(checkpoint))
    assert len(measured) == 1, "the second load in this process ran the first one's choice"
    assert again.tuned.earlier and not again.tuned.cached and again.default_tree == busy.default_tree
    assert again.tuned.paths == busy.tuned.paths == json.loads(Path(again.default_tree).read_text())
    assert again.tree_note.endswith(" by an earlier load in this process while other programs were using the CPU "
                                    "(this app got 50% of it), so it is not kept in the cache; a load on a quiet CPU, "
                                    "or a restart, measures again)")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.json"))
    load(spec(checkpoint, retune=True))
    assert len(measured) == 2, "--retune measures again"
    monkeypatch.setattr(tree_tuning, "cpu_share_now", lambda: 0.9)
    monkeypatch.setattr(tree_tuning, "with_cpu_share", lambda run: (run(), 0.9))
    quiet = load(spec(checkpoint))                  # the CPU is quiet now: measured, and kept
    assert len(measured) == 3 and not quiet.tuned.contended and not quiet.tuned.earlier
    later = load(spec(checkpoint))
    assert len(measured) == 3 and later.tuned.cached and not later.tuned.earlier


def test_no_speedup_measured_on_a_busy_cpu_says_so_in_the_pane_title_too():
    """QA: a busy tuning's "Plain decoding: Medusa gives no speedup on this device" read as a property of the
    machine, which measured 1.35x when quiet; the status line said "while other programs ..." but the title not."""
    tuned = tree_tuning.TunedTree(paths=[], nodes=1, expected_tokens_per_step=1.0, expected_speedup=1.0,
                                  best_speedup=0.27, best_nodes=6, step_ms={"1": 10.0, "6": 60.0}, seconds=95,
                                  accuracy_source="test", machine="test", cpu_share=0.47, accuracy=[[0.6], [0.4]])
    assert tuned.no_speedup_cause == "on this device (as measured while other programs used the CPU)"
    assert dataclasses.replace(tuned, cpu_share=0.95).no_speedup_cause == "on this device"


def test_a_tuning_beside_an_answer_of_the_model_it_replaces_blames_that_answer(checkpoint, measured, monkeypatch):
    """QA: a Load while a tab still answered said the CPU was busy with other programs, with nothing else running."""
    from medusa_core.quant.kernel_timing import beside

    monkeypatch.setattr(tree_tuning, "MIN_SPEEDUP", 0.0)
    monkeypatch.setattr(tree_tuning, "with_cpu_share", lambda run: (run(), 0.5))
    with beside(lambda: (True, 1)):          # the replaced model's answer runs all along
        loaded = load(spec(checkpoint))
    assert loaded.tuned.beside_answer and loaded.tuned.contended
    assert loaded.tree_note.endswith("while an answer on the model this load replaces still ran, so it is not kept "
                                     "in the cache)"), loaded.tree_note
    assert "other programs" not in loaded.tree_note
    assert dataclasses.replace(loaded.tuned, paths=[], nodes=1).no_speedup_cause == \
        "on this device (as measured while an answer on the model this load replaces used the CPU)"


def test_a_cache_that_cannot_be_written_runs_the_tuned_tree_and_says_it_was_not_kept(checkpoint, measured,
                                                                                       monkeypatch, tmp_path):
    """QA: a tuned-tree cache that could not be written failed the load after minutes of tuning, where the GPU's
    kernel timings only said "not kept". Now this start runs what it measured, from a file of its own, and its line
    names the path in the way and the fix; the next start tunes again."""
    monkeypatch.setattr(tree_tuning, "MIN_SPEEDUP", 0.0)          # some tree pays: there is a tree file
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tuned-trees").write_text("a file where the folder goes")
    first = load(spec(checkpoint))
    assert first.tuned.pays and json.loads(Path(first.default_tree).read_text()) == first.tuned.paths
    assert first.tree_note.endswith(f", not kept: could not write the tuned tree: {tmp_path / 'cache' / 'tuned-trees'} "
                                    "is a file, not a folder: move it away, or set MEDUSA_CHAT_CACHE to a writable "
                                    "directory)")
    again = load(spec(checkpoint))          # a load later in this process runs what this one measured
    assert len(measured) == 1 and again.tuned.earlier and again.tuned.paths == first.tuned.paths
    assert again.tree_note.endswith(", not kept: could not write the tuned tree: "
                                    f"{tmp_path / 'cache' / 'tuned-trees'} is a file, not a folder: move it away, or set "
                                    "MEDUSA_CHAT_CACHE to a writable directory; restarting the app measures again)")
    monkeypatch.setattr(tree_tuning, "_NOT_CACHED", {})                 # the next start
    again = load(spec(checkpoint))
    assert len(measured) == 2 and not again.tuned.cached and not again.tuned.earlier
    assert ", not kept: could not write the tuned tree: " in again.tree_note
    # nor a file of its own: one line, naming the folder and the ways out
    denied = PermissionError(13, "Permission denied", str(tmp_path / "tmp"))
    monkeypatch.setattr(tree_tuning.tempfile, "mkdtemp", lambda prefix: (_ for _ in ()).throw(denied))
    monkeypatch.setattr(tree_tuning, "_NOT_CACHED", {})                 # another start
    with pytest.raises(LoadError) as err:
        load(spec(checkpoint))
    assert str(err.value) == (f"could not write the tuned tree's file into {tmp_path / 'tmp'} (Permission denied): "
                              "set TMPDIR to a writable folder, or pass --tree")


def test_a_tree_file_that_disagrees_with_its_entry_is_measured_again(checkpoint, measured, monkeypatch, tmp_path):
    monkeypatch.setattr(tree_tuning, "MIN_SPEEDUP", 0.0)
    first = load(spec(checkpoint))
    Path(first.default_tree).write_text(json.dumps([[0], [1], [2]]) + "\n")   # another start's tree
    again = load(spec(checkpoint))
    assert len(measured) == 2 and not again.tuned.cached


def test_the_cpu_share_is_what_this_process_got():
    usable = this_machine.usable_cpus(torch.get_num_threads())
    busy = this_machine.with_cpu_share(lambda: sum(i * i for i in range(3_000_000)))[1]   # one thread busy
    idle = this_machine.with_cpu_share(lambda: time.sleep(0.3))[1]
    # one thread's worth at most, whatever the machine's thread count (1/16 on 16 threads)
    assert idle < busy / 4 and busy <= 1 / usable + 0.1


def test_a_changed_key_or_retune_measures_again(checkpoint, measured, monkeypatch):
    load(spec(checkpoint))
    load(spec(checkpoint, retune=True))
    assert len(measured) == 2, "--retune measures even with a cached choice"
    load(spec(checkpoint, dtype="bfloat16"))
    assert len(measured) == 3, "another compute dtype is another mode: its own measurement"
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    load(spec(checkpoint))
    assert len(measured) == 4, "another thread count is another machine"
    monkeypatch.undo()


def test_on_cuda_a_kernel_change_is_another_key(monkeypatch):
    """On a GPU a step's cost moves with the kernels: an upgrade of Triton or bitsandbytes, or a change in the
    kernels' source, timed the kernels again (kernel_memory) and kept the tree tuned on the old ones (review)."""
    from tiny import tiny_model

    model = tiny_model()
    monkeypatch.setattr(tree_tuning, "machine_identity", lambda device: {"gpu": "a GPU"})
    kernels = {"version": 1, "machine": {"gpu": "a GPU"}, "triton": "3.6.0", "bitsandbytes": "0.50.2", "kernels": "a"}
    monkeypatch.setattr(tree_tuning, "memory_key", lambda device: dict(kernels))

    def key():
        return tree_tuning.tuning_key(model, None, "nf4", ACCURACY, (1, 2), torch.device("cuda"))

    before = key()
    for field, value in (("triton", "3.7.0"), ("bitsandbytes", "0.51.0"), ("kernels", "b")):
        kernels[field] = value
        assert key() != before, field
    assert "triton" not in tree_tuning.tuning_key(model, None, "fp32", ACCURACY, (1, 2), torch.device("cpu"))


def test_changed_accuracies_measure_again(checkpoint, measured):
    load(spec(checkpoint))
    calibration = checkpoint[1] / CALIBRATION_FILE
    try:
        calibration.write_text(json.dumps({"accuracy": [row[:2] for row in ACCURACY]}))
        load(spec(checkpoint))
        assert len(measured) == 2
    finally:
        calibration.write_text(json.dumps({"accuracy": ACCURACY}))


def test_tree_overrides_the_tuned_choice(checkpoint, measured):
    loaded = load(spec(checkpoint, tree="chain-2"))
    assert measured == [] and loaded.tuned is None
    assert loaded.default_tree == "chain-2" and "set by --tree" in loaded.tree_note
    assert ChatEngine(loaded).trees.default == "chain-2"


def test_where_no_tree_pays_plain_decoding_runs_and_the_page_says_so(checkpoint, measured, monkeypatch):
    # every node costs a whole step: the best 2-node tree expects 1.6 tokens for 2 steps' time
    monkeypatch.setattr(tree_tuning, "measure_step_seconds",
                        lambda model, heads, trees, *args, **kw: {n: 0.01 * n for n in trees})
    slot = ModelSlot(log=lambda line: None)
    slot.start(spec(checkpoint))
    state = slot.wait(120)
    assert state.phase == "ready", state.line
    assert "Medusa gives no speedup on this device" in state.line and "plain decoding runs" in state.line
    engine = slot.engine
    assert engine.trees.default == "baseline" and engine.no_speedup
    assert any(name == "small-8" for _, name in engine.trees.choices), "other trees stay on offer"
    prompt = engine.prompt_ids([{"role": "user", "content": "hello"}], None)
    last = list(engine.answer(Session(), prompt, Settings(max_new_tokens=8), (MEDUSA,)))[-1]
    device_bound = NO_SPEEDUP.format(cause="on this device")
    assert last.stats.label == device_bound and last.stats.tree_size == 1
    from app.model_panel import medusa_pane

    assert medusa_pane(engine)["label"] == device_bound, "the chat pane's title says it too"
    # the user picks a tree with heads anyway: Medusa runs, and the title and the readout say so
    # ...and the title says beforehand what it is expected to give here: every node costs a step's time
    assert medusa_pane(engine, "small-8")["label"].startswith("Medusa · small-8 (9 nodes) expected 0.")
    assert medusa_pane(engine, "small-8")["label"].endswith("on this machine for a typical prompt, slower than plain decoding")
    # a tree larger than any timed: a bound, said as one (a 64-node tree "at most 1.00x" read as breaking even,
    # an 82-node one "at most 1.69x" as better than the tuned tree's 1.57x)
    big = max(map(int, engine.loaded.tuned.step_ms))
    assert medusa_pane(engine, "CARTESIAN-3x3x03")["label"] == (
        "Medusa · cartesian-3x3x3 (40 nodes) expected slower than plain decoding on this machine (under "
        f"{engine.loaded.tuned.speedup_of(resolve_tree('cartesian-3x3x3'))[0]:.2f}x even at the {big}-node tree's cost)")
    # a tree the heads cannot fill (too deep; ranks 0-10 and 20, wider than the heads' top 10), a name that is
    # no tree, a file (read at start only: no file is read for a title): said as it is typed, no estimate
    for typed in ("chain-9", "cartesian-11", "cartesian-21x2", "banana", "/etc/x.json"):
        assert medusa_pane(engine, typed)["label"] == f"Medusa · tree {typed!r} cannot run here (Send says why)"
    assert medusa_pane(engine, "baseline")["label"] == device_bound
    last = list(engine.answer(Session(), prompt, Settings(max_new_tokens=8, tree="small-8"), (MEDUSA,)))[-1]
    assert last.stats.label == "Medusa" and last.stats.tree == "small-8" and last.stats.tree_size > 1


def test_heads_that_are_rarely_right_are_named_as_the_cause_not_the_device(checkpoint, measured, monkeypatch):
    # trees cost nothing more than a plain step, but the heads almost never guess right: no tree pays, and a
    # faster device would not change that (QA: "no speedup on this device" sent users after their hardware)
    monkeypatch.setattr(tree_tuning, "measure_step_seconds", lambda model, heads, trees, *args, **kw: {n: 0.01 for n in trees})
    calibration = checkpoint[1] / CALIBRATION_FILE
    try:
        calibration.write_text(json.dumps({"accuracy": [[0.002] * len(row) for row in ACCURACY]}))
        slot = ModelSlot(log=lambda line: None)
        slot.start(spec(checkpoint))
        state = slot.wait(120)
    finally:
        calibration.write_text(json.dumps({"accuracy": ACCURACY}))
    assert state.phase == "ready", state.line
    assert "Medusa gives no speedup with these heads: they are rarely right" in state.line, state.line
    assert "on this device" not in state.line and "plain decoding runs" in state.line
    engine = slot.engine
    assert engine.trees.default == "baseline"
    prompt = engine.prompt_ids([{"role": "user", "content": "hello"}], None)
    last = list(engine.answer(Session(), prompt, Settings(max_new_tokens=4), (MEDUSA,)))[-1]
    assert last.stats.label == NO_SPEEDUP.format(cause="with these heads")


def test_the_medusa_pane_keeps_its_title_where_a_tree_pays(checkpoint, measured, monkeypatch):
    from app.model_panel import medusa_pane

    # a node costs nothing extra: every tree pays (set here, not measured: no test rests on this CPU's speed)
    monkeypatch.setattr(tree_tuning, "measure_step_seconds",
                        lambda model, heads, trees, *args, **kw: {n: 0.01 for n in trees})
    engine = ChatEngine(load(spec(checkpoint)))
    assert not engine.no_speedup and medusa_pane(engine)["label"] == "Medusa"
    assert medusa_pane(None)["label"] == "Medusa"        # no model loaded
    assert medusa_pane(engine, "chain-2")["label"] == "Medusa · chain-2 (3 nodes) expected 1.84x on this machine for a typical prompt"
    big = max(map(int, engine.loaded.tuned.step_ms))
    assert medusa_pane(engine, "cartesian-3x3x3")["label"] == (
        # 1 + 0.75 + 0.75 x 0.55 + 0.75 x 0.55 x 0.45 tokens per step, each step costing the plain one
        f"Medusa · cartesian-3x3x3 (40 nodes) expected under 2.35x on this machine (2.35x if it cost no more than the "
        f"{big}-node tree timed)")
    # timed beside other programs: the title says so (QA: "expected 0.81x" above a measured "Speedup: 1.34x")
    engine.trees.tuned = dataclasses.replace(engine.trees.tuned, cpu_share=0.4)
    assert medusa_pane(engine, "chain-2")["label"] == ("Medusa · chain-2 (3 nodes) expected 1.84x on this machine for "
                                                       "a typical prompt, from timings taken while other programs used "
                                                       "the CPU")
    # the user picks the plain tree: the pane decodes plainly, and its title and readout say so
    assert medusa_pane(engine, "baseline")["label"] == "Plain decoding"
    prompt = engine.prompt_ids([{"role": "user", "content": "hello"}], None)
    last = list(engine.answer(Session(), prompt, Settings(max_new_tokens=4, tree="baseline"), (MEDUSA,)))[-1]
    assert last.stats.label == "Plain decoding" and last.stats.tree_size == 1


def test_heads_without_accuracies_get_a_preset_and_say_how_to_tune(tmp_path, measured):
    backbone, heads = tiny_checkpoint(tmp_path / "plain", steps=5)
    loaded = load(LoadSpec(model=str(backbone), heads=str(heads), device="cpu"))
    assert measured == [] and loaded.tuned is None
    assert loaded.default_tree == "small-16" and "medusa_core.calibrate" in loaded.tree_note
    from app.model_panel import medusa_pane

    # no estimate without accuracies, but a typed tree's size, which the picker's labels give listed trees only
    engine = ChatEngine(loaded)
    assert all(name != "cartesian-2x2" for _, name in engine.trees.choices)
    assert medusa_pane(engine, "CARTESIAN-2x02")["label"] == "Medusa · cartesian-2x2 (7 nodes)"
    assert medusa_pane(engine, "chain-2")["label"] == "Medusa", "listed: its size is in the picker"


def test_a_broken_calibration_file_is_one_line(checkpoint, measured):
    calibration = checkpoint[1] / CALIBRATION_FILE
    try:
        for text, says in (("{", "not a calibration report"), (json.dumps({"accuracy": [[0.5]]}), "for 1 heads"),
                           (json.dumps({"accuracy": [[0.9, 0.9]] * 5}), "summing to at most 1"),
                           (json.dumps({"accuracy": [[0.5, 0.1]] * 4 + [[0.5]]}), "as many ranks")):
            calibration.write_text(text)
            with pytest.raises(LoadError, match=says) as err:
                load(spec(checkpoint))
            assert "\n" not in str(err.value) and str(calibration) in str(err.value)
    finally:
        calibration.write_text(json.dumps({"accuracy": ACCURACY}))


# ---- the choice itself (pure)

def test_choose_takes_the_best_expected_speedup_and_refuses_a_loss():
    acc = [[0.5, 0.2], [0.3, 0.1]]
    # costs that grow slowly: the biggest tree wins
    chosen, speedup, best, _, _ = tree_tuning.choose(acc, {1: 1.0, 2: 1.0, 3: 1.0, 5: 1.0})
    assert chosen == best == 5 and speedup == pytest.approx(expected_tokens_per_step(grow_tree(acc, 4), acc))
    # a 2-node tree at 1.4x the cost: 1.5 / 1.4 = 1.07x, over MIN_SPEEDUP; 3 nodes at 2x cost lose
    chosen, speedup, *_ = tree_tuning.choose(acc, {1: 1.0, 2: 1.4, 3: 2.0})
    assert chosen == 2 and speedup == pytest.approx(1.5 / 1.4)
    # every tree slower than plain decoding: the baseline, with the best loser reported
    chosen, speedup, best, best_speedup, _ = tree_tuning.choose(acc, {1: 1.0, 2: 1.6, 3: 2.0})
    assert (chosen, speedup, best) == (1, 1.0, 2) and best_speedup < tree_tuning.MIN_SPEEDUP
    # a plain step measured slower than the trees (load noise): no tree costs less than it, so heads that
    # never hit (1.00 tokens a step) expect no speedup (they expected 1.13x, and their tree ran)
    never = [[0.0, 0.0], [0.0, 0.0]]
    chosen, speedup, best, best_speedup, fitted = tree_tuning.choose(never, {1: 1.13, 2: 1.0, 3: 1.0})
    assert (chosen, speedup) == (1, 1.0) and best_speedup == pytest.approx(1.0) and min(fitted.values()) == 1.13


def test_sizes_that_cannot_win_are_not_timed_again():
    lengths = {1: 1.0, 2: 1.5, 4: 1.8, 8: 2.0, 16: 2.1}
    # 8 nodes at 2.2 steps' cost could give at most 2.1 / 2.2 < 1: neither it nor 16 can win
    seconds = {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.2, 16: 3.0}
    assert tree_tuning._worth_timing(seconds, lengths, [1, 2, 4, 8, 16]) == [1, 2, 4]


def test_load_that_comes_and_goes_moves_no_size():
    """On 2 shared cores load slows every step for a few hundred ms at a time, longer than a block
    of one size's steps: the sizes are timed in turn, each step against the plain step of its cycle,
    so a slow phase cancels, even one over half of the cycles, and a spike or a dip in a few steps
    is outvoted. Steps are counted on one clock across all sizes, as wall time runs. Neither each
    size's median step (the phase) nor its fastest (the dip) gives the costs."""
    import itertools

    cost = {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5}
    lengths = {1: 1.0, 2: 1.5, 4: 1.8, 8: 2.0}        # 8 nodes can give at most 2.0 / 2.5: dropped early
    clock, closed = itertools.count(), []

    def load(k: int) -> float:         # 22 cycles: 4 steps each up to step 31, then 3 (size 8 dropped)
        return 1.6 if 30 <= k < 62 else 3.0 if k in (13, 21, 67) else 0.5 if k == 70 else 1.0

    def loop(n):
        try:
            while True:
                yield cost[n] * load(next(clock))
        finally:
            closed.append(n)

    lines, loops = [], {n: loop(n) for n in cost}
    got = tree_tuning.time_in_cycles(loops, lengths, lines.append)
    assert next(clock) == 74, "the clock the loads are placed on"
    assert {n: s / got[1] for n, s in got.items()} == pytest.approx(cost)     # what the choice reads
    assert lines[0].endswith("nodes (warm-up)") and "timing trees of 1, 2, 4 nodes" in lines[-1]
    assert closed == [8], "a size no longer timed lets its loop (its cache) go at once"


def test_a_slow_or_busy_machine_stops_timing_at_the_budget():
    # QA: on a busy machine every start tuned for 5-7 minutes before its first answer (and, measured under load,
    # the choice was not kept)
    cost = {1: 1.0, 2: 1.2, 4: 1.5}
    steps = {n: 0 for n in cost}

    def loop(n):
        while True:
            time.sleep(0.1 * cost[n])          # 6 timed cycles (the least) take 2 s: past the budget
            steps[n] += 1
            yield 0.1 * cost[n]

    lines: list[str] = []
    started = time.perf_counter()
    got = tree_tuning.time_in_cycles({n: loop(n) for n in cost}, {1: 1.0, 2: 1.5, 4: 1.8}, lines.append, budget_s=0.05)
    took = time.perf_counter() - started
    timed = steps[1] - tree_tuning.WARMUP
    assert tree_tuning.PRUNE_AFTER <= timed < tree_tuning.CYCLES, steps
    said = re.fullmatch(f"tuning the tree for this machine: stopped after {timed} of {tree_tuning.CYCLES} steps, "
                        r"(\d+) s \(the CPU is slow or busy\): choosing from them", lines[-1])
    # the seconds the steps took, which may pass the budget (6 steps at least): it said the budget, "45 s", where
    # they had taken 110
    assert said and 1 <= int(said[1]) <= took, (lines[-1], took)
    assert {n: s / got[1] for n, s in got.items()} == pytest.approx(cost, rel=0.5)


def test_a_reply_that_ends_is_decoded_again(checkpoint, monkeypatch):
    """A size's loop keeps giving steps past its reply: cut after RUN_STEPS steps (2 here) or ended
    sooner, the reply is decoded again from the cached prompt, so 7 steps take at least 4 replies."""
    import itertools

    from medusa_core.decoding import generate as generation
    from medusa_core.decoding.generate import new_cache
    from medusa_core.decoding.tree import build_tree_buffers

    loaded = load(spec(checkpoint, tree="chain-2"))
    monkeypatch.setattr(tree_tuning, "RUN_STEPS", 2)
    replies, real = [], generation.generate
    monkeypatch.setattr(generation, "generate", lambda *a, **kw: (replies.append(1), real(*a, **kw))[1])
    tree = build_tree_buffers([[0], [0, 0]], 2)
    ids = loaded.tokenizer("a lighthouse keeper finds a bottle").input_ids
    loop = tree_tuning.step_seconds(loaded.model, loaded.heads, tree, ids, new_cache(loaded.model))
    with torch.inference_mode():
        seconds = list(itertools.islice(loop, 7))
    loop.close()
    assert len(seconds) == 7 and all(s > 0 for s in seconds) and len(replies) >= 4


def test_a_prompt_answered_with_nothing_is_a_load_error(checkpoint, monkeypatch):
    """No step to time is a one-line LoadError naming the fix, which the model slot shows (the
    page never stays on "loading")."""
    from medusa_core.decoding.generate import new_cache
    from medusa_core.decoding.tree import build_tree_buffers

    loaded = load(spec(checkpoint, tree="chain-2"))
    loaded.model.generation_config.eos_token_id = list(range(loaded.model.config.vocab_size))   # every token ends it
    ids = loaded.tokenizer("hello").input_ids
    loop = tree_tuning.step_seconds(loaded.model, loaded.heads, build_tree_buffers([], 0), ids, new_cache(loaded.model))
    with pytest.raises(LoadError, match="no step to time: start with --tree"), torch.inference_mode():
        next(loop)


@needs_avx2
def test_the_key_names_the_kernels_this_cpu_runs():
    """ATEN_CPU_CAPABILITY=avx2 makes torch run its AVX2 kernels (as on a CPU without AVX-512):
    a tree measured under it is another machine's, and the key says so."""
    code = "import json; from medusa_core.loading.this_machine import machine_identity; import torch; " \
           "print(json.dumps(machine_identity(torch.device('cpu'))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **AVX2_ENV}, capture_output=True,
                         text=True, check=True)
    machine = json.loads(out.stdout.strip().splitlines()[-1])
    assert machine["aten_capability"] == "AVX2" and machine["onednn_bf16"] is False
    assert machine["threads"] >= 1 and machine["torch"] == torch.__version__


def test_another_model_picked_in_the_page_gets_its_own_tuned_tree():
    """--tree and --retune were for the model the app started with: a model picked later is not
    forced onto a tree its heads may not fill, nor re-measured at every switch."""
    from app.models import KNOWN_MODELS, spec_for

    base = LoadSpec(device="cpu", tree="chain-2", retune=True)
    for picked in (spec_for(KNOWN_MODELS[1].label, "", "", base), spec_for(None, "some/model", "some/heads", base)):
        assert picked.tree is None and not picked.retune and picked.device == "cpu"


def test_the_page_and_the_console_show_the_tuning_progress(checkpoint, measured):
    import threading

    gate, console = threading.Event(), []

    def tuning(spec, progress):
        progress("tuning the tree for this machine: timing trees of 1, 2 nodes (step 1 of 20)")
        gate.wait(60)
        return load(spec, progress)

    slot = ModelSlot(loader=tuning, log=console.append)
    slot.start(spec(checkpoint))
    try:
        for _ in range(100):
            if "Tuning the tree" in slot.state().line:
                break
            threading.Event().wait(0.05)
        assert slot.state().line.startswith("⏳ Tuning the tree for this machine: timing trees of 1, 2 nodes")
    finally:
        gate.set()
    assert slot.wait(120).phase == "ready"
    assert any(line.startswith("tuning the tree for this machine") for line in console)
    assert any("tree tuned for this machine" in line or "no speedup" in line for line in console)


def test_published_heads_use_the_published_accuracies_until_calibrated(tmp_path):
    from medusa_core.heads.accuracy import PUBLISHED_ACCURACIES, head_accuracy, rank_table

    vicuna = head_accuracy(None, "FasterDecoding/medusa-vicuna-7b-v1.3", 5)
    assert vicuna is not None and vicuna.table == rank_table(PUBLISHED_ACCURACIES) and "published" in vicuna.source
    assert head_accuracy(None, "someone/medusa-vicuna-7b-v1.3-copy", 5) is None     # exact ids only
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"accuracy": ACCURACY}))
    measured = head_accuracy(tmp_path, "FasterDecoding/medusa-vicuna-7b-v1.3", 5)
    assert measured.table == ACCURACY and measured.source.startswith("calibrated"), "a calibration file wins"
