"""The chat engine: one loaded model shared by every browser tab, generation one
request at a time, and per-tab state (KV caches, Stop flag) owned by the tab.

``ChatEngine.answer`` is a generator the UI iterates: it waits its turn in the
line for the model (yielding its place), then streams the reply text and the
live Stats of each pass. It holds no Gradio objects, so tests drive it directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from medusa_core.generate import DecodeConfig, compute_dtype, generate, new_cache
from medusa_core.kv_cache import TreeKVCache
from medusa_core.tree import PRESETS, TreeBuffers, TreeError, build_tree_buffers, resolve_tree

from .readout import Meter, Stats

BASELINE, MEDUSA = "baseline", "medusa"
LABELS = {BASELINE: "Plain decoding", MEDUSA: "Medusa"}
UPDATE_SECONDS = 0.05  # stream at most ~20 updates/s: the browser gains nothing from more


@dataclass(frozen=True)
class Settings:
    """What the controls say; turned into a DecodeConfig (which validates it) per answer."""

    mode: str = "greedy"
    temperature: float = 0.7
    top_p: float = 1.0
    epsilon: float = 0.09
    delta: float = 0.3
    max_new_tokens: int = 256
    tree: str = "baseline"
    seed: int | None = None
    colour_heads: bool = False

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(
            mode=self.mode, temperature=float(self.temperature), top_p=float(self.top_p),
            epsilon=float(self.epsilon), delta=float(self.delta), max_new_tokens=int(self.max_new_tokens),
            seed=None if self.seed is None or self.seed < 0 else int(self.seed),
        )


@dataclass(frozen=True)
class Update:
    """One streamed state of a request. ``queued`` > 0: waiting, that many requests ahead."""

    pass_name: str = MEDUSA
    text: str = ""                  # the reply as shown (Markdown, maybe with head colouring)
    plain: str = ""                 # the reply as the model wrote it: what the next turn's prompt holds
    stats: Stats = field(default_factory=Stats)
    tokens: tuple[int, ...] = ()
    queued: int = 0
    error: str | None = None
    done: bool = False


@dataclass
class Turn:
    """One exchange as the tab shows it. Only turns with a reply reach the model's prompt;
    ``note`` (an error or notice) is shown in the chat and never sent to the model."""

    user: str
    reply: str | None = None       # Medusa's answer, plain text; None if it failed
    shown: str = ""                # the same, as displayed
    baseline: str | None = None    # the plain-decoding pane's answer in comparison mode
    note: str | None = None


class Session:
    """Per-tab state, kept in a gr.State: the conversation, one KV cache per decoder (the
    baseline pane's cache must not rewind Medusa's every turn) and the Stop flag."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.cancel = threading.Event()
        self.caches: dict[str, TreeKVCache] = {}
        self.busy = threading.Lock()        # one request per tab at a time

    def messages(self) -> list[dict]:
        out: list[dict] = []
        for turn in self.turns:
            if turn.user and turn.reply is not None:
                out += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.reply}]
        return out

    def __deepcopy__(self, memo: dict) -> "Session":
        # gr.State deep-copies its value; a Session is made fresh per tab and holds locks
        return self

    def drop_caches(self) -> None:
        self.caches.clear()


