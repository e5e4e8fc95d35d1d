"""The Gradio page: layout and event wiring. Everything is built inside
``build_ui`` from one ChatEngine; per-tab state lives in a gr.State(Session).
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no phoning home

from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from .engine import BASELINE, MEDUSA, ChatEngine, Session, Settings, Turn
from .readout import Stats, render_comparison, render_live

CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "style.css"
MODES = [("Greedy", "greedy"), ("Exact sampling", "sample"), ("Typical acceptance", "typical")]
NOTE = "⚠️ "


def _msg(role: str, text: str) -> dict:
    # Text parts, not bare strings: Gradio runs inspect.cleandoc on bare strings,
    # which would strip the indentation of code in a reply.
    return {"role": role, "content": [{"type": "text", "text": text}]}


def display(turns: list[Turn], pane: str = MEDUSA) -> list[dict]:
    out: list[dict] = []
    for turn in turns:
        if turn.user:
            out.append(_msg("user", turn.user))
        text = turn.baseline if pane == BASELINE and turn.baseline is not None else turn.shown
        if text:
            out.append(_msg("assistant", text))
        if turn.note:
            out.append(_msg("assistant", NOTE + turn.note))
    return out


def control_state(mode: str) -> tuple[dict, dict, dict, dict]:
    """Temperature, top-p, ε, δ: enabled only where the mode uses them."""
    return (gr.update(interactive=mode != "greedy"), gr.update(interactive=mode == "sample"),
            gr.update(interactive=mode == "typical"), gr.update(interactive=mode == "typical"))


def build_ui(engine: ChatEngine, *, system_prompt: str = "", note: str = "", status: str = "") -> gr.Blocks:
    ready = status or f"Ready · {engine.loaded.description}"
    depth = engine.num_heads + 1

    def turn_views(session: Session, stats: Stats | None, base: Stats | None, comparison: str,
                   status_line: str, box: str | dict = gr.update()) -> tuple:
        raw = {"medusa": stats.as_dict() if stats else None, "baseline": base.as_dict() if base else None}
        return (display(session.turns), display(session.turns, BASELINE),
                render_live(stats, depth) if stats else gr.update(),
                render_live(base, depth) if base else gr.update(),
                comparison, status_line, raw, box)

    def run(session: Session, message: str, system: str, compare: bool, settings: Settings) -> Iterator[tuple]:
        if not session.busy.acquire(blocking=False):
            yield turn_views(session, None, None, gr.update(),
                             "⏳ Still answering your previous message: wait, or press Stop")
            return
        try:
            yield from _run(session, message, system, compare, settings)
        finally:
            session.busy.release()

    def _run(session: Session, message: str, system: str, compare: bool, settings: Settings) -> Iterator[tuple]:
        message = (message or "").strip()
        if not message:
            session.turns.append(Turn(user="", note="the message is empty: type a question, then send"))
            yield turn_views(session, None, None, "", ready)
            return
        session.cancel.clear()
        history = session.messages() + [{"role": "user", "content": message}]
        turn = Turn(user=message)
        session.turns.append(turn)
        passes = (BASELINE, MEDUSA) if compare else (MEDUSA,)
        final: dict[str, Stats] = {}
        tokens: dict[str, tuple[int, ...]] = {}
        stats = base = None
        yield turn_views(session, None, None, "", "Starting…", "")
        try:
            prompt = engine.prompt_ids(history, system)
        except ValueError as err:  # a chat template that rejects the conversation
            turn.note = str(err)
            yield turn_views(session, None, None, "", ready, message)
            return
        for update in engine.answer(session, prompt, settings, passes):
            if update.queued:
                yield turn_views(session, None, None, "", f"⏳ Queued: {update.queued} request(s) ahead of you; "
                                 "your answer starts when the model is free")
                continue
            # an error before the first token leaves the previous readout in place
            measured = update.stats if update.stats.tokens or not update.error else None
            if update.pass_name == BASELINE:
                turn.baseline, base = update.text, measured or base
            else:
                turn.shown, stats = update.text, measured or stats
                if update.done:
                    turn.reply = update.plain if (update.plain or not update.error) else None
            if update.error:
                turn.note = update.error
            if update.done and not update.error:
                final[update.pass_name], tokens[update.pass_name] = update.stats, update.tokens
            label = "plain decoding (1/2)" if update.pass_name == BASELINE else (
                f"Medusa{' (2/2)' if compare else ''}, tree {settings.tree}")
            yield turn_views(session, stats, base, "", f"Generating: {label}…")
        comparison = ""
        if BASELINE in final and MEDUSA in final:
            greedy = settings.mode == "greedy" or (settings.mode == "sample" and settings.temperature == 0)
            finished = all(final[p].finish_reason in ("eos", "length") for p in passes)
            identical = tokens[BASELINE] == tokens[MEDUSA] if greedy and finished else None
            comparison = render_comparison(final[BASELINE], final[MEDUSA], identical)
        elif compare and turn.reply is None and not turn.note:
            turn.note = "stopped before the Medusa pass"
        # A failed message goes back into the box so it can be edited and resent.
        box = message if turn.reply is None else gr.update()
        yield turn_views(session, stats, base, comparison, ready, box)

    with gr.Blocks(title="Medusa chat") as demo:
        session = gr.State(Session)
        gr.Markdown("# Medusa chat")
        if note:
            gr.Markdown(note, elem_id="note", elem_classes="note")
        status_md = gr.Markdown(ready, elem_id="status", elem_classes="status")
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Row(equal_height=True):
                    with gr.Column(visible=False, elem_id="pane-baseline") as base_col:
                        base_chat = gr.Chatbot(label="Plain decoding", elem_id="chat-baseline",
                                               buttons=["copy", "copy_all"], height=460)
                        base_readout = gr.Markdown(elem_id="readout-baseline", elem_classes="readout")
                    with gr.Column(elem_id="pane-medusa"):
                        chat = gr.Chatbot(label="Medusa", elem_id="chat", buttons=["copy", "copy_all"],
                                          height=460, placeholder="Ask something. Speed shows below as it streams.")
                        readout = gr.Markdown("*tokens/s, tokens per step and time to first token show here*",
                                              elem_id="readout", elem_classes="readout")
                comparison_md = gr.Markdown(elem_id="comparison")
                with gr.Row():
                    box = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=6,
                                     elem_id="message", autofocus=True)
                    send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                with gr.Row():
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    regen = gr.Button("Regenerate", elem_id="regenerate")
                    clear = gr.Button("Clear", elem_id="clear")
                with gr.Accordion("Raw numbers", open=False):
                    raw = gr.JSON(label="Stats of the last answer", elem_id="raw")
            with gr.Column(scale=1, min_width=280):
                system = gr.Textbox(system_prompt, label="System prompt", lines=3, elem_id="system")
                compare = gr.Checkbox(False, label="Compare with plain decoding", elem_id="compare")
                colour = gr.Checkbox(False, label="Colour tokens that came from the heads")
                mode = gr.Radio(MODES, value="greedy", label="Decoding mode")
                temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", interactive=False)
                top_p = gr.Slider(0, 1, value=1.0, step=0.01, label="Top-p", interactive=False)
                epsilon = gr.Number(0.09, label="ε: posterior threshold (typical)", interactive=False)
                delta = gr.Number(0.3, label="δ: posterior alpha (typical)", interactive=False)
                max_new = gr.Slider(1, 4096, value=engine.max_new_tokens, step=1, label="Max new tokens")
                tree = gr.Dropdown(engine.tree_choices, value=engine.default_tree, label="Tree (node count)")
                seed = gr.Number(-1, precision=0, label="Seed (-1: random)")

        controls = [mode, temperature, top_p, epsilon, delta, max_new, tree, seed, colour]
        outputs = [chat, base_chat, readout, base_readout, comparison_md, status_md, raw, box]

        def settings_of(mode, temperature, top_p, epsilon, delta, max_new, tree, seed, colour) -> Settings:
            return Settings(mode, temperature, top_p, epsilon, delta, max_new, tree,
                            None if seed is None else int(seed), bool(colour))

        def on_send(session, message, system, compare, *values):
            yield from run(session, message, system, compare, settings_of(*values))

        def on_regenerate(session, system, compare, *values):
            while session.turns and not session.turns[-1].user:
                session.turns.pop()  # notes after the last message
            if not session.turns:
                session.turns.append(Turn(user="", note="nothing to regenerate yet: send a message first"))
                yield turn_views(session, None, None, "", ready)
                return
            message = session.turns.pop().user
            yield from run(session, message, system, compare, settings_of(*values))

        def on_stop(session):
            session.cancel.set()  # the loop checks it after every token: generation ends within one step

        def on_clear(session):
            session.cancel.set()
            session.turns.clear()
            return [], [], "", "", "", ready, None

        chat_events = dict(outputs=outputs, concurrency_limit=16, concurrency_id="chat")
        gr.on([box.submit, send.click], on_send, [session, box, system, compare, *controls],
              api_name="send", **chat_events)
        regen.click(on_regenerate, [session, system, compare, *controls], api_name="regenerate", **chat_events)
        # Stop and Clear must not wait behind a running answer: no concurrency limit.
        stop.click(on_stop, [session], None, api_name="stop", concurrency_limit=None)
        clear.click(on_clear, [session], outputs[:-1], api_name="clear", concurrency_limit=None)
        mode.change(control_state, [mode], [temperature, top_p, epsilon, delta], api_name=False,
                    concurrency_limit=None)
        compare.change(lambda on: gr.update(visible=on), [compare], [base_col], api_name=False,
                       concurrency_limit=None)
    return demo


def theme() -> gr.themes.Base:
    return gr.themes.Soft(primary_hue="violet")
