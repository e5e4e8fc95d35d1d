"""A number typed out of a slider's range says so. Gradio's slider clamps the value its number box
holds when the box loses focus (temperature 100 becomes 2, -1 becomes 0: exact sampling turned
greedy without a word; a cleared box, or text the browser cannot read as a number, becomes the
minimum), and that happens before a Send click reads it, so the server never sees the typed value
to refuse it. SCRIPT, run once per page load, watches the sliders' number boxes (before Gradio's own
handler) and shows a one-line note naming the value, the range and what was used
(assets/style.css styles it); a fraction typed where a whole number goes is named at once too.
A decimal comma typed in those boxes becomes a point: the browser dropped it ("0,7" became 7, set
to the maximum 2, under a note naming a 7 nobody typed). Text typed in the Seed box that is no number
is said too, and so is an emptied Seed box: either reads as empty, which samples with a random seed."""

NOTE_ID = "range-note"
SHOWN_S = 8
SLIDER_BOX = "number input for "   # the start of a slider's number box's aria-label (Gradio 6)
SEED_ID, SEED_NAME = "seed", "Seed"     # the seed's number box (layout.py), which the note names

SCRIPT = f"""() => {{
  if (window.medusaRangeNotice) return;
  window.medusaRangeNotice = true;
  const show = (name, text) => {{
    let note = document.getElementById("{NOTE_ID}");
    if (!note) {{
      note = document.createElement("div");
      note.id = "{NOTE_ID}";
      note.setAttribute("role", "alert");
      note.title = "click to close";
      note.onclick = () => note.remove();
      document.body.appendChild(note);
    }}
    note.textContent = text;
    note.dataset.slider = name;
    clearTimeout(note.timer);
    note.timer = setTimeout(() => note.remove(), {SHOWN_S * 1000});
  }};
  const sliderBox = (box) => box instanceof HTMLInputElement && box.type === "number"
    && (box.getAttribute("aria-label") || "").startsWith("{SLIDER_BOX}");
  const seedBox = (box) => box instanceof HTMLInputElement && box.type === "number" && box.closest("#{SEED_ID}");
  document.addEventListener("keydown", (event) => {{
    // typed as a point where the browser takes it (where it does not, the comma goes through as before)
    if (event.key === "," && sliderBox(event.target) && document.execCommand("insertText", false, "."))
      event.preventDefault();
  }}, true);
  // what the Seed box's last keystroke left: text the browser cannot read as a number is forgotten by Gradio's
  // binding, which can set the box to "" after it (a busy machine: the blur then found an empty, readable box)
  document.addEventListener("input", (event) => {{
    const box = event.target;
    if (seedBox(box))
      box.dataset.unreadable = box.validity.badInput ? "yes" : "";
  }}, true);
  // capture: this runs before the box's own blur handler clamps the value
  document.addEventListener("blur", (event) => {{
    const box = event.target;
    if (seedBox(box)) {{
      // text the browser cannot read as a number ("1e", "--2") reads as an empty box, which samples with a random
      // seed: said, or the answer's seed was not the one typed without a word (QA)
      const unreadable = box.dataset.unreadable === "yes";
      box.dataset.unreadable = "";      // said once: a later visit that types nothing finds the box as it is
      if (box.validity.badInput || (box.value === "" && unreadable))
        show("{SEED_NAME}", "{SEED_NAME}: what was typed is not a whole number: type one, or -1 for a random seed " +
             "(a random seed is used)");
      else if (box.value === "")    // cleared (or letters the box refused): sampled as -1 is, unsaid (QA)
        show("{SEED_NAME}", "{SEED_NAME} is empty: a random seed is used (type a whole number to repeat an " +
             "answer, or -1)");
      return;
    }}
    if (!sliderBox(box) || box.min === "" || box.max === "") return;
    const name = box.getAttribute("aria-label").slice({len(SLIDER_BOX)});
    const [low, high] = [Number(box.min), Number(box.max)];
    const range = `use a value from ${{low}} to ${{high}}`;
    if (box.value === "") {{      // cleared, or unreadable: Gradio takes it as 0
      show(name, `${{name}} is empty or not a number: ${{range}} (set to ${{Math.min(Math.max(0, low), high)}})`);
      return;
    }}
    const value = Number(box.value);
    if (value >= low && value <= high) {{
      // a whole-number slider (max new tokens) keeps a typed fraction, which Send then refuses: say so now
      if (Number(box.step) === 1 && Number.isInteger(low) && !Number.isInteger(value))
        show(name, `${{name}} ${{box.value}} is not a whole number: use one from ${{low}} to ${{high}}, ` +
             `e.g. ${{Math.floor(value)}} or ${{Math.ceil(value)}}`);
      else {{   // corrected: a note about this slider's earlier value goes (QA: it stayed its 8 s, naming it)
        const note = document.getElementById("{NOTE_ID}");
        if (note && note.dataset.slider === name) note.remove();
      }}
      return;
    }}
    const used = Math.min(Math.max(value, low), high);
    show(name, `${{name}} ${{box.value}} is out of range: ${{range}} (set to ${{used}})`);
  }}, true);
}}"""
