"""The CPU int4 mode's gain, measured once per (model, machine) and remembered (loading/int4_speed.py):
restarts near cpu_int4.MIN_GAIN must not flip between fp32 and int4, whose greedy answers differ."""

from __future__ import annotations

import json

import pytest
from tiny import char_tokenizer, tiny_model

from medusa_core.loading import int4_speed, this_machine, load as load_module
from medusa_core.loading.load import load
from medusa_core.loading.spec import LoadSpec
from medusa_core.quant import cpu_int4

pytestmark = pytest.mark.skipif(not cpu_int4.kernel_available(), reason="this torch has no int4 CPU kernel")


@pytest.fixture
def timings(monkeypatch) -> list[dict]:
    """cpu_int4.measure stood in by figures the test queues (each call takes the next); the list keeps
    what is left, so a test sees how many measurements ran. The CPU is quiet unless a test says not."""
    queued: list[dict] = []
    monkeypatch.setattr(cpu_int4, "measure", lambda model: queued.pop(0))
    monkeypatch.setattr(int4_speed, "with_cpu_share", lambda run: (run(), 1.0))
    monkeypatch.setattr(int4_speed, "cpu_share_now", lambda: 1.0)
    return queued


def near_the_line(*gains: float) -> list[dict]:
    return [{"fp32_ms": round(10.0 * g, 3), "int4_ms": 10.0} for g in gains]


def test_the_first_start_measures_and_later_starts_keep_its_choice(timings, tmp_path):
    model = tiny_model(hidden=64)
    timings.extend(near_the_line(1.05, 1.2))      # what four QA restarts saw on an emulated AVX2 CPU, in short
    first = int4_speed.remembered_speed(model, tmp_path)
    assert round(first.gain, 2) == 1.05 and first.source == int4_speed.FRESH
    assert len(list((tmp_path / int4_speed.FOLDER).glob(f"*/{int4_speed.NAME}"))) == 1
    again = int4_speed.remembered_speed(tiny_model(hidden=64), tmp_path)   # the same model, loaded again
    assert (again.fp32_ms, again.int4_ms) == (first.fp32_ms, first.int4_ms) and again.source == int4_speed.READ
    assert len(timings) == 1, "the second start read the first one's figures instead of measuring"
    applied, line = cpu_int4.use_int4(tiny_model(hidden=64), measured=True, trees=False,
                                      speed=lambda: int4_speed.remembered_speed(model, tmp_path))
    assert not applied and line == ("fp32 matmuls (int4 at 1.05x fp32's matmul speed, under the 1.1x it needs, "
                                    "measured earlier on this machine and kept until --retune)")


def test_the_heads_two_timings_are_kept_with_the_gain_and_decide_at_a_later_start(timings, tmp_path):
    model = tiny_model(hidden=64)
    timings.append({"fp32_ms": 30.0, "int4_ms": 10.0, "head_bf16_ms": 3.0, "head_int4_ms": 1.0})
    first = int4_speed.remembered_speed(model, tmp_path)
    again = int4_speed.remembered_speed(tiny_model(hidden=64), tmp_path)
    assert (again.head_bf16_ms, again.head_int4_ms) == (first.head_bf16_ms, first.head_int4_ms) == (3.0, 1.0)
    assert again.source == int4_speed.READ and not timings


def test_retune_measures_again_and_keeps_the_new_figures(timings, tmp_path):
    model = tiny_model(hidden=64)
    timings.extend(near_the_line(1.05, 1.2))
    int4_speed.remembered_speed(model, tmp_path)
    retuned = int4_speed.remembered_speed(model, tmp_path, retune=True)
    assert round(retuned.gain, 2) == 1.2 and not timings
    assert round(int4_speed.remembered_speed(model, tmp_path).gain, 2) == 1.2


def test_another_machine_or_model_measures_for_itself(timings, tmp_path, monkeypatch):
    timings.extend(near_the_line(1.05, 1.2, 1.3))
    int4_speed.remembered_speed(tiny_model(hidden=64), tmp_path)
    other = int4_speed.remembered_speed(tiny_model(hidden=64, layers=3), tmp_path)
    assert round(other.gain, 2) == 1.2, "another model's config is another key"
    real = int4_speed.machine_identity
    # the same CPU with fewer threads, or run with ATEN_CPU_CAPABILITY=avx2, is another machine's cost
    monkeypatch.setattr(int4_speed, "machine_identity", lambda device: {**real(device), "threads": 1})
    assert round(int4_speed.remembered_speed(tiny_model(hidden=64), tmp_path).gain, 2) == 1.3 and not timings


