"""Copy buttons: one under each ended answer, which copies the answer as the model wrote it (its Markdown, which
render.answer_html keeps hidden in the bubble), and one on each of its code blocks, which copies the code. Gradio's
own copy button would copy a message's HTML (the page renders answers itself: render.py). SCRIPT, run once per page
load, adds the buttons wherever an answer appears, in both panes: Gradio replaces a message's HTML at every update,
and a button added to it goes with it. The buttons are icons, with their names for screen readers: a label would
be read as part of the answer's text."""

PANES = ("#chat", "#chat-baseline")
COPIED_FOR_S = 1.5     # the tick shows this long after a copy
FAILED_FOR_S = 6       # a failed copy says so this long

_ICON = ('<svg width="15" height="15" viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2" '
         'aria-hidden="true"><rect x="9" y="9" width="12" height="12" rx="2"/>'
         '<path d="M5 15H4a2 2 0 0 1-2-2V4a2 2 0 0 1 2-2h9a2 2 0 0 1 2 2v1"/></svg>')
_TICK = ('<svg width="15" height="15" viewBox="0 0 24 24" fill="none" stroke="currentColor" stroke-width="2.5" '
         'aria-hidden="true"><path d="M4 12l5 5L20 6"/></svg>')

SCRIPT = f"""() => {{
  if (window.medusaCopyButtons) return;
  window.medusaCopyButtons = true;
  const icon = {_ICON!r}, tick = {_TICK!r};
  const write = async (text) => {{
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    // a page served over plain http on a network address has no clipboard API: the older way
    const area = Object.assign(document.createElement("textarea"), {{value: text}});
    area.style.cssText = "position: fixed; top: 0; opacity: 0";
    document.body.append(area);
    area.select();
    const copied = document.execCommand("copy");
    area.remove();
    if (!copied) throw new Error("the browser refused");
  }};
  const button = (kind, name, text) => {{
    const made = document.createElement("button");
    Object.assign(made, {{type: "button", className: `copy ${{kind}}`, title: name, innerHTML: icon}});
    made.setAttribute("aria-label", name);
    let timer;
    made.addEventListener("click", async (event) => {{
      event.stopPropagation();
      clearTimeout(timer);
      let shown = {COPIED_FOR_S * 1000};
      try {{
        await write(text());
        Object.assign(made, {{innerHTML: tick, title: "Copied"}});
      }} catch (err) {{
        // said on the button: a copy that silently did nothing leaves the user pasting the old clipboard
        Object.assign(made, {{textContent: `Copy failed (${{err.message}}): select the text and copy it`,
                             title: "Copy failed"}});
        made.classList.add("failed");
        shown = {FAILED_FOR_S * 1000};
      }}
      timer = setTimeout(() => {{
        Object.assign(made, {{innerHTML: icon, title: name}});
        made.classList.remove("failed");
      }}, shown);
    }});
    return made;
  }};
  // the buttons go inside the answer's own elements, which each update replaces: Svelte leaves a node it did not
  // make where it is, and a button appended to the message stayed at its top, copying the text it was made for
  const source = (reply) => reply.parentElement.querySelector(":scope > .reply-source");
  const add = () => {{
    for (const reply of document.querySelectorAll({", ".join(f"{pane} .reply" for pane in PANES)!r})) {{
      if (source(reply) && !reply.querySelector(":scope > .copy-answer")) {{
        reply.append(button("copy-answer", "Copy the answer", () => source(reply).textContent));
      }}
      for (const pre of reply.querySelectorAll("pre")) {{
        if (pre.querySelector(":scope > .copy-code")) continue;
        // markdown-it ends a block's code with a line break that is not the model's
        pre.prepend(button("copy-code", "Copy the code",
                           () => (pre.querySelector("code") ?? pre).textContent.replace(/\\n$/, "")));
      }}
    }}
  }};
  // called before the page paints the change: a streamed update never shows its code blocks without the button
  new MutationObserver(add).observe(document.body, {{subtree: true, childList: true}});
  add();
}}"""
