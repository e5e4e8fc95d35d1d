"""The Gradio page, assembled from its parts: the layout (app/layout.py), the model panel's wiring
(app/model_panel.py) and the chat controller (app/chat_controller.py), all over one ModelSlot.
Per-tab state lives in a gr.State(Session), and the conversation is also kept in the browser, per
tab (app/browser_copy.py), so it survives a reload.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no phoning home

from pathlib import Path

import gradio as gr

from medusa_core.loading.spec import LoadSpec

from . import browser_copy, copy_buttons, message_labels, pane_titles, range_notice, tree_enter
from .chat_controller import ChatController, restored_comparison, restored_readouts, wire_chat
from .layout import build_layout
from .model_panel import model_outputs, wire_model_panel
from .models import ModelSlot, start_settings

CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "style.css"
# How long Gradio's queue sleeps between looks for a new event while it has none. Its own 1 ms (50 ms on
# Windows) kept the idle app at 5% of a core, 1,700 wake-ups a second with no tab open (QA17); 20 ms is
# unnoticed before an answer that takes seconds.
IDLE_POLL_S = 0.02


def build_ui(slot: ModelSlot, *, system_prompt: str = "", base_spec: LoadSpec = LoadSpec()) -> gr.Blocks:
    # delete_cache: whatever Gradio copies into its cache goes after a day (checked hourly). The export files,
    # once a copy per change, are served as they are (app/export_files.py): nothing of ours is copied there
    with gr.Blocks(title="Medusa chat", delete_cache=(3600, 86400)) as demo:
        start = start_settings(base_spec)
        page = build_layout(slot, system_prompt, start)
        sync = wire_model_panel(page, slot, base_spec, start)
        chat = ChatController(slot)
        save_after = wire_chat(page, chat)

        def restore(session, stored, kept, max_new_value, system, request: gr.Request):
            """Page load: the conversation, its system prompt and the compare toggle kept in the browser (with the
            last answer's readouts and comparison line), the model controls, and the decoding settings kept for the
            loaded model (the Medusa pane, last of them, gets the conversation and its title in one update)."""
            chat.tab_opened(session, request.session_hash)
            medusa, baseline, system, compare, box = chat.restored(session, stored, system)
            *controls, pane = sync(None, max_new_value, kept, session)
            turns = session.turns
            return (baseline, system, compare, box, *restored_readouts(turns), restored_comparison(turns), *controls,
                    {**pane, "value": medusa})

        # this tab's copies of the conversation and the settings from the browser first, then the page built from them
        demo.load(None, None, [page.saved, page.kept], js=browser_copy.READ_BOTH, api_name=False).then(
            restore, [page.session, page.saved, page.kept, page.controls["max_new_tokens"], page.system],
            [page.base_chat, page.system, page.compare, page.box, page.readout, page.base_readout, page.comparison,
             *model_outputs(page)],
            api_name=False).then(**save_after)
        page.saved.change(None, [page.saved], None, js=browser_copy.WRITE, api_name=False)
        page.kept.change(None, [page.kept], None, js=browser_copy.WRITE_SETTINGS, api_name=False)
        demo.load(None, None, None, js=range_notice.SCRIPT, api_name=False)
        demo.load(None, None, None, js=tree_enter.SCRIPT, api_name=False)
        demo.load(None, None, None, js=pane_titles.SCRIPT, api_name=False)
        demo.load(None, None, None, js=copy_buttons.SCRIPT, api_name=False)
        demo.load(None, None, None, js=message_labels.SCRIPT, api_name=False)

        def closed(request: gr.Request):
            chat.tab_closed(request.session_hash)

        demo.unload(closed)
    return demo


def start_queue(demo: gr.Blocks) -> None:
    """The page's queue: one event per handler at a time unless it says otherwise, polled every IDLE_POLL_S
    while idle. Gradio has no public setting for the poll: where its queue lacks the attribute, the console
    says so and Gradio's own poll stays."""
    demo.queue(default_concurrency_limit=1)
    if isinstance(getattr(demo._queue, "sleep_when_free", None), float):
        demo._queue.sleep_when_free = IDLE_POLL_S
    else:
        print(f"note: Gradio {gr.__version__}'s queue has no sleep_when_free: its idle poll stays as Gradio sets "
              "it (a few percent of a core while idle)", file=sys.stderr, flush=True)


def theme() -> gr.themes.Base:
    return gr.themes.Soft(primary_hue="violet")