def busy(share: float):
    return lambda run: (run(), share)


def test_a_busy_cpus_measurement_is_provisional_until_a_quiet_start_and_never_replaces_a_quiet_one(timings, tmp_path,
                                                                                                   monkeypatch):
    # QA on an emulated AVX2 CPU: busy starts measured 0.96-0.99x, quiet ones 1.21x; each start decided anew and the
    # mode changed three times in five starts. Now: one change at most, from a busy first figure to a quiet one
    model = tiny_model(hidden=64)
    timings.extend(near_the_line(0.97, 0.99, 1.21, 0.96, 1.3))
    monkeypatch.setattr(int4_speed, "with_cpu_share", busy(0.53))
    monkeypatch.setattr(int4_speed, "cpu_share_now", lambda: 0.5)
    first = int4_speed.remembered_speed(model, tmp_path)
    assert round(first.gain, 2) == 0.97 and first.source == ("measured while other programs used the CPU, this app "
                                                              "getting 53% of it: kept until a load on a quiet CPU "
                                                              "measures again")
    # busy again: a 0.3 s look at the CPU, and the first figure decides without measuring (QA: measuring on a busy
    # CPU took 40-110 s of each start, to change nothing)
    second = int4_speed.remembered_speed(model, tmp_path)
    assert round(second.gain, 2) == 0.97 and len(timings) == 4
    assert second.source.endswith("; this load found it busy too, this app getting 50% of the CPU")
    # the look saw a quiet CPU, but the measurement was busy: the first figure still decides
    monkeypatch.setattr(int4_speed, "cpu_share_now", lambda: 0.9)
    third = int4_speed.remembered_speed(model, tmp_path)
    assert round(third.gain, 2) == 0.97 and "; this load measured 0.99x while other programs used the CPU, this app " \
        "getting 53% of it" in third.source
    monkeypatch.setattr(int4_speed, "with_cpu_share", busy(0.97))
    quiet = int4_speed.remembered_speed(model, tmp_path)              # the one change of mode
    assert round(quiet.gain, 2) == 1.21 and quiet.source == int4_speed.FRESH
    monkeypatch.setattr(int4_speed, "with_cpu_share", busy(0.5))
    assert int4_speed.remembered_speed(model, tmp_path).source == int4_speed.READ and len(timings) == 2, \
        "a quiet figure is read, not measured again, whatever the CPU's load now"
    retuned = int4_speed.remembered_speed(model, tmp_path, retune=True)
    assert round(retuned.gain, 2) == 1.21 and "this --retune measured 0.96x while other programs used the CPU" \
        in retuned.source and retuned.source.endswith("and did not keep it")
    monkeypatch.setattr(int4_speed, "with_cpu_share", busy(1.0))
    assert round(int4_speed.remembered_speed(model, tmp_path, retune=True).gain, 2) == 1.3 and not timings


def test_a_load_beside_an_answer_of_the_model_it_replaces_blames_that_answer_not_other_programs(timings, tmp_path,
                                                                                                monkeypatch):
    # QA: a Load while this tab still answered said "while other programs used the CPU" with nothing else running
    from medusa_core.quant.kernel_timing import beside

    model = tiny_model(hidden=64)
    timings.extend(near_the_line(0.97, 0.99))
    monkeypatch.setattr(int4_speed, "with_cpu_share", busy(0.6))
    monkeypatch.setattr(int4_speed, "cpu_share_now", lambda: 0.6)
    with beside(lambda: (True, 1)):          # the replaced model's answer runs all along
        first = int4_speed.remembered_speed(model, tmp_path)
        second = int4_speed.remembered_speed(model, tmp_path)
    assert first.source == ("measured while an answer on the model this load replaces still ran: kept until a load "
                            "on a quiet CPU measures again")
    assert second.source == ("measured at an earlier load on a busy CPU and kept until a load on a quiet CPU measures "
                             "again; this load found it busy too, with an answer still running here")
    monkeypatch.setattr(int4_speed, "cpu_share_now", lambda: 0.9)   # the look quiet, the measurement not
    third = int4_speed.remembered_speed(model, tmp_path)             # and no answer beside it: other programs it is
    assert third.source.endswith("this load measured 0.99x while other programs used the CPU, this app getting 60% "
                                 "of it")


def test_the_look_at_the_cpu_gives_a_share_of_its_threads_time():
    # here, whatever else runs: a share of the threads' time, never more than all of it
    assert 0 < this_machine.cpu_share_now(0.1) <= 1.05


