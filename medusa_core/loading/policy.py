"""Defaults that depend on the machine: which device, quantization and compute dtype a load gets,
and which tree a model's heads decode with when the user names none (tuned on this machine where
the heads carry accuracies, a preset where they do not)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ..decoding.tree import TreeError, build_tree_buffers, resolve_tree, tree_name
from ..errors import LoadError
from ..heads.accuracy import head_accuracy
from ..heads.medusa_heads import MedusaHeads
from . import smollm2
from .assets import CPU_DEFAULT_CALIBRATION, CPU_DEFAULT_TREE
from .spec import LoadSpec
from .tree_tuning import Progress, TunedTree, tuned_tree

CUDA_MODEL = "lmsys/vicuna-7b-v1.3"
CUDA_HEADS = "FasterDecoding/medusa-vicuna-7b-v1.3"
# The CUDA default's weights alone, by --heads-quant: Vicuna-7B in NF4 (3.91 GB measured on the GPU, embeddings
# and lm_head in bf16 included: docs/perf/h200.json) and its 5 heads (1.48 GB in bf16, measured; with --heads-quant
# nf4 their 32000 x 4096 projections take half a byte a weight and a byte per 64 for the scales, 0.34 GB, beside
# 0.17 GB of bf16 blocks: 4.42 GB once loaded, and 4.77 GB while the last projection is quantized, from its fp32 copy
# (0.52 GB) on the GPU, before the blocks come: heads/quantize.py). A GPU with less memory cannot load it.
CUDA_DEFAULT_WEIGHT_BYTES = {"none": 3.91e9 + 1.48e9, "nf4": 3.91e9 + 0.34e9 + 0.52e9}
QUANTS = ("auto", "nf4", "int8", "int4", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADS_QUANTS = ("none", "nf4")
# Default trees for published heads, keyed by the exact repo id (never a substring of it): the tree
# a repo's heads decode with where no accuracies tune one (pick_tree). A tree may not be deeper than
# the heads are many: depth d reads head d-1. Over NF4 on CUDA, mc_sim_7b_63 becomes its best 16
# nodes (choose_tree).
TREE_BY_HEADS = {
    # Medusa-1, 5 heads each (their configs say 2): the reference ships mc_sim_7b_63 (depth 4) as its
    # default for all three Vicuna sizes. These heads carry published accuracies, so the loader tunes
    # a tree from those; this preset is what --tree and the table promise.
    "FasterDecoding/medusa-vicuna-7b-v1.3": "mc_sim_7b_63",
    "FasterDecoding/medusa-vicuna-13b-v1.3": "mc_sim_7b_63",
    "FasterDecoding/medusa-vicuna-33b-v1.3": "mc_sim_7b_63",
    # Medusa-2 (the backbone fine-tuned with its 5 heads): the reference decodes it with its own
    # zephyr_stage2 tree (63 nodes, depth 4, not a preset here); mc_sim_7b_63 has the same size and
    # depth and is the reference's default for heads without a tree of their own.
    "FasterDecoding/medusa-1.0-zephyr-7b-beta": "mc_sim_7b_63",
    # 3 heads each (so depth 3 at most, where the mc_sim trees need 4), and no published accuracies:
    # the top-2 guesses of every head, 14 nodes, inside the 16-row budget a 4-bit backbone on CUDA
    # affords (docs/performance.md). TGI itself speculates a chain of the 3 top-1 guesses.
    "text-generation-inference/Mistral-7B-Instruct-v0.2-medusa": "cartesian-2x2x2",
    "philschmid/llama-3-1-8b-instruct-medusa": "cartesian-2x2x2",
}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise LoadError(f"device {device!r} is unknown: use auto, cpu, cuda or cuda:N") from err
    if kind not in ("cpu", "cuda"):   # meta "loaded" a model of no weights; xpu failed in an AssertionError (review)
        raise LoadError(f"device {device!r} is not one this app runs on: use auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"device {device!r} was asked for but torch sees no CUDA GPU: use --device cpu, or install a CUDA build of torch")
    index = torch.device(device).index
    if kind == "cuda" and index is not None and index >= (count := torch.cuda.device_count()):
        raise LoadError(f"device {device!r} is not here: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return device


def check_default_fits(device: str, heads_quant: str) -> None:
    """LoadError where this GPU has less memory in all than the CUDA default's weights (a 4 GB laptop GPU
    downloaded 15 GB, then ran out of memory, and the fix offered never named the CPU: review)."""
    total = torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory
    needed = CUDA_DEFAULT_WEIGHT_BYTES.get(heads_quant, CUDA_DEFAULT_WEIGHT_BYTES["none"])
    if total < needed:
        nf4 = CUDA_DEFAULT_WEIGHT_BYTES["nf4"]
        smaller = f" (or --heads-quant nf4, whose load needs {nf4 / 1e9:.1f} GB)" \
            if total >= nf4 and heads_quant != "nf4" else ""
        raise LoadError(f"this GPU has {total / 1e9:.1f} GB, and the CUDA default, {CUDA_MODEL} in 4 bits with its "
                        f"Medusa heads, needs {needed / 1e9:.1f} GB for its weights alone: run --device cpu for "
                        f"{smollm2.NAME}{smaller}, or give a smaller --model")


def machine_memory() -> int | None:
    """This machine's memory in bytes, or its container's limit where that is lower (cgroup v2); None where the
    OS does not say (Windows has no sysconf)."""
    if not hasattr(os, "sysconf"):
        return None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()     # "max" where none is set
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


STORED_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def check_fits_in_memory(name: str, config: dict, index: dict, dtype: torch.dtype | str) -> None:
    """LoadError where a backbone's weights, unquantized in ``dtype`` on the CPU, take more than this machine's
    memory in all: the OS would kill the app mid-load, and every open chat with it (review: the Vicuna-7B entry
    picked on a CPU machine is 27 GB in fp32). Counted from the shard index (``metadata.total_size``, read before
    any shard downloads) and the dtype the config says it is stored in; where that dtype is not said, 4 bytes a
    weight, the fewest weights the size can hold: a model that fits is never refused. ``dtype`` "auto" keeps the
    stored one."""
    metadata = index.get("metadata")
    size = metadata.get("total_size") if isinstance(metadata, dict) else None
    total = machine_memory()
    if not isinstance(size, (int, float)) or total is None:
        return
    stored = STORED_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 4)
    needed = size / stored * dtype.itemsize if isinstance(dtype, torch.dtype) else size
    if needed > total:
        as_what = f"in {str(dtype).removeprefix('torch.')}" if isinstance(dtype, torch.dtype) else "as stored"
        raise LoadError(f"{name}: its weights take {needed / 1e9:.1f} GB {as_what} on the CPU, more than this "
                        f"machine's {total / 1e9:.1f} GB of memory: load it on a CUDA GPU (in 4 bits), or pick a "
                        f"smaller model ({smollm2.NAME} runs here)")


def resolve_quant(quant: str, device: str, cpu_default: bool = False, dtype: torch.dtype = torch.float32) -> str:
    """nf4/int8: bitsandbytes; int4: torch's CPU kernel (cpu_int4.py). auto: nf4 on CUDA; on the CPU,
    int4 for the CPU default in fp32, whose weights are 4-bit already (GGUF Q4_1), if measured faster
    there, and none for any other model, which int4 would really quantize."""
    if quant not in QUANTS:
        raise LoadError(f"quant {quant!r} is unknown: use one of {', '.join(QUANTS)}")
    on_cpu = torch.device(device).type == "cpu"
    if quant == "int4" and not on_cpu:
        raise LoadError(f"quant 'int4' is torch's CPU kernel and the device is {device}: use --device cpu, "
                        "or --quant nf4 on CUDA")
    if quant == "auto":
        if device.startswith("cuda"):
            return "nf4"
        return "int4" if on_cpu and cpu_default and dtype == torch.float32 else "none"
    return quant


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device.startswith("cuda"):
            # bf16 keeps fp32's range; fp16 where the GPU has no bf16 arithmetic (pre-Ampere: RTX 20xx, T4).
            # Not is_bf16_supported(): it says True there too, by emulation, and asks the current GPU, not this one
            major, _ = torch.cuda.get_device_capability(torch.device(device))
            return torch.bfloat16 if major >= 8 else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise LoadError(f"dtype {dtype!r} is unknown: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]



def choose_tree(heads_source: str | None, heads: MedusaHeads | None, device: str, bundled: bool,
                quant: str = "none") -> str:
    """Explicit table first, then the bundled heads' calibrated tree (``bundled``: the heads are
    assets/smollm2/heads), then a preset sized for the device.
    Over a 4-bit backbone on CUDA the 64-node tree gives way to its best 16 nodes: there every
    verified row costs, and the smaller tree projects the better speedup with the published head
    accuracies (docs/performance.md, "Default tree over NF4 on CUDA")."""
    if heads is None:
        return "baseline"
    if heads_source in TREE_BY_HEADS:
        tree = TREE_BY_HEADS[heads_source]
        return "mc_sim_7b_16" if tree == "mc_sim_7b_63" and quant == "nf4" and device.startswith("cuda") else tree
    if bundled:
        return str(CPU_DEFAULT_TREE)
    n = heads.config.num_heads
    if device.startswith("cuda"):
        # a bf16 GPU verifies 64 nodes for little more than the price of one, while NF4 pays for every
        # row (docs/performance.md): 16 nodes at most there (3 heads had 103). mc_sim_7b_16 needs depth 3,
        # mc_sim_7b_63 depth 4
        if quant == "nf4":
            return "mc_sim_7b_16" if n >= 3 else "cartesian-" + "x".join(["4", "2"][:n])
        return "mc_sim_7b_63" if n >= 4 else "cartesian-" + "x".join(["6", "4", "3"][:n])
    # on CPU every node costs: small trees (small-16 has depth 5, small-8 depth 4)
    return "small-16" if n >= 5 else "small-8" if n == 4 else f"chain-{n}"


def tuning_mode(spec: LoadSpec, model, device: str, quant: str, dtype: torch.dtype, heads=None) -> str:
    """What a tuned tree's cache entry is for, besides the machine, model and heads: the NF4 kernel (and the NF4
    heads' where it is not bitsandbytes) and the norms, rotary and attention are the ones routed (``auto`` picks
    each by timing on the GPU, and trees tuned on one step do not fit another), the CPU int4 mode's lm_head, and
    the projections fused (fused_projections.py). transformers' own, the bf16 head and projections apart add no
    key, so entries tuned before the Triton kernels, the int4 head and the fusion still match."""
    from ..quant.attention_routing import attention_routed, rotary_routed
    from ..quant.bnb import routed_kernel
    from ..quant.fused_projections import fused_groups
    from ..quant.norm_routing import norms_routed

    norms, rotary, attention = norms_routed(model), rotary_routed(model), attention_routed(model)
    head = getattr(model.get_output_embeddings(), "kind", "")      # the CPU int4 mode's (cpu_int4.choose_head)
    fused = ",".join(fused_groups(model))
    # NF4 heads' kernel (use_nf4_heads): bitsandbytes was the only one until 2026-11-30, so that adds no key
    heads_kernel = routed_kernel(heads) if heads is not None and spec.heads_quant == "nf4" else None
    return json.dumps({"device": device, "quant": quant, "dtype": str(dtype), "heads_quant": spec.heads_quant,
                       "nf4_kernel": routed_kernel(model) or spec.nf4_kernel,
                       **({"heads_kernel": heads_kernel} if heads_kernel not in (None, "bnb") else {}),
                       **({"lm_head": head} if head == "int4" else {}),
                       **({"fused": fused} if fused else {}),
                       **({"norms": norms} if norms == "triton" else {}),
                       **({"rotary": rotary} if rotary == "triton" else {}),
                       **({"attention": attention} if attention == "split" else {})}, sort_keys=True)


def pick_tree(spec: LoadSpec, model, tokenizer, heads: MedusaHeads | None, heads_dir: Path | None, device: str,
              bundled: bool, quant: str, dtype: torch.dtype, progress: Progress) -> tuple[str, str, TunedTree | None]:
    """(default tree, one line saying why, the tuner's choice): the user's --tree; else the tree tuned
    on this machine from the heads' accuracies (cached per machine, model, heads and mode); else,
    for heads that carry no accuracies, a preset (choose_tree)."""
    if heads is None:
        ignored = spec.tree not in (None, "baseline")
        return "baseline", (f"--tree {spec.tree} is not used: this model has no Medusa heads, so it runs plain "
                            "decoding (add --heads)" if ignored else ""), None
    for tree in spec.must_run:     # bench: timing these was the point, so tuning another first only costs minutes
        try:
            build_tree_buffers(resolve_tree(tree), heads.config.num_heads)
        except TreeError as err:
            raise LoadError(f"tree {tree} cannot run with these heads: {err}") from None
    if spec.tree:
        try:
            build_tree_buffers(resolve_tree(spec.tree), heads.config.num_heads)
        except TreeError as err:   # deeper or wider than these heads: the model that loaded is kept, with the
            # tree it gets without --tree (it was thrown away, leaving no model and no word of --tree's part)
            tree, line, tuned = pick_tree(replace(spec, tree=None), model, tokenizer, heads, heads_dir, device,
                                          bundled, quant, dtype, progress)
            return tree, f"--tree {spec.tree} cannot run with these heads ({err}); instead: {line}", tuned
        return spec.tree, f"tree {tree_name(spec.tree)} (set by --tree)", None
    accuracy = head_accuracy(heads_dir, spec.heads, heads.config.num_heads,
                             calibration=CPU_DEFAULT_CALIBRATION if bundled else None)
    if accuracy is None:
        tree = choose_tree(spec.heads, heads, device, bundled, quant)
        return tree, (f"tree {tree}: a preset, since these heads carry no accuracies to tune a tree with "
                      "(python -m medusa_core.calibrate --out HEADS_DIR/tree.json measures them)"), None
    try:
        tuned, tree_file = tuned_tree(model, heads, tokenizer, accuracy.table, accuracy.source, heads_dir=heads_dir,
                                      mode=tuning_mode(spec, model, device, quant, dtype, heads),
                                      cache_root=smollm2.cache_root(),
                                      retune=spec.retune, progress=progress)
    except OSError as err:     # the tree file this start runs from, in the temporary folder (the cache's does not fail)
        raise LoadError(f"could not write the tuned tree's file into {err.filename or tempfile.gettempdir()} "
                        f"({err.strerror or err}): set TMPDIR to a writable folder, or pass --tree") from None
    return (str(tree_file) if tuned.pays else "baseline"), tuned.line(), tuned
