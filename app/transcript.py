"""A conversation as data: what the browser keeps across reloads, and the JSON and
Markdown files the page exports."""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

from markdown_it import MarkdownIt

from medusa_core.decoding.config import is_greedy

from .session import Turn
from .readout import FINISH_TEXT, count
from .render import answer_html

FORMAT = "medusa-chat/1"
# A line that opens or closes a fenced code block (CommonMark): up to 3 spaces, then 3 or more
# backticks or tildes, then the rest of the line (an info string, or nothing on a closing fence).
FENCE = re.compile(r"( {0,3})(`{3,}|~{3,})(.*)")
# what a Markdown viewer makes of a text: CommonMark with GitHub's tables and strikethrough
VIEWER = MarkdownIt("commonmark").enable(["table", "strikethrough"])
NO_HTML = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])    # as the page reads a reply


def to_saved(turns: list[Turn], first_turn: int, system: str = "", compare: bool = False) -> dict:
    """JSON-ready form of a conversation, its system prompt and whether it is compared with plain decoding
    (the text only: the caches are rebuilt by the next answer; which words the heads guessed is not kept, so a
    restored answer is shown uncoloured)."""
    return {"format": FORMAT, "first_turn": first_turn, "system": system, "compare": compare,
            "turns": [{"user": t.user, "reply": t.reply, "baseline": t.baseline, "note": t.note, "system": t.system,
                       "answered": t.answered, "in_box": t.in_box, "cut": t.cut} for t in turns]}


