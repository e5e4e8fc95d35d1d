"""Enter in the tree picker takes the tree as typed. Gradio's dropdown takes the option its filter
highlights on Enter, so a tree typed that begins another listed one ran the other: `cartesian-2`
became `cartesian-2x2 (7 nodes)`, `small-1` became `small-16`, without a word (QA). SCRIPT, run once
per page load, catches Enter in the picker before Gradio does and, unless the arrow keys moved
through the list since the last keystroke (then Enter picks what they chose), ends the typing as Tab
or a click outside does: the box keeps the text, and the server names the tree or says why it cannot run."""

TREE_BOX = "#tree input"

SCRIPT = f"""() => {{
  if (window.medusaTreeEnter) return;
  window.medusaTreeEnter = true;
  let chosen = false;     // the arrow keys moved through the list since the last keystroke
  const inBox = (event) => event.target instanceof HTMLInputElement && event.target.matches("{TREE_BOX}");
  document.addEventListener("input", (event) => {{ if (inBox(event)) chosen = false; }}, true);
  // capture: this runs before the dropdown's own key handler
  document.addEventListener("keydown", (event) => {{
    if (!inBox(event)) return;
    if (event.key === "ArrowDown" || event.key === "ArrowUp") {{ chosen = true; return; }}
    if (event.key !== "Enter" || chosen) return;
    event.preventDefault();
    event.stopImmediatePropagation();
    event.target.blur();
  }}, true);
}}"""
