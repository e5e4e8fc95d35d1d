"""Medusa heads on disk: every published layout in, the project's layout out.

Layouts read (all end as the published keys ``{h}.{l}.linear.weight/bias`` for
residual blocks and ``{h}.{L}.weight`` for a head's own vocabulary projection):

- medusa-1: ``config.json`` + ``medusa_lm_head.safetensors`` or ``.pt`` (FasterDecoding);
- version-2: the same files without the projections; the heads reuse the backbone's lm_head;
- medusa-2: a full model whose shards also hold ``medusa_head.{h}...`` keys;
- medusa-chat: this project's ``save_heads`` output (its config is checked against the weights),
  which may add root blocks ``root.{h}.linear.weight/bias`` (heads.RootBlock: heads that read the
  root token; no serving engine knows these, so export refuses them).

Beside the weights, a heads directory may hold ``proposal_vocab.json`` (this project's own
addition): the token ids the heads guess among (heads.MedusaHeads.restrict_proposals).

Head and block counts come from the keys, never the config (the published 7B config
says 2 heads where the file holds 5). Loading is strict: a missing, unexpected or
mis-shaped tensor is a HeadsLoadError naming the file and the keys.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import LoadError, first_line
from .medusa_heads import HeadsConfig, MedusaHeads

HEADS_FILE = "medusa_lm_head.safetensors"
HEADS_FILES = (HEADS_FILE, "medusa_lm_head.pt")   # order = preference: safetensors never runs code
OWN_FORMAT = "medusa-chat-heads"
PROPOSAL_FILE = "proposal_vocab.json"   # {"token_ids": [...], ...}: optional
MEDUSA2_PREFIX = "medusa_head."

_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
_ROOT_KEY = re.compile(r"^root\.(\d+)\.linear\.(weight|bias)$")


class HeadsLoadError(LoadError, ValueError):
    """Heads that cannot be used with this backbone; the message names the file and the fix."""


@dataclass(frozen=True)
class HeadsFiles:
    """Head weights read from one source, before any backbone is involved."""

    state: dict[str, torch.Tensor]   # published keys
    source: str                      # file (or directory, for shards) named in messages
    layout: str                      # medusa-1 | version-2 | medusa-2 | medusa-chat
    base_model: str | None           # backbone to pair with; a medusa-2 repo is its own backbone
    config: dict
    proposal_ids: list[int] | None = None   # the tokens the heads guess among (PROPOSAL_FILE); None: all


# ---------------------------------------------------------------- reading files

def read_heads_file(path: Path) -> dict[str, torch.Tensor]:
    """One heads file -> state dict. Pickles load with weights_only=True: anything beyond
    tensors and plain containers is refused before it can run."""
    path = Path(path)
    if not path.is_file():
        raise HeadsLoadError(f"{path} does not exist: point --heads (the page's Medusa heads box) at a directory with medusa_lm_head.safetensors or .pt")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        check_not_a_pointer(path, first_bytes(path))
        try:
            return load_file(str(path))
        except SafetensorError as err:
            raise HeadsLoadError(f"{path} is not a valid safetensors file ({err}): download it again") from err
    state = read_torch_file(path, "use a medusa_lm_head.safetensors file or re-save it as a plain state dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HeadsLoadError(f"{path} holds a {type(state).__name__}, not a state dict of head tensors: re-save the heads' state_dict()")
    return dict(state)


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:   # an editor's UTF-16: launch ended in a traceback (review)
        raise HeadsLoadError(f"{path} is not UTF-8 text (byte {err.start}): save it as UTF-8 JSON, or re-download "
                             "it") from None
    except json.JSONDecodeError as err:
        raise HeadsLoadError(f"{path} is not valid JSON ({err}): fix or re-download it") from err
    except OSError as err:
        raise HeadsLoadError(f"{path} cannot be read ({err.strerror}): check its permissions") from None
    if not isinstance(config, dict):
        raise HeadsLoadError(f"{path} holds a {type(config).__name__}, not a JSON object: fix or re-download it")
    return config


def _medusa2_state(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """``medusa_head.*`` tensors from a full model's shards (safetensors preferred), prefix removed."""
    shards = sorted(directory.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if shards:
        from safetensors import safe_open

        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    if key.startswith(MEDUSA2_PREFIX):
                        state[key[len(MEDUSA2_PREFIX):]] = f.get_tensor(key)
    else:
        for shard in sorted(directory.glob("*.bin")):
            # mmap: only the medusa_head tensors are read into memory, not a 7B shard
            for key, value in read_torch_file(shard, "use safetensors shards", mmap=True).items():
                if key.startswith(MEDUSA2_PREFIX):
                    state[key[len(MEDUSA2_PREFIX):]] = value.clone()
    return state, str(directory)


LFS_POINTER = b"version https://git-lfs"     # how a Git LFS pointer file begins
TORCH_FILE = (b"PK\x03\x04", b"\x80")        # a torch file: a zip archive, or (before torch 1.6) a pickle


def first_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(32)


def check_not_a_pointer(path: Path, head: bytes) -> None:
    """A Git LFS pointer, what a clone without git-lfs holds in place of a weights file (FasterDecoding's heads
    are .pt files in LFS), is said as one: it was refused as a pickle that "could run code" (review). ``head``:
    the file's first bytes."""
    if head.startswith(LFS_POINTER):
        raise HeadsLoadError(f"{path} is a Git LFS pointer, not the weights (cloned without git-lfs): run "
                             "`git lfs pull` in its folder, or download the file again")


def read_torch_file(path: Path, safer: str, mmap: bool = False):
    """A torch pickle, loaded with weights_only=True; ``safer`` is the fix a refused pickle's message names."""
    head = first_bytes(path)
    check_not_a_pointer(path, head)
    if not head.startswith(TORCH_FILE):      # an error page saved under the file's name, say
        raise HeadsLoadError(f"{path} is not a torch file (it begins {head[:16]!r}): download it again")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise HeadsLoadError(f"{path} needs more than tensors to unpickle (it could run code) and was refused: "
                             f"{safer}") from err
    except (RuntimeError, EOFError, OSError) as err:   # a file cut short (mmap of one raised a bare OSError)
        raise HeadsLoadError(f"{path} is not a readable torch file ({type(err).__name__}): download it again") from err


def _has_projections(state: dict[str, torch.Tensor]) -> bool:
    """Whether the heads carry their own vocabulary projections (``{h}.{L}.weight``): medusa-1 heads
    do; version-2 heads (philschmid's Llama-3.1 heads, Medusa's train_legacy since medusa2) do not."""
    return any(m is not None and m[3] == "weight" for m in map(_KEY.match, state))


def read_heads_dir(directory: str | Path) -> HeadsFiles:
    """Head weights from a local directory in any published layout."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadsLoadError(f"{directory} does not exist: give a heads directory or a hub id like owner/name")
    config = _read_config(directory)
    for name in HEADS_FILES:
        if (directory / name).is_file():
            path = directory / name
            state = read_heads_file(path)
            # the same file names hold both published layouts; the keys tell them apart (the load line shows it)
            layout = ("medusa-chat" if config.get("format") == OWN_FORMAT
                      else "medusa-1" if _has_projections(state) else "version-2")
            return HeadsFiles(state, str(path), layout, config.get("base_model_name_or_path"), config,
                              read_proposal_vocab(directory))
    if config.get("model_type") == "medusa":
        # vLLM's Medusa draft (blocks.*, lm_heads.*): it read as a full model without medusa_head weights
        raise HeadsLoadError(f"{directory} is a vLLM Medusa draft (export --format vllm), which this app does not "
                             "read: give the heads it was exported from, or the export's tgi folder")
    if "model_type" in config:
        state, source = _medusa2_state(directory)
        if not state:
            raise no_medusa2_heads(str(directory))
        return HeadsFiles(state, source, "medusa-2", str(directory), config)
    raise no_heads(directory)


def no_medusa2_heads(source: str) -> HeadsLoadError:
    return HeadsLoadError(f"{source} holds a full model without medusa_head.* weights: point --heads (the page's "
                          "Medusa heads box) at Medusa heads (medusa_lm_head.*) or a Medusa-2 model")


def no_heads(directory: Path | str) -> HeadsLoadError:
    return HeadsLoadError(
        f"{directory} has no medusa_lm_head.safetensors, medusa_lm_head.pt or model shards with medusa_head.* keys: "
        "point --heads (the page's Medusa heads box) at a Medusa heads directory"
    )


def declared_heads(directory: Path) -> dict:
    """What a heads directory shows without reading its weights: HeadsLoadError where it holds neither a heads
    file nor a model's config (an empty or wrong folder), else its config.json ({} where it has none). Its
    medusa_num_heads is checked against the weights only in this project's layout (check_declared)."""
    config = _read_config(directory)
    if not any((directory / name).is_file() for name in HEADS_FILES) and "model_type" not in config:
        raise no_heads(directory)
    return config


def no_projection_to_quantize(source: str) -> HeadsLoadError:
    return HeadsLoadError(f"--heads-quant nf4: the heads in {source} reuse the backbone's lm_head and have no "
                          "projection to quantize: drop --heads-quant")


def read_proposal_vocab(directory: Path) -> list[int] | None:
    """The token ids in ``directory/proposal_vocab.json``, or None when there is no such file."""
    path = directory / PROPOSAL_FILE
    if not path.is_file():
        return None
    fix = "rebuild it (smol_build --stages vocab) or delete it to let the heads guess among all tokens"
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise HeadsLoadError(f'{path} is not {{"token_ids": [...]}} ({type(err).__name__}): {fix}') from err
    if not isinstance(ids, list) or not ids:
        raise HeadsLoadError(f"{path}: token_ids is {str(ids)[:40]!r}, not a list of token ids: {fix}")
    seen: set[int] = set()
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i in seen:
            why = "a repeat" if i in seen else "not a token id"
            raise HeadsLoadError(f"{path}: token_ids holds {i!r}, {why}: {fix}")
        seen.add(i)
    return ids


def save_proposal_vocab(directory: str | Path, token_ids: list[int], about: dict) -> Path:
    """Write ``proposal_vocab.json``: the ids, most used first, and how they were chosen."""
    path = Path(directory) / PROPOSAL_FILE
    path.write_text(json.dumps({**about, "token_ids": [int(i) for i in token_ids]}) + "\n")
    return path


# ---------------------------------------------------------------- checking against a backbone

def heads_config_from_keys(state: dict[str, torch.Tensor], source: str) -> HeadsConfig:
    """Count heads and residual blocks from the keys (vocab_size 0 when heads reuse the lm_head)."""
    unexpected = sorted(k for k in state if not (_KEY.match(k) or _ROOT_KEY.match(k)))
    if unexpected:
        raise HeadsLoadError(f"{source}: unexpected keys {unexpected[:8]}: not a Medusa heads file (keys must look like 0.0.linear.weight)")
    if not state:
        raise HeadsLoadError(f"{source}: holds no head weights: point --heads (the page's Medusa heads box) at trained Medusa heads")
    root_conditioned = any(map(_ROOT_KEY.match, state))
    parsed = [(int(m[1]), int(m[2]), m[3]) for m in map(_KEY.match, state) if m]
    if not parsed:
        raise HeadsLoadError(f"{source}: holds root blocks but no heads: the file is incomplete; save the heads again")
    num_heads = max(h for h, _, _ in parsed) + 1
    num_layers = max((l for _, l, kind in parsed if kind.startswith("linear")), default=-1) + 1
    projections = [state[f"{h}.{l}.weight"] for h, l, kind in parsed if kind == "weight"]
    own_projection = bool(projections)
    any_block = next((state[k] for k in state if k.endswith("linear.weight") and _KEY.match(k)), None)
    hidden = any_block.shape[-1] if any_block is not None else projections[0].shape[-1]
    vocab = projections[0].shape[0] if own_projection else 0
    return HeadsConfig(num_heads, num_layers, hidden, vocab, own_projection, root_conditioned)


def check_declared(files: HeadsFiles, found: HeadsConfig) -> None:
    """What a config promises must match the weights where a mismatch means a wrong file."""
    config = files.config
    declared_v2 = str(config.get("version", "")) == "2" or config.get("own_projection") is False
    if not found.own_projection and files.layout != "medusa-2" and config and not declared_v2:
        missing = [f"{h}.{found.num_layers}.weight" for h in range(found.num_heads)]
        raise HeadsLoadError(
            f"{files.source}: missing keys {missing[:8]} (the heads' vocab projections) and its config.json "
            'does not say "version": "2": the file is incomplete; re-download it'
        )
    if files.layout == "medusa-chat":
        for field, value in (("medusa_num_heads", found.num_heads), ("medusa_num_layers", found.num_layers),
                             ("hidden_size", found.hidden_size), ("root_conditioned", found.root_conditioned)):
            if config.get(field, False if field == "root_conditioned" else value) != value:
                raise HeadsLoadError(
                    f"{files.source}: config.json says {field}={config.get(field, False)} but the weights hold {value}: "
                    "the directory mixes two saves; save the heads again"
                )


def heads_from_state(
    state: dict[str, torch.Tensor], model: nn.Module, source: str, dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MedusaHeads:
    """Build heads that match ``state`` exactly, check them against the backbone, load strictly; on ``device``
    (default: the backbone's lm_head's)."""
    found = heads_config_from_keys(state, source)
    text = model.config.get_text_config()
    if found.hidden_size != text.hidden_size:
        raise HeadsLoadError(
            f"{source}: heads have hidden size {found.hidden_size} but the backbone has {text.hidden_size}: "
            "use heads trained for this backbone, or load the backbone they were trained for (--model, or the page's backbone box)"
        )
    lm_head = model.get_output_embeddings()
    vocab = int(lm_head.out_features)
    if found.own_projection and found.vocab_size != vocab:
        raise HeadsLoadError(
            f"{source}: heads have vocabulary size {found.vocab_size} but the backbone has {vocab}: "
            "use heads trained for this backbone, or load the backbone they were trained for (--model, or the page's backbone box)"
        )
    heads = MedusaHeads(HeadsConfig(found.num_heads, found.num_layers, found.hidden_size, vocab, found.own_projection,
                                    found.root_conditioned))
    expected = heads.published_state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadsLoadError(
            f"{source}: missing keys {missing[:8]}, unexpected keys {unexpected[:8]} "
            f"for {found.num_heads} heads x {found.num_layers} blocks: the file is incomplete or not Medusa heads"
        )
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items() if state[k].shape != v.shape]
    if wrong:
        raise HeadsLoadError(f"{source}: tensors with the wrong shape: {wrong[:4]}: the heads are inconsistent; re-download them")
    heads.load_published_state_dict(state)
    if dtype is None:
        weight = lm_head.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.bfloat16
    return heads.to(device=device or lm_head.weight.device, dtype=dtype).eval().requires_grad_(False)


def load_heads_files(files: HeadsFiles, model: nn.Module, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> MedusaHeads:
    check_declared(files, heads_config_from_keys(files.state, files.source))
    heads = heads_from_state(files.state, model, files.source, dtype, device)
    if files.proposal_ids is not None:
        lm_head = model.get_output_embeddings()
        vocab = int(lm_head.out_features)
        outside = [i for i in files.proposal_ids if not 0 <= i < vocab]
        if outside:
            raise HeadsLoadError(f"{files.source}: {PROPOSAL_FILE} names token ids {outside[:4]} outside the "
                                 f"backbone's vocabulary of {vocab}: it belongs to another model; "
                                 "delete it, or load the backbone the heads were trained for (--model, or the page's backbone box)")
        try:
            heads.restrict_proposals(torch.tensor(files.proposal_ids), lm_head)
        except ValueError as err:
            raise HeadsLoadError(f"{files.source}: {PROPOSAL_FILE} cannot be used ({err}): delete it") from err
    return heads


def load_heads_dir(directory: str | Path, model: nn.Module) -> MedusaHeads:
    """Heads in any published layout from a local directory, checked against ``model``."""
    return load_heads_files(read_heads_dir(directory), model)


# ---------------------------------------------------------------- the project's own layout

def save_safetensors(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with the mode every other file gets (the umask's): save_file writes 0600, so a
    heads or export folder shared with another user, or mounted into a container, had unreadable weights. A write
    that fails is one OSError line naming ``path``, and leaves the file ``path`` held as it was."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    # written beside it, then renamed over it: a failed write (a full disk) leaves the file that was there whole
    partial = path.with_name(f".{path.name}.partial")
    try:
        save_file(state, str(partial), metadata=metadata)
    except SafetensorError as err:     # said in safetensors' own error (not an OSError), naming no path
        partial.unlink(missing_ok=True)
        full = any(sign in str(err) for sign in ("StorageFull", "No space left", "os error 28"))
        fix = "free space on its disk, or give a folder on another" if full else "give a folder you can write"
        raise OSError(f"{path} could not be written ({first_line(err)}): {fix}") from None
    partial.chmod(0o666 & ~current_umask())
    os.replace(partial, path)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (setting it to read it back would, for
    a moment, leave another thread's new files world-writable)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def json_object(path: Path) -> dict:
    """The JSON object in ``path``; {} where it holds none or cannot be read (the step that needs it says so)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def model_type_in(folder: Path) -> str | None:
    """The model type a folder's config.json names: a model's (a backbone, a Medusa-2 model); None for heads (their
    config names none, or "medusa" in a TGI export) and for a folder without a readable one."""
    kind = json_object(folder / "config.json").get("model_type")
    return kind if isinstance(kind, str) and kind != "medusa" else None


def check_heads_out(directory: str | Path, flag: str = "--out") -> None:
    """ValueError where heads written into ``directory`` would replace a model's config.json (a backbone's, a
    Medusa-2 model's): said before any work. Training with --out at the backbone's own folder left the backbone
    unloadable ("holds Medusa heads, not a backbone"; review)."""
    if (kind := model_type_in(Path(directory))) is not None:
        raise ValueError(f"{flag} {directory} holds a {kind} model, whose config.json the heads' would replace: give "
                         "another folder for the heads")


def save_heads(heads: MedusaHeads, directory: str | Path, base_model: str) -> Path:
    """The project's heads layout: published keys in safetensors, plus a config that records
    what the loader checks (head count, blocks, sizes, base model). TGI reads it as is unless the
    heads are root-conditioned."""
    check_heads_out(directory, "the heads' folder")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.published_state_dict().items()}
    save_safetensors(state, directory / HEADS_FILE)
    c = heads.config
    config = {
        "format": OWN_FORMAT,
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "own_projection": c.own_projection,
        "root_conditioned": c.root_conditioned,
        "base_model_name_or_path": base_model,
    }
    if not c.own_projection:
        config["version"] = "2"
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