@pytest.mark.parametrize("damage", ["cut short", "not an object", "zero times", "no share"])
def test_a_damaged_entry_is_measured_again(timings, tmp_path, damage):
    model = tiny_model(hidden=64)
    timings.extend(near_the_line(1.05, 1.2))
    int4_speed.remembered_speed(model, tmp_path)
    entry = next((tmp_path / int4_speed.FOLDER).glob(f"*/{int4_speed.NAME}"))
    saved = json.loads(entry.read_text())
    entry.write_text({"cut short": entry.read_text()[:40], "not an object": "[1, 2]",
                      "zero times": json.dumps({**saved, "fp32_ms": 0, "int4_ms": 0}),
                      "no share": json.dumps({k: v for k, v in saved.items() if k != "cpu_share"})}[damage])
    assert round(int4_speed.remembered_speed(model, tmp_path).gain, 2) == 1.2 and not timings


@pytest.fixture
def int4_backbone(tmp_path, monkeypatch):
    """A tiny checkpoint that quant auto treats as the CPU default (int4 chosen by measurement), in a
    fresh cache directory."""
    folder = tmp_path / "backbone"
    tiny_model(vocab=len(char_tokenizer()), hidden=64).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(load_module, "resolve_quant", lambda quant, device, **kw: "int4" if quant == "auto" else quant)
    # no fidelity check: a random model's near-uniform logits agree with int4's on one CPU's rounding and not on
    # another's, and what is tested here is the speed alone
    monkeypatch.setattr(load_module, "fidelity_reference", lambda tokenizer: ())
    # nor this CPU's row invariance, which would send the load to fp32 before the speed is read (test audit)
    monkeypatch.setattr(cpu_int4, "exact_probe", lambda model: (None, cpu_int4.HEAD_ROWS_PER_CALL[0]))
    return folder


def test_a_restart_loads_with_the_first_starts_measurement(timings, int4_backbone, tmp_path):
    timings.extend(near_the_line(1.05, 1.5))
    first = load(LoadSpec(model=str(int4_backbone), device="cpu"))
    again = load(LoadSpec(model=str(int4_backbone), device="cpu"))
    assert len(timings) == 1 and first.description.replace(int4_speed.FRESH, int4_speed.READ) == again.description
    assert "fp32 matmuls (int4 at 1.05x" in again.description and int4_speed.READ in again.description
    retuned = load(LoadSpec(model=str(int4_backbone), device="cpu", retune=True))
    assert not timings and "row-exact attention: 1.50x fp32's matmul speed, " + int4_speed.FRESH in retuned.description


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_cache_that_cannot_be_written_loads_with_what_was_measured_and_names_the_path_whatever_the_cpus_load(
        timings, int4_backbone, tmp_path, monkeypatch, share):
    # QA: the cache folder was named where the failing path was a file inside it; a busy start, which wrote
    # nothing, loaded where a quiet one failed; then the load failed after measuring, where an unwritable cache
    # of kernel timings or of the tuned tree only says they were not kept
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / int4_speed.FOLDER).write_text("a file where the folder goes")
    monkeypatch.setattr(int4_speed, "with_cpu_share", busy(share))
    timings.extend(near_the_line(1.5, 1.05))
    first = load(LoadSpec(model=str(int4_backbone), device="cpu"))
    assert "row-exact attention: 1.50x fp32's matmul speed, measured " in first.description
    assert (f"not kept: could not write the measured speed: {cache / int4_speed.FOLDER} is a file, not a folder: move "
            "it away, or set MEDUSA_CHAT_CACHE to a writable directory") in first.description
    assert ("while other programs used the CPU" in first.description) == (share < 1.0)
    again = load(LoadSpec(model=str(int4_backbone), device="cpu"))     # nothing was kept: measured again
    assert not timings and "fp32 matmuls (int4 at 1.05x" in again.description


def test_the_load_says_when_it_checks_and_times_the_4bit_weights(timings, int4_backbone):
    # QA: a first start's status line kept saying it converted the model while it checked int4 against fp32; a
    # review: every start said it timed them, where later starts read the timing from the cache
    timings.extend(near_the_line(1.5))
    lines: list[str] = []
    load(LoadSpec(model=str(int4_backbone), device="cpu"), progress=lines.append)
    assert lines[:2] == ["checking the 4-bit weights against fp32",
                         "timing the 4-bit weights against fp32 on this CPU"], lines
    lines.clear()
    load(LoadSpec(model=str(int4_backbone), device="cpu"), progress=lines.append)
    assert not timings and lines[0] == "checking the 4-bit weights against fp32" and not any("timing" in line
                                                                                              for line in lines), lines
