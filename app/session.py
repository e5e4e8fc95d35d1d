"""Per-tab state: the conversation as the tab shows it, the tab's KV caches and Stop flag, and
the queue every request waits in for the one model."""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Turn:
    """One exchange as the tab shows it. Only turns with a reply reach the model's prompt;
    ``note`` (an error or notice) is shown in the chat and never sent to the model."""

    user: str
    reply: str | None = None       # Medusa's answer, plain text; None if it failed
    shown: str = ""                # the same as displayed (HTML, maybe with head colouring)
    baseline: str | None = None    # the plain-decoding pane's answer in comparison mode
    baseline_shown: str = ""
    note: str | None = None
    system: str | None = None      # the system prompt it was answered with (None: not recorded)
    answered: dict | None = None   # how: {"settings": ..., "medusa": stats, "baseline": stats} (exports)
    in_box: bool = False           # unanswered, and its text went back to the message box to be resent
    cut: str | None = None         # the notice that its prompt cut the oldest exchanges (also in ``note``): an
    #                                answer regenerated runs without them too, and says so again

    @property
    def unanswered(self) -> bool:
        """Neither pane has an answer to it (a plain pass stopped before its first token has "")."""
        return self.reply is None and not self.baseline


@dataclass(frozen=True)
class Replaced:
    """The exchange a regenerate answers again, as it was: put back whole where no new answer comes."""

    turn: Turn
    first_turn: int                # Session.first_turn before: the new answer's prompt may cut more


# every Session's caches (each tab's, the API's shared set), held weakly: a decode that ran out of GPU memory frees
# them all (review: it freed only its own, and an idle tab's or the API's, a GB each at 7B, stayed)
_EVERY_CACHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()    # by id(): a mapping is unhashable
_EVERY_CACHES_LOCK = threading.Lock()


def drop_every_cache() -> None:
    """Every tab's and the API's KV caches dropped (each reads its conversation again at its next message): what a
    decode out of GPU memory frees. Requests decode one at a time (RequestQueue), so none of them is in use."""
    with _EVERY_CACHES_LOCK:
        every = list(_EVERY_CACHES.values())
    for caches in every:
        caches.clear()


