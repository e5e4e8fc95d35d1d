"""The conversation: a message (or a regenerate) becomes a request to the engine, and its stream
becomes the chat panes, the readouts and the status line. Clear, Stop, the browser's copy of the
conversation and the export files are here too."""

from __future__ import annotations

import inspect
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import asdict, replace

import gradio as gr

from medusa_core.decoding.config import SettingError

from .browser_copy import PENDING, FinishedCopies
from .engine import BASELINE, COMPARISON, LABELS, MEDUSA, ChatEngine, EngineClosed
from .layout import READOUT_HINT, Page
from .models import ModelSlot, SlotState
from .readout import Stats, count, render_comparison, render_live
from .render import answer_html, ended_html, note_html, reply_html, user_html
from .session import Replaced, Session, Turn
from .settings import Settings, flag, text
from .export_files import discard_tab_exports, write_tab_exports
from .transcript import from_saved, saved_compare, saved_system, to_saved

WAITING_FOR_LOAD = "waiting for the model to load: the answer starts once it is ready (Stop gives the message back)"
# a Stop pressed while the request waited for the tab's previous answer to end (Session.start_request)
STOPPED_BEFORE_START = "stopped before it started"
STOPPED_BEFORE_FIRST = "stopped before the first token"
BACK_IN_BOX = ": the message is back in the box"   # said of a sent message; a regenerate's stays in the chat
KEPT = " (the answer stays as it was)"              # said of a regenerate that gave no new answer
# the status line between Send and the first token (QA: a bare "Starting…" read as the app or model restarting)
ANSWER_STARTING = "Starting the answer…"
CANCELLED = "stopped: the request was cancelled"   # a script's job.cancel(): Gradio closed the handler
INTERRUPTED = "the page was reloaded before this answer finished: press Regenerate to answer it"
ELSEWHERE = ("another tab was still answering this message when this one opened: the answer is there, or press "
             "Regenerate to answer it here")
RELOADED = "the page was reloaded while this answer ran, which stopped it here: press Regenerate for a whole one"
NOT_COMPARED = "plain decoding did not answer this message (compare was off): Medusa's answer is in its pane"
BUSY = "Still answering your previous message: wait, or press Stop"
STOPPING_WAIT_S = 30.0   # a stopped answer ends within one step, or one prompt piece while a long prompt is read
# The readouts while a new answer has no token yet: the last answer's figures (or "stopped before the
# first token") would read as this one's, through a queue or a long prompt's reading.
READOUT_PENDING = "*measuring this answer: its figures show from its first token*"


def _msg(role: str, html: str) -> dict:
    # Text parts, not bare strings: Gradio runs inspect.cleandoc on bare strings.
    return {"role": role, "content": [{"type": "text", "text": html}]}


def display(turns: list[Turn], pane: str = MEDUSA) -> list[dict]:
    out: list[dict] = []
    for turn in turns:
        if turn.user:
            out.append(_msg("user", user_html(turn.user)))
        if pane == BASELINE and turn.baseline is None and turn.shown:
            out.append(_msg("assistant", note_html(NOT_COMPARED)))
        elif shown := turn.baseline_shown if pane == BASELINE and turn.baseline is not None else turn.shown:
            out.append(_msg("assistant", shown + ended(turn, pane)))
        if turn.note:
            out.append(_msg("assistant", note_html(turn.note)))
    return out


def ended(turn: Turn, pane: str) -> str:
    """The mark under ``pane``'s answer where it ended early (render.ENDED), from its figures: none while it
    streams (they come as it ends), and the same after a reload (the browser's copy keeps them)."""
    figures = (turn.answered or {}).get(pane)
    if not isinstance(figures, dict):     # no answer in that pane, or a damaged copy from the browser
        return ""
    reason, tokens = figures.get("finish_reason"), figures.get("tokens")
    return ended_html(reason, tokens) if isinstance(reason, str) and isinstance(tokens, int) else ""


def how_answered(settings: Settings, stats: Stats | None, base: Stats | None, comparison: str) -> dict:
    """How an answer was made, kept with its turn: the settings it ran with (the seed it drew), each pane's figures,
    and the comparison's line as the page showed it (its spread and verdict are not in the figures): a reload
    shows them again, and the exports have them."""
    return {"settings": {k: v for k, v in asdict(settings).items() if k != "colour_heads"},
            "medusa": stats.as_dict() if stats else None, "baseline": base.as_dict() if base else None,
            **({"comparison": comparison} if comparison else {})}


def said(err: Exception) -> str:
    """An error as the page words it: a setting by the label the page shows ("Max new tokens"), not by
    its field name ("max_new_tokens", the API's word)."""
    return err.labelled if isinstance(err, SettingError) else str(err)