def saved_system(saved) -> str | None:
    """The system prompt kept with a saved conversation: the one it was held with, or one typed before its first
    message or after Clear (QA: the box came back empty, where the other settings came back as set); None where
    there is none of these (an empty box with no conversation gives back the prompt the app was started with)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("system"), str):
        return None
    return saved["system"] if saved.get("turns") or saved["system"] else None


def saved_compare(saved) -> bool:
    """Whether the page compared with plain decoding when the conversation was saved: a reload keeps
    the plain pane and its answers in view (an empty conversation keeps it too: the toggle is the user's)."""
    return isinstance(saved, dict) and saved.get("compare") is True


def from_saved(saved) -> tuple[list[Turn], int]:
    """Turns and the context cut from ``to_saved`` output; anything else (an older format,
    a damaged entry) gives an empty conversation rather than an error on page load."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or not isinstance(saved.get("turns"), list):
        return [], 0
    turns = []
    for t in saved["turns"]:
        if isinstance(t, dict) and isinstance(t.get("user"), str):
            reply = t.get("reply") if isinstance(t.get("reply"), str) else None
            baseline = t.get("baseline") if isinstance(t.get("baseline"), str) else None
            # no answer (or an empty one), nothing shown: an empty bubble read as an answer (the plain pane said
            # that compare was off for a message a reload had cut off mid-comparison)
            turns.append(Turn(user=t["user"], reply=reply, shown=answer_html([(reply, False)]) if reply else "",
                              baseline=baseline, baseline_shown=answer_html([(baseline, False)]) if baseline else "",
                              note=t.get("note") if isinstance(t.get("note"), str) else None,
                              system=t.get("system") if isinstance(t.get("system"), str) else None,
                              answered=_answered(t.get("answered")), in_box=t.get("in_box") is True,
                              cut=t.get("cut") if isinstance(t.get("cut"), str) else None))
    first = saved.get("first_turn")
    return turns, first if isinstance(first, int) and 0 <= first <= len(turns) else 0


def _answered(saved) -> dict | None:
    """A saved turn's ``answered`` in the shape the app writes, or None: the browser's copy may be
    older or damaged, and the page's load writes the exports from it (answered_line reads it)."""
    if not isinstance(saved, dict):
        return None
    settings, comparison = saved.get("settings"), saved.get("comparison")
    return {"settings": settings if isinstance(settings, dict) else {},
            **{name: saved.get(name) if isinstance(saved.get(name), dict) else None for name in ("medusa", "baseline")},
            **({"comparison": comparison} if isinstance(comparison, str) and comparison else {})}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def closed_fences(text: str) -> str:
    """``text`` with the code fence it leaves open, if any, closed. A reply cut off inside a code
    block (max new tokens reached, or Stop) would otherwise turn the rest of the Markdown file into
    code."""
    open_fence = None      # (indent, fence) of the block the text is inside
    for line in text.split("\n"):
        found = FENCE.fullmatch(line)
        if found is None:
            continue
        indent, fence, rest = found.groups()
        if open_fence is None:
            if not (fence[0] == "`" and "`" in rest):   # a backtick fence's info string holds no backtick
                open_fence = indent, fence
        elif fence[0] == open_fence[1][0] and len(fence) >= len(open_fence[1]) and not rest.strip():
            open_fence = None
    if open_fence is None:
        return text
    indent, fence = open_fence     # closed at the opening's indent: a block in a list item ends in the item
    return text + ("" if text.endswith("\n") else "\n") + indent + fence


# CommonMark autolinks (<https://...>, <name@host>), which the page links with raw HTML off: left as they are
AUTOLINK = re.compile(r"<(?:[A-Za-z][A-Za-z0-9+.-]{1,31}:[^\s<>]*|[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9]"
                      r"(?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*)>")
BACKTICKS = re.compile(r"`+")


def html_as_text(reply: str) -> str:
    """``reply`` with each '<' a viewer would read as HTML escaped, outside code: the page shows an answer's raw
    HTML as text, and a viewer of the export hid it ("Put <br> here" lost its tag; a reply cut inside an
    unclosed '<!--' or '<pre>' hid every later turn)."""
    lines = reply.split("\n")
    code, spans = set(), {}     # lines of code blocks; first line -> end of the lines one inline text spans
    for token in NO_HTML.parse(reply):      # the reply's blocks as the page reads them
        if token.type in ("fence", "code_block") and token.map:    # which show '<' as it is
            code.update(range(*token.map))
        elif token.type == "inline" and token.map:                 # where code spans may run across lines
            spans[token.map[0]] = max(token.map[1], spans.get(token.map[0], 0))
    out, i = [], 0
    while i < len(lines):
        end = i + 1 if i in code else max(spans.get(i, 0), i + 1)
        text = "\n".join(lines[i:end])
        out.append(text if i in code else _escaped_outside_spans(text))
        i = end
    return "\n".join(out)


def _escaped_outside_spans(text: str) -> str:
    """``text`` (lines of one block) with '<' backslash-escaped outside code spans and autolinks, unless a
    backslash escapes it already."""
    pieces, at, pos = [], 0, 0
    while (opening := BACKTICKS.search(text, pos)) is not None:
        start, end = opening.span()
        slashes = start - len(text[:start].rstrip("\\"))     # a backslash before a run escapes its first backtick
        start += slashes % 2
        # a link begun first holds the backticks (in its URL)
        link = next((m for m in AUTOLINK.finditer(text, pos) if m.start() >= start or m.end() > start), None)
        if link is not None and link.start() < start:
            pos = link.end()
            continue
        pos = end
        if start == end:
            continue
        # a code span runs to the next run of as many backticks (inside it a backslash is a backslash); a run
        # that none closes is plain text
        closing = next((r for r in BACKTICKS.finditer(text, end) if len(r.group()) == end - start), None)
        if closing is not None:
            # a line of it that starts with '<' would start an HTML block, which ends the span: it goes on the line
            # before (inside a span a line break is a space)
            pieces += [_escaped(text[at:start]), re.sub(r"\n(?= {0,3}<)", " ", text[start:closing.end()])]
            at = pos = closing.end()
    pieces.append(_escaped(text[at:]))
    return "".join(pieces)


def _escaped(text: str) -> str:
    out, at = [], 0
    for k, char in enumerate(text):
        if char != "<" or (AUTOLINK.match(text, k) and text[k + 1] not in "?!"):   # ('<?a@b>' starts HTML too)
            continue
        slashes = len(text[:k]) - len(text[:k].rstrip("\\"))
        if slashes % 2 == 0:                # an odd count escapes it already
            out += [text[at:k], "\\"]
            at = k
    out.append(text[at:])
    return "".join(out)


def literal(text: str) -> str:
    """Text the user typed, as the page shows it: literally. Where a Markdown viewer would show it as
    written (most one-line messages) it stays as is; otherwise ('# x', a list, '<b>', a pasted code fence,
    line breaks, which a viewer joins) it goes in a fenced block longer than any backtick run inside, so
    no line of it closes it. A tilde or an emoji code (':heart:') goes in the block too: GitHub's viewer
    strikes '~b~' through and draws the emoji, where CommonMark shows them as typed."""
    plain = "\n" not in text and "~" not in text and not re.search(r":[\w+-]+:", text)
    as_typed = html.escape(text, quote=False).replace('"', "&quot;")     # as markdown-it escapes a paragraph
    if plain and VIEWER.render(text) == f"<p>{as_typed}</p>\n":
        return text
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
    return f"{fence}text\n{text}\n{fence}"


def answered_line(figures: dict | None, settings: dict) -> str | None:
    """One pass's figures as an export shows them under its answer ('*Medusa · tree small-8 (9 nodes) ·
    greedy: 40 tokens · 12.3 tokens/s after the first · 1.47 tokens/step*', with why it ended where it
    did not end on its own: '40 tokens (stopped)'); what a saved copy lacks is left out."""
    tokens = figures.get("tokens") if isinstance(figures, dict) else None
    if not _number(tokens) or tokens < 1:
        return None
    parts = [str(figures.get("label") or "Answer")]
    tree, size = figures.get("tree"), figures.get("tree_size")
    if isinstance(tree, str) and tree:
        parts.append(f"tree {tree}" + (f" ({count(int(size), 'node')})" if _number(size) else ""))
    mode, temperature = settings.get("mode"), settings.get("temperature")
    if isinstance(mode, str):       # what ran, as the API reports it: sampling at temperature 0 is greedy
        # a damaged copy's temperature may be missing or no number: not compared (it raised, and every save failed)
        if mode == "greedy" or (_number(temperature) and is_greedy(mode, temperature)):
            parts.append("greedy")
        else:
            ran = mode + (f" at temperature {temperature:g}" if _number(temperature) else "")
            # the settings that shaped it, as the page set them (QA: the export named none of them)
            top_p, top_k, epsilon, delta = (settings.get(k) for k in ("top_p", "top_k", "epsilon", "delta"))
            if mode == "sample":
                ran += f", top-p {top_p:g}" if _number(top_p) and top_p < 1 else ""
                ran += f", top-k {top_k:g}" if _number(top_k) and top_k > 0 else ""
            if mode == "typical" and _number(epsilon) and _number(delta):
                ran += f", ε {epsilon:g}, δ {delta:g}"
            seed = settings.get("seed")
            if mode == "sample" and isinstance(seed, int) and not isinstance(seed, bool):
                ran += f", seed {seed}"     # what it drew with: the answer can be run again (typical draws nothing)
            parts.append(ran)
    line = " · ".join(parts) + f": {count(int(tokens), 'token')}"
    reason = figures.get("finish_reason")
    if reason != "eos" and isinstance(reason, str) and reason in FINISH_TEXT:   # cut off: the readout said so too
        line += f" ({FINISH_TEXT[reason]})"
    rate, per_step = figures.get("tokens_per_second"), figures.get("mean_accepted")
    if figures.get("steps") and _number(rate) and _number(per_step):
        line += f" · {rate:.1f} tokens/s after the first · {per_step:.2f} tokens/step"
    return f"*{line}*"


def to_markdown(turns: list[Turn], system: str = "") -> str:
    """The conversation as a Markdown file. What the user typed shows literally, as on the page (see
    literal); each answer is closed off on its own (see closed_fences), so one cut-off reply does not
    swallow the rest. The system prompt shows where it changed, above
    the turns answered under it, and at the end if the page's (``system``) differs from the last used;
    a conversation that recorded none (saved before turns kept theirs) shows ``system`` at the top."""
    lines = ["# Medusa chat conversation", ""]
    current = "" if any(t.system is not None for t in turns) else system
    if current:
        lines += [_system_line("System", current), ""]
    for t in turns:
        if t.system is not None and t.system != current:
            lines += [_system_line("System", t.system), ""]
            current = t.system
        answered = t.answered or {"settings": {}}
        if t.user:
            lines += ["**User:**", "", literal(t.user), ""]
        if t.reply is not None:
            lines += ["**Assistant:**", "", closed_fences(html_as_text(t.reply)), ""]
            figures = answered_line(answered.get("medusa"), answered.get("settings"))
            lines += [figures, ""] if figures else []
        if t.baseline is not None:
            lines += ["**Assistant (plain decoding):**", "", closed_fences(html_as_text(t.baseline)), ""]
            figures = answered_line(answered.get("baseline"), answered.get("settings"))
            lines += [figures, ""] if figures else []
        if isinstance(answered.get("comparison"), str):     # the page's line under the readouts, as it showed
            lines += [f"Comparison: {answered['comparison']}", ""]
        if t.note:
            lines += [f"> ⚠️ {t.note}", ""]
    if system != current:
        lines += [_system_line("System (for the next message)", system), ""]
    return "\n".join(lines)


def _system_line(title: str, system: str) -> str:
    """'**System:** text' for a one-line prompt; a prompt that needs a block goes under its title."""
    if not system:
        return f"**{title}:** (none: the model default)"
    shown = literal(system)
    return f"**{title}:**" + (f" {shown}" if shown == system else f"\n\n{shown}")


def write_exports(turns: list[Turn], first_turn: int, folder: Path, system: str = "",
                  compare: bool = False) -> tuple[str, str]:
    """(JSON path, Markdown path) of the conversation, written into ``folder`` (app/export_files.py
    says which)."""
    as_json, as_md = folder / "conversation.json", folder / "conversation.md"
    saved = to_saved(turns, first_turn, system, compare)
    as_json.write_text(json.dumps(saved, ensure_ascii=False, indent=2), encoding="utf-8")
    as_md.write_text(to_markdown(turns, system), encoding="utf-8")
    return str(as_json), str(as_md)
