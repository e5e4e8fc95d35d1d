"""Screen readers name each chat bubble by its aria-label, which Gradio writes as "user's message: " and the
message's content: here that content is the HTML the page renders itself (render.py), so a reader heard the
markup ('<div class="user-text">Hi</div>', every colouring span; QA). SCRIPT, run once per page load, puts the
bubble's own text after Gradio's prefix wherever Gradio writes a label, in both panes, during streaming too."""

PANES = ("#chat", "#chat-baseline")
SUFFIX = "'s message: "     # Gradio's label: the role, this, the content

SCRIPT = f"""() => {{
  if (window.medusaMessageLabels) return;
  window.medusaMessageLabels = true;
  const suffix = {SUFFIX!r};
  const relabel = (node) => {{
    const label = node.getAttribute("aria-label") || "";
    const at = label.indexOf(suffix);
    if (at < 0) return;
    const wanted = label.slice(0, at + suffix.length) + node.innerText.trim();
    if (label !== wanted) node.setAttribute("aria-label", wanted);     // only a change: no loop with itself
  }};
  const sweep = () => {{
    for (const pane of {list(PANES)}) {{
      document.querySelectorAll(`${{pane}} [aria-label*="${{suffix}}"]`).forEach(relabel);
    }}
  }};
  let queued = false;
  new MutationObserver(() => {{
    if (!queued) {{ queued = true; requestAnimationFrame(() => {{ queued = false; sweep(); }}); }}
  }}).observe(document.body, {{subtree: true, childList: true, characterData: true, attributes: true,
                               attributeFilter: ["aria-label"]}});
  sweep();
}}"""