def empty_note(stats: Stats, greedy: bool, answered_beside: bool = False) -> str:
    """Why an answer shows nothing, and what to do (review: "end-of-turn token first" was said of blanks before it,
    and "try sampling" of a sampled answer). ``answered_beside``: the plain pane answered the message, which then
    stays in the chat."""
    if stats.finish_reason == "length":
        return (f"the answer is blank ({count(stats.tokens, 'token')} of spaces or line breaks) when max new "
                "tokens was reached: raise max new tokens")
    if stats.finish_reason == "eos":
        fix = "rephrase, or try sampling" if greedy else "rephrase, or press Regenerate for another sample"
        if stats.tokens <= 1:       # the end-of-turn token counts as one
            return f"the model ended its answer at once (end-of-turn token first): {fix}"
        return f"the model ended its answer after {count(stats.tokens - 1, 'blank token')}: {fix}"
    if stats.finish_reason == "cancelled":   # Stop while a long prompt was being read
        return STOPPED_BEFORE_FIRST + ("" if answered_beside else BACK_IN_BOX)
    return "the answer is empty"


class ChatController:
    """Turns one tab's requests into page updates: ``views`` is what every chat event outputs."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot
        # each open tab's Session by Gradio's session hash, so that closing or reloading the tab stops its
        # answer (weak: a tab's Session goes with Gradio's state for it)
        self.tabs: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        self.finished = FinishedCopies()     # each sent message's conversation as its answer ended

    def tab_opened(self, session: Session, session_hash: str | None) -> None:
        """A request from the tab starts (or its page loads): the tab is alive. Gradio also runs the page's
        unload when only the tab's heartbeat connection drops (a laptop that slept, a network blip), and the
        page goes on without one: a message sent after that is the user's, and is answered (it was stopped
        before its first token, every time, until a reload). What a blip still costs: an answer running
        through it stops (Gradio's signal is the same as a closed tab's), and, with no heartbeat left,
        closing the tab later is not seen: an answer it left running runs to its end, and its caches stay
        until the model is unloaded or replaced (Gradio never expires the tab's Session)."""
        if session_hash:
            self.tabs[session_hash] = session
            session.closed = False

    def tab_closed(self, session_hash: str | None) -> None:
        """The tab was closed or reloaded: its answer stops at the next step (or prompt piece). Nobody
        reads it, and Gradio would let it run to the end while the next message, from the reloaded
        tab, waited behind it (a minute and more for a long prompt on a CPU)."""
        session = self.tabs.pop(session_hash, None) if session_hash else None
        if session is not None:
            session.closed = True     # a request that starts later (a Send queued after Stop) stops too
            session.cancel.set()
            # Its keys and values are never read again (a reloaded tab, a script's next Client, is a new
            # session): freed now, not when Gradio drops the closed session's state an hour later. Its export
            # files too: the State's delete_callback, which removed them, never ran (Gradio 6 calls it only for
            # a State some event returns), and every reload left a copy of the conversation in /tmp (QA)
            session.drop_caches()
            discard_tab_exports(session)

    def views(self, session: Session, stats: Stats | None, base: Stats | None, comparison: str,
              status_line: str, box: str | dict = gr.update(), blank: tuple[str, str] | None = None,
              error: str | None = None, partial: str | None = None) -> tuple:
        """(chat, baseline chat, readout, baseline readout, comparison, status, raw numbers, message box).
        A readout without stats stays as it is, or shows ``blank``'s text (Medusa's, plain decoding's);
        ``error``, what ended the answer, is in the raw numbers for scripts. A message waiting for a model
        (``session.waiting``) is shown after the conversation, with a note. ``partial``: the answer so far
        while it streams (its turn's reply is set when it ends), for a script reading the raw output."""
        medusa_keep, base_keep = blank or (gr.update(), gr.update())
        waiting = session.waiting
        last = session.turns[-1] if session.turns and waiting is None else None
        raw = {"medusa": stats.as_dict() if stats else None, "baseline": base.as_dict() if base else None,
               "reply": last.reply if last else None, "baseline_reply": last.baseline if last else None}
        if partial is not None and last is not None and last.reply is None:
            raw["reply"] = partial
        if last is not None and last.answered:     # the seed it sampled with (one drawn at -1 too): to run it again
            raw["seed"] = last.answered["settings"].get("seed")
        if error:
            raw["error"] = error
        turns = session.turns if waiting is None else [*session.turns, Turn(user=waiting, note=WAITING_FOR_LOAD)]
        return (display(turns), display(turns, BASELINE),
                render_live(stats) if stats else medusa_keep,
                render_live(base) if base else base_keep,
                comparison, status_line, raw, box)

    def status_while_answering(self, line: str) -> str:
        """A status line shown while an answer runs (starting, queued, reading the prompt, generating) over the Ready
        line's later paragraphs (the tree and why, a note on max new tokens): the status keeps the Ready line's
        height, so the chat under it stays in place as every answer starts and ends. (A 62 px min-height held a
        two-line Ready line only: a tree line that wrapped, as one tuned on a busy CPU does, moved the chat.)"""
        rest = self.slot.state().model_line.partition("\n\n")[2]
        return f"{line}\n\n{rest}" if rest else line

    def failed(self, session: Session, message: str, error: str) -> tuple:
        """A message that could not be answered: kept in the chat with its one-line error (never sent to
        the model), and put back in the box to be edited and resent; the raw output says it for scripts."""
        session.turns.append(Turn(user=message, note=error, in_box=True))
        # the readouts go back to their hint: the figures of the answer before read as this message's (QA NIT)
        return self.views(session, None, None, "", self.slot.state().model_line, message, blank=(READOUT_HINT, ""),
                          error=error)

    def cleared(self, session: Session) -> tuple:
        """A message sent before a Clear: the conversation went, and it with it (it landed in the cleared chat)."""
        return self.views(session, None, None, "", self.slot.state().model_line, blank=(READOUT_HINT, ""))

    def engine_or_wait(self, session: Session) -> Iterator[str | SlotState]:
        """Yield status lines while a model loads, then the slot's state with its engine; a str last means
        no engine."""
        state = self.slot.state()
        while state.phase == "loading" and not session.cancel.is_set():
            yield f"⏳ Waiting for the model: {state.line.removeprefix('⏳ ')}"
            state = self.slot.wait(0.5)
        if state.phase == "loading":   # Stop while waiting (there may be no model yet to say "stopped")
            yield "stopped while the model was loading" + BACK_IN_BOX
            return
        yield state if state.engine is not None else no_engine(state)

    @staticmethod
    def for_engine(controls: dict, shown, state: SlotState) -> dict:
        """``controls`` for the engine of ``state``: a tab whose controls still show another model (``shown``,
        the (slot version, engine version) they show; None from a script, which shows nothing) named that
        model's tree, and this one's default runs instead, as after waiting for a load (a tab's Send in the
        2 s before it caught up with a model switched elsewhere ran the old tree: plain decoding on a
        Medusa model, or a refusal). ``shown`` is the server's copy: a Send whose inputs the browser took just
        before the new model's controls reached it can still carry the old tree, a window of one round trip."""
        if shown is not None and shown[1] != state.engine_version:
            return {**controls, "tree": None}
        return controls

    @staticmethod
    def take_turn(session: Session, mark: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """The tab's lock: at once, or, where Stop (or Clear) was pressed and the answer is ending, as soon
        as it has ended: a message sent right after Stop is answered, not refused. Returns the mark the request
        came after (Session.start_request): ``mark``, the page's click's, or one taken now; None: refused."""
        if session.busy.acquire(blocking=False):
            return mark or session.mark()
        if not session.cancel.is_set():
            return None
        mark = mark or session.mark()      # taken after the flag: the Stop this message follows is counted
        return mark if session.busy.acquire(timeout=STOPPING_WAIT_S) else None

    def run(self, session: Session, message, system, compare, controls: dict, shown=None) -> Iterator[tuple]:
        """One request from the tab; ``controls`` are the raw control values by Settings field name, ``shown``
        the model version the tab's controls show (for_engine)."""
        try:     # a script's list or number is refused, not answered as its printed form
            message, system = text("message", message), text("system", system)
        except ValueError as err:
            yield self.refused(str(err))
            return
        mark = self.take_turn(session, session.sent_mark())
        if mark is None:
            yield self.refused(BUSY + " (your text stays in the box)")
            return
        try:
            yield from self._run(session, message.strip(), system, compare, controls, shown, mark)
        finally:
            session.busy.release()

    def kept(self, updates: Iterator[tuple], session: Session, system, compare) -> Iterator[tuple]:
        """The page's send or regenerate (``updates``), then the conversation as its answer ended, kept under the
        id of the browser's copy written as it was sent, where a page load finds it (FinishedCopies): the page
        shows the answer done before the follow-up event stores that copy in the browser."""
        copy_id = session.sent_copy     # none for a script: no copy was written at its send
        if copy_id:
            self.finished.started(copy_id, lambda: session.closed)
        try:
            yield from updates
        finally:     # also where Gradio closes the handler: a reload cancels the page's running event
            if copy_id:
                self.finished.ended(copy_id, self.ended_copy(session, system, compare))

    def ended_copy(self, session: Session, system, compare) -> dict | None:
        """The browser's copy as the tab's answer ended. An answer its tab's reload stopped is kept as far as it got,
        saying so (the page had shown it; QA: only a note to press Regenerate came back); one stopped before its
        first token is not: the copy written at the send comes back, with that note (INTERRUPTED)."""
        if not session.closed:
            return self.browser_copy(session, system, compare)
        last = session.turns[-1] if session.turns else None
        if last is None or last.reply is None:
            return None
        if ((last.answered or {}).get(MEDUSA) or {}).get("finish_reason") in (None, "cancelled"):  # cut, not ended
            notes = [part for part in (last.note or "").split(" · ") if part and part != CANCELLED]
            last.note = " · ".join([*notes, RELOADED])
        return self.browser_copy(session, system, compare)

    @staticmethod
    def refused(reason: str) -> tuple:
        """A request the tab does not take: a toast says why (a note in the chat would stay in the
        conversation, and a running answer's next update would overwrite a status line), and nothing on
        the page changes; the raw output says it for scripts."""
        gr.Warning(reason)
        return (*[gr.update()] * 6, {"error": reason}, gr.update())

    def unanswered(self, session: Session, message: str, error: str, replaces: Replaced | None,
                   attempt: Turn | None = None) -> tuple:
        """A request that gave no answer: a sent message fails (``failed``); a regenerate leaves the conversation
        as it was before it (its ``attempt`` goes, the exchange it replaces comes back) and the box as it is,
        and a toast says why."""
        if replaces is None:
            return self.failed(session, message, error)
        session.put_back(replaces, attempt)
        error = error.removesuffix(BACK_IN_BOX) + KEPT
        gr.Warning(error)
        # the kept answer's figures and comparison line, as a reload shows them (review: the line went blank, and
        # the raw output had no figures)
        return self.views(session, *restored_stats(session.turns), restored_comparison(session.turns),
                          self.slot.state().model_line, blank=restored_readouts(session.turns), error=error)

    def _run(self, session: Session, message: str, system: str, compare, controls: dict, shown,
             mark: tuple[int, int], replaces: Replaced | None = None) -> Iterator[tuple]:
        """``compare`` and ``controls`` as the page or a script sent them: checked here. ``mark``: what the request
        came after (Session.mark); ``replaces``: the exchange a regenerate (which has started the request) answers
        again, whose prompt's cut still holds (Session.first_turn) and so is not made, nor said, again. A
        regenerate leaves the message box as it is: it may hold the next message, being typed."""
        if not message:
            yield self.refused("The message is empty: type a question, then send")
            return
        resent = session.drop_resent()
        # its prompt's cut still holds: the answer to the message sent again says it (Turn.cut)
        cut_before = replaces.turn.cut if replaces is not None else resent.cut if resent is not None else None
        emptied = "" if replaces is None else gr.update()      # the box, as the answer starts
        if not (replaces is not None or session.start_request(mark)):
            yield self.cleared(session) if session.cleared_since(mark) else \
                self.failed(session, message, STOPPED_BEFORE_START + BACK_IN_BOX)
            return
        got, waited = None, False
        try:
            for got in self.engine_or_wait(session):
                if isinstance(got, str) and got.startswith("⏳"):
                    # in the chat while it waits, as a queued message is (it sat in the box, as if Enter did
                    # nothing), and in the browser's copy (Session.waiting)
                    waited, session.waiting = True, message
                    yield self.views(session, None, None, "", got, emptied)
        except GeneratorExit:   # cancelled while it waited (review: the exchange or the message was lost): as below,
            # a regenerate keeps the answer it would have replaced, a message stays, saying so
            if replaces is not None:
                session.put_back(replaces)
            elif not session.cleared_since(mark):
                session.turns.append(Turn(user=message, note=CANCELLED, system=system))
            raise
        finally:
            session.waiting = None
        if session.cleared_since(mark):       # Clear while it waited
            yield self.cleared(session)
            return
        try:
            if isinstance(got, str):
                raise ValueError(got)
            engine = got.engine
            # sent while another model loaded: the tree named was the old model's, this one's default runs
            controls = {**controls, "tree": None} if waited else self.for_engine(controls, shown, got)
            compare = flag("compare", compare)
            settings = Settings.parse(**controls).with_drawn_seed()
            engine.check(settings)
            prompt, cut = engine.fit_prompt(session, message, system, settings)
        except (ValueError, EngineClosed) as err:   # bad settings, no model, a message longer than the context
            yield self.unanswered(session, message, said(err), replaces)
            return
        cut = cut or cut_before
        turn = Turn(user=message, note=cut, system=system, cut=cut)
        session.turns.append(turn)
        pending = (READOUT_PENDING, READOUT_PENDING if compare else "")
        try:
            yield self.views(session, None, None, "", self.status_while_answering(ANSWER_STARTING), emptied,
                             blank=pending)
            stats, base, comparison, error = yield from self._stream(session, turn, engine, prompt, settings, compare)
        except GeneratorExit:   # cancelled (a script's job.cancel()): nothing more can be shown. The message stays,
            # saying so (it stayed on screen and was silently left out of the prompt), but a regenerate with nothing
            # new to show keeps the answer it would have replaced.
            if replaces is not None and turn.unanswered:
                session.put_back(replaces, turn)
            else:
                turn.note = " · ".join(filter(None, [turn.note, CANCELLED]))
            raise
        turn.answered = how_answered(settings, stats, base, comparison)
        if compare and turn.reply is None and not turn.note:
            turn.note = "stopped before the Medusa pass"
        if not any(t is turn for t in session.turns):   # Clear during the answer: its readouts went with it
            yield self.views(session, None, None, "", self.slot.state().model_line, blank=(READOUT_HINT, ""))
            return
        if replaces is not None and turn.unanswered:
            yield self.unanswered(session, message, error or STOPPED_BEFORE_FIRST, replaces, turn)
            return
        # A failed message goes back into the box so it can be edited and resent (and is replaced when it is:
        # unless plain decoding answered it in a comparison)
        turn.in_box = turn.unanswered
        # (one answered by the plain pane stays in the chat, so its text is not put back: sent again, it showed twice)
        box = message if turn.in_box and replaces is None else gr.update()
        # a pass that failed before its first token has no figures: the hint comes back
        yield self.views(session, stats, base, comparison, self.slot.state().model_line, box, blank=(READOUT_HINT, ""),
                         error=error)

    def _stream(self, session: Session, turn: Turn, engine: ChatEngine, prompt: list[int], settings: Settings,
                compare: bool):
        """Show the engine's updates as they come; returns the last (Medusa stats, baseline stats, comparison)."""
        passes = (BASELINE, MEDUSA) if compare else (MEDUSA,)
        cut, stats, base, comparison, error = turn.note, None, None, "", None
        medusa = engine.medusa_label(settings.tree) == LABELS[MEDUSA]
        tree = engine.trees.shown_name(settings.tree or engine.trees.default)
        label = (f"plain decoding and {'Medusa' if medusa else 'plain decoding again'}, step-interleaved" if compare
                 else f"{'Medusa' if medusa else 'plain decoding'}, tree {tree}")
        partial = ""
        try:
            for update in engine.answer(session, prompt, settings, passes):
                if update.queued:
                    yield self.views(session, None, None, "", self.status_while_answering(
                        f"⏳ Queued: {count(update.queued, 'request')} ahead of you; your answer starts when the "
                        "model is free"))
                    continue
                if update.notice:
                    yield self.views(session, None, None, "", self.status_while_answering(f"⏳ {update.notice}"))
                    continue
                if update.pass_name == COMPARISON:
                    comparison = render_comparison(update.comparison)
                    continue
                # an error before the first token has no figures: the readout stays as it is (Stop during the
                # reading has: "Answer: none: stopped before the first token")
                measured = update.stats if update.stats.tokens or not update.error else None
                # the answer's Markdown for its Copy button once it has ended: each streamed update sends the bubble
                # whole, and a copy of the partial text twice over would only double that
                shown = (answer_html if update.done else reply_html)(list(update.segments), settings.colour_heads) \
                    if update.segments else ""
                if update.pass_name == BASELINE:
                    turn.baseline, turn.baseline_shown, base = update.plain, shown, measured or base
                else:
                    turn.shown, partial, stats = shown, update.plain, measured or stats
                    if update.done:
                        # stopped before its first token (a long prompt being read): like a failed message,
                        # it goes back to the box and stays out of the next prompt
                        unanswered = update.error or (update.stats.finish_reason == "cancelled"
                                                      and not update.stats.tokens)
                        turn.reply = None if unanswered and not update.plain else update.plain
                        if not update.error and not update.plain.strip():
                            note = empty_note(update.stats, settings.greedy, bool(turn.baseline))
                            turn.note = " · ".join(filter(None, [turn.note, note]))
                if update.error:
                    error = update.error
                    turn.note = " · ".join(filter(None, [cut, error]))
                # a load (another tab's, a script's) replaces the model this answer runs on once it is ready: said
                # while it runs, so the cut is no surprise (QA: the status said "Generating" to the end)
                loading = " (a model is loading: this answer stops once it has loaded)" \
                    if self.slot.loading else ""
                yield self.views(session, stats, base, "",
                                 self.status_while_answering(f"Generating: {label}…{loading}"), partial=partial)
        except GeneratorExit:   # the request was cancelled mid-answer: what was shown stays in the next prompt, as
            # after Stop (_run notes the cancel), with how it was made for the exports (QA: a reload's cut answer had
            # no settings, and a sampled one's seed was lost)
            if turn.reply is None and partial:
                turn.reply = partial
            if turn.reply is not None or turn.baseline is not None:
                # a pass still running here was stopped here: said under each pane (QA: after a reload mid-comparison
                # one pane said "stopped", the other nothing)
                stats, base = (replace(s, finish_reason="cancelled") if s is not None and s.finish_reason is None
                               else s for s in (stats, base))
                turn.answered = how_answered(settings, stats, base, comparison)
            raise
        return stats, base, comparison, error

    def regenerate(self, session: Session, system, compare, controls: dict, shown=None) -> Iterator[tuple]:
        try:
            system = text("system", system)
        except ValueError as err:
            yield self.refused(f"{err}{KEPT}")
            return
        # the tab's lock first: a second click while the first regenerates must not pop the turn it answers
        mark = self.take_turn(session, session.sent_mark())
        if mark is None:
            yield self.refused(BUSY)
            return
        try:
            while session.turns and not session.turns[-1].user:
                session.turns.pop()  # notes after the last message
            if not session.turns:
                yield self.refused("Nothing to regenerate yet: send a message first")
                return
            state = self.slot.state()
            try:   # no model, or bad settings: refused before the answer they would replace goes
                if state.engine is None:
                    raise ValueError(no_engine(state))
                state.engine.check(Settings.parse(**self.for_engine(controls, shown, state)))
            except (ValueError, EngineClosed) as err:
                yield self.refused(said(err) + KEPT)
                return
            if not session.start_request(mark):
                yield self.refused(STOPPED_BEFORE_START + KEPT)
                return
            replaces = session.take_last()
            yield from self._run(session, replaces.turn.user, system, compare, controls, shown, mark, replaces)
        finally:
            session.busy.release()

    def clear(self, session: Session) -> tuple:
        session.restart()
        return [], [], READOUT_HINT, "", "", self.slot.state().model_line, None

    @staticmethod
    def browser_copy(session: Session, system: str, compare: bool) -> dict:
        """The conversation as the browser keeps it (app/browser_copy.py)."""
        # a message waiting for a model is kept as an unanswered one: a reload brings it back, to Regenerate
        turns = [*session.turns, Turn(user=session.waiting)] if session.waiting else session.turns
        saved = to_saved(turns, session.first_turn, system or "", compare is True)
        if session.busy.locked() and session.sent_copy is not None:
            # saved while an answer runs (the system prompt's box left, Compare ticked, a Send refused): the copy
            # keeps the answer's id, which a reload brings its answer back by (review: it lost the answer without a
            # word). The save after the answer has ended is the page's own state, with no id.
            saved[PENDING] = session.sent_copy
        return saved

    @classmethod
    def save_conversation(cls, session: Session, system: str, compare: bool):
        """After each change: the browser's copy of the conversation, the export files, and Regenerate on
        while there is a message to answer again and the tab is not answering (``regenerate_state``). An empty
        conversation is saved too: Clear must also empty the browser's copy, or a reload brings it back."""
        saved = cls.browser_copy(session, system, compare)
        regenerate = regenerate_state(session)
        if not session.turns:    # Clear: the cleared conversation's files go too (QA: kept until the app ended)
            discard_tab_exports(session)
            return (saved, gr.update(value=None, interactive=False), gr.update(value=None, interactive=False),
                    regenerate)
        as_json, as_md = write_tab_exports(session, system or "", compare is True)
        return saved, gr.update(value=as_json, interactive=True), gr.update(value=as_md, interactive=True), regenerate

    @staticmethod
    def save_pending(session: Session, message, system: str, compare: bool):
        """Just before a send: the browser's copy with the message in it, so a reload during the
        answer loses nothing typed (the copy written after the answer replaces it), and Stop on: the
        answer can be stopped from now on, also while it waits for a model."""
        session.send_started()
        message = str(message or "").strip()
        if not message:          # refused at once: Stop and Regenerate stay as they are
            return gr.update(), gr.update(), gr.update()
        # a message back in the box is replaced by the one sent (Session.drop_resent): kept here, a reload
        # during the answer brought it back for good
        turns = session.turns[:-1] if session.turns and session.turns[-1].in_box else session.turns
        return (sent_copy(session, [*turns, Turn(user=message)], system, compare), gr.update(interactive=True),
                gr.update(interactive=False))

    @staticmethod
    def regenerate_pending(session: Session, system: str, compare: bool):
        """Just before a regenerate: Stop on, Regenerate off, and the browser's copy as it is, with the id its new
        answer is kept under."""
        session.send_started()
        return sent_copy(session, session.turns, system, compare), gr.update(interactive=True), \
            gr.update(interactive=False)

    def restored(self, session: Session, stored, system: str) -> tuple:
        """Page load: (chat, baseline chat, system prompt, compare, message box) from the conversation kept in
        the browser, or the one its answer ended with (FinishedCopies). A message whose answer a reload cut off
        before its first token comes back with a note saying so (a new tab opened while another tab still
        answers it says that instead: QA, it claimed a reload); one that had gone back to the box (refused, or
        stopped before its first token) goes back there again, still to be replaced when it is resent (it
        stayed in the conversation for good, under a note saying it was in the box, which was empty)."""
        copy = self.finished.newest(stored)
        if not session.turns:
            session.turns, session.first_turn = from_saved(copy)
            last = session.turns[-1] if session.turns else None
            if last is not None and last.user and last.reply is None and not last.note:
                last.note = ELSEWHERE if self.finished.still_answering(copy) else INTERRUPTED
        last = session.turns[-1] if session.turns else None
        kept = saved_system(copy)
        return (display(session.turns), display(session.turns, BASELINE), system if kept is None else kept,
                saved_compare(copy), last.user if last is not None and last.in_box else gr.update())


def restored_stats(turns: list[Turn]) -> tuple[Stats | None, Stats | None]:
    """(Medusa's figures, plain decoding's) of the last answer as they were when it ended; None where it has none."""
    answered = (turns[-1].answered or {}) if turns else {}
    return Stats.from_saved(answered.get("medusa")), Stats.from_saved(answered.get("baseline"))


def restored_readouts(turns: list[Turn]) -> tuple[str, str]:
    """(Medusa's readout, plain decoding's) after a reload: the last answer's figures as they showed when it ended,
    or the hint where the last exchange has none (cut off by the reload, or refused)."""
    medusa, base = restored_stats(turns)
    return (render_live(medusa) if medusa else READOUT_HINT), (render_live(base) if base else "")


def restored_comparison(turns: list[Turn]) -> str:
    """The comparison line under the readouts after a reload: the last answer's, as it showed when it ended; none
    where the last exchange was not compared (or was cut off by the reload)."""
    line = (turns[-1].answered or {}).get("comparison") if turns else None
    return line if isinstance(line, str) else ""


def regenerate_state(session: Session) -> dict:
    """Regenerate on while the conversation has a message to answer again and the tab is not answering."""
    return gr.update(interactive=any(turn.user for turn in session.turns) and not session.answering())


def sent_copy(session: Session, turns: list[Turn], system: str, compare: bool) -> dict:
    """The browser's copy of ``turns`` as a message is sent, with a new id: the copy its answer ends with is kept
    under it (ChatController.kept)."""
    session.sent_copy = uuid.uuid4().hex
    return {**to_saved(turns, session.first_turn, system or "", compare is True), PENDING: session.sent_copy}


def no_engine(state: SlotState) -> str:
    """Why no model can answer now, in one line."""
    if state.phase == "loading":
        return "the model is still loading: ask again once it has loaded"
    if state.phase == "failed":
        return state.line.removeprefix("❌ ")
    return "no model is loaded: pick one under Model and press Load"


# After compare shows or hides the plain pane: the Medusa pane changed width, its messages reflowed to another
# height, and its scroll position no longer read as "at the bottom", so Gradio stopped following new answers
# (they arrived out of sight, under a "↓" button). Both panes go back to their end once the layout has settled.
SCROLL_TO_END = """() => setTimeout(() => document.querySelectorAll('#chat .bubble-wrap, #chat-baseline .bubble-wrap')
    .forEach(pane => pane.scrollTo({top: pane.scrollHeight})), 300)"""


# Stop answers the "Still answering …: press Stop" toast: it goes with the click (QA: it stayed its 10 s beside the
# Ready line of the stopped answer, still asking for Stop)
DISMISS_BUSY = """() => document.querySelectorAll('[data-testid="toast-body"]').forEach(toast => {
    if (toast.innerText.includes(%r)) toast.querySelector('[data-testid="toast-close"]')?.click();
})""" % BUSY


def wire_chat(page: Page, chat: ChatController) -> dict:
    """Attach the conversation's events; returns ``save_after``, the event that follows every change.
    The chat handlers' parameters are the scripting API's parameter names, and ``page.inputs``
    picks the components by those names."""

    # request: the session hash, so that a script's session (which runs no page load) also stops its
    # answer when its client goes; Gradio passes it by its type, and it is no input of the API
    def on_send(session: Session, message: str, system: str, compare: bool, mode: str, temperature: float,
                top_p: float, epsilon: float, delta: float, max_new_tokens: int, tree: str | None,
                seed: int, colour_heads: bool, shown_version: tuple[int, int] | None, request: gr.Request):
        chat.tab_opened(session, request.session_hash)
        yield from chat.kept(chat.run(session, message, system, compare, dict(
            mode=mode, temperature=temperature, top_p=top_p, epsilon=epsilon, delta=delta,
            max_new_tokens=max_new_tokens, tree=tree, seed=seed, colour_heads=colour_heads), shown_version),
            session, system, compare)

    def on_regenerate(session: Session, system: str, compare: bool, mode: str, temperature: float,
                      top_p: float, epsilon: float, delta: float, max_new_tokens: int, tree: str | None,
                      seed: int, colour_heads: bool, shown_version: tuple[int, int] | None, request: gr.Request):
        chat.tab_opened(session, request.session_hash)
        yield from chat.kept(chat.regenerate(session, system, compare, dict(
            mode=mode, temperature=temperature, top_p=top_p, epsilon=epsilon, delta=delta,
            max_new_tokens=max_new_tokens, tree=tree, seed=seed, colour_heads=colour_heads), shown_version),
            session, system, compare)

    def on_stop(session: Session):
        session.stop()  # the loop checks it after every token: generation ends within one step

    def stop_state(session: Session):
        """After a send or a regenerate: Stop stays on while the tab still answers or has a send still to
        start (a send refused because the tab was busy must not turn it off under the running answer, nor
        the end of a stopped answer under the message sent right after it), and goes grey when nothing runs;
        Regenerate the other way round."""
        return gr.update(interactive=session.send_ended()), regenerate_state(session)

    outputs = [page.chat, page.base_chat, page.readout, page.base_readout, page.comparison, page.status,
               page.raw, page.box]
    save_after = dict(fn=chat.save_conversation, inputs=[page.session, page.system, page.compare],
                      outputs=[page.saved, page.export_json, page.export_md, page.regenerate], api_name=False,
                      concurrency_limit=None)
    # Raw values (preprocess=False): a bad value from the API becomes a one-line note in the
    # chat instead of a traceback in the console; Settings.parse and the engine validate.
    # trigger_mode "multiple": a send while the tab answers reaches run(), which says why it waits (Gradio's
    # default drops it without a word while the first is pending)
    events = dict(outputs=outputs, concurrency_limit=16, concurrency_id="chat", preprocess=False,
                  trigger_mode="multiple", show_progress_on=[page.chat])   # the status line stays readable (Gradio's
    #                                                                        bar covered it for the whole answer)
    # Stop is on while the tab has an answer running or waiting: from the send (save_pending) or the regenerate
    # click to the end of that answer's events
    # Regenerate is off meanwhile: pressed, it only said "Still answering…" (QA)
    stop_after = dict(fn=stop_state, inputs=[page.session], outputs=[page.stop, page.regenerate], api_name=False,
                      concurrency_limit=None, show_progress="hidden")
    gr.on([page.box.submit, page.send.click], chat.save_pending, [page.session, page.box, page.system, page.compare],
          [page.saved, page.stop, page.regenerate], api_name=False, concurrency_limit=None, show_progress="hidden",
          trigger_mode="multiple").then(
        on_send, page.inputs(*_parameters(on_send)), api_name="send", **events).then(**save_after).then(**stop_after)
    page.regenerate.click(chat.regenerate_pending, [page.session, page.system, page.compare],
                          [page.saved, page.stop, page.regenerate], api_name=False, concurrency_limit=None,
                          show_progress="hidden", trigger_mode="multiple").then(
        on_regenerate, page.inputs(*_parameters(on_regenerate)), api_name="regenerate", **events).then(
        **save_after).then(**stop_after)
    # Stop and Clear must not wait behind a running answer: no concurrency limit.
    page.stop.click(on_stop, [page.session], None, api_name="stop", concurrency_limit=None)
    page.stop.click(None, None, None, js=DISMISS_BUSY, api_name=False)
    # the chat panes' own bin icons do what Clear does
    for trigger, name in ((page.clear.click, "clear"), (page.chat.clear, False), (page.base_chat.clear, False)):
        trigger(chat.clear, [page.session], outputs[:-1], api_name=name, concurrency_limit=None).then(**save_after)
    page.compare.change(lambda on: (gr.update(visible=on), gr.update(visible=on), gr.update() if on else ""),
                        [page.compare], [*page.base_panes, page.comparison], api_name=False,
                        concurrency_limit=None).then(None, None, None, js=SCROLL_TO_END, api_name=False)
    # kept with the conversation when the user toggles it (a restore that sets it saves on its own: a
    # second save at once could make a second export folder)
    page.compare.input(**save_after)
    # a system prompt edited after the last message is kept with the conversation when the user leaves the
    # box, not only with the next message (a reload in between would bring back the old one)
    page.system.blur(**save_after)
    return save_after


def _parameters(fn) -> list[str]:
    """The page inputs a handler takes, by its parameter names (the request is Gradio's, not an input)."""
    return [name for name in inspect.signature(fn).parameters if name != "request"]
