"""The machine a measurement was made on, and what is remembered of it.

Choices made by timing (the tree, the CPU's int4 mode) hold for the machine that timed them only:
another CPU, another ISA that torch dispatches to, another thread count or another torch changes the
costs. Each is remembered in the user's cache under a key that names this machine (``machine_identity``)
and everything else it depends on, and measured again where the key differs. A measurement made while
other programs used the CPU (``with_cpu_share`` under BUSY_SHARE) is not trusted as one made on a quiet
CPU: a tree measured so is used for that start only, int4's gain is kept as provisional (int4_speed.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

# ISA flags that change which kernels torch and oneDNN run (/proc/cpuinfo names)
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
# A CPU tuning during which this process got less than this share of its threads' CPU time was
# measured against other programs (a build, tests, a video call): its choice is used for this start
# only. The CPU default on 2 cores: quiet 0.99 and 1.00 (plain step 18-21 ms, 2 nodes at 1.23x, 5-6 s);
# beside a test run 0.54 (plain step 63 ms, "no speedup" chosen and, before this, remembered).
BUSY_SHARE = 0.75


def machine_identity(device: torch.device) -> dict:
    """The hardware and software a step's cost depends on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "memory": props.total_memory,
                "cuda": torch.version.cuda, "torch": torch.__version__}
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {"cpu": name, "isa": sorted(f for f in CPU_FLAGS if f in flags), "threads": torch.get_num_threads(),
            # what torch and oneDNN dispatch to (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA lower these)
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), "torch": torch.__version__}


def machine_line(machine: dict) -> str:
    if "gpu" in machine:
        return f"{machine['gpu']} (sm_{machine['capability'].replace('.', '')})"
    return f"{machine['cpu']}, {machine['aten_capability']}, {machine['threads']} threads"


def file_stamp(path: Path) -> list:
    """Identity of the files under ``path`` (name, size, mtime): a changed file changes the key."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def with_cpu_share(run: Callable[[], T]) -> tuple[T, float]:
    """``run()``'s result and the share of the CPU time its threads could use that this process got
    meanwhile: CPU seconds over wall seconds times usable CPUs (other programs' work lowers it)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return result, cpu / (wall * usable_cpus(torch.get_num_threads())) if wall > 0 else 1.0


def cpu_share_now(seconds: float = 0.3) -> float:
    """``with_cpu_share`` of ``seconds`` of matmuls on all of torch's threads: a quick look at whether other programs
    use the CPU now, before a measurement they would skew (2 cores: 1.0 quiet, 0.5 beside two busy loops)."""
    a = torch.randn(512, 512)      # large enough that torch's matmul takes every thread

    def work() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a

    return with_cpu_share(work)[1]


def usable_cpus(threads: int) -> float:
    """``threads``, or fewer where a cgroup quota (a container's --cpus) grants less CPU time: there
    torch still starts a thread per core, and the share must not blame other programs for the quota."""
    quota = cgroup_cpus()
    return min(threads, quota) if quota else threads


def cgroup_cpus() -> float | None:
    """The CPUs this process's cgroup quota grants (v2 cpu.max, v1 cfs quota / period); None: no quota."""
    try:
        try:
            quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        except FileNotFoundError:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        return float(quota) / float(period) if float(period) > 0 else None
    except (OSError, ValueError):
        return None       # no cgroup files (not Linux, or hidden): no quota to account for


def entry_path(key: dict, root: Path, folder: str, name: str) -> Path:
    """One folder per key under ``root/folder``: the file ``name`` in it holds the key and what was measured."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / folder / digest / name


def write_atomic(path: Path, text: str) -> None:
    """Two apps starting at once never read half a file: each writes its own copy and renames it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError as err:      # a full disk, a folder where the file goes: the error names the path, no copy stays
        partial.unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, str(path)) from None
