"""The GPU's kernel timings remembered across starts (loading/kernel_memory.py), run here with the GPU stood
in: a device that says "cuda", and each tuner's timing replaced by a counter. A second start on the same GPU
routes as the first did without timing anything; --retune, another GPU, another Triton or a changed kernel
times again; a damaged file is timed again and rewritten; a tuner that failed is not remembered; an
unwritable cache is said in the load line, naming the folder and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="the NF4 tuners and the Triton norm need Triton: pip install triton")
from tiny import tiny_model  # noqa: E402

from medusa_core.loading import kernel_memory  # noqa: E402
from medusa_core.loading.load import route_kernels  # noqa: E402
from medusa_core.loading.spec import LoadSpec  # noqa: E402
from medusa_core.quant import bnb as qb  # noqa: E402
from medusa_core.quant import nf4_matmul as nm  # noqa: E402
from medusa_core.quant import nf4_repacked_configs as rc  # noqa: E402
from medusa_core.quant import nf4_repacked_matmul as rm  # noqa: E402
from medusa_core.quant import norm_routing as nr  # noqa: E402
from medusa_core.quant.kernel_timing import NoConfigCompiled  # noqa: E402

GPU = torch.device("cuda")


class StandInGpu:
    """A GPU named ``name`` whose tuners time nothing: each measurement is counted in ``timed`` and gives
    a config (and µs) that depends on the shape, so a wrong entry read back would show."""

    def __init__(self, monkeypatch, name: str = "Stand-in H100"):
        self.timed: list[str] = []
        self.failing: set[str] = set()
        self.monkeypatch = monkeypatch
        self.use(name)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None: SimpleNamespace(multi_processor_count=132, L2_cache_size=50 << 20))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

        def repacked(m, n, k, dtype, device, group, key):
            self.timed.append(f"repacked {n}x{k} m{m}")
            if "repacked" in self.failing:
                raise NoConfigCompiled(f"no repacked NF4 config compiled for {n}x{k} on {key[0]}")
            best = rc.RepackedConfig(m > 4, rc.row_class(m), 32 if n > k else 64, 2, serial=m == 1)
            return best, [(best.describe(), 20.0 + m), ("gemv m16 n16 split4 w8", None)]

        def triton(m, n, k, dtype, device, blocksize, wide, key):
            self.timed.append(f"triton {n}x{k} m{m}")
            best = nm.KernelConfig(nm.row_class(m), 128, 4, 4, 1, sub=1, slots=2)
            return best, [(best.describe(), 30.0 + m)]

        def norms(modules, dtype, device):
            self.timed.append(f"norms x{len(modules)}")
            return 13.0 * len(modules), 3.0 * len(modules)

        monkeypatch.setattr(rm, "_time_candidates", repacked)
        monkeypatch.setattr(nm, "_time_candidates", triton)
        monkeypatch.setattr(qb, "_time_layer", lambda layer, dtype, rows, kernel: self.timed.append(kernel) or 24.0)
        monkeypatch.setattr(nr, "_timed_sums", norms)
        monkeypatch.setattr(nr, "_device_of", lambda modules: GPU)

    def use(self, name: str) -> None:
        """Another GPU in the same slot (what the cache key reads of it)."""
        self.monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        self.monkeypatch.setattr(kernel_memory, "machine_identity", lambda device: {
            "gpu": name, "capability": "9.0", "memory": 85 << 30, "cuda": "13.0", "torch": torch.__version__})


def start(root: Path, retune: bool = False, monkeypatch=None, new_process: bool = True,
          blocksize: int = 64) -> tuple[kernel_memory.KernelTimings, list]:
    """One load's routing: what the app's load asks the tuners (some twice, as the routings do) and the norm
    routing; ``new_process``: with the in-process caches empty (a new start), else as a second load in the
    same process. Returns the timings and everything the routing decided."""
    if new_process:
        for module in (rm, nm):
            monkeypatch.setattr(module, "_TUNED", {})
            monkeypatch.setattr(module, "TUNING_LOG", {})
        monkeypatch.setattr(qb, "_TIMED", {})
    layer = SimpleNamespace(weight=SimpleNamespace(device=GPU, quant_state=SimpleNamespace(shape=(11008, 4096),
                                                                                           blocksize=blocksize)))
    timings = kernel_memory.recall(GPU, root, retune)
    model = tiny_model()
    with timings.routing():
        decided = [rm.tuned_us(m, 11008, 4096, torch.bfloat16, GPU) for m in (1, 16, 1)]
        decided += [rm.tune_shape(m, 11008, 4096, torch.bfloat16, GPU) for m in (1, 16)]
        decided += [nm.tune_shape(16, 11008, 4096, torch.bfloat16, GPU), qb._timed_us(layer, torch.bfloat16, 1, "bnb"),
                    qb._timed_us(layer, torch.bfloat16, 1, "bnb"), nr.use_norm_kernel(model, "auto")]
    timings.save()
    return timings, decided + [dict(rm.TUNING_LOG), dict(nm.TUNING_LOG)]


def test_a_second_start_on_the_same_gpu_routes_as_the_first_without_timing(monkeypatch, tmp_path):
    gpu = StandInGpu(monkeypatch)
    first, decided = start(tmp_path, monkeypatch=monkeypatch)
    assert len(gpu.timed) == 5 and len(first.memory.measured) == 5 and not first.memory.read   # each once
    assert first.note.startswith("kernel timings: 5 measured now in ") and \
        first.note.endswith(" s, kept for this Stand-in H100 (sm_90) until --retune")
    assert decided[-3].startswith("norms: one Triton kernel for each of 5 RMSNorms (auto measured 15 µs against 65")

    gpu.timed.clear()
    second, again = start(tmp_path, monkeypatch=monkeypatch)
    assert gpu.timed == []                       # nothing timed: the configs, the µs and the logs came from disk
    assert again == decided
    assert len(second.memory.read) == 5 and second.note == (
        "kernel timings: 5 read from those kept for this Stand-in H100 (sm_90), --retune measures them again")


def test_a_second_load_in_one_process_says_what_it_used_and_retune_reaches_the_in_process_caches(monkeypatch, tmp_path):
    """QA: a second load in the same process took its NF4 timings from the tuners' own caches without counting
    them, and --retune there timed only the norms."""
    gpu = StandInGpu(monkeypatch)
    start(tmp_path, monkeypatch=monkeypatch)
    gpu.timed.clear()
    again, _ = start(tmp_path, monkeypatch=monkeypatch, new_process=False)
    assert gpu.timed == [] and len(again.memory.read) == 5, again.note
    retuned, _ = start(tmp_path, retune=True, monkeypatch=monkeypatch, new_process=False)
    assert len(gpu.timed) == 5 and len(retuned.memory.measured) == 5 and not retuned.memory.read


def test_retune_another_gpu_another_triton_or_a_changed_kernel_times_again(monkeypatch, tmp_path):
    gpu = StandInGpu(monkeypatch)
    start(tmp_path, monkeypatch=monkeypatch)
    gpu.timed.clear()
    timings, _ = start(tmp_path, retune=True, monkeypatch=monkeypatch)
    assert len(gpu.timed) == 5 and not timings.memory.read

    gpu.use("Stand-in RTX 4090")
    gpu.timed.clear()
    start(tmp_path, monkeypatch=monkeypatch)
    assert len(gpu.timed) == 5
    gpu.use("Stand-in H100")                     # both GPUs' timings are kept, each under its own key
    gpu.timed.clear()
    start(tmp_path, monkeypatch=monkeypatch)
    assert gpu.timed == []

    real_version = kernel_memory._version
    monkeypatch.setattr(kernel_memory, "_version", lambda package: "9.9" if package == "triton" else real_version(package))
    start(tmp_path, monkeypatch=monkeypatch)
    assert len(gpu.timed) == 5

    # a kernel's source changed (here: another folder of modules): its digest is part of the key
    sources = tmp_path / "quant"
    sources.mkdir()
    (sources / "nf4_repacked_matmul.py").write_text("BLOCK = 64\n")
    before = kernel_memory.sources_digest(sources)
    (sources / "nf4_repacked_matmul.py").write_text("BLOCK = 128\n")
    assert kernel_memory.sources_digest(sources) != before
    assert kernel_memory.sources_digest() == kernel_memory.memory_key(GPU)["kernels"]


def test_a_layer_of_another_blocksize_is_timed_for_itself(monkeypatch, tmp_path):
    # QA: the in-process cache left the blocksize out, so a same-shape layer of another blocksize got the first's µs
    gpu = StandInGpu(monkeypatch)
    start(tmp_path, monkeypatch=monkeypatch)
    gpu.timed.clear()
    start(tmp_path, monkeypatch=monkeypatch, new_process=False, blocksize=128)
    assert gpu.timed == ["bnb"]


def test_an_unreadable_file_is_timed_again_and_a_cache_it_cannot_write_is_said_not_failed(monkeypatch, tmp_path):
    """QA: a timings file this user could not read failed every load with a traceback blaming the model's files;
    a cache it could not write failed the load after the routing was done."""
    gpu = StandInGpu(monkeypatch)
    first, decided = start(tmp_path, monkeypatch=monkeypatch)
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **kw: (_ for _ in ()).throw(PermissionError(13, "denied"))
                        if self == first.entry else real_read(self, *a, **kw))
    gpu.timed.clear()
    assert start(tmp_path, monkeypatch=monkeypatch)[1] == decided and len(gpu.timed) == 5
    monkeypatch.undo()

    gpu = StandInGpu(monkeypatch)
    first.entry.unlink()
    first.entry.mkdir()                                             # a folder where the file goes
    timings, again = start(tmp_path, monkeypatch=monkeypatch)
    assert again == decided and len(gpu.timed) == 5
    # the folder in the way named, and moving it away as the first fix (QA: only the cache variable was offered)
    assert timings.note.endswith(f", not kept: could not write them: {first.entry} is a folder, not a file: move it "
                                 "away, or set MEDUSA_CHAT_CACHE to a writable directory"), timings.note
    assert sorted(p.name for p in first.entry.parent.iterdir()) == ["timings.json"]   # no partial copy left

    first.entry.rmdir()                                             # a full disk
    real_write = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, *a, **kw: (_ for _ in ()).throw(OSError(28, "No space left"))
                        if self.name.startswith(".timings.json") else real_write(self, *a, **kw))
    timings, _ = start(tmp_path, monkeypatch=monkeypatch)
    assert timings.note.endswith(f", not kept: could not write them into {first.entry.parent} (No space left): set "
                                 "MEDUSA_CHAT_CACHE to a writable directory"), timings.note
    assert list(first.entry.parent.iterdir()) == []


def test_timings_measured_beside_a_running_answer_route_this_load_only(monkeypatch, tmp_path):
    """QA: a Load beside an answer still running on the GPU (the app's ModelSlot passes its old engine's queue as
    the probe) would have kept skewed timings until --retune."""
    from medusa_core.quant.kernel_timing import beside

    gpu = StandInGpu(monkeypatch)
    # (an answer running, answers ever started), read before and after each measurement
    for seen in ([(False, 0)] * 5 + [(True, 1)],     # an answer starts during the third measurement
                 [(False, 0)] * 3 + [(False, 1)]):   # one starts and ends inside the second (QA: it was missed)
        answering = iter(seen)
        with beside(lambda: next(answering, seen[-1])):
            timings, decided = start(tmp_path, monkeypatch=monkeypatch)
        assert timings.note.endswith(" s, used for this load only: measured while an answer ran on this GPU"), \
            timings.note
        assert not timings.entry.exists()
    gpu.timed.clear()
    again, _ = start(tmp_path, monkeypatch=monkeypatch)           # a quiet load measures again, and keeps them
    assert len(gpu.timed) == 5 and again.entry.exists() and again.note.endswith("until --retune")


def test_a_damaged_file_is_timed_again_and_written_whole(monkeypatch, tmp_path):
    gpu = StandInGpu(monkeypatch)
    first, decided = start(tmp_path, monkeypatch=monkeypatch)
    first.entry.write_text(first.entry.read_text()[:100])          # an interrupted write
    gpu.timed.clear()
    assert start(tmp_path, monkeypatch=monkeypatch)[1] == decided and len(gpu.timed) == 5
    assert len(json.loads(first.entry.read_text())["entries"]) == 5

    saved = json.loads(first.entry.read_text())                     # one entry an older tuner wrote differently
    name = next(n for n in saved["entries"] if n.startswith("repacked "))
    saved["entries"][name] = {"block": 64}
    first.entry.write_text(json.dumps(saved))
    gpu.timed.clear()
    assert start(tmp_path, monkeypatch=monkeypatch)[1] == decided and gpu.timed == ["repacked 11008x4096 m1"]


def test_a_tuner_that_failed_is_tried_again_at_the_next_start(monkeypatch, tmp_path):
    gpu = StandInGpu(monkeypatch)
    gpu.failing.add("repacked")
    with pytest.raises(NoConfigCompiled):
        start(tmp_path, monkeypatch=monkeypatch)
    gpu.failing.clear()
    gpu.timed.clear()
    start(tmp_path, monkeypatch=monkeypatch)
    assert "repacked 11008x4096 m1" in gpu.timed


def test_outside_a_load_every_tuning_times_afresh(monkeypatch):
    """The benchmarks time every run: no memory is read or written outside ``routing()``."""
    gpu = StandInGpu(monkeypatch)
    for _ in range(2):
        monkeypatch.setattr(rm, "_TUNED", {})
        rm.tune_shape(16, 4096, 4096, torch.bfloat16, GPU)
    assert gpu.timed == ["repacked 4096x4096 m16"] * 2


def test_the_load_line_says_what_was_timed_and_what_could_not_be_kept(monkeypatch, tmp_path):
    StandInGpu(monkeypatch)
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    spec = LoadSpec(device="cuda", norm_kernel="auto")
    said = []
    text = route_kernels(tiny_model(), spec, "none", "cuda", said.append)
    assert said == ["timing the kernels on this GPU (once: later starts read what this measures)"]   # the page's line
    assert text.startswith("; norms: one Triton kernel for each of 5 RMSNorms (auto measured") and \
        "; kernel timings: 1 measured now in " in text, text
    assert route_kernels(tiny_model(), spec, "none", "cuda", said.append).endswith(
        "; kernel timings: 1 read from those kept for this Stand-in H100 (sm_90), --retune measures them again")
    assert route_kernels(tiny_model(), LoadSpec(device="cuda", norm_kernel="torch"), "none", "cuda") == \
        "; norms: transformers' own"                                # nothing timed: nothing said about timings
    assert len(said) == 1, said                                     # a start that reads its timings is quick

    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(blocker))
    assert route_kernels(tiny_model(), spec, "none", "cuda").endswith(
        f", not kept: could not write them: {blocker} is a file, not a folder: move it away, or set MEDUSA_CHAT_CACHE "
        "to a writable directory")


def test_exact_modes_config_is_the_fastest_of_those_checked_row_exact_on_the_gpu(monkeypatch, tmp_path):
    # nf4_repacked_matmul.tune_exact with the GPU stood in: a candidate whose multi-row calls give a row other bits
    # than the row alone is skipped, however fast; the fastest of the rest over a 1-row and a 16-row call is kept,
    # remembered across starts, and is what exact mode's calls then run
    StandInGpu(monkeypatch)
    n, k = 64, 256
    weight = torch.randn(n, k)
    monkeypatch.setattr(rm, "tuning_weight", lambda n, k, dtype, device, group: (weight, [weight], None))
    monkeypatch.setattr(torch, "randn", lambda *shape, **kw: torch.ones(*shape[:2]) * torch.arange(1, shape[0] + 1)[:, None])
    candidates = rc.exact_candidates(n, k // 128, 132)
    first, drifting, fastest = candidates[0], candidates[2], candidates[3]

    def matmul(x, w, config):       # rows alone, as exact mode must; one candidate drifts with the row count
        out = torch.stack([w @ row for row in x])
        return out + (1e-3 if config == drifting and x.shape[0] > 1 else 0.0)

    speed = {first: 40.0, drifting: 5.0, fastest: 20.0}
    monkeypatch.setattr(rm, "repacked_matmul", matmul)
    monkeypatch.setattr(rm, "graph_time_us", lambda calls, replays: speed.get(calls[0].keywords["config"], 30.0))
    monkeypatch.setattr(rm, "_EXACT", {})
    timings = kernel_memory.recall(GPU, tmp_path)
    with timings.routing():
        chosen = rm.exact_tuned(n, k, torch.bfloat16, GPU)
    timings.save()
    assert chosen == fastest
    log = dict(rm.TUNING_LOG[rm._exact_key(n, k, torch.bfloat16, GPU, 128)])
    assert log[drifting.describe()] is None and log[fastest.describe()] == 40.0    # skipped; 20 µs at 1 and at 16 rows
    from medusa_core.benchmarks.nf4_kernel import tuned_lines, tuning_log

    assert f"repacked {k}->{n} exact, every M: {fastest.describe()} 40.0 µs for a 1-row and a 16-row call (1 of " \
        f"{len(candidates)} not row-exact or failed)" in tuned_lines(tuning_log())
    assert rm.choose_config(16, SimpleNamespace(n=n, k=k, group=128, blocksize=64, arrivals=None), torch.bfloat16, GPU,
                            exact=True) == fastest
    monkeypatch.setattr(rm, "_EXACT", {})           # a new start reads it instead of timing
    monkeypatch.setattr(rm, "repacked_matmul", lambda *a, **kw: pytest.fail("timed again"))
    again = kernel_memory.recall(GPU, tmp_path)
    with again.routing():
        assert rm.exact_tuned(n, k, torch.bfloat16, GPU) == fastest
    assert again.note.startswith("kernel timings: 1 read from those kept")
