"""Which model the app serves. ``ModelSlot`` loads in a background thread, so the
page opens at once and shows the load's progress; a new model replaces the old one
only once it has loaded (a failed load keeps the old one); unloading frees it.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from medusa_core.errors import LoadError
from medusa_core.loading.assets import CPU_DEFAULT_HEADS, CPU_DEFAULT_TREE, is_bundled_heads, is_cpu_default_backbone
from medusa_core.loading.load import load
from medusa_core.loading.memory import free_memory, memory_report
from medusa_core.loading.spec import LoadSpec
from medusa_core.loading.policy import CUDA_HEADS, CUDA_MODEL, TREE_BY_HEADS, resolve_device
from medusa_core.loading import smollm2
from medusa_core.loading.smollm2 import NAME as SMOLLM2
from medusa_core.decoding.tree import TreeError
from medusa_core.quant.kernel_timing import beside

from .engine import ChatEngine
from .settings import Settings


@dataclass(frozen=True)
class KnownModel:
    """A backbone and the Medusa heads people download for it, as the page's model list offers them.
    Any hub id or local directory can be typed instead."""

    label: str
    model: str | None   # backbone hub id; None: the heads name it (a Medusa-2 repo is its own backbone,
                        # the bundled heads' backbone is SmolLM2's converted copy in the user's cache)
    heads: str          # hub id, or the bundled heads' directory
    chat: str           # the prompt format the backbone needs, and where it comes from
    turn_end: str       # the token that ends a reply: the loader's stop ids must hold it
    device: str         # "cuda" or "cpu": where it is meant to run (a 7B model on a CPU runs, slowly)

    @property
    def tree(self) -> str:
        """The tree these heads decode with where no accuracies tune one: the policy's table, or the
        bundled heads' calibrated tree. Read from there, so the list and the loader never disagree."""
        return str(CPU_DEFAULT_TREE) if is_bundled_heads(self.heads) else TREE_BY_HEADS[self.heads]


_VICUNA_CHAT = "vicuna v1.1 (FastChat's form; the tokenizer carries no chat template)"
# The CUDA default first, the CPU default second, then the other published heads.
KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel("Vicuna-7B v1.3 + Medusa heads (CUDA)", CUDA_MODEL, CUDA_HEADS, _VICUNA_CHAT, "</s>", "cuda"),
    KnownModel(f"{SMOLLM2} + Medusa heads (CPU)", None, str(CPU_DEFAULT_HEADS),
               "the tokenizer's chat template (ChatML)", "<|im_end|>", "cpu"),
    KnownModel("Vicuna-13B v1.3 + Medusa heads (CUDA)", "lmsys/vicuna-13b-v1.3",
               "FasterDecoding/medusa-vicuna-13b-v1.3", _VICUNA_CHAT, "</s>", "cuda"),
    KnownModel("Vicuna-33B v1.3 + Medusa heads (CUDA)", "lmsys/vicuna-33b-v1.3",
               "FasterDecoding/medusa-vicuna-33b-v1.3", _VICUNA_CHAT, "</s>", "cuda"),
    # a gated backbone: its license is accepted on huggingface.co first (the load says so)
    KnownModel("Llama-3.1-8B-Instruct + Medusa heads (CUDA)", "meta-llama/Llama-3.1-8B-Instruct",
               "philschmid/llama-3-1-8b-instruct-medusa", "the tokenizer's chat template (Llama 3 headers)",
               "<|eot_id|>", "cuda"),
    KnownModel("Mistral-7B-Instruct-v0.2 + Medusa heads (CUDA)", "mistralai/Mistral-7B-Instruct-v0.2",
               "text-generation-inference/Mistral-7B-Instruct-v0.2-medusa",
               "the tokenizer's chat template ([INST] ... [/INST])", "</s>", "cuda"),
    KnownModel("Zephyr-7B beta, Medusa-2 (CUDA)", None, "FasterDecoding/medusa-1.0-zephyr-7b-beta",
               "the tokenizer's chat template (<|user|> / <|assistant|>)", "</s>", "cuda"),
)

# The page's decoding controls once the CPU default (SmolLM2 + its heads) has loaded: exact sampling
# at the default temperature, which repeats itself far less than greedy or typical acceptance on this
# small model (measured in docs/cpu_default.md, "Sampling defaults for the app"). Greedy stays one click away.
CPU_DEFAULTS = Settings(mode="sample")


def default_settings(loaded) -> Settings:
    """The decoding controls a freshly loaded model starts with."""
    return CPU_DEFAULTS if loaded.cpu_default else Settings()