class Session:
    """Per-tab state, kept in a gr.State: the conversation, one KV cache per decoder (the
    baseline pane's cache must not rewind Medusa's every turn) and the Stop flag."""

    def __init__(self, caches: weakref.WeakKeyDictionary | None = None) -> None:
        self.turns: list[Turn] = []
        self.first_turn = 0                 # turns before this were cut to fit the context
        self.cancel = threading.Event()
        # Stops (Clear is one) and Clears so far: a message is stopped by a Stop pressed after it was sent, while it
        # waited for the tab's turn or in Gradio's queue (clearing the flag for it wiped that Stop), and dropped by
        # a Clear. A page send's mark is taken at the click (send_started); a script's when its request starts.
        self.stops, self.clears, self._stop_lock = 0, 0, threading.Lock()
        self._sent_marks: collections.deque[tuple[int, int]] = collections.deque()   # one per click, oldest first
        self.waiting: str | None = None     # a message waiting for a model load: shown and saved, not yet a turn
        self.closed = False                 # the tab was closed or reloaded: what it asked before then does not run
        # {pass: KV cache} under the engine they belong to, held weakly: an unloaded or replaced model's
        # caches go with its engine (SmolLM2's held 250 MiB past Unload until the tab's next message). ``caches``:
        # ones shared with other Sessions that never answer at once (the API's requests)
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary() if caches is None else caches
        with _EVERY_CACHES_LOCK:
            _EVERY_CACHES[id(self._caches)] = self._caches
        self.busy = threading.Lock()        # one request per tab at a time
        # the page's sends and regenerates whose events have not all run yet: Stop stays on while there is one
        self._sends, self._sends_lock = 0, threading.Lock()
        self.export_dir: Path | None = None  # the tab's export files (app/export_files.py), made on first use
        self.typed_trees: list[str] = []    # trees typed into the picker in this tab, oldest first: kept in its list
        self.sent_copy: str | None = None   # the id the browser's copy written at the last send carries (browser_copy)
        # the model slot's version after a Load this tab refused (no model given) took an old failure off the status
        # line: its syncs keep the refusal under the Load button (QA: it gave way to the Ready line within seconds)
        self.refused_at: int | None = None
        self.busy_hint_shown = False        # whether the tab shows layout.BUSY_ELSEWHERE (model_panel.watch)

    def stop(self, clear: bool = False) -> None:
        with self._stop_lock:     # one hold: a mark taken meanwhile sees the Clear and its Stop, or neither
            self.stops += 1
            self.clears += clear
            self.cancel.set()

    def mark(self) -> tuple[int, int]:
        """(Stops, Clears) so far: what a request sent now comes after."""
        with self._stop_lock:     # as stop() counts them: never a Clear's count without its Stop's
            return self.stops, self.clears

    def sent_mark(self) -> tuple[int, int] | None:
        """The mark of the oldest click whose request has not started (requests start in the order clicked; one
        slot gave a request waiting in Gradio's queue the mark of a later click, and a Stop between them was lost);
        None for a script's request, which has no click."""
        return self._sent_marks.popleft() if self._sent_marks else None

    def start_request(self, mark: tuple[int, int]) -> bool:
        """A request that has the tab's turn begins: False where Stop (or Clear) was pressed since ``mark``, and it
        does not run; else Stop is cleared for it (a closed tab's stays set: it ends)."""
        with self._stop_lock:
            if self.stops != mark[0]:
                return False
            if not self.closed:
                self.cancel.clear()
            return True

    def cleared_since(self, mark: tuple[int, int]) -> bool:
        return self.clears != mark[1]

    def send_started(self) -> None:
        """The page's Send or Regenerate was clicked: Stop stays on until its events have run, and its request
        comes after what was pressed until now (sent_mark)."""
        with self._sends_lock:
            self._sends += 1
        self._sent_marks.append(self.mark())

    def send_ended(self) -> bool:
        """One of the page's sends has run its last event; whether the tab still answers or has one to come."""
        with self._sends_lock:
            self._sends = max(0, self._sends - 1)
        return self.answering()

    def answering(self) -> bool:
        """Whether the tab has an answer running, or a send of the page's still to start or end."""
        with self._sends_lock:
            return self._sends > 0 or self.busy.locked()

    def drop_resent(self) -> Turn | None:
        """A message is sent: the last one, if its text went back to the box unanswered (refused, or stopped
        before its first token), is what the user resends, edited or not. Kept, it showed twice. Returns it."""
        if self.turns and self.turns[-1].in_box:
            dropped = self.turns.pop()
            self.first_turn = min(self.first_turn, len(self.turns))
            return dropped
        return None

    def take_last(self) -> Replaced:
        """The last exchange, out of the conversation for a regenerate to answer again."""
        replaced = Replaced(self.turns.pop(), self.first_turn)
        self.first_turn = min(self.first_turn, len(self.turns))
        return replaced

    def put_back(self, replaced: Replaced, attempt: Turn | None = None) -> None:
        """A regenerate that gave no answer: its turn (``attempt``, where it made one) goes, and the exchange
        it would have replaced comes back as it was."""
        self.turns = [t for t in self.turns if t is not attempt] + [replaced.turn]
        self.first_turn = replaced.first_turn

    def exchanges(self) -> list[tuple[int, str, str]]:
        """(turn index, user, reply) of the turns the next prompt may hold."""
        return [(i, t.user, t.reply) for i, t in enumerate(self.turns)
                if i >= self.first_turn and t.user and t.reply is not None]

    def __deepcopy__(self, memo: dict) -> "Session":
        """A new, empty Session: how each tab gets its own from the page's gr.State(Session()), whose
        value Gradio deep-copies for every new tab as the tab's first event reads it. (A callable,
        gr.State(Session), is called by a load event of Gradio's own, which raced the page's restore:
        on some reloads it replaced the Session the restored turns had gone to.)"""
        return Session()

    @property
    def caches(self) -> dict[str, object]:
        """{pass: KV cache} of the engine this tab last used; empty once that engine is gone."""
        return next(iter(self._caches.values()), {})

    def drop_caches(self) -> None:
        self._caches.clear()

    def restart(self) -> None:
        """A new conversation: forget the turns; rewind the caches (keeping their buffers and
        captured CUDA graphs) unless an answer is running, which ends at the cancel, as does a message sent before
        the Clear and still waiting."""
        self.stop(clear=True)
        self.turns.clear()
        self.first_turn = 0
        if self.busy.acquire(blocking=False):
            try:
                for cache in self.caches.values():
                    cache.rewind(0)
            finally:
                self.busy.release()

    def caches_for(self, engine: object) -> dict[str, object]:
        if engine not in self._caches:      # another model: the old one's caches are useless
            self._caches.clear()
            self._caches[engine] = {}
        return self._caches[engine]


class RequestQueue:
    """First come, first served access to the model; waiting callers learn their place."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[object] = []   # the head of the queue is generating
        self.joined = 0                     # requests ever queued: one that came and went is seen by the count

    def join(self) -> object:
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
            self.joined += 1
        return ticket

    def wait(self, ticket: object, timeout: float) -> int:
        """Block up to ``timeout`` s for the model; return how many are ahead (0 = our turn)."""
        with self._cond:
            self._cond.wait_for(lambda: self._waiting[0] is ticket, timeout)
            return self._waiting.index(ticket)

    def activity(self) -> tuple[bool, int]:
        """(whether a request is generating or waiting, requests ever queued): kernel_timing.beside's probe."""
        with self._cond:
            return bool(self._waiting), self.joined

    def leave(self, ticket: object) -> None:
        with self._cond:
            self._waiting.remove(ticket)
            self._cond.notify_all()
