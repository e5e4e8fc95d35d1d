"""The chat engine: one loaded model shared by every browser tab, generation one
request at a time, and per-tab state (conversation, KV caches, Stop flag) owned by the tab.

``ChatEngine.answer`` is a generator the UI iterates: it waits its turn in the
request queue (yielding its place), then streams each pass's reply and live
Stats. A comparison runs plain decoding and Medusa step-interleaved, so both see
the same machine load. It holds no Gradio objects, so tests drive it directly.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from medusa_core.decoding.config import DecodeConfig, SettingError
from medusa_core.decoding.generate import generate, max_context, new_cache, prefill_piece
from medusa_core.decoding.step import compute_dtype
from medusa_core.decoding.step_store import needs_capture
from medusa_core.decoding.tree import TreeBuffers
from medusa_core.loading.memory import free_memory

from .detok import Detokenizer
from .render import plain_text
from .readout import Comparison, Meter, Stats, explain_divergence, interleaved_ratios
from .session import RequestQueue, Session, drop_every_cache
from .settings import Settings
from .trees import TreeCatalogue

BASELINE, MEDUSA, COMPARISON = "baseline", "medusa", "comparison"
LABELS = {BASELINE: "Plain decoding", MEDUSA: "Medusa"}
UPDATE_SECONDS = 0.05  # stream at most ~20 updates/s: the browser gains nothing from more
# No step runs while the page renders an update, and rendering grows with the reply (its whole Markdown
# each time): a 3,000-character reply at 30 ms steps took 28% longer. Updates are spaced so that the
# rendering takes at most this share of the answer's time.
RENDER_SHARE = 0.1
PREPARING = "preparing tree (first use)…"
# the Medusa pane's label where the tuner found that no tree pays on this machine (tree_tuning.py)
NO_SPEEDUP = "Plain decoding: Medusa gives no speedup {cause}"   # cause: TunedTree.no_speedup_cause
STOP_HINT = " (Stop works meanwhile)"     # for the page; an API client has no Stop (openai_api leaves it out)

@dataclass(frozen=True)
class Update:
    """One streamed state of a request. ``queued`` > 0: waiting, that many requests ahead."""

    pass_name: str = MEDUSA
    segments: tuple[tuple[str, bool], ...] = ()   # the reply so far: (text, came from the heads)
    stats: Stats = field(default_factory=Stats)
    tokens: tuple[int, ...] = ()
    queued: int = 0
    notice: str | None = None          # a status line, e.g. while a CUDA graph is captured
    comparison: Comparison | None = None
    error: str | None = None
    done: bool = False

    @property
    def plain(self) -> str:
        return plain_text(self.segments)


def oom_message() -> str:
    return ("out of GPU memory while generating: the conversation's cache was freed; "
            "lower max new tokens, pick a smaller tree, or clear the conversation")


class EngineClosed(RuntimeError):
    """The engine was unloaded or replaced while a request still used it; the message says which."""


def fault_note(err: Exception) -> str:
    """The one line an answer ends with after a fault nothing foresaw. A CUDA error stays with the process
    (every later CUDA call fails too), so asking again cannot help there."""
    first_line = next(iter(str(err).splitlines()), "")
    advice = "restart the app: a CUDA error stays with the process" if "CUDA error" in str(err) else "ask again"
    return f"the answer failed: {type(err).__name__}: {first_line} (the console has the details; {advice})"


class DecoderRun:
    """One decoder's run over a prompt: its generate() iterator, meter and text so far."""

    def __init__(self, engine: "ChatEngine", name: str, prompt_ids: list[int], config: DecodeConfig,
                 tree_name: str, tree: TreeBuffers, cache, should_stop) -> None:
        label = engine.medusa_label(tree_name) if name == MEDUSA else LABELS[name]
        if name == BASELINE or tree.num_heads == 0:
            tree_name, tree, heads = "baseline", engine.trees.buffers("baseline"), None
        else:
            heads = engine.heads
        self.engine, self.name, self.tree, self.config, self.cache = engine, name, tree, config, cache
        self.meter = Meter(label, tree_name, tree.size, tree.num_heads)
        self.detok = Detokenizer(engine.tokenizer, skip=engine.loaded.stop_ids)
        self.segments: list[tuple[str, bool]] = []
        self.tokens: list[int] = []
        self.done = False
        self.steps = generate(engine.model, prompt_ids, heads=heads, tree=tree, config=config, cache=cache,
                              stop_ids=engine.loaded.stop_ids, should_stop=should_stop)

    def advance(self):
        """Run one forward pass; None once the pass has finished."""
        step = self.engine.on_model_thread(next, self.steps, None)
        if step is None:
            self.done = True
            return None
        closed = step.finish_reason == "cancelled" and self.engine._closed
        if closed:        # the model went (Unload, another model), not the user's Stop: ended as interrupted
            step = replace(step, finish_reason=None)
        self.meter.add(step)
        self.tokens.extend(step.tokens)
        for i, token in enumerate(step.tokens):
            piece = self.detok.add(token)
            if piece:
                self.segments.append((piece, i < step.from_heads))
        if step.finish_reason:
            self._end()
        if closed:
            raise EngineClosed(self.engine._closed)    # the answer says why it ended
        return step

    def _end(self) -> None:
        self.done = True
        tail = self.detok.flush()
        if tail:
            self.segments.append((tail, False))

    def update(self, error: str | None = None) -> Update:
        """The pass so far; with ``error``, its last: what it wrote stays (text the detokenizer still held
        included), and an answer that had begun ends "interrupted", so its readout sums it up as a stopped
        one does (it showed no summary line, as if still running), and the note says why."""
        stats = self.meter.snapshot()
        if error is not None and not self.done:
            self._end()
            stats = replace(stats, finish_reason=stats.finish_reason or "interrupted")
        return Update(self.name, tuple(self.segments), stats, tuple(self.tokens), error=error,
                      done=self.done or error is not None)


