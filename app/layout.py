"""The page's components and where they sit; no behaviour (app/model_panel.py and
app/chat_controller.py wire them). The decoding controls take their ranges, defaults and labels
from medusa_core/decoding/config.py and are named by Settings' field names."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from medusa_core.decoding.config import limits

from .models import KNOWN_MODELS, ModelSlot
from .session import Session
from .settings import Settings

MODE_CHOICES = [("Greedy", "greedy"), ("Exact sampling", "sample"), ("Typical acceptance", "typical")]


def cpu_default_note(weights: str | None, dtype: str = "float32") -> str:
    """The note over the CPU default: what it is, and in which weights it runs here (``weights`` as
    quant/formats.py names them, else the compute ``dtype``). The 4-bit mode is chosen at load where it
    measures faster and exact, so the note says which it is on this machine (it said 4-bit beside a model
    line that said float32)."""
    runs = ("on its own 4-bit weights" if weights and weights.startswith("int4") else
            "on bitsandbytes' 4-bit NF4 weights" if weights and weights.startswith("NF4") else f"in {dtype}")
    return ("**SmolLM2-135M-Instruct on the CPU.** This is what `python launch.py` serves without a CUDA GPU: "
            "SmolLM2-135M-Instruct, a small instruction-tuned chat model (135 M parameters), with Medusa heads "
            f"trained for it, running on the CPU {runs} (the Model panel says which matmuls run, and why). Expect "
            "short, simple answers; the speed numbers are real. On a CUDA machine `python launch.py` loads "
            "Vicuna-7B with Medusa heads.")


READOUT_HINT = "*tokens/s, tokens per step and time to first token show here*"   # the readout before an answer
MAX_NEW_LIMIT = 4096   # the slider's top before a model is loaded; then the model's context
SAMPLING = ("temperature", "top_p", "epsilon", "delta")   # set by a model's defaults
# enabled by the mode that uses them: greedy and typical acceptance draw nothing, so the seed is exact sampling's
MODE_CONTROLS = (*SAMPLING, "seed")
# an idle tab's line while another tab's or a script's request holds the model (QA: it said only "Ready", and a
# message sent then waited without the tab having said why until it was sent)
BUSY_ELSEWHERE = "⏳ The model is answering another tab or a script now: a message you send waits for it."


@dataclass
class Page:
    session: gr.State
    saved: gr.JSON               # the conversation's copy in the browser (app/browser_copy.py)
    kept: gr.JSON                # the decoding settings' copy in the browser (app/model_panel.py, settings_copy)
    shown_version: gr.State   # (slot version, engine version) the page's model controls show; None at first
    timer: gr.Timer              # the model controls' sync while a model loads or has changed (model_panel.py)
    watch: gr.Timer              # looks, while idle, whether the model changed elsewhere; then starts ``timer``
    note: gr.Markdown
    status: gr.Markdown
    busy_hint: gr.Markdown       # shown while the model answers another tab or a script (model_panel.watch)
    base_panes: tuple[gr.Column, gr.Column]   # the plain-decoding pane's chat and readout columns
    base_chat: gr.Chatbot
    base_readout: gr.Markdown
    chat: gr.Chatbot
    readout: gr.Markdown
    comparison: gr.Markdown
    box: gr.Textbox
    send: gr.Button
    stop: gr.Button
    regenerate: gr.Button
    clear: gr.Button
    export_json: gr.DownloadButton
    export_md: gr.DownloadButton
    raw: gr.JSON
    known: gr.Dropdown
    model_box: gr.Textbox
    heads_box: gr.Textbox
    load: gr.Button
    unload: gr.Button
    model_status: gr.Markdown
    system: gr.Textbox
    compare: gr.Checkbox
    controls: dict[str, gr.components.Component]   # by Settings field name

    def inputs(self, *names: str) -> list:
        """Components by the names a handler's parameters carry (the chat's are named as its API is)."""
        named = {"session": self.session, "message": self.box, "system": self.system, "compare": self.compare,
                 "shown_version": self.shown_version, **self.controls}
        return [named[name] for name in names]

    @property
    def mode_controls(self) -> list:
        return [self.controls[name] for name in MODE_CONTROLS]


def mode_enabled(mode: str) -> dict[str, bool]:
    """Which of MODE_CONTROLS ``mode`` uses, by name: temperature unless greedy, top-p and the seed for
    exact sampling, ε and δ for typical acceptance."""
    return {"temperature": mode != "greedy", "top_p": mode == "sample", "epsilon": mode == "typical",
            "delta": mode == "typical", "seed": mode == "sample"}


def _number_control(name: str, value, **kw):
    spec = limits(name)
    if spec.slider is None:
        return gr.Number(value, label=spec.label, info=None, elem_id=name, **kw)
    low, high, step = spec.slider
    return gr.Slider(low, high, value=value, step=step, label=spec.label, elem_id=name, **kw)


def decoding_controls(max_new_tokens: int, start: Settings) -> dict:
    """The decoding controls at ``start``, the ones a mode uses enabled as its mode needs."""
    enabled = mode_enabled(start.mode)
    return {
        "mode": gr.Radio(MODE_CHOICES, value=start.mode, label=limits("mode").label),
        **{name: _number_control(name, getattr(start, name), interactive=enabled[name]) for name in SAMPLING},
        # --max-new-tokens past the usual top raises it: a value above the slider's maximum broke the whole page
        # (an Error on every component, Send off); the model's context becomes the top once it has loaded
        "max_new_tokens": gr.Slider(limits("max_new_tokens").low, max(MAX_NEW_LIMIT, max_new_tokens),
                                    value=max_new_tokens, step=1,
                                    label=limits("max_new_tokens").label, elem_id="max-new"),
        # "" = the model's default tree (the choices arrive with the model)
        "tree": gr.Dropdown([], value="", label="Tree (node count, the root included)", elem_id="tree",
                            allow_custom_value=True),
        "seed": gr.Number(-1, precision=0, label=limits("seed").label, elem_id="seed", interactive=enabled["seed"]),
    }


def build_layout(slot: ModelSlot, system_prompt: str, start: Settings) -> Page:
    """The components, inside the caller's gr.Blocks; the decoding controls at ``start``."""
    # each tab's own Session: a copy of this one, made when the tab's first event reads it (Session.__deepcopy__)
    # (a closed tab's end is ChatController.tab_closed's, from the page's unload: Gradio 6 calls a State's
    # delete_callback only for a State some event returns, and none returns this one)
    session = gr.State(Session())
    saved = gr.JSON(None, visible=False, elem_id="saved")   # filled and stored by app/browser_copy.py's scripts
    kept = gr.JSON(None, visible=False, elem_id="kept")     # likewise
    shown_version, timer, watch = gr.State(None), gr.Timer(0.5, active=True), gr.Timer(2.0, active=True)
    gr.Markdown("# Medusa chat")
    note = gr.Markdown(cpu_default_note(None), elem_id="note", elem_classes="note", visible=False)
    status = gr.Markdown(slot.state().line, elem_id="status", elem_classes="status")
    busy_hint = gr.Markdown(BUSY_ELSEWHERE, elem_id="busy-hint", visible=False)
    with gr.Row():
        with gr.Column(scale=3):
            # the panes' height=460 is the one a page without the stylesheet gets: assets/style.css sizes them to
            # the window, so the message box under them is on the first screen
            with gr.Row(equal_height=True):
                with gr.Column(visible=False, elem_id="pane-baseline") as base_column:
                    base_chat = gr.Chatbot(label="Plain decoding", elem_id="chat-baseline", buttons=[],
                                           height=460, render_markdown=False, latex_delimiters=[])
                with gr.Column(elem_id="pane-medusa"):
                    chat = gr.Chatbot(label="Medusa", elem_id="chat", buttons=[], height=460,
                                      render_markdown=False, latex_delimiters=[],
                                      placeholder="Ask something. Speed shows below as it streams.")
            # the message box and its buttons right under the chat, the readouts under them: a readout grows as an
            # answer runs (its table, bars, then the summary), and above the box it moved the box and Stop down by
            # 140-220 px during every answer, and up again as the next one started (QA)
            with gr.Row():
                box = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=6,
                                 elem_id="message", autofocus=True)
                # a narrow min_width: at the default 160 px, a phone's row gave the box only half its width (QA)
                send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send",
                                 interactive=slot.engine is not None or slot.loading)
            with gr.Row():
                # on while the tab has an answer running or waiting (app/chat_controller.py, wire_chat)
                stop = gr.Button("Stop", variant="stop", elem_id="stop", interactive=False)
                # on while the conversation has a message to answer again (save_conversation)
                regenerate = gr.Button("Regenerate", elem_id="regenerate", interactive=False)
                clear = gr.Button("Clear", elem_id="clear")
                export_json = gr.DownloadButton("Export JSON", elem_id="export-json", interactive=False)
                export_md = gr.DownloadButton("Export Markdown", elem_id="export-md", interactive=False)
            # each pane's readout under its chat's half of the row: shown and hidden with the pane (``base_panes``)
            with gr.Row(equal_height=True):
                with gr.Column(visible=False, elem_id="readout-pane-baseline") as base_readout_column:
                    base_readout = gr.Markdown(elem_id="readout-baseline", elem_classes="readout")
                with gr.Column(elem_id="readout-pane-medusa"):
                    readout = gr.Markdown(READOUT_HINT, elem_id="readout", elem_classes="readout")
            comparison = gr.Markdown(elem_id="comparison")
            with gr.Accordion("Raw numbers", open=False):
                raw = gr.JSON(label="Stats of the last answer", elem_id="raw")
        with gr.Column(scale=1, min_width=280):
            with gr.Accordion("Model", open=False, elem_id="model-panel"):
                known = gr.Dropdown([entry.label for entry in KNOWN_MODELS], value=None, label="Known models",
                                    elem_id="known-model")
                model_box = gr.Textbox(label="…or a backbone: hub id or local directory", elem_id="model-id")
                heads_box = gr.Textbox(label="Medusa heads: hub id or local directory (optional)",
                                       elem_id="heads-id")
                with gr.Row():
                    load = gr.Button("Load", elem_id="load-model")
                    unload = gr.Button("Unload", elem_id="unload-model")
                model_status = gr.Markdown(elem_id="model-status")
            system = gr.Textbox(system_prompt, label="System prompt", lines=3, elem_id="system")
            compare = gr.Checkbox(False, label="Compare with plain decoding", elem_id="compare")
            # words only: punctuation can be Markdown syntax (a list's "1."), so a marker around it would break
            # the rendering; QA counted "4 from heads" in the readout and saw one word coloured
            colour = gr.Checkbox(False, label="Colour words that came from the heads", elem_id="colour",
                                 info="punctuation, spaces and line breaks the heads guessed count in the readout "
                                      "but are not coloured")
            controls = {**decoding_controls(slot.max_new_tokens, start), "colour_heads": colour}
    return Page(session, saved, kept, shown_version, timer, watch, note, status, busy_hint,
                (base_column, base_readout_column), base_chat, base_readout, chat, readout,
                comparison, box, send, stop, regenerate, clear, export_json, export_md, raw, known, model_box,
                heads_box, load, unload, model_status, system, compare, controls)
