"""The step's Triton kernels launched as programmatic dependents (quant/triton_runtime.py set_dependent_launch),
compiled for an H100 (sm_90) on this GPU-less machine and read back; on a Hopper GPU, the bits they decode.

What a dependent launch must never do: read or write, before its wait, anything the kernel before it could have
written. Each kernel's SASS is read for where its wait (ACQBULK) stands: before every global load and store, except
the NF4 matmul's loads of its table and first weights (which no kernel writes), and never a store before it."""

import contextlib
import re
from pathlib import Path

import pytest
import torch

from medusa_core.benchmarks import kernel_sass as ks
from medusa_core.quant import nf4_repacked_configs as rc
from medusa_core.quant import triton_runtime as tr

TRIGGER, WAIT = "PREEXIT", "ACQBULK"      # griddepcontrol.launch_dependents and .wait, as sm_90's SASS names them
MEMORY = re.compile(r"^(LDG|STG|ATOM|RED|LDGSTS)\b")


@pytest.fixture(autouse=True)
def _fp_fusion(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")     # the launch passes it explicitly; silences a warning


@contextlib.contextmanager
def dependent(on: bool):
    tr.set_dependent_launch(on)
    try:
        yield
    finally:
        tr.set_dependent_launch(False)


def sass(make_launch, on: bool, tmp_path: Path) -> list[str]:
    """The SASS opcodes (predicates dropped) of the launch ``make_launch()`` builds, dependent launch ``on``."""
    with dependent(on):
        launch = make_launch()
    assert launch.meta.get("PDL", False) == on and launch.meta.get("launch_pdl", False) == on, launch.meta
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(ks.compile_launch(launch, 90).asm["cubin"])
    return [ks.opcode(ins) for ins in ks.disassemble(cubin) if not ins.endswith(":")]


def memory_before_wait(ops: list[str]) -> list[str]:
    return [op for op in ops[:ops.index(WAIT)] if MEMORY.match(op)]


GEMV = rc.RepackedConfig(False, 1, 64, 4, prefetch=1)
LAUNCHES = {
    "gemv, one group ahead in registers": lambda: ks.repacked_launch(4096, 11008, 1, GEMV),
    "gemv, pipelined with x ahead, serial sum": lambda: ks.repacked_launch(
        4096, 11008, 1, rc.RepackedConfig(False, 1, 64, 4, prefetch=2, x_ahead=True, serial=True)),
    "16-row scaled tile": lambda: ks.repacked_launch(
        4096, 11008, 16, rc.RepackedConfig(True, 16, 64, 2, num_stages=3, plane_lookup=True, decode="scaled")),
    "norm": lambda: ks.norm_launch(4096, rows=1),
    "rotary": lambda: ks.rotary_launch(32, 32, 128, tokens=1),
    "cache write": lambda: ks.cache_write_launch(32, 128, tokens=1),
    "split attention": lambda: ks.split_attention_launch(32, 32, 128, rows=16, serial=True),
}


@pytest.mark.parametrize("name", LAUNCHES)
def test_a_dependent_kernel_lets_the_next_start_and_stores_nothing_before_its_wait(name, tmp_path):
    ops = sass(LAUNCHES[name], True, tmp_path)
    assert ops.count(TRIGGER) == 1 and ops.count(WAIT) == 1, name
    assert ops.index(TRIGGER) < ops.index(WAIT)
    early = memory_before_wait(ops)
    assert not [op for op in early if not op.startswith("LDG")], early          # no store, atomic or async copy
    if not name.startswith(("gemv", "16-row")):       # these read nothing before the wait
        assert not early, (name, early)


def test_the_one_row_matmul_loads_its_first_weights_while_the_kernel_before_it_runs(tmp_path):
    # the 16-byte words of its first group, and its scales, leave before the wait: only x waits for it. Exactly the
    # words' loads: 64 rows x 16 words a group over 128 threads, 8 words each, two 16-byte loads (a load of x moved
    # above the wait would add to them)
    early = memory_before_wait(sass(LAUNCHES["gemv, one group ahead in registers"], True, tmp_path))
    words = GEMV.block_n * 16 // (32 * GEMV.num_warps) // 4
    assert early.count("LDG.E.128") == words == 2 and set(early) <= {"LDG.E", "LDG.E.128"}, early


@pytest.mark.parametrize("name", ["gemv, pipelined with x ahead, serial sum", "16-row scaled tile"])
def test_a_pipelined_matmul_fetches_its_first_weights_into_l2_while_the_kernel_before_it_runs(name, tmp_path):
    # its loads are the pipeliner's, after the wait: the first two groups' words and scales are prefetched into L2
    # (CCTL.E.PF2, PTX prefetch.global.L2) before it, and nothing is loaded into registers but the table
    ops = sass(LAUNCHES[name], True, tmp_path)
    before = ops[:ops.index(WAIT)]
    assert before.count("CCTL.E.PF2") >= 4, before
    assert all(op == "LDG.E" for op in memory_before_wait(ops)), memory_before_wait(ops)


@pytest.mark.parametrize("name", ["gemv, one group ahead in registers", "norm", "split attention"])
def test_off_by_default_the_kernels_compile_without_either(name, tmp_path):
    ops = sass(LAUNCHES[name], False, tmp_path)
    assert TRIGGER not in ops and WAIT not in ops


def test_the_interpreter_never_gets_it_and_a_cpu_or_older_gpu_is_refused():
    with dependent(True):
        assert tr.dependent_launch(interpret=True) == {}
        assert tr.dependent_launch(interpret=False) == {"PDL": True, "launch_pdl": True}
    assert tr.dependent_launch(interpret=False) == {}
    with pytest.raises(ValueError, match=r"^dependent launch is a CUDA launch \(sm_90 and later\) and the device is "
                                         r"cpu: leave it off there$"):
        tr.set_dependent_launch(True, torch.device("cpu"))
    assert tr.dependent_launch(interpret=False) == {}


def test_the_benchmark_refuses_it_off_a_gpu_before_building_anything(capsys):
    from medusa_core.bench_synthetic import main

    assert main(["--device", "cpu", "--dependent-launch", "off", "on"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: --dependent-launch on: dependent launch is a CUDA launch (sm_90 and later) and the device "
                   "is cpu: leave it off there"), err


hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not hopper, reason="needs an sm_90 (Hopper) or later CUDA GPU")
def test_a_captured_bf16_step_launched_as_dependents_decodes_the_tokens_it_decodes_launched_alone():
    # every kernel of the routed step (NF4 matmul, norms, rotary, cache write, split attention) in the same order
    # with the same arithmetic: the same bits, so the same tokens, where a read before a wait would race
    from tiny import tree_decoding

    from medusa_core.quant.attention_routing import use_attention, use_rotary
    from medusa_core.quant.bnb import quantize_linear_nf4_, use_nf4_kernel
    from medusa_core.quant.norm_routing import use_norm_kernel

    model, decode = tree_decoding("cuda", torch.bfloat16, max_new_tokens=48, graphs=True)
    quantize_linear_nf4_(model, torch.bfloat16)
    use_nf4_kernel(model, "repacked")
    use_norm_kernel(model, "triton")
    use_rotary(model, "triton")
    assert use_attention(model, "split").startswith("attention: split over the keys")
    alone = decode()
    tr.set_dependent_launch(True, torch.device("cuda"))
    try:
        dependents = [decode() for _ in range(3)]
    finally:
        tr.set_dependent_launch(False)
    assert all(d == alone for d in dependents) and len(alone) == 48, (alone, dependents)
