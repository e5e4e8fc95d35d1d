"""The Gradio page: layout and event wiring. Everything is built inside
``build_ui`` from one ModelSlot; per-tab state lives in a gr.State(Session), and the
conversation is also kept in the browser (gr.BrowserState) so it survives a reload.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no phoning home

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import gradio as gr

from medusa_core.loading import LoadSpec

from .engine import BASELINE, COMPARISON, MEDUSA, ChatEngine, Session, Settings, Turn
from .models import KNOWN_MODELS, ModelSlot, default_settings, spec_for
from .readout import Stats, render_comparison, render_live
from .render import note_html, reply_html, user_html
from .transcript import discard_exports, export_folder, from_saved, to_saved, write_exports

CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "style.css"
MODES = [("Greedy", "greedy"), ("Exact sampling", "sample"), ("Typical acceptance", "typical")]
CPU_DEFAULT_NOTE = ("**SmolLM2-135M-Instruct on the CPU.** This is what `python launch.py` serves without a CUDA "
                    "GPU: SmolLM2-135M-Instruct, a small instruction-tuned chat model (135 M parameters), with "
                    "Medusa heads trained for it, running on the CPU on its own 4-bit weights where that measures "
                    "faster (the model line says which matmuls run). Expect short, simple answers; the speed "
                    "numbers are real. On a CUDA machine `python launch.py` loads Vicuna-7B with Medusa heads.")
STORAGE_KEY = "medusa-chat-conversation"
MAX_NEW_LIMIT = 4096   # the slider's top before a model is loaded; then the model's context


def _msg(role: str, html: str) -> dict:
    # Text parts, not bare strings: Gradio runs inspect.cleandoc on bare strings.
    return {"role": role, "content": [{"type": "text", "text": html}]}


def display(turns: list[Turn], pane: str = MEDUSA) -> list[dict]:
    out: list[dict] = []
    for turn in turns:
        if turn.user:
            out.append(_msg("user", user_html(turn.user)))
        shown = turn.baseline_shown if pane == BASELINE and turn.baseline is not None else turn.shown
        if shown:
            out.append(_msg("assistant", shown))
        if turn.note:
            out.append(_msg("assistant", note_html(turn.note)))
    return out


def control_state(mode: str) -> tuple[dict, dict, dict, dict]:
    """Temperature, top-p, ε, δ: enabled only where the mode uses them."""
    return (gr.update(interactive=mode != "greedy"), gr.update(interactive=mode == "sample"),
            gr.update(interactive=mode == "typical"), gr.update(interactive=mode == "typical"))


def decoding_controls(settings: Settings) -> tuple[dict, ...]:
    """Mode, temperature, top-p, ε, δ set to ``settings`` (a model's defaults), enabled as the mode needs."""
    enabled = control_state(settings.mode)
    values = (settings.temperature, settings.top_p, settings.epsilon, settings.delta)
    return (gr.update(value=settings.mode), *({**e, "value": v} for e, v in zip(enabled, values)))


def empty_note(stats: Stats) -> str:
    if stats.finish_reason == "length":
        return (f"the answer is blank: its {stats.tokens} token(s) were only spaces or line breaks before "
                "max new tokens was reached: raise max new tokens")
    if stats.finish_reason == "eos":
        return "the model ended its answer at once (end-of-turn token first): rephrase, or try sampling"
    return "the answer is empty"


def build_ui(slot: ModelSlot, *, system_prompt: str = "", base_spec: LoadSpec = LoadSpec()) -> gr.Blocks:
    def engine_or_wait(session: Session) -> Iterator[str | ChatEngine]:
        """Yield status lines while a model loads, then the engine; a str last means no engine."""
        state = slot.state()
        while state.phase == "loading" and not session.cancel.is_set():
            yield f"⏳ Waiting for the model: {state.line}"
            state = slot.wait(0.5)
        engine = slot.engine
        yield engine if engine is not None else ("no model is loaded: pick one under Model and press Load"
                                                 if state.phase != "failed" else state.line.lstrip("❌ "))

    def turn_views(session: Session, stats: Stats | None, base: Stats | None, comparison: str,
                   status_line: str, box: str | dict = gr.update()) -> tuple:
        last = session.turns[-1] if session.turns else None
        raw = {"medusa": stats.as_dict() if stats else None, "baseline": base.as_dict() if base else None,
               "reply": last.reply if last else None, "baseline_reply": last.baseline if last else None}
        return (display(session.turns), display(session.turns, BASELINE),
                render_live(stats, depth(stats)) if stats else gr.update(),
                render_live(base, depth(base)) if base else gr.update(),
                comparison, status_line, raw, box)

    def depth(stats: Stats) -> int:
        engine = slot.engine
        return engine.num_heads + 1 if engine is not None else 1

    def run(session: Session, message, system, compare, values: tuple) -> Iterator[tuple]:
        if not session.busy.acquire(blocking=False):
            yield turn_views(session, None, None, gr.update(),
                             "⏳ Still answering your previous message: wait, or press Stop")
            return
        try:
            yield from _run(session, str(message or "").strip(), str(system or ""), bool(compare), values)
        finally:
            session.busy.release()

    def _run(session: Session, message: str, system: str, compare: bool, values: tuple) -> Iterator[tuple]:
        if not message:
            session.turns.append(Turn(user="", note="the message is empty: type a question, then send"))
            yield turn_views(session, None, None, "", slot.state().line)
            return
        session.cancel.clear()
        turn = Turn(user=message)
        engine = None
        for engine in engine_or_wait(session):
            if isinstance(engine, str) and engine.startswith("⏳"):
                yield turn_views(session, None, None, "", engine)
        try:
            if isinstance(engine, str):
                raise ValueError(engine)
            settings = Settings.parse(*values)
            engine.check(settings)
            prompt, cut = engine.fit_prompt(session, message, system, settings)
        except ValueError as err:   # bad settings, no model, a message longer than the context
            session.turns.append(replace(turn, note=str(err)))
            yield turn_views(session, None, None, "", slot.state().line, message)
            return
        session.turns.append(turn)
        turn.note = cut
        passes = (BASELINE, MEDUSA) if compare else (MEDUSA,)
        stats = base = None
        comparison = ""
        yield turn_views(session, None, None, "", "Starting…", "")
        tree_name = settings.tree or engine.default_tree
        for update in engine.answer(session, prompt, settings, passes):
            if update.queued:
                yield turn_views(session, None, None, "", f"⏳ Queued: {update.queued} request(s) ahead of you; "
                                 "your answer starts when the model is free")
                continue
            if update.notice:
                yield turn_views(session, None, None, "", f"⏳ {update.notice}")
                continue
            if update.pass_name == COMPARISON:
                comparison = render_comparison(update.comparison)
                continue
            # an error before the first token leaves the previous readout in place
            measured = update.stats if update.stats.tokens or not update.error else None
            shown = reply_html(list(update.segments), settings.colour_heads) if update.segments else ""
            if update.pass_name == BASELINE:
                turn.baseline, turn.baseline_shown, base = update.plain, shown, measured or base
            else:
                turn.shown, stats = shown, measured or stats
                if update.done:
                    turn.reply = update.plain if (update.plain or not update.error) else None
                    if not update.error and not update.plain.strip():
                        turn.note = " · ".join(filter(None, [turn.note, empty_note(update.stats)]))
            if update.error:
                turn.note = " · ".join(filter(None, [cut, update.error]))
            label = "plain decoding and Medusa, step-interleaved" if compare else f"Medusa, tree {tree_name}"
            yield turn_views(session, stats, base, "", f"Generating: {label}…")
        if compare and turn.reply is None and not turn.note:
            turn.note = "stopped before the Medusa pass"
        # A failed message goes back into the box so it can be edited and resent.
        box = message if turn.reply is None else gr.update()
        yield turn_views(session, stats, base, comparison, slot.state().line, box)

    # delete_cache: Gradio keeps a copy of each export file it serves, one per change; those older than a
    # day go (checked hourly): a tab left for a day gets fresh links with its next change
    with gr.Blocks(title="Medusa chat", delete_cache=(3600, 86400)) as demo:
        session = gr.State(Session, delete_callback=discard_exports)   # called when the tab's session ends
        # a fixed key and secret: the conversation survives a server restart too (it never leaves this browser)
        saved = gr.BrowserState(None, storage_key=STORAGE_KEY, secret=STORAGE_KEY)
        seen = gr.State(-1)            # the slot version the page's model controls show
        timer = gr.Timer(0.5, active=True)
        gr.Markdown("# Medusa chat")
        note_md = gr.Markdown(CPU_DEFAULT_NOTE, elem_id="note", elem_classes="note", visible=False)
        status_md = gr.Markdown(slot.state().line, elem_id="status", elem_classes="status")
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Row(equal_height=True):
                    with gr.Column(visible=False, elem_id="pane-baseline") as base_col:
                        base_chat = gr.Chatbot(label="Plain decoding", elem_id="chat-baseline", buttons=[],
                                               height=460, render_markdown=False, latex_delimiters=[])
                        base_readout = gr.Markdown(elem_id="readout-baseline", elem_classes="readout")
                    with gr.Column(elem_id="pane-medusa"):
                        chat = gr.Chatbot(label="Medusa", elem_id="chat", buttons=[], height=460,
                                          render_markdown=False, latex_delimiters=[],
                                          placeholder="Ask something. Speed shows below as it streams.")
                        readout = gr.Markdown("*tokens/s, tokens per step and time to first token show here*",
                                              elem_id="readout", elem_classes="readout")
                comparison_md = gr.Markdown(elem_id="comparison")
                with gr.Row():
                    box = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=6,
                                     elem_id="message", autofocus=True)
                    send = gr.Button("Send", variant="primary", scale=1, elem_id="send",
                                     interactive=slot.engine is not None)
                with gr.Row():
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    regen = gr.Button("Regenerate", elem_id="regenerate")
                    clear = gr.Button("Clear", elem_id="clear")
                    export_json = gr.DownloadButton("Export JSON", elem_id="export-json", interactive=False)
                    export_md = gr.DownloadButton("Export Markdown", elem_id="export-md", interactive=False)
                with gr.Accordion("Raw numbers", open=False):
                    raw = gr.JSON(label="Stats of the last answer", elem_id="raw")
            with gr.Column(scale=1, min_width=280):
                with gr.Accordion("Model", open=False, elem_id="model-panel"):
                    known = gr.Dropdown([label for label, *_ in KNOWN_MODELS], value=None, label="Known models",
                                        elem_id="known-model")
                    model_box = gr.Textbox(label="…or a backbone: hub id or local directory", elem_id="model-id")
                    heads_box = gr.Textbox(label="Medusa heads: hub id or local directory (optional)",
                                           elem_id="heads-id")
                    with gr.Row():
                        load_btn = gr.Button("Load", elem_id="load-model")
                        unload_btn = gr.Button("Unload", elem_id="unload-model")
                    model_md = gr.Markdown(elem_id="model-status")
                system = gr.Textbox(system_prompt, label="System prompt", lines=3, elem_id="system")
                compare = gr.Checkbox(False, label="Compare with plain decoding", elem_id="compare")
                colour = gr.Checkbox(False, label="Colour tokens that came from the heads", elem_id="colour")
                mode = gr.Radio(MODES, value="greedy", label="Decoding mode")
                temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", interactive=False)
                top_p = gr.Slider(0, 1, value=1.0, step=0.01, label="Top-p", interactive=False)
                epsilon = gr.Number(0.09, label="ε: posterior threshold (typical)", interactive=False)
                delta = gr.Number(0.3, label="δ: posterior alpha (typical)", interactive=False)
                max_new = gr.Slider(1, MAX_NEW_LIMIT, value=slot.max_new_tokens, step=1, label="Max new tokens",
                                    elem_id="max-new")
                # "" = the model's default tree (the choices arrive with the model)
                tree = gr.Dropdown([], value="", label="Tree (node count)", elem_id="tree", allow_custom_value=True)
                seed = gr.Number(-1, precision=0, label="Seed (-1: random)")

        controls = [mode, temperature, top_p, epsilon, delta, max_new, tree, seed, colour]
        outputs = [chat, base_chat, readout, base_readout, comparison_md, status_md, raw, box]
        decoding = [mode, temperature, top_p, epsilon, delta]
        model_outputs = [status_md, note_md, send, tree, max_new, *decoding, timer, seen]

        # ---- the model: load progress, switching, unloading
        def sync(version: int, max_new_value) -> tuple:
            """The page's model controls for the slot's state; no-ops where nothing changed."""
            state = slot.state()
            loading = state.phase == "loading"
            if state.version == version and not loading:
                return (*[gr.update()] * (5 + len(decoding)), gr.Timer(active=False), version)
            engine = slot.engine
            if engine is None:
                tree_update, max_update = gr.update(choices=[], value=None), gr.update()
                decoding_update = (gr.update(),) * len(decoding)
            else:
                try:
                    current = int(float(max_new_value))
                except (TypeError, ValueError):
                    current = engine.max_new_tokens
                tree_update = gr.update(choices=engine.tree_choices, value=engine.default_tree,
                                        info=engine.loaded.tree_note or None)
                max_update = gr.update(maximum=engine.context, value=min(current, engine.context))
                decoding_update = decoding_controls(default_settings(engine.loaded))
            return (state.line, gr.update(visible=engine is not None and engine.loaded.cpu_default),
                    gr.update(interactive=engine is not None and not loading), tree_update, max_update,
                    *decoding_update, gr.Timer(active=loading), state.version)

        def on_load_model(choice, model_id, heads_id, max_new_value):
            try:
                spec = spec_for(choice, model_id, heads_id, base_spec)
            except ValueError as err:
                return (f"❌ {err}", *sync(-1, max_new_value))
            refused = slot.start(spec)
            return (f"❌ {refused}" if refused else "", *sync(-1, max_new_value))

        def on_unload(max_new_value):
            return (slot.unload(), *sync(-1, max_new_value))

        timer.tick(sync, [seen, max_new], model_outputs, api_name=False, concurrency_limit=None,
                   show_progress="hidden")
        load_btn.click(on_load_model, [known, model_box, heads_box, max_new], [model_md, *model_outputs],
                       api_name="load_model", concurrency_limit=None)
        unload_btn.click(on_unload, [max_new], [model_md, *model_outputs], api_name="unload_model",
                         concurrency_limit=None)

        # ---- the conversation
        def on_send(session: Session, message: str, system: str, compare: bool, mode: str, temperature: float,
                    top_p: float, epsilon: float, delta: float, max_new_tokens: int, tree: str | None,
                    seed: int, colour_heads: bool):
            yield from run(session, message, system, compare,
                           (mode, temperature, top_p, epsilon, delta, max_new_tokens, tree, seed, colour_heads))

        def on_regenerate(session: Session, system: str, compare: bool, mode: str, temperature: float,
                          top_p: float, epsilon: float, delta: float, max_new_tokens: int, tree: str | None,
                          seed: int, colour_heads: bool):
            while session.turns and not session.turns[-1].user:
                session.turns.pop()  # notes after the last message
            if not session.turns:
                session.turns.append(Turn(user="", note="nothing to regenerate yet: send a message first"))
                yield turn_views(session, None, None, "", slot.state().line)
                return
            message = session.turns.pop().user
            session.first_turn = min(session.first_turn, len(session.turns))
            yield from run(session, message, system, compare,
                           (mode, temperature, top_p, epsilon, delta, max_new_tokens, tree, seed, colour_heads))

        def on_stop(session: Session):
            session.cancel.set()  # the loop checks it after every token: generation ends within one step

        def on_clear(session: Session):
            session.restart()
            return [], [], "", "", "", slot.state().line, None

        def keep(session: Session, system: str):
            """After each change: the browser's copy of the conversation and the export files."""
            if not session.turns:
                return None, gr.update(value=None, interactive=False), gr.update(value=None, interactive=False)
            if session.export_dir is None:
                session.export_dir = export_folder()
            as_json, as_md = write_exports(session.turns, session.first_turn, session.export_dir, system or "")
            return (to_saved(session.turns, session.first_turn), gr.update(value=as_json, interactive=True),
                    gr.update(value=as_md, interactive=True))

        def restore(session: Session, stored, max_new_value):
            """Page load: the conversation kept in the browser, and the model controls."""
            if not session.turns:
                session.turns, session.first_turn = from_saved(stored)
            return (display(session.turns), display(session.turns, BASELINE), *sync(-1, max_new_value))

        kept = dict(fn=keep, inputs=[session, system], outputs=[saved, export_json, export_md], api_name=False,
                    concurrency_limit=None)
        # Raw values (preprocess=False): a bad value from the API becomes a one-line note in the
        # chat instead of a traceback in the console; Settings.parse and the engine validate.
        chat_events = dict(outputs=outputs, concurrency_limit=16, concurrency_id="chat", preprocess=False)
        gr.on([box.submit, send.click], on_send, [session, box, system, compare, *controls],
              api_name="send", **chat_events).then(**kept)
        regen.click(on_regenerate, [session, system, compare, *controls], api_name="regenerate",
                    **chat_events).then(**kept)
        # Stop and Clear must not wait behind a running answer: no concurrency limit.
        stop.click(on_stop, [session], None, api_name="stop", concurrency_limit=None)
        # the chat panes' own bin icons do what Clear does
        for trigger, name in ((clear.click, "clear"), (chat.clear, False), (base_chat.clear, False)):
            trigger(on_clear, [session], outputs[:-1], api_name=name, concurrency_limit=None).then(**kept)
        demo.load(restore, [session, saved, max_new], [chat, base_chat, *model_outputs], api_name=False).then(**kept)
        mode.change(control_state, [mode], [temperature, top_p, epsilon, delta], api_name=False,
                    concurrency_limit=None)
        compare.change(lambda on: gr.update(visible=on), [compare], [base_col], api_name=False,
                       concurrency_limit=None)
    return demo


def theme() -> gr.themes.Base:
    return gr.themes.Soft(primary_hue="violet")
