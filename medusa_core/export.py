"""Write Medusa heads in the layouts serving engines load.

``python -m medusa_core.export --heads SRC --out DIR [--format tgi|vllm|both]``

- ``tgi``: FasterDecoding's layout, which TGI and TensorRT-LLM's converter read:
  ``medusa_lm_head.safetensors`` with keys ``{h}.{l}.linear.weight/bias`` and ``{h}.{L}.weight``
  plus ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and
  ``base_model_name_or_path``. No ``architectures`` field: TGI takes a config that has
  one for an MLP speculator, not Medusa.
- ``vllm``: vLLM's Medusa draft model (``model_executor/models/medusa.py``): ``model.safetensors``
  with ``blocks.{h}.layers.{l}.weight/bias`` and ``lm_heads.{h}.weight`` (or one shared
  ``lm_head.weight`` with ``original_lm_head`` for heads that reuse the backbone's lm_head),
  and a ``model_type: medusa`` config with ``num_heads``, ``num_hidden_layers``,
  ``hidden_size``, ``vocab_size``, ``truncated_vocab_size`` and ``medusa_fc_bias``. Heads with a
  proposal vocabulary (``proposal_vocab.json``) keep it as vLLM's ``token_map``; TGI has none, and
  the export says so.

SRC is any layout ``load`` reads (hub id or directory). See docs/serving.md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .errors import LoadError, OneLineParser, check_folder, run_command
from .heads.medusa_heads import HeadsConfig
from .heads.files import (HEADS_FILE, PROPOSAL_FILE, HeadsFiles, check_declared, heads_config_from_keys,
                          model_type_in, read_heads_dir, save_safetensors)
from .loading.hub import backbone_name, local_dir

FORMATS = ("tgi", "vllm", "both")
WRITES = {"tgi": (HEADS_FILE, "config.json"), "vllm": ("model.safetensors", "config.json")}   # each format's files
DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExportSpec:
    heads: str                      # hub id or local directory, any layout load() reads
    out: Path
    format: str = "both"            # tgi | vllm | both (both: out/tgi and out/vllm)
    model: str | None = None        # backbone: needed for vLLM when the heads reuse its lm_head
    dtype: str = "keep"             # keep | float32 | bfloat16 | float16


def read_source(source: str) -> tuple[HeadsFiles, HeadsConfig]:
    from .loading.load import heads_source_dir

    from .loading.hub import local_dir

    files = read_heads_dir(heads_source_dir(source))
    if files.layout == "medusa-2" and local_dir(source) is None:
        files = replace(files, base_model=source)   # the hub id, not this machine's cache path
    found = heads_config_from_keys(files.state, files.source)
    check_declared(files, found)
    if found.root_conditioned:
        raise LoadError(f"{files.source}: these heads are root-conditioned (root.* blocks, this project's own layout), "
                        "which TGI and vLLM cannot run: export heads trained without --root-conditioned")
    return files, found


@dataclass(frozen=True)
class Exported:
    folders: list[Path]             # one per format written
    notes: list[str]                # what a serving engine will do differently from this app


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Weights cast to ``dtype`` (None: as stored); token ids (vLLM's token_map) stay integers."""
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
            for k, v in state.items()}


