"""The page's model controls: loading another model (with its progress on the status line),
unloading, and the controls that follow the loaded model (tree choices, context, its decoding
defaults, and the user's settings for it that the browser keeps across reloads)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import gradio as gr

from medusa_core.decoding.config import limits, number
from medusa_core.loading.spec import LoadSpec

from .engine import BASELINE, LABELS, MEDUSA
from .layout import MODE_CONTROLS, SAMPLING, Page, cpu_default_note, mode_enabled
from .models import KNOWN_MODELS, ModelSlot, default_settings, spec_for
from .session import Session
from .settings import Settings, tree_choice


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
    tree than the default is expected to give here (``TreeCatalogue.outlook``). The readout under each
    answer names what decoded that answer."""
    if engine is None:
        return gr.update(label=LABELS[MEDUSA])
    typed = (tree_name or "").strip()
    if typed and engine.trees.paths(typed) is None:   # said as it is typed: it was said only after a Send
        return gr.update(label=f"{LABELS[MEDUSA] if engine.num_heads else LABELS[BASELINE]} · tree {typed!r} cannot "
                               "run here (Send says why)")
    outlook = engine.trees.outlook(tree_name)
    if outlook is None and (typed_choice := engine.trees.typed_choice(typed)) is not None:
        outlook = typed_choice[0]   # no estimate (a tree set by --tree, heads without accuracies): still its size
    return gr.update(label=engine.medusa_label(tree_name) + (f" · {outlook}" if outlook else ""))


MAX_TYPED_TREES = 8     # typed trees a tab's picker keeps listed, the latest


def tree_picker(engine, tree_name: str | None, earlier: Sequence[str] = ()) -> dict:
    """The picker's choices for ``engine``, with a typed tree ``tree_name`` labelled by its node count and shown
    by its name as the list spells it (CHAIN-03 is chain-3, a listed tree, shown with its label). ``earlier``:
    trees typed before in this tab, listed after the model's own where these heads run them (QA: a typed
    tree left the list once a listed one was picked, and had to be typed again)."""
    typed = engine.trees.typed_choice(tree_name)
    kept = [choice for name in earlier if (choice := engine.trees.typed_choice(name)) is not None and choice != typed]
    choices = [*engine.trees.choices, *kept, *([typed] if typed is not None else [])]
    if typed is not None:
        return gr.update(choices=choices, value=typed[1])
    if isinstance(tree_name, str) and not tree_name.strip():
        # an emptied box sends the default tree: it shows it (QA: spaces typed stayed there as the choice)
        return gr.update(choices=choices, value=engine.trees.default)
    listed = engine.trees.shown_name(tree_choice(tree_name)) if isinstance(tree_name, str) else ""
    if listed != tree_name and listed in {name for _, name in engine.trees.choices}:
        return gr.update(choices=choices, value=listed)
    return gr.update(choices=choices)


def on_tree_typed(engine, session, tree_name: str | None) -> dict:
    """A tree typed into the picker, or one picked from it: the list, with the trees this tab typed kept in
    it (``session.typed_trees``, updated)."""
    if engine is None:
        return gr.update()
    note_typed(engine, session, tree_name)
    return tree_picker(engine, tree_name, session.typed_trees)


def note_typed(engine, session, tree_name) -> None:
    """``session.typed_trees`` with ``tree_name`` last where it is a typed tree these heads run; the same list
    however often it is called for one tree (the picker's handler and the browser's copy both call it)."""
    typed = engine.trees.typed_choice(tree_name) if isinstance(tree_name, str) else None
    if typed is not None and session.typed_trees[-1:] != [typed[1]]:   # the latest MAX_TYPED_TREES, this one last
        session.typed_trees = [*(name for name in session.typed_trees if name != typed[1]), typed[1]][-MAX_TYPED_TREES:]


def kept_typed(kept) -> list[str]:
    """The typed trees in the browser's copy (settings_copy), for a tab that reloads: names only (the loaded
    heads decide which are listed); none from an older or damaged copy."""
    typed = kept.get("typed_trees") if isinstance(kept, dict) else None
    if not isinstance(typed, list):
        return []
    return [name for name in typed if isinstance(name, str) and 0 < len(name.strip()) <= 200][-MAX_TYPED_TREES:]


MAX_STATUS_WAIT_S = 600    # the longest /model_status waits for a load (a hub download can take longer: ask again)

