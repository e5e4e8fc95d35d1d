"""How weights are multiplied: bitsandbytes and the Triton NF4 kernels on CUDA, the CPU int4 mode
and its row-exact attention."""

import logging


def _not_the_hub_kernel_probe(record: logging.LogRecord) -> bool:
    return "kernels-community" not in record.getMessage()


# bitsandbytes 0.50, imported on a CPU with AVX-512 bf16 (Sapphire Rapids, Zen 4), tries to fetch a CPU
# 4-bit kernel from the Hugging Face hub through the optional `kernels` package and, without it, logs
# "Failed to load CPU gemm_4bit_forward ... pip install kernels": the first line a CUDA user with such a
# CPU saw at every NF4 start. Without the package nothing needs that kernel (CUDA has bnb's CUDA ops; NF4
# on the CPU runs bnb's own C++ one), and installing it would have bnb download code from the hub at each
# import, which the line's advice does not say. Only that line is dropped: the logger's others still show.
# Here, in the package, so that every path to bitsandbytes (the loaders, the benchmarks) has it first.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_hub_kernel_probe)
