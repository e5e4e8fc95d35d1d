"""In compare mode the two panes' first messages start level. The Medusa pane's title names the tree and
what it is expected to give ("Medusa · cartesian-3x3 (13 nodes) expected 0.42x on this machine for a typical
prompt, slower than plain decoding"), which in a half-width pane wraps to two or three lines, while "Plain
decoding" takes one: every message of the Medusa pane stood 40 px below its counterpart (QA). The titles
take their own room above the messages (assets/style.css), so SCRIPT, run once per page load, gives the
shorter title the difference as bottom margin whenever a title's text, the panes shown or the window's
width change. One pane alone keeps its own height."""

TITLES = ("#chat label.float", "#chat-baseline label.float")

SCRIPT = f"""() => {{
  if (window.medusaPaneTitles) return;
  window.medusaPaneTitles = true;
  const titles = () => {list(TITLES)}.map((selector) => document.querySelector(selector));
  let queued = false;
  const level = () => {{
    queued = false;
    const found = titles();
    if (found.some((title) => !title)) return;
    found.forEach((title) => {{ title.style.marginBottom = ""; }});
    if (!found.every((title) => title.offsetParent)) return;        // one pane shown
    const heights = found.map((title) => title.getBoundingClientRect().height);
    const tallest = Math.max(...heights);
    found.forEach((title, i) => {{
      const bottom = parseFloat(getComputedStyle(title).marginBottom) || 0;
      if (tallest - heights[i] > 0.5) title.style.marginBottom = `${{bottom + tallest - heights[i]}}px`;
    }});
  }};
  const soon = () => {{ if (!queued) {{ queued = true; requestAnimationFrame(level); }} }};
  // its own margins are not news: they would call it again every frame
  new MutationObserver((records) => {{
    if (records.every((r) => r.type === "attributes" && r.target instanceof Element && r.target.matches("label.float"))) return;
    soon();
  }}).observe(document.body, {{subtree: true, childList: true, characterData: true, attributes: true,
                               attributeFilter: ["style", "class", "hidden"]}});
  window.addEventListener("resize", soon);
  soon();
}}"""