# what ``sync`` updates, in its order (the Medusa pane last: only its title)
MODEL_OUTPUTS = ("model_status", "status", "note", "send", "known", "tree", "max_new_tokens", "mode", *MODE_CONTROLS,
                 "colour_heads", "timer", "shown_version", "kept", "pane")


# the decoding controls a reload brings back, by Settings field name (compare and the system prompt are kept
# with the conversation)
KEPT = ("mode", *SAMPLING, "max_new_tokens", "tree", "seed", "colour_heads")


def settings_copy(engine, *values, typed: Sequence[str] = ()) -> dict:
    """What the browser keeps of the decoding controls (``values`` in KEPT's order, as the page holds them):
    the values and the model they were set for, ``engine`` (None while the page has no model yet: the copy is
    then for the model that arrives, and sync labels it for that one). The model's default tree is kept as
    None, "the default": the tree tuned on this start may be plain decoding on the next, or not listed.
    ``typed``: the tab's typed trees, which a reload lists again (QA: they were gone after a reload)."""
    # a value no control runs is not kept (the copy keeps only what kept_values would put back): a seed
    # typed past 2**64 could not even be stored, and its traceback took the copy's other values with it
    settings = {name: value for name, value in ((name, as_the_slider_runs(name, value, engine))
                                                for name, value in zip(KEPT, values)) if valid(name, value)}
    if engine is not None and settings.get("tree") == engine.trees.default:
        settings["tree"] = None
    return {"model": engine.loaded.source if engine is not None else None, "settings": settings,
            **({"typed_trees": list(typed)} if typed else {})}


