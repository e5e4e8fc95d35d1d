"""What the user asked to load, before the machine's defaults fill it in (loading/policy.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadSpec:
    model: str | None = None          # hub id or local dir; None -> heads' base_model_name_or_path, else default
    heads: str | None = None          # hub id or local dir; None -> no heads (baseline) unless defaults apply
    device: str = "auto"              # auto -> cuda if available else cpu
    quant: str = "auto"               # auto|nf4|int8|int4|none; auto = nf4 on CUDA, int4 for the CPU default, else none
    dtype: str = "auto"               # auto|float32|bfloat16|float16: compute dtype
    heads_quant: str = "none"         # none|nf4: quantize the heads' vocab projections
    trust_remote_code: bool = False
    nf4_kernel: str = "auto"          # auto|triton|bnb|repacked|repacked-exact: who multiplies NF4 layers (quant/bnb.py)
    norm_kernel: str = "auto"         # auto|torch|triton: who computes the RMSNorms (quant/norm_routing.py)
    rotary_kernel: str = "auto"       # auto|torch|triton: who rotates queries and keys (quant/attention_routing.py)
    attention_kernel: str = "auto"    # auto|sdpa|split: who attends over the cache (quant/attention_routing.py)
    tree: str | None = None           # a preset or .json tree instead of the tree tuned for this machine
    must_run: tuple[str, ...] = ()    # trees the heads must be able to run, checked before any tuning (bench)
    retune: bool = False              # measure the tree (CPU int4's gain, the GPU's kernel timings) again even if cached