def start_settings(spec: LoadSpec) -> Settings:
    """The decoding controls the page opens with while ``spec`` (launch.py's model) loads: the ones it will
    have once loaded, so a choice made meanwhile is not replaced when it is ready. Decided from the spec
    as the loader decides ``Loaded.cpu_default`` (SmolLM2's converted backbone, named or not, with the
    bundled heads, not on CUDA)."""
    try:
        on_cpu = not resolve_device(spec.device).startswith("cuda")
    except LoadError:
        return Settings()       # the load itself reports the bad device
    smollm2_backbone = spec.model is None or is_cpu_default_backbone(Path(spec.model).expanduser())
    bundled = (spec.heads is None and spec.model is None) or is_bundled_heads(spec.heads)
    return CPU_DEFAULTS if on_cpu and smollm2_backbone and bundled else Settings()


def known_label(spec: LoadSpec, device_type: str) -> str | None:
    """The label of the Known models entry that ``spec`` loads on a ``device_type`` machine (launch.py's
    default spec names no model: the entry of the machine's default); None for any other model."""
    model, heads = spec.model, spec.heads
    if model is None and heads is None:
        model, heads = (CUDA_MODEL, CUDA_HEADS) if device_type == "cuda" else (None, str(CPU_DEFAULT_HEADS))
    return next((entry.label for entry in KNOWN_MODELS if (entry.model, entry.heads) == (model, heads)), None)


EMPTY_LINE = "No model loaded: pick one under Model and press Load"
NONE_LOADED = "no model is loaded"      # said after a failed load's reason where no model was loaded before it


@dataclass(frozen=True)
class SlotState:
    """What the page shows about the model: ``phase`` is loading, ready, failed or empty."""

    phase: str
    line: str                 # one line for the status bar
    version: int              # changes whenever the engine or phase changes
    engine_version: int       # changes only when the engine is replaced (a load that fails keeps it)
    engine: ChatEngine | None = None   # the engine of that version, read in the same snapshot
    error: str | None = None           # why the last load failed (the model before it may still be loaded)
    ready_line: str = ""               # the loaded model's Ready line, also while ``line`` says a switch failed
    # the loaded model in full (its weights, kernels, fidelity check, heads, memory): the Model panel's, not the
    # status line's (QA: a five-line paragraph of internals on every page view, where a user looks for the tree)
    details: str = ""

    @property
    def model_line(self) -> str:
        """The status line for what answers now: the loaded model's Ready line, also after a switch failed beside
        it. That failure is news for the tab that pressed Load, as it happens (``line``), not for every later
        answer and page (QA: every visitor's status line showed another tab's failed Load after each answer)."""
        return self.ready_line if self.phase == "ready" and self.ready_line else self.line


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def memory_now() -> str:
    """Memory in use now: GPU allocated on CUDA, the process's resident size elsewhere."""
    if torch.cuda.is_available():
        return f"GPU {_size(torch.cuda.memory_allocated())} allocated"
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return f"process {_size(int(line.split()[1]) * 1024)} resident"
    return "memory use unknown on this system"


def downloaded(source: str | None) -> int:
    """Bytes of ``source`` (a hub repo id) in the hub cache so far, partial files included:
    the page's download progress. 0 for local directories."""
    from huggingface_hub.constants import HF_HUB_CACHE

    total = 0
    try:
        if not source or "/" not in source or Path(source).expanduser().exists():
            return 0
        blobs = Path(HF_HUB_CACHE) / f"models--{source.replace('/', '--')}" / "blobs"
        for f in blobs.glob("*") if blobs.is_dir() else ():
            try:
                total += f.stat().st_size
            except OSError:     # renamed as it completed (x.incomplete -> x) since the glob: counted under its new name
                continue
    except OSError:             # a name no file system takes (too long): nothing downloads under it
        return 0
    return total


def out_of_memory_fix(spec: LoadSpec) -> str:
    """What would make ``spec`` fit: only the options it does not use already (a model already in NF4, the
    CUDA default, was told "use quant nf4")."""
    fixes = [] if spec.quant in ("auto", "nf4") else ["--quant nf4"]     # auto is NF4 on CUDA
    if spec.heads_quant == "none" and (spec.heads is not None or spec.model is None):    # None: the default's heads
        fixes.append("--heads-quant nf4 (the heads' vocabulary projections: about 1 GB at 7B)")
    if spec.model is None and spec.heads is None:      # the default: the CPU's is the model that fits anywhere
        fixes.append("--device cpu (SmolLM2-135M-Instruct)")
    return f"try {', '.join(fixes + ['a smaller model, or unload the current one first'])}"


