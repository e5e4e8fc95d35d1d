"""The page's model controls: loading another model (with its progress on the status line),
unloading, and the controls that follow the loaded model (tree choices, context, its decoding
defaults)."""

from __future__ import annotations

import gradio as gr

from medusa_core.loading.spec import LoadSpec

from .engine import LABELS, MEDUSA
from .layout import MODE_CONTROLS, SAMPLING, Page, mode_enabled
from .models import ModelSlot, default_settings, spec_for
from .settings import Settings


def control_state(mode: str) -> tuple[dict, ...]:
    """Temperature, top-p, ε, δ, seed: enabled only where the mode uses them."""
    enabled = mode_enabled(mode)
    return tuple(gr.update(interactive=enabled[name]) for name in MODE_CONTROLS)


def decoding_values(settings: Settings) -> tuple[dict, ...]:
    """Mode, temperature, top-p, ε, δ set to ``settings`` (a model's defaults), and they and the seed
    (kept as the user set it) enabled as the mode needs."""
    enabled = control_state(settings.mode)
    return (gr.update(value=settings.mode),
            *({**update, "value": getattr(settings, name)} if name in SAMPLING else update
              for update, name in zip(enabled, MODE_CONTROLS)))


def medusa_pane(engine, tree_name: str | None = None) -> dict:
    """The Medusa pane's title: what its next answer runs with the tree control's value ``tree_name``
    (None or "": the model's default tree), as ``ChatEngine.medusa_label`` names it, with what another
    tree than the default is expected to give here (``ChatEngine.outlook``). The readout under each
    answer names what decoded that answer."""
    if engine is None:
        return gr.update(label=LABELS[MEDUSA])
    outlook = engine.outlook(tree_name)
    return gr.update(label=engine.medusa_label(tree_name) + (f" · {outlook}" if outlook else ""))


def wire_model_panel(page: Page, slot: ModelSlot, base_spec: LoadSpec, start: Settings):
    """Attach the model panel's events; returns ``sync(shown, max_new_value)``, the update of
    ``model_outputs(page)`` the page's load event uses too. ``start``: the decoding settings the page
    opened with (app.models.start_settings)."""
    decoding = [page.controls["mode"], *page.mode_controls]

    def sync(shown: tuple[int, int] | None, max_new_value) -> tuple:
        """The page's model controls for the slot's state; ``shown`` is the (slot version, engine
        version) the page shows now (None: nothing yet). The tree, max new tokens and the decoding
        settings go to the model's defaults only when the model itself changed: a status change
        (a load starting, or failing while the previous model stays) keeps the user's choices."""
        state = slot.state()
        loading = state.phase == "loading"
        now = (state.version, state.engine_version)
        if shown == now and not loading:
            return (*[gr.update()] * (5 + len(decoding)), gr.Timer(active=False), shown, gr.update())
        engine = state.engine
        if shown is not None and shown[1] == state.engine_version:
            tree_update = max_update = pane = gr.update()
            decoding_update = (gr.update(),) * len(decoding)
        elif engine is None:
            tree_update, max_update, pane = gr.update(choices=[], value=None), gr.update(), medusa_pane(None)
            decoding_update = (gr.update(),) * len(decoding)
        else:
            try:
                current = int(float(max_new_value))
            except (TypeError, ValueError):
                current = engine.max_new_tokens
            # why this tree (tuned, preset...) is on the status line: not repeated under the picker
            tree_update = gr.update(choices=engine.tree_choices, value=engine.default_tree)
            max_update = gr.update(maximum=engine.context, value=min(current, engine.context))
            defaults = default_settings(engine.loaded)
            # the first model the page shows, with the settings the page opened with: the controls hold
            # those, or what the user chose while it loaded
            kept = shown is not None and shown[1] == 0 and defaults == start
            decoding_update = (gr.update(),) * len(decoding) if kept else decoding_values(defaults)
            pane = medusa_pane(engine)
        return (state.line, gr.update(visible=engine is not None and engine.loaded.cpu_default),
                gr.update(interactive=engine is not None and not loading), tree_update, max_update,
                *decoding_update, gr.Timer(active=loading), now, pane)

    def on_load_model(choice, model_id, heads_id, max_new_value, shown):
        try:
            spec = spec_for(choice, model_id, heads_id, base_spec)
        except ValueError as err:
            return (f"❌ {err}", *sync(shown, max_new_value))
        refused = slot.start(spec)
        if refused:     # a toast: a line under the panel would still say "still loading" once it has loaded
            gr.Warning(refused)
        return ("", *sync(shown, max_new_value))

    def on_unload(max_new_value, shown):
        return (slot.unload(), *sync(shown, max_new_value))

    max_new, outputs = page.controls["max_new_tokens"], model_outputs(page)
    page.timer.tick(sync, [page.shown_version, max_new], outputs, api_name=False, concurrency_limit=None,
                    show_progress="hidden")
    # raw values (preprocess=False): a script's bad number reaches sync, which takes it as unset, instead of
    # Gradio's multi-line preprocessing error
    page.load.click(on_load_model, [page.known, page.model_box, page.heads_box, max_new, page.shown_version],
                    [page.model_status, *outputs], api_name="load_model", concurrency_limit=None, preprocess=False)
    page.unload.click(on_unload, [max_new, page.shown_version], [page.model_status, *outputs], api_name="unload_model",
                      concurrency_limit=None, preprocess=False)
    page.controls["mode"].change(control_state, [page.controls["mode"]], page.mode_controls, api_name=False,
                                 concurrency_limit=None)
    page.controls["tree"].change(lambda tree: medusa_pane(slot.engine, tree), [page.controls["tree"]], [page.chat],
                                 api_name=False, concurrency_limit=None, show_progress="hidden")
    return sync


def model_outputs(page: Page) -> list:
    """What ``sync`` updates, in its order (the Medusa pane last: only its title)."""
    return [page.status, page.note, page.send, page.controls["tree"], page.controls["max_new_tokens"],
            page.controls["mode"], *page.mode_controls, page.timer, page.shown_version, page.chat]
