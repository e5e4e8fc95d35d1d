"""How weights are multiplied: bitsandbytes and the Triton NF4 kernels on CUDA, the CPU int4 mode
and its row-exact attention."""