class ModelSlot:
    """The current ChatEngine (or None) and the load in progress. ``loader`` is
    ``medusa_core.loading.load.load`` (called with the spec and ``progress=``); tests pass one that
    waits, to see the page mid-load."""

    def __init__(self, *, max_new_tokens: int = 256, loader: Callable[[LoadSpec], object] = load,
                 log: Callable[[str], None] = print) -> None:
        self.max_new_tokens = max_new_tokens
        self._loader, self._log = loader, log
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.engine: ChatEngine | None = None
        self._phase, self._line, self._version = "empty", EMPTY_LINE, 0
        self._ready_line = ""       # the loaded model's Ready line, which a dismissed failure gives back
        self._details = ""          # the loaded model's description and memory (SlotState.details)
        self._engine_version = 0
        self._error: str | None = None
        self._kept = ""             # what a failed switch says of the loaded model: its name and tree line
        self._loading: LoadSpec | None = None
        # the Known models entry of the model loaded last, kept after an Unload: Load then loads it again (QA:
        # the list went blank, and Load said no model was given)
        self._known: str | None = None
        self._started = 0.0
        self._retiring: list[ChatEngine] = []     # replaced engines, until _retire closes them

    # ---- state
    @property
    def loading(self) -> bool:
        """Whether a load runs now (cheaper than state(), which looks at the download)."""
        with self._lock:
            return self._phase == "loading"

    def known_label(self) -> str | None:
        """The Known models entry the loaded model is, if it is one, or after an Unload the one it was: a page
        opened shows it picked (QA: the list was blank beside its own loaded entry)."""
        with self._lock:
            return self._known

    def state(self) -> SlotState:
        with self._lock:
            line = self._line
            if self._phase == "loading":
                got = sum(downloaded(s) for s in (self._loading.model, self._loading.heads))
                line += f" {time.perf_counter() - self._started:.0f} s"
                line += f" · downloaded {_size(got)}" if got else ""
            loaded = self.engine is not None
            return SlotState(self._phase, line, self._version, self._engine_version, self.engine, self._error,
                             self._ready_line if loaded else "", self._details if loaded else "")

    def _set(self, phase: str, line: str, engine: ChatEngine | None = None, replace_engine: bool = False,
             error: str | None = None) -> None:
        with self._lock:
            self._commit(phase, line, engine, replace_engine, error)
        self._retire(engine)

    def _commit(self, phase: str, line: str, engine: ChatEngine | None, replace_engine: bool,
                error: str | None) -> None:
        """The new state, under the lock; the engine it replaces goes to ``_retiring``, for ``_retire`` once the lock
        is let go."""
        self._error = error
        if replace_engine:
            if self.engine is not None:
                self._retiring.append(self.engine)
            self.engine = engine
            self._engine_version += 1
        self._phase, self._line = phase, line
        self._version += 1
        self._ready.notify_all()

    def _swap(self, engine: ChatEngine, spec: LoadSpec, ready_line: str, details: str) -> None:
        """``engine``, loaded from ``spec``, answers from now on (the line still says the load runs); the one it
        replaces is retired. Its Known models entry, Ready line and details go with it, in the same hold of the
        lock: a page synced in between showed the new model beside the old one's entry (QA), or its details."""
        with self._lock:
            self._known = known_label(spec, engine.device.type)
            self._ready_line, self._details = ready_line, details
            self._commit(self._phase, self._line, engine, True, self._error)
        self._retire(engine)

    def _retire(self, new: ChatEngine | None) -> None:
        """Close the engines replaced since the last call, and free their memory. Only ``_retiring`` held them:
        a caller's own reference kept a model alive past the memory figure said after it (QA: Unload said
        921 MiB resident where the process was at 724 MiB a moment later)."""
        with self._lock:
            retiring, self._retiring = self._retiring, []
        if not retiring:
            return
        while retiring:
            old = retiring.pop()
            if new is None:
                old.close("the model was unloaded")
                continue
            # the same model loaded again is not "another model" (QA: a Load of the model already loaded said so)
            what = "the model was loaded again" if old.loaded.source == new.loaded.source else "another model was loaded"
            old.close(f"{what}: ask again to have it answer")
        free_memory()

    def wait(self, timeout: float) -> SlotState:
        """Block while a load runs (up to ``timeout`` s); the state after."""
        with self._lock:
            self._ready.wait_for(lambda: self._phase != "loading", timeout)
        return self.state()

    # ---- actions
    def start(self, spec: LoadSpec) -> str | None:
        """Load ``spec`` in the background; a one-line refusal if a load is already running."""
        what = self._describe(spec)     # before the slot changes: a fault in it left the slot "loading" for good
        with self._lock:
            if self._phase == "loading":
                return f"a model is still loading ({self._describe(self._loading)}): wait for it to finish"
            self._phase, self._loading, self._started = "loading", spec, time.perf_counter()
            self._error = None
            self._line = f"⏳ Loading {what}…"
            self._version += 1
        threading.Thread(target=self._load, args=(spec,), name="model-load", daemon=True).start()
        return None

    def unload(self) -> str:
        # the check and the change in one hold of the lock: a Load started between them ran while the slot
        # said "No model loaded", and a second Load was taken beside it
        with self._lock:
            if self._phase == "loading":
                return "a model is loading: unload it once it has loaded"
            self._commit("empty", EMPTY_LINE, None, True, None)
        self._retire(None)
        memory = memory_now()
        line = f"Model unloaded · {memory}"
        with self._lock:     # the status keeps it: the page replaced it with EMPTY_LINE at its next sync (QA: 0.6 s)
            if self._phase == "empty" and self._line == EMPTY_LINE:
                self._line = f"{EMPTY_LINE} · unloaded: {memory}"
                self._version += 1
        self._log(line)
        return line

    def stop_answers(self) -> None:
        """The app is exiting: every answer on the loaded model ends at its next step (no wait: a signal handler
        calls this)."""
        engine = self.engine
        if engine is not None:
            engine.close("the app is shutting down")

    def shut_down(self, timeout: float) -> bool:
        """The app is exiting: every answer ends at its next step, and this waits up to ``timeout`` s for the
        loaded model's thread to leave torch (ChatEngine.shut_down); True once it has (or no model is loaded).
        Replaced models' engines were closed when replaced."""
        with self._lock:
            engine = self.engine
        return engine is None or engine.shut_down(timeout)

    def dismiss_failure(self) -> None:
        """A Load the page refused before starting (no model given) supersedes the last failed load: its
        error leaves the status line, which says again what is loaded (the refusal has its own line)."""
        with self._lock:
            if self._phase == "loading" or not self._line.startswith("❌"):
                return
            self._phase, self._line = ("ready", self._ready_line) if self.engine is not None else ("empty", EMPTY_LINE)
            self._error = None
            self._version += 1

    def _load(self, spec: LoadSpec) -> None:
        what = self._describe(spec)
        self._log(f"Loading {what}…")
        try:
            old = self.engine     # still answering meanwhile: kernel timings taken beside it are not kept
            with beside(lambda: old.queue.activity() if old is not None else (False, 0)):
                loaded = self._loader(spec, progress=self._progress)
            replacing, old = old is not None, None    # this frame's reference kept the old model from being freed
            with self._lock:
                self._line = "⏳ Building the decoding trees…"
            engine = ChatEngine(loaded, max_new_tokens=self.max_new_tokens)
        except (LoadError, TreeError) as err:
            self._fail(f"{err}")
            return
        except torch.OutOfMemoryError:
            self._fail(f"out of GPU memory while loading {what}: {out_of_memory_fix(spec)}")
            return
        except Exception as err:   # a thread boundary: a fault nothing foresaw must still end the load, or the
            traceback.print_exc()  # slot stayed "loading" for good: every Load, Unload and message refused or waiting
            first = next(iter(str(err).splitlines()), "")[:200]
            self._fail(f"could not load {what}: {type(err).__name__}: {first} (the console has the details; "
                       "check the model's files, or load another)")
            return
        seconds = time.perf_counter() - self._started
        line = f"Ready · {loaded_name(loaded)} · {runs_as(engine)} · loaded in {seconds:.1f} s"
        if loaded.tree_note:   # on a line of its own: which tree runs, and why, is what a user looks for
            line += f"\n\n{loaded.tree_note}"
        if self.max_new_tokens > engine.context:   # said, as the page says a value typed past the slider (QA)
            line += (f"\n\n--max-new-tokens {self.max_new_tokens} is more than this model's {engine.context:,}-token "
                     f"context: its default is {engine.max_new_tokens}")
        memory = loaded.memory
        if replacing:
            # the new engine answers from here on and the old model is freed before the memory is told: measured
            # during the load, it counted both models (QA: a second load of SmolLM2 said 1.88 GiB for 1.18)
            try:
                self._swap(engine, spec, line, f"{loaded.description} · memory: measuring, now the old model is freed")
                memory = memory_report(loaded.model, loaded.heads, str(engine.device))
            except Exception as err:   # the load still ends (review: a fault here left the slot "loading" for good)
                traceback.print_exc()
                memory = f"memory: not measured ({type(err).__name__}: the console has the details)"
        details = f"{loaded.description} · {memory}"
        with self._lock:
            self._ready_line, self._details = line, details
            self._known = known_label(spec, engine.device.type)
            self._kept = f"{loaded_name(loaded)} is still loaded" + (f"\n\n{loaded.tree_note}" if loaded.tree_note
                                                                      else "")
        self._set("ready", line, engine, replace_engine=self.engine is not engine)   # (swapped in above, or not yet)
        self._log(f"{line}\n\n{details}")

    def _progress(self, line: str) -> None:
        """A long step of the load (the first start's tree tuning): the page's line and the console."""
        with self._lock:
            self._line = f"⏳ {line[:1].upper()}{line[1:]}…"
        self._log(line)

    def _fail(self, message: str) -> None:
        keep = self.engine is not None
        self._log(f"error: {message}")
        # what answers now, either way (QA: after an Unload, the error alone left Send grey with no reason)
        self._set("failed" if not keep else "ready",
                  f"❌ {message} · {self._kept if keep else NONE_LOADED}", error=message)

    @staticmethod
    def _describe(spec: LoadSpec) -> str:
        if spec.model is None and spec.heads is None:
            try:
                on_cpu = not resolve_device(spec.device).startswith("cuda")
            except LoadError:
                on_cpu = False   # the load itself reports the bad device
            if not on_cpu:
                return "the default model for this machine"
            try:
                first = not smollm2.is_converted()
            except smollm2.MissingModel:
                first = False   # the load itself says how to install it
            # the first start converts SmolLM2 (half a minute or more): say why it takes a while
            return f"{SMOLLM2} with its Medusa heads" + (" (the CPU default; this first start converts it into "
                                                         "your cache: half a minute on two idle cores, longer on a "
                                                         "busy machine)" if first else "")
        what = spec.model or (SMOLLM2 if is_bundled_heads(spec.heads) else f"{spec.heads} (its base model, or itself for a Medusa-2 model)")
        return what + (f" with heads {spec.heads}" if spec.heads else "")


