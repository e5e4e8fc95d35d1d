"""A number typed out of a slider's range says so. Gradio's slider clamps the value its number box
holds when the box loses focus (temperature 100 becomes 2, -1 becomes 0: exact sampling turned
greedy without a word), and that happens before a Send click reads it, so the server never sees
the typed value to refuse it. SCRIPT, run once per page load, watches those boxes (before
Gradio's own handler) and shows a one-line note naming the value, the range and what was used."""

NOTE_ID = "range-note"
SHOWN_S = 8

SCRIPT = f"""() => {{
  if (window.medusaRangeNotice) return;
  window.medusaRangeNotice = true;
  const show = (text) => {{
    let note = document.getElementById("{NOTE_ID}");
    if (!note) {{
      note = document.createElement("div");
      note.id = "{NOTE_ID}";
      note.setAttribute("role", "alert");
      note.style.cssText = "position:fixed;top:16px;right:16px;z-index:1000;max-width:420px;padding:10px 14px;" +
        "border-radius:8px;background:#fff7ed;border:1px solid #f59e0b;color:#7c2d12;font-size:14px;" +
        "box-shadow:0 2px 8px rgba(0,0,0,.15);cursor:pointer";
      note.title = "click to close";
      note.onclick = () => note.remove();
      document.body.appendChild(note);
    }}
    note.textContent = text;
    clearTimeout(note.timer);
    note.timer = setTimeout(() => note.remove(), {SHOWN_S * 1000});
  }};
  // capture: this runs before the box's own blur handler clamps the value
  document.addEventListener("blur", (event) => {{
    const box = event.target;
    if (!(box instanceof HTMLInputElement) || box.type !== "number" || box.value === "") return;
    const label = (box.getAttribute("aria-label") || "").replace(/^number input for /, "");
    const [value, low, high] = [Number(box.value), Number(box.min), Number(box.max)];
    if (box.min === "" || box.max === "" || !Number.isFinite(value) || (value >= low && value <= high)) return;
    const used = Math.min(Math.max(value, low), high);
    show(`${{label}} ${{box.value}} is out of range: use a value from ${{low}} to ${{high}} (set to ${{used}})`);
  }}, true);
}}"""