def as_the_slider_runs(name: str, value, engine):
    """``value`` as the page runs it: a number typed into a slider's box past one of its ends is put back at that
    end when the box loses focus, and the answer runs with that, but no input event says so. Kept as typed, a
    temperature of -1 ran at 0 and came back at the default, 0.7, after a reload (QA)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if name == "max_new_tokens":       # its top is the model's context, once a model has loaded
        low, high = limits(name).low, engine.context if engine is not None else None
    elif name in SAMPLING and limits(name).slider is not None:
        low, high, _ = limits(name).slider
    else:
        return value
    return min(max(value, low), high) if high is not None else max(value, low)


def kept_values(kept, engine) -> dict:
    """The controls' values, by name, from the browser's copy (settings_copy) that apply now: the copy is
    for the loaded model or for whichever arrives (another model starts from its own defaults, as a load
    does), and each value is one its control takes and this model runs (an older or damaged copy, or a
    tree this start does not offer, loses only what is wrong in it)."""
    if engine is None or not isinstance(kept, dict) or kept.get("model") not in (None, engine.loaded.source) \
            or not isinstance(kept.get("settings"), dict):
        return {}
    values = {}
    for name, value in kept["settings"].items():
        if name not in KEPT or (name == "tree" and not (isinstance(value, str) and
                                                         engine.trees.paths(value) is not None)):
            continue                # the default tree (None) is what sync puts in the box
        if valid(name, value) and (name != "max_new_tokens" or Settings.parse(max_new_tokens=value).max_new_tokens
                                   <= engine.context):
            values[name] = value
    return values


def valid(name: str, value) -> bool:
    """Whether the control ``name`` runs ``value`` (as Send checks it; the model's own limits aside)."""
    try:
        Settings.parse(**{name: value})
    except ValueError:
        return False
    return True


def with_kept(updates: dict, values: dict, engine, typed: Sequence[str] = ()) -> dict:
    """The model controls' ``updates`` by name with the kept ``values`` put in: the mode's controls
    enabled as the kept mode needs, and the pane titled for the kept tree (``typed``: the tab's typed trees,
    listed with it)."""
    updates = {**updates, **{name: {**updates.get(name, gr.update()), "value": value} for name, value in values.items()}}
    if "mode" in values:
        for name, on in mode_enabled(values["mode"]).items():
            updates[name] = {**updates.get(name, gr.update()), "interactive": on}
    if "tree" in values:
        updates["pane"] = medusa_pane(engine, values["tree"])
        updates["tree"] = {**updates["tree"], **tree_picker(engine, values["tree"], typed)}   # a kept typed tree's size
    return updates


def first_paragraph(line: str) -> str:
    """The status line's first paragraph, for the line under the Load button (the tree's paragraph is the
    status line's)."""
    return line.split("\n\n")[0]


def panel_status(news: str, state) -> str:
    """Under the Load button: ``news`` (what this page's Load or Unload did, or a change it saw), then the loaded
    model in full (SlotState.details), which the status line leaves out."""
    return "\n\n".join(filter(None, [news, f"Loaded: {state.details}" if state.details else ""]))


def wire_model_panel(page: Page, slot: ModelSlot, base_spec: LoadSpec, start: Settings):
    """Attach the model panel's events; returns ``sync(shown, max_new_value, stored)``, the update of
    ``model_outputs(page)`` the page's load event uses too. ``start``: the decoding settings the page
    opened with (app.models.start_settings)."""

    def sync(shown: tuple[int, int] | None, max_new_value, stored=None, session: Session | None = None) -> tuple:
        """The page's model controls for the slot's state; ``shown`` is the (slot version, engine
        version) the page shows now (None: nothing yet); ``session``: the tab's, whose typed trees a model
        that arrives lists too where its heads run them. The tree, max new tokens and the decoding
        settings go to the model's defaults only when the model itself changed: a status change
        (a load starting, or failing while the previous model stays) keeps the user's choices. A
        model that arrives gets the settings the browser kept for it (``stored``, settings_copy)."""
        state = slot.state()
        loading = state.phase == "loading"
        now = (state.version, state.engine_version)
        if shown == now and not loading:
            return tuple({"timer": gr.Timer(active=False), "shown_version": shown}.get(name, gr.update())
                         for name in MODEL_OUTPUTS)
        engine = state.engine
        if shown is None and session is not None and not session.typed_trees:
            session.typed_trees = kept_typed(stored)        # a reloaded tab's typed trees, from the browser's copy
        cpu_default = engine is not None and engine.loaded.cpu_default
        note = cpu_default_note(engine.weights, str(engine.dtype).removeprefix("torch.")) if cpu_default else None
        # the status line's first paragraph under the Load button too (the tree's is the status line's), for a
        # change this page saw: on a phone the line at the top is far out of view, and a failed Load showed
        # nothing where the user pressed it
        under = panel_status(first_paragraph(state.line) if shown is not None else "", state)
        if session is not None and session.refused_at == state.version:
            under = gr.update()        # this tab's refused Load made this version: its refusal stays the news
        # a page opened after another tab's Load failed beside the model that stayed: that model's Ready line (QA:
        # every new visitor's first sight was a red error about a model they never asked for); tabs open then
        # saw the failure as it happened, the one that pressed Load under its button too
        # a tab whose message waited for this load is answering it now: its status line is the answer's (the load's
        # Ready line, written over "Generating", read as an idle page, and a message sent then was refused as busy)
        answering = session is not None and session.busy.locked()
        status = gr.update() if answering else state.model_line if shown is None else state.line
        updates = {"status": status, "model_status": under,
                   "note": gr.update(visible=cpu_default, **({"value": note} if note else {})),
                   # on while a model is loading too: a message sent then waits for it, as Enter's always did (QA: a
                   # grey Send beside an Enter that sent read as "you cannot send now")
                   "send": gr.update(interactive=engine is not None or loading),
                   "timer": gr.Timer(active=loading), "shown_version": now}
        if shown is not None and shown[1] == state.engine_version:
            pass                       # the same model: the controls stay as the user set them
        elif engine is None:
            updates.update(tree=gr.update(choices=[], value=None), pane=medusa_pane(None), known=slot.known_label())
        else:
            try:
                current = int(float(max_new_value))
            except (TypeError, ValueError, OverflowError):     # "abc", "nan", "inf": the page's value is unset
                current = engine.max_new_tokens
            # why this tree (tuned, preset...) is on the status line: not repeated under the picker
            typed = session.typed_trees if session is not None else ()
            # the model list shows the model that arrived where it is one of its entries (QA: blank beside it)
            updates.update(known=slot.known_label(),
                           tree=tree_picker(engine, None, typed) | {"value": engine.trees.default},
                           max_new_tokens=gr.update(maximum=engine.context, value=min(current, engine.context)),
                           pane=medusa_pane(engine))
            defaults = default_settings(engine.loaded)
            # the first model the page shows, with the settings the page opened with: the controls hold
            # those, or what the user chose while it loaded
            if not (shown is not None and shown[1] == 0 and defaults == start):
                updates.update(zip(("mode", *MODE_CONTROLS), decoding_values(defaults)))
            updates = with_kept(updates, kept_values(stored, engine), engine, typed)
            if isinstance(stored, dict) and stored.get("model") is None and isinstance(stored.get("settings"), dict):
                # set while the page had no model: this model's now (the browser keeps it under its name)
                typed_kept = kept_typed(stored)
                updates["kept"] = {"model": engine.loaded.source,
                                   "settings": {k: v for k, v in stored["settings"].items() if valid(k, v)},
                                   **({"typed_trees": typed_kept} if typed_kept else {})}
        return tuple(updates.get(name, gr.update()) for name in MODEL_OUTPUTS)

    def page_only(updates: tuple) -> tuple:
        """``sync``'s updates less the shown version, for the Load and Unload buttons, which scripts call too:
        only the page's own events (its load and the sync timer) say which model its controls show. A script's
        session never runs the timer, so a version written here, mid-load, stayed the old model's, and every
        later send of that script ran the default tree instead of the one it named (ChatController.for_engine)."""
        return tuple(update for name, update in zip(MODEL_OUTPUTS, updates) if name != "shown_version")

    def on_load_model(choice, model_id, heads_id, max_new_value, shown, session=None):
        try:
            spec = spec_for(choice, model_id, heads_id, base_spec)
        except ValueError as err:
            slot.dismiss_failure()      # this refusal is the news: an older load's error is not repeated beside it
            if isinstance(session, Session):
                session.refused_at = slot.state().version
            return (f"❌ {err}", *page_only(sync(shown, max_new_value, session=session))[1:])
        refused = slot.start(spec)
        if refused:
            # under the button, as a refused choice is, and the first thing a script's /load_model gets (QA: it got
            # the other load's "Loading" line and read it as its own); the sync writes that load's end over it
            if isinstance(session, Session):
                session.refused_at = slot.state().version
            return (f"⚠ {refused}", *page_only(sync(shown, max_new_value, session=session))[1:])
        # a load that failed at once (a missing folder) may have ended by now: then its line has the tree paragraph
        # too (else the sync timer shows how it ended)
        state = slot.state()
        return (panel_status(first_paragraph(state.line), state), *page_only(sync(shown, max_new_value))[1:])

    def on_unload(max_new_value, shown):
        return (slot.unload(), *page_only(sync(shown, max_new_value))[1:])

    def watch(session: Session, shown):
        """Every 2 s: a model loaded, switched or unloaded elsewhere (another tab, the API) starts the sync timer,
        so this tab's status line, Send button and tree follow it (a tab said Ready with Send on after an unload,
        and after a switch ran its old tree on the new model). The watch itself outputs only that timer and the busy
        hint (a line of its own): the sync's outputs, even unchanged, put stale values back into a streaming answer's
        status line and a tree picked meanwhile. While this tab answers, its status line is the answer's: the sync
        waits for it."""
        state = slot.state()
        hint = busy_hint(session, state.engine)
        if session.busy.locked() or (shown == (state.version, state.engine_version) and state.phase != "loading"):
            return gr.update(), hint
        return gr.Timer(active=True), hint

    def busy_hint(session: Session, engine) -> dict:
        """The line under the status while another tab's or a script's request holds the model and this tab has none
        running: shown or hidden only when that changes (the status line itself stays the sync's and the answer's)."""
        elsewhere = engine is not None and not session.busy.locked() and engine.queue.activity()[0]
        if elsewhere == session.busy_hint_shown:
            return gr.update()
        session.busy_hint_shown = elsewhere
        return gr.update(visible=elsewhere)

    def model_status(wait: float = 0.0) -> dict:
        """For scripts, which see no status line: {"phase": "loading", "ready", "failed" or "empty", "status": the
        page's status line, "details": the loaded model in full (the Model panel's), "model": the loaded model or
        null, "error": why the last load failed or null (a failed switch keeps the model before it: phase "ready"),
        "trees" and "default_tree": the model's}, after waiting up to ``wait`` seconds (at most MAX_STATUS_WAIT_S)
        for a load in progress to end. /load_model answers at once, while the load starts: a script could not tell
        a path that failed from a load still running."""
        try:
            seconds = 0.0 if wait is None else number("wait", wait)    # a bool is refused, not 1 s
        except ValueError as err:
            raise gr.Error(f"{err} (the seconds to wait for a load)", print_exception=False) from None
        if not 0 <= seconds <= MAX_STATUS_WAIT_S:
            raise gr.Error(f"wait {seconds:g} is out of range: give 0 to {MAX_STATUS_WAIT_S} seconds",
                           print_exception=False)
        state = slot.wait(seconds) if seconds else slot.state()
        engine = state.engine
        # the trees /send's tree takes as listed (the picker's choices; view_api cannot list them: they come with the
        # model), and the one it runs without a tree
        return {"phase": state.phase, "status": state.line, "details": state.details,
                "model": engine.loaded.source if engine is not None else None, "error": state.error,
                "trees": [name for _, name in engine.trees.choices] if engine is not None else [],
                "default_tree": engine.trees.default if engine is not None else None}

    gr.api(model_status, api_name="model_status", concurrency_limit=None)
    max_new, outputs = page.controls["max_new_tokens"], model_outputs(page)
    page.timer.tick(sync, [page.shown_version, max_new, page.kept, page.session], outputs, api_name=False,
                    concurrency_limit=None, show_progress="hidden")
    page.watch.tick(watch, [page.session, page.shown_version], [page.timer, page.busy_hint], api_name=False,
                    concurrency_limit=None, show_progress="hidden")
    # raw values (preprocess=False): a script's bad number reaches sync, which takes it as unset, instead of
    # Gradio's multi-line preprocessing error
    buttons = [output for output in outputs if output is not page.shown_version]    # the line under them first
    page.load.click(on_load_model, [page.known, page.model_box, page.heads_box, max_new, page.shown_version,
                                    page.session], buttons, api_name="load_model", concurrency_limit=None,
                    preprocess=False)
    # the model controls show what Load will load: a pick from the list empties the boxes, and text put in a box
    # takes the pick back (QA: a path left in the backbone box silently won over a model picked after it). In the
    # browser only: nothing to ask the server. The list's input event also comes when its filter text is
    # dropped (Escape, a click away): only a listed entry empties the boxes (QA: typed paths were wiped). A
    # box's change event, not its input: a pasted or filled-in path sends no input event (QA); the boxes
    # emptied by a pick send a change too, which keeps the pick
    labels = json.dumps([entry.label for entry in KNOWN_MODELS])
    page.known.input(None, [page.known, page.model_box, page.heads_box], [page.model_box, page.heads_box],
                     js=f"(known, model, heads) => {labels}.includes(known) ? ['', ''] : [model, heads]",
                     api_name=False)
    for box in (page.model_box, page.heads_box):
        box.change(None, [box, page.known], [page.known], js="(text, known) => text.trim() ? null : known",
                   api_name=False)
    page.unload.click(on_unload, [max_new, page.shown_version], buttons, api_name="unload_model",
                      concurrency_limit=None, preprocess=False)
    page.controls["mode"].change(control_state, [page.controls["mode"]], page.mode_controls, api_name=False,
                                 concurrency_limit=None)
    page.controls["tree"].change(lambda tree: medusa_pane(slot.engine, tree), [page.controls["tree"]], [page.chat],
                                 api_name=False, concurrency_limit=None, show_progress="hidden")
    # a tree typed in: listed with its size (on input only: the update would otherwise trigger itself)
    page.controls["tree"].input(lambda session, tree: on_tree_typed(slot.engine, session, tree),
                                [page.session, page.controls["tree"]], [page.controls["tree"]], api_name=False,
                                concurrency_limit=None, show_progress="hidden")
    # the browser keeps the decoding controls as the user sets them (a model's defaults are not the user's
    # choice; the page's load puts them back: kept_values); raw values, as the controls hold them.
    # "always_last": each copy holds every control, so an older copy must never land after a newer one
    # (two controls set in quick succession each sent one)
    def on_control(shown, session: Session, *values):
        """The browser's copy after the user set a control, for the model whose controls the page shows: in
        the moment between another model's arrival and the page showing its controls, the values are still
        the old model's (they were saved under the new one). A typed tree is noted here too: this may run
        before the picker's own handler."""
        state = slot.state()
        if state.engine is not None and (shown is None or shown[1] != state.engine_version):
            return gr.update()
        if state.engine is not None:
            note_typed(state.engine, session, values[KEPT.index("tree")])
        return settings_copy(state.engine, *values, typed=session.typed_trees)

    kept = [page.controls[name] for name in KEPT]
    gr.on([control.input for control in kept], on_control, [page.shown_version, page.session, *kept], [page.kept],
          api_name=False, concurrency_limit=None, preprocess=False, show_progress="hidden", trigger_mode="always_last")
    return sync


def model_outputs(page: Page) -> list:
    named = {"model_status": page.model_status, "status": page.status, "note": page.note, "send": page.send,
             "known": page.known,
             "timer": page.timer, "shown_version": page.shown_version, "kept": page.kept, "pane": page.chat,
             **page.controls}
    return [named[name] for name in MODEL_OUTPUTS]