class ChatEngine:
    """The loaded model, its tree buffers (built once per tree choice) and the request queue for it."""

    def __init__(self, loaded, *, max_new_tokens: int = 256) -> None:
        self.loaded = loaded
        self.model, self.tokenizer, self.heads = loaded.model, loaded.tokenizer, loaded.heads
        self.dtype = compute_dtype(self.model)   # the activations' dtype (4-bit weights are uint8)
        self.device = self.model.get_output_embeddings().weight.device
        self.weights = loaded.weights   # what a greedy divergence is explained by
        self.context = max_context(self.model)
        self.max_new_tokens = min(max_new_tokens, self.context)
        self.num_heads = self.heads.config.num_heads if self.heads is not None else 0
        # measured at load: every tree is slower than plain decoding here, which runs instead
        self.no_speedup = loaded.tuned is not None and not loaded.tuned.pays
        self.no_speedup_cause = loaded.tuned.no_speedup_cause if self.no_speedup else ""
        # Every forward pass runs on this one thread, whichever thread asked (a Gradio worker, an API
        # request). torch's OpenMP keeps a thread pool per calling thread, and with pools alive in
        # several threads libgomp throttles them all: an answer decoded from a second thread ran far
        # slower (measured in docs/serving.md, "one model thread").
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._closed: str | None = None   # why the engine went (close): a request still on it ends, saying so
        self.queue = RequestQueue()
        self.trees = TreeCatalogue(self.num_heads, self.device, loaded.default_tree, loaded.tuned)

    def on_model_thread(self, fn: Callable, *args):
        """``fn(*args)`` on the engine's model thread (the caller waits): every forward pass and capture goes
        there (a cache's bookkeeping, as a rewind, runs on the caller's thread while the queue keeps the model
        thread idle). EngineClosed once the engine is closed."""
        if self._closed:
            raise EngineClosed(self._closed)
        try:
            future = self._model_thread.submit(fn, *args)
        except RuntimeError:       # closed between the check and the submit, or the interpreter is exiting (Ctrl+C:
            # an API stream was told "the model was unloaded")
            raise EngineClosed(self._closed or "the app is shutting down") from None
        try:
            return future.result()
        finally:
            # a raised error's traceback holds this frame, which held the future, which holds the error: a cycle
            # that kept a failed step's cache and activations until a garbage collection (an OOM's retry met them)
            del future

    def close(self, reason: str = "the model was unloaded") -> None:
        """Let the model thread go (with its OpenMP pool) once the engine is replaced or unloaded; a request
        still on it ends at its next step with ``reason`` (it used to end on a raw executor error)."""
        self._closed = reason
        self._model_thread.shutdown(wait=False)

    def shut_down(self, timeout: float) -> bool:
        """Close for the app's exit and wait up to ``timeout`` s for the model thread to end the step it is in
        (a request on it ends at its next step, saying the app is shutting down): True once it has. Why: the
        interpreter's exit with that thread inside torch aborted ("terminate called without an active
        exception", exit -6), so a Ctrl+C or docker stop during an answer ended in a crash, skipping the exit's
        clean-up."""
        self.close("the app is shutting down")
        waiter = threading.Thread(target=self._model_thread.shutdown, name="model-exit", daemon=True)
        waiter.start()                    # shutdown(wait=True) has no timeout of its own
        waiter.join(timeout)
        return not waiter.is_alive()

    # ---- trees
    def medusa_label(self, tree_name: str | None) -> str:
        """What the Medusa pane runs with ``tree_name`` ("" or None: the default tree), as its title
        and its readout name it: Medusa; plain decoding where the tree has no heads, and why where
        the tuner found that no tree pays on this machine."""
        name = self.trees.shown_name(tree_name or self.trees.default)
        if not self.trees.listed(name) or self.trees.buffers(name).num_heads:
            return LABELS[MEDUSA]
        return NO_SPEEDUP.format(cause=self.no_speedup_cause) if self.no_speedup else LABELS[BASELINE]

    def check(self, settings: Settings) -> tuple[DecodeConfig, str, TreeBuffers]:
        """The decode config, tree name and tree of ``settings``; ValueError in one line."""
        config = settings.decode_config()
        if config.max_new_tokens > self.context:
            raise SettingError("max_new_tokens", f"{config.max_new_tokens} is more than the model's context "
                               f"({self.context} tokens): use at most {self.context}")
        name = self.trees.shown_name(settings.tree or self.trees.default)
        if not self.trees.listed(name):
            self.trees.offer(name, self.on_model_thread)
        return config, name, self.trees.buffers(name)

    # ---- prompts
    def prompt_ids(self, messages: list[dict], system: str | None) -> list[int]:
        from medusa_core.loading.chat_format import render_chat

        # a blank system prompt is none: the model's own default, not a prompt of spaces
        return render_chat(self.tokenizer, messages, system=system if system and system.strip() else None)

    def fit_prompt(self, session: Session, message: str, system: str | None, settings: Settings
                   ) -> tuple[list[int], str | None]:
        """The prompt for ``message`` after the conversation, leaving room for the answer. When it
        does not fit the context, the oldest exchanges are cut (the system prompt stays); the
        cut is kept in ``session.first_turn`` and announced in the returned one-line notice."""
        tree = self.trees.buffers(settings.tree or self.trees.default)
        # at most a quarter of the context is held for the answer, so that a long max new tokens does not
        # push the conversation out of the prompt; an answer longer than the room left ends at the context
        answer = min(int(settings.max_new_tokens), self.context // 4)
        reserve = answer + tree.size      # a verification step writes the whole tree's rows past the answer
        exchanges = session.exchanges()
        whole = None                      # the prompt with every exchange: whether the answer's room cut it
        for drop in range(len(exchanges) + 1):
            messages = [m for _, user, reply in exchanges[drop:]
                        for m in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]
            ids = self.prompt_ids(messages + [{"role": "user", "content": message}], system)
            whole = len(ids) if whole is None else whole
            if len(ids) + reserve <= self.context:
                if not drop:
                    return ids, None
                session.first_turn = exchanges[drop - 1][0] + 1
                # all that are out by now, those an earlier message cut included (it counted only this cut's)
                out = sum(1 for t in session.turns[:session.first_turn] if t.user and t.reply is not None)
                exchanges_out = f"{out} exchanges" if out > 1 else "exchange"     # QA NIT: "the oldest 1 exchange"
                note = (f"the oldest {exchanges_out} left the model's prompt to fit its {self.context:,}-token context "
                        "(still shown here)")
                if whole + tree.size < self.context:
                    # the conversation fitted; a large Max new tokens took its room (QA: a pasted document went
                    # for an answer that used 42 of the 2,048 tokens held for it, and the note blamed the context)
                    note += (f": {answer:,} tokens are kept for the answer (Max new tokens "
                             f"{int(settings.max_new_tokens):,}), and a lower Max new tokens keeps more of the conversation")
                return ids, note
        system = system if system and system.strip() else None
        alone = len(self.prompt_ids([{"role": "user", "content": message}], None))
        fixes = []
        room = self.context - len(ids) - tree.size      # the longest answer that fits with the message
        if room >= 1:       # QA: a paste that fitted with a lower Max new tokens was told only to shorten itself
            fixes.append(f"lower Max new tokens to {room:,} or less")
        fixes.append("shorten the system prompt (the message fits without it)"
                     if system and alone + reserve <= self.context else "shorten the message")
        # with no system prompt given, the extra tokens are the chat format's (and its default system prompt's)
        what = "with the system prompt" if system else "in the model's chat format"
        raise ValueError(f"the message needs {len(ids):,} tokens {what}, and {reserve:,} are kept for the answer "
                         f"({answer:,} new tokens and {tree.size} for the tree's verification), but the model's "
                         f"context is {self.context:,}: {', or '.join(fixes)}")

    # ---- answering
    def answer(self, session: Session, prompt_ids: list[int], settings: Settings,
               passes: Sequence[str] = (MEDUSA,)) -> Iterator[Update]:
        """Stream one request; with both passes, a step-interleaved comparison."""
        try:
            config, tree_name, tree = self.check(settings)
        except (ValueError, EngineClosed) as err:   # one line each: DecodeConfig, TreeError, or the engine
            yield Update(error=str(err), done=True)    # closed while a typed tree was being built
            return
        ticket = self.queue.join()
        try:
            # the Stop checked before the place: one pressed as the turn came (or with nobody ahead) is said too
            # (it ended the request without a word, the status line saying Ready as if it had answered)
            while True:
                ahead = self.queue.wait(ticket, 0.25)
                if session.cancel.is_set() or self._closed:
                    yield Update(error=f"stopped while waiting: {self._closed}" if self._closed else
                                 "stopped while waiting for the model", done=True)
                    return
                if not ahead:
                    break
                yield Update(queued=ahead)
            caches = session.caches_for(self)
            for name in passes:
                if name not in caches:     # (setdefault would build a cache each request, to throw it away)
                    caches[name] = new_cache(self.model)
            pane_caches = [caches[name] for name in passes]
            # Both panes prefill the same tokens: a pane whose cache fell behind (compare was off for some
            # turns) would otherwise prefill the whole conversation and show a slower first token.
            held = max(cache.length for cache in pane_caches)
            shared = min(cache.reuse_prefix(prompt_ids) for cache in pane_caches)
            for cache in pane_caches:
                cache.rewind(shared)
            # the prompt's pieces are read inside one call: the unloaded or replaced model stops between them
            # too (it read a long prompt to its end, taking the cores from the model after it)
            runs = [DecoderRun(self, name, prompt_ids, config, tree_name, tree, cache,
                               lambda: session.cancel.is_set() or self._closed is not None)
                    for name, cache in zip(passes, pane_caches)]
            if any(needs_capture(self.model, r.cache, r.tree, config, len(prompt_ids)) for r in runs):
                yield Update(notice=PREPARING)
            if len(prompt_ids) - shared > prefill_piece(self.device):   # read in pieces: seconds on a CPU, say why
                # kept tokens past the shared start no longer match (the oldest exchange left the context, the
                # system prompt changed, a pane joined): "new" read as a short follow-up of 8,097 tokens (QA). Said
                # of the tokens, not of a conversation: the API's requests share caches, and a request of another
                # conversation heard that its conversation "changed" (API QA)
                what = "prompt tokens before the answer, from where they differ from what the model read last" \
                    if shared < held - 1 else "new prompt tokens before the answer"
                yield Update(notice=f"reading {len(prompt_ids) - shared:,} {what}{STOP_HINT}…")
            yield from self._drive(session, runs, settings)
        finally:
            self.queue.leave(ticket)

    def _drive(self, session: Session, runs: list[DecoderRun], settings: Settings) -> Iterator[Update]:
        """Advance the passes, always the one that has emitted fewer tokens (baseline first on a
        tie): the two decoders alternate at the scale of single steps, so background load hits
        both alike, and both reach the same point of the answer at about the same time."""
        events: list[tuple[str, int, float]] = []   # (pass, tokens, seconds) of steps taken while both ran
        last_yield, interval = 0.0, UPDATE_SECONDS
        ended: set[str] = set()                     # passes whose last update was yielded
        try:
            while active := [r for r in runs if not r.done]:
                run = min(active, key=lambda r: (len(r.tokens), r.name != BASELINE))
                step = run.advance()
                if step is not None and step.tokens and not step.prefill and len(active) == len(runs) > 1:
                    events.append((run.name, len(step.tokens), step.seconds))
                now = time.perf_counter()
                if run.done or (step is not None and step.prefill) or now - last_yield >= interval:
                    for r in runs:
                        if r.name not in ended:     # a pass's end is said once (its blank-answer note was added
                            yield r.update()        # again at each update of the pass still running: QA saw 102)
                            if r.done:
                                ended.add(r.name)
                    last_yield = time.perf_counter()
                    rendered = last_yield - now        # the consumer's time, while no step ran
                    # at most a second: one stall of the page (another tab loading) must not freeze the stream
                    interval = min(1.0, max(UPDATE_SECONDS, rendered * (1 - RENDER_SHARE) / RENDER_SHARE))
        except torch.OutOfMemoryError:
            # this tab's caches, and the idle tabs' and the API's: its retry has their memory too. Dropped and
            # collected while no other thread captures a graph (empty_cache asserts it; a freed graph breaks it)
            free_memory(drop=drop_every_cache)
            for r in runs:
                yield r.update(error=oom_message())
            return
        except ValueError as err:  # ContextOverflowError (the prompt does not fit), or a value a step refused
            for r in runs:
                yield r.update(error=str(err))
            return
        except EngineClosed as closed:   # Unload, or another model loaded: what was written stays
            for r in runs:
                yield r.update(error=f"stopped: {closed}")
            return
        except Exception as err:   # a fault nothing foresaw (a CUDA error, a bug): the answer ends saying so,
            traceback.print_exc()  # keeps what it wrote, and the console has the traceback for a report
            session.drop_caches()  # a step cut off midway may have written rows it never committed
            for r in runs:
                yield r.update(error=fault_note(err))
            return
        if len(runs) == 2:
            yield Update(COMPARISON, comparison=self._compare(runs, events, settings), done=True)

    def _compare(self, runs: list[DecoderRun], events: list, settings: Settings) -> Comparison:
        base, medusa = runs
        # both reached their natural end (the context's too: Medusa finishes it with the one-node step)
        finished = all(r.meter.snapshot().finish_reason in ("eos", "length", "context") for r in runs)
        identical = divergence = None
        if settings.greedy and finished:
            identical = base.tokens == medusa.tokens
            if not identical:
                divergence = explain_divergence(
                    base.tokens, medusa.tokens, decode=self.tokenizer.decode, device=self.device.type,
                    dtype=self.dtype, weights=self.weights)
        return Comparison(base.meter.snapshot(), medusa.meter.snapshot(), tuple(interleaved_ratios(events)),
                          identical, divergence, unlike=not settings.greedy and base.tokens != medusa.tokens)