def write_tgi(files: HeadsFiles, found: HeadsConfig, out: Path, dtype: torch.dtype | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(_cast(files.state, dtype), out / HEADS_FILE, metadata={"format": "pt"})
    config = {
        "medusa_num_heads": found.num_heads,
        "medusa_num_layers": found.num_layers,
        "base_model_name_or_path": files.base_model,
        "hidden_size": found.hidden_size,
    }
    if found.own_projection:
        config["vocab_size"] = found.vocab_size
    else:
        config["version"] = "2"      # TGI's MedusaHeadV2: one residual block per head + the backbone's lm_head
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def vllm_state(state: dict[str, torch.Tensor], found: HeadsConfig, lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Published keys -> vLLM Medusa parameter names."""
    out = {}
    for h in range(found.num_heads):
        for l in range(found.num_layers):
            out[f"blocks.{h}.layers.{l}.weight"] = state[f"{h}.{l}.linear.weight"]
            out[f"blocks.{h}.layers.{l}.bias"] = state[f"{h}.{l}.linear.bias"]
        if found.own_projection:
            out[f"lm_heads.{h}.weight"] = state[f"{h}.{found.num_layers}.weight"]
    if not found.own_projection:
        out["lm_head.weight"] = lm_head
    return out


def _backbone_lm_head(model: str | None, source: str, hidden: int) -> tuple[torch.Tensor, int]:
    from .loading.load import load_backbone

    if model is None:
        raise LoadError(f"{source}: these heads reuse the backbone's lm_head, which vLLM needs in the draft checkpoint: pass --model")
    # "auto": the checkpoint's own dtype, so the lm_head is copied bit for bit
    backbone, _ = load_backbone(model, "cpu", "none", "auto")
    weight = backbone.get_output_embeddings().weight.detach()
    if weight.shape[1] != hidden:
        raise LoadError(f"{source}: heads have hidden size {hidden} but {model} has {weight.shape[1]}: pass the heads' own backbone as --model")
    return weight, weight.shape[0]


def write_vllm(files: HeadsFiles, found: HeadsConfig, out: Path, dtype: torch.dtype | None = None) -> Path:
    lm_head, vocab = (None, found.vocab_size) if found.own_projection else \
        _backbone_lm_head(files.base_model, files.source, found.hidden_size)
    state = vllm_state(files.state, found, lm_head)
    guessed = vocab
    if files.proposal_ids is not None:
        # vLLM reads the tokens the heads guess among as token_map (and slices the projections to them itself)
        outside = [i for i in files.proposal_ids if not 0 <= i < vocab]
        if outside:        # vLLM would fail at startup indexing with them
            raise LoadError(f"{files.source}: {PROPOSAL_FILE} names token {outside[0]}, outside the backbone's "
                            f"vocabulary of {vocab}: rebuild it for this backbone, or delete it")
        state["token_map"] = torch.tensor(files.proposal_ids, dtype=torch.long)
        guessed = len(files.proposal_ids)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(_cast(state, dtype), out / "model.safetensors", metadata={"format": "pt"})
    first = next(iter(state.values()))
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": found.hidden_size,
        "vocab_size": vocab,
        "truncated_vocab_size": guessed,    # below vocab_size: vLLM reads the token_map
        "num_heads": found.num_heads,
        "num_hidden_layers": found.num_layers,
        "medusa_fc_bias": True,             # Medusa residual blocks have biases; vLLM drops them without this
        "original_lm_head": not found.own_projection,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": str(dtype or first.dtype).removeprefix("torch."),
        "base_model_name_or_path": files.base_model,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def check_backbone(model: str) -> None:
    """LoadError where ``model``, written into the exports as their backbone, names none: a path not there (a typo was
    written into both configs without a word: QA), or a folder without a model's config.json (heads, an empty one).
    A hub id is taken as it is: the export reads nothing of it unless vLLM needs its lm_head."""
    folder = local_dir(model, "the backbone's config.json and weights")
    if folder is not None and model_type_in(folder) is None:
        raise LoadError(f"--model {model} holds no backbone (a config.json with its model_type): give the folder the "
                        "heads were trained on, or its hub id")


def export(spec: ExportSpec) -> Exported:
    if spec.format not in FORMATS:
        raise LoadError(f"format {spec.format!r} is unknown: use one of {', '.join(FORMATS)}")
    if spec.dtype not in DTYPES:
        raise LoadError(f"dtype {spec.dtype!r} is unknown: use one of {', '.join(DTYPES)}")
    check_folder(spec.out)      # before the heads are read: a hub download can take minutes
    if spec.model is not None:
        check_backbone(spec.model)
    files, found = read_source(spec.heads)
    if spec.model is not None:      # --model is the backbone; a local one by its absolute path, as train writes it
        files = replace(files, base_model=backbone_name(spec.model))
    folders = {kind: spec.out / kind if spec.format == "both" else spec.out for kind in ("tgi", "vllm")
               if spec.format in (kind, "both")}
    source = Path(files.source)
    source = (source if source.is_dir() else source.parent).resolve()
    if any(folder.resolve() == source for folder in folders.values()):   # it rewrote them, cast, without a word
        raise LoadError(f"--out {spec.out} would overwrite the heads it exports ({source}): give another folder")
    # QA: other heads in --out were replaced without a word (their checkpoint and tree then described heads that
    # were gone); an export is written into a new or emptied folder
    for kind, folder in folders.items():
        taken = [name for name in WRITES[kind] if (folder / name).exists()]
        if taken:
            raise LoadError(f"--out {spec.out}: {folder} already holds {', '.join(taken)}, which the export would "
                            "overwrite: give a new folder, or delete those files")
    if "tgi" in folders and not found.own_projection and found.num_layers != 1:
        # TGI's loader for heads without a projection (MedusaHeadV2) asserts one block: said here, not in TGI's log
        raise LoadError(f"{files.source}: TGI runs heads without their own projection only with one residual block "
                        f"each, and these have {found.num_layers}: export them with --format vllm")
    if "tgi" in folders and files.base_model is None:
        raise LoadError(f"{files.source}: the heads name no backbone (base_model_name_or_path), which TGI loads from "
                        "the exported config: pass --model")
    notes = []
    if "tgi" in folders and files.proposal_ids is not None:
        notes.append(f"TGI has no proposal vocabulary: there these heads guess among the whole vocabulary, not the "
                     f"{len(files.proposal_ids):,} tokens of {PROPOSAL_FILE} they were trained to guess among (vLLM's "
                     "export keeps those as its token_map)")
    dtype = DTYPES[spec.dtype]
    # vLLM's first: it may need the backbone (--model), and a failure there left the TGI half written
    vllm = write_vllm(files, found, folders["vllm"], dtype) if "vllm" in folders else None
    tgi = write_tgi(files, found, folders["tgi"], dtype) if "tgi" in folders else None
    return Exported([path for path in (tgi, vllm) if path is not None], notes)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m medusa_core.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", required=True, help="heads: hub id or local directory (any published layout)")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--format", default="both", choices=FORMATS, help="tgi (also TensorRT-LLM), vllm, or both (subdirectories)")
    parser.add_argument("--model", help="backbone; needed for vLLM when the heads reuse its lm_head (version 2)")
    parser.add_argument("--dtype", default="keep", choices=list(DTYPES), help="cast the weights (default: as stored)")
    args = parser.parse_args(argv)

    def body() -> None:
        exported = export(ExportSpec(args.heads, args.out, args.format, args.model, args.dtype))
        for path in exported.folders:
            print(f"wrote {path}")
        for note in exported.notes:
            print(f"note: {note}")

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
