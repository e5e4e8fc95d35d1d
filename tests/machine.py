"""What the CPU running the tests can stand in for."""

import pytest
import torch

# ATEN_CPU_CAPABILITY=avx2 runs torch's AVX2 kernels (what an AMD Zen 3 runs) only on an x86 CPU that has
# them: elsewhere torch warns and keeps its own, and a test of "an AVX2 CPU" would test this one
needs_avx2 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="this CPU cannot run torch's AVX2 kernels (not x86, or no AVX2)")

# The environment that makes this CPU compute as an AVX2-only one (an AMD Zen 3): torch's own kernels, oneDNN's,
# and MKL's, which torch's fp32 matmuls go through (audit: without the last, every fp32 matmul kept AVX-512's
# rounding while the tests said they ran an AVX2 CPU's)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# run first in a process under AVX2_ENV: MKL then names the instructions it uses on stdout
MKL_SAYS_ITS_ISA = ("import torch\nwith torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):\n"
                    "    torch.mm(torch.ones(8, 8), torch.ones(8, 8))\n")
MKL_AVX2 = "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors"


def mkl_kept_to_avx2(stdout: str) -> bool:
    """Whether MKL's banner (printed by MKL_SAYS_ITS_ISA) names AVX2 as its instructions. On an AMD CPU the banner
    names none (an EPYC with AVX-512, CI 12-01): there MKL's own choice cannot be read, and only torch's and
    oneDNN's are checked, as the test that uses this says."""
    banner = next((line for line in stdout.splitlines() if line.startswith("MKL_VERBOSE oneMKL")), "")
    return MKL_AVX2 in banner or ("enabled processors" not in banner and "AMD" in cpu_vendor())


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it ("GenuineIntel", "AuthenticAMD"); "" where /proc/cpuinfo says none."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")), "")
    except OSError:       # not Linux: no vendor to read, and MKL's banner is then the only word
        return ""


def skip_unless_row_exact(loaded) -> None:
    """Greedy trees give plain decoding's tokens in the CPU's int4 mode only where its kernels are row-invariant
    on this CPU (exact_probe): there is no equality to test where they are not. A load with heads must then say
    so; one without runs plain decoding only, and says nothing of trees."""
    from medusa_core.quant.cpu_int4 import exact_mode

    said = "so trees may differ from plain decoding" in loaded.description
    if exact_mode(loaded.model):
        assert not said, loaded.description
        return
    assert said or loaded.heads is None, loaded.description
    pytest.skip(f"int4 is not row-exact on this CPU: {loaded.description}")