def loaded_name(loaded) -> str:
    """The loaded model in a few words: its hub id or its directory's name, and whether heads came with it."""
    name = str(getattr(loaded.model.config, "name_or_path", "") or "the model")
    return (Path(name).name if Path(name).is_absolute() else name) + \
        (" with its Medusa heads" if loaded.heads is not None else "")


def runs_as(engine: ChatEngine) -> str:
    """How the weights run, in a few words: "int4 on cpu", "NF4 on cuda", "bfloat16 on cuda"."""
    return f"{engine.weights or str(engine.dtype).removeprefix('torch.')} on {engine.device.type}"


def spec_for(choice: str | None, model: str, heads: str, base: LoadSpec) -> LoadSpec:
    """The LoadSpec of the page's model controls: a typed model (and heads) wins over the list.
    The command line's --tree and --retune were for the model it started with: another model gets
    its own tuned tree (from the cache when this machine has measured it)."""
    # the scripting API passes its values as sent (a number reached .strip() as a traceback's last line: QA)
    for what, value, fix in (("model choice", choice, "a label from Known models"),
                             ("model id", model, "a hub id or a local directory"),
                             ("heads id", heads, "a hub id or a local directory")):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{what} {value!r} is not text: give {fix} as a string")
        if value and any(ord(c) < 32 for c in value.strip()):   # a NUL made the path code raise in the slot (review)
            raise ValueError(f"{what} {value[:80]!r} holds a control character: give {fix} without it")
    model, heads = (model or "").strip(), (heads or "").strip()
    base = replace(base, tree=None, retune=False)
    if model or heads:
        return replace(base, model=model or None, heads=heads or None)
    for entry in KNOWN_MODELS:
        if entry.label == choice:
            return replace(base, model=entry.model, heads=entry.heads)
    if not choice:
        raise ValueError("no model given: pick one from Known models, or type a hub id or local directory")
    raise ValueError(f"model choice {choice!r} is unknown: pick one from the list, or type a hub id or directory")
