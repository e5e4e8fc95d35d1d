"""What the CPU running the tests can stand in for."""

import pytest
import torch

# ATEN_CPU_CAPABILITY=avx2 runs torch's AVX2 kernels (what an AMD Zen 3 runs) only on an x86 CPU that has
# them: elsewhere torch warns and keeps its own, and a test of "an AVX2 CPU" would test this one
needs_avx2 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="this CPU cannot run torch's AVX2 kernels (not x86, or no AVX2)")