class Line:
    """First come, first served access to the model; waiting callers learn their place."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._line: list[object] = []   # the head of the line is generating

    def join(self) -> object:
        ticket = object()
        with self._cond:
            self._line.append(ticket)
        return ticket

    def wait(self, ticket: object, timeout: float) -> int:
        """Block up to ``timeout`` s for the model; return how many are ahead (0 = our turn)."""
        with self._cond:
            self._cond.wait_for(lambda: self._line[0] is ticket, timeout)
            return self._line.index(ticket)

    def leave(self, ticket: object) -> None:
        with self._cond:
            self._line.remove(ticket)
            self._cond.notify_all()


class Detokenizer:
    """Incremental decoding: each new token decodes only a small window behind it, so the
    cost per token is constant, and text is released only once complete (a UTF-8 character
    split over byte tokens shows as U+FFFD until its last byte arrives)."""

    def __init__(self, tokenizer, skip: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip = set(skip)
        self.ids: list[int] = []
        self.prefix = 0   # window start: one token before the released text, for leading-space rules
        self.read = 0     # tokens whose text has been released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


def oom_message() -> str:
    return ("out of GPU memory while generating: the conversation's cache was freed; "
            "lower max new tokens, pick a smaller tree, or clear the conversation")


class ChatEngine:
    """The loaded model, its tree buffers (built once per tree choice) and the line for it."""

    def __init__(self, loaded, *, extra_trees: Sequence[str] = (), max_new_tokens: int = 256) -> None:
        self.loaded = loaded
        self.model, self.tokenizer, self.heads = loaded.model, loaded.tokenizer, loaded.heads
        self.max_new_tokens = max_new_tokens
        self.dtype = compute_dtype(self.model)   # the tree mask's dtype (4-bit weights are uint8)
        self.device = self.model.get_output_embeddings().weight.device
        self.num_heads = self.heads.config.num_heads if self.heads is not None else 0
        self._trees: dict[str, TreeBuffers] = {}
        self._trees_lock = threading.Lock()
        self.line = Line()
        self.tree_choices = self._tree_choices([*extra_trees, loaded.default_tree])  # the user's --tree first
        self.default_tree = self.tree_choices[0][1]

    # ---- trees
    def _tree_choices(self, preferred: Sequence[str]) -> list[tuple[str, str]]:
        """(label with node count, spec) for every tree the loaded heads can fill; the trees the
        user named come first. A named tree that does not fit raises TreeError at startup."""
        choices: list[tuple[str, str]] = []
        for spec in [*dict.fromkeys(s for s in preferred if s)]:
            if self.num_heads or spec == "baseline":
                name = Path(spec).name if spec.endswith(".json") else spec
                choices.append((f"{name} ({self.tree(spec).size} nodes)", spec))
        for spec in [*PRESETS, *(f"chain-{d}" for d in range(1, self.num_heads + 1))]:
            if spec in {s for _, s in choices}:
                continue
            try:
                choices.append((f"{spec} ({self.tree(spec).size} nodes)", spec))
            except TreeError:
                continue  # a preset deeper than the loaded heads: not offered
        if not choices:
            choices.append(("baseline (1 node)", "baseline"))
        return choices

    def tree(self, spec: str) -> TreeBuffers:
        with self._trees_lock:
            if spec not in self._trees:
                self._trees[spec] = build_tree_buffers(
                    resolve_tree(spec), self.num_heads, dtype=self.dtype, device=self.device)
            return self._trees[spec]

    # ---- prompts
    def prompt_ids(self, messages: list[dict], system: str | None) -> list[int]:
        from medusa_core.chat_format import render_chat

        return render_chat(self.tokenizer, messages, system=system or None)

    # ---- answering
    def answer(self, session: Session, prompt_ids: list[int], settings: Settings,
               passes: Sequence[str] = (MEDUSA,)) -> Iterator[Update]:
        """Stream every pass of one request, holding the model across all of them so a
        comparison's two timings are not interleaved with another tab's work."""
        try:
            config = settings.decode_config()
            tree = self.tree(settings.tree)
        except ValueError as err:  # DecodeConfig and TreeError give one-line messages
            yield Update(error=str(err), done=True)
            return
        ticket = self.line.join()
        try:
            while (ahead := self.line.wait(ticket, 0.25)) > 0:
                if session.cancel.is_set():
                    yield Update(error="stopped while waiting for the model", done=True)
                    return
                yield Update(queued=ahead)
            for name in passes:
                if session.cancel.is_set():
                    return
                ok = yield from self._one_pass(session, name, prompt_ids, config, settings, tree)
                if not ok:
                    return  # an error ends the request: the second pass would fail the same way
        finally:
            self.line.leave(ticket)

    def _one_pass(self, session: Session, name: str, prompt_ids: list[int], config: DecodeConfig,
                  settings: Settings, tree: TreeBuffers) -> Generator[Update, None, bool]:
        if name == BASELINE or tree.num_heads == 0:
            tree, tree_name, heads = None, "baseline", None
        else:
            tree_name, heads = settings.tree, self.heads
        if name not in session.caches:
            session.caches[name] = new_cache(self.model, 0)
        meter = Meter(LABELS[name], tree_name, tree.size if tree is not None else 1)
        detok = Detokenizer(self.tokenizer, skip=self.loaded.stop_ids)
        segments: list[tuple[str, bool]] = []   # (text, came from the heads)
        tokens: list[int] = []
        last_yield = 0.0
        try:
            for step in generate(self.model, prompt_ids, heads=heads, tree=tree, config=config,
                                 cache=session.caches[name], stop_ids=self.loaded.stop_ids,
                                 should_stop=session.cancel.is_set):
                meter.add(step)
                tokens.extend(step.tokens)
                for i, token in enumerate(step.tokens):
                    piece = detok.add(token)
                    if piece:
                        segments.append((piece, i < step.from_heads))
                if step.finish_reason:
                    break
                now = time.perf_counter()
                if step.prefill or now - last_yield >= UPDATE_SECONDS:
                    last_yield = now
                    shown = render_text(segments, settings.colour_heads)
                    yield Update(name, shown, "", meter.snapshot(), tuple(tokens))
        except torch.OutOfMemoryError:
            session.drop_caches()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            text = render_text(segments, False)
            yield Update(name, text, text, meter.snapshot(), tuple(tokens), error=oom_message(), done=True)
            return False
        except ValueError as err:  # ContextOverflowError: the prompt does not fit
            yield Update(name, stats=meter.snapshot(), error=str(err), done=True)
            return False
        tail = detok.flush()
        if tail:
            segments.append((tail, False))
        yield Update(name, render_text(segments, settings.colour_heads), render_text(segments, False),
                     meter.snapshot(), tuple(tokens), done=True)
        return True


def render_text(segments: list[tuple[str, bool]], colour: bool) -> str:
    """The reply as Markdown. With ``colour``, plain-prose pieces that came from the heads
    are wrapped in a span; inside code (fenced or inline) and around Markdown syntax nothing
    is wrapped, since a tag there would show literally or break the block."""
    if not colour:
        return "".join(s for s, _ in segments)
    out: list[str] = []
    fences, line_ticks, tail = 0, 0, ""   # code state so far, updated per piece (linear time)
    for text, from_heads in segments:
        in_code = fences % 2 == 1 or line_ticks % 2 == 1
        plain = not any(c in text for c in "`*_<>[]#|\\\n~")
        escaped = tail.endswith("\\")  # a backslash before the tag would make Markdown print it
        if from_heads and plain and not in_code and not escaped and text.strip():
            out.append(f'<span class="from-heads">{text}</span>')
        else:
            out.append(text)
        fences += (tail + text).count("```") - tail.count("```")
        line_ticks = text.rsplit("\n", 1)[1].count("`") if "\n" in text else line_ticks + text.count("`")
        tail = (tail + text)[-2:]
    return "".join(out)
