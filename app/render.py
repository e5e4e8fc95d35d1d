"""Chat messages as the HTML the page shows.

The Chatbot is built with ``render_markdown=False``: it shows each message's
content as HTML (still sanitized by Gradio). The server decides what is Markdown:

- a user's message is shown exactly as typed (HTML-escaped, whitespace kept);
- a reply is Markdown rendered here by markdown-it with raw HTML disabled, so
  ``<script>`` in a reply shows as text and ``javascript:`` links stay plain text;
- with head colouring, the words that came from Medusa guesses are marked with two
  private-use characters *before* rendering and turned into spans *after* it, so
  a span never appears as tag text, inside code blocks included.
"""

from __future__ import annotations

import html
import re
from functools import lru_cache

_OPEN, _CLOSE = "\ue000", "\ue001"            # private-use: never produced by a tokenizer's text
_WORD = re.compile(r"[^\W_]+")                 # letters and digits: never Markdown syntax
_LIST_NUMBER = re.compile(r"(^|\n)[ \t]*$")    # a digit run at a line start may be a list marker
_TAG_OR_TEXT = re.compile(r"(<[^>]*>)")
_MARKED = re.compile(f"{_OPEN}([^{_OPEN}{_CLOSE}<]*){_CLOSE}")


def _unmarked(text: str) -> str:
    return text.replace(_OPEN, "").replace(_CLOSE, "")


@lru_cache(maxsize=1)
def _markdown():
    from markdown_it import MarkdownIt

    class Renderer(MarkdownIt):
        """A link's address is checked and written without the colouring's markers: with them, a marked
        host was punycoded into another one (https://xn--example-bx78ana...), and a marked
        "javascript:" passed the check that keeps such links plain text."""

        def validateLink(self, url: str) -> bool:
            return super().validateLink(_unmarked(url))

        def normalizeLink(self, url: str) -> str:
            return super().normalizeLink(_unmarked(url))

    # js-default: CommonMark + tables + strikethrough; html off = raw HTML is shown as text
    return Renderer("js-default", {"html": False, "breaks": True, "linkify": False})


def user_html(text: str) -> str:
    """A user's message, literally: no Markdown, no HTML, line breaks and spaces kept."""
    return f'<div class="user-text">{html.escape(text)}</div>'


def note_html(text: str) -> str:
    return f'<div class="note-text">⚠️ {html.escape(text)}</div>'


# Why an answer ended before its own end, under it in its bubble: an answer cut at Max new tokens ended mid-sentence
# with only the readout, under the message box, saying why (QA). By StepResult's finish reason; "eos" needs none.
ENDED = {
    "length": "cut at Max new tokens ({tokens}): raise it in the panel, then Regenerate, for the rest",
    "context": "cut where the model's context window filled, after {tokens}",
    "cancelled": "stopped",
}


def ended_html(reason: str, tokens: int) -> str:
    """The line under an answer that ``reason`` ended early; "" for an answer that ended itself (or unknown)."""
    text = ENDED.get(reason)
    count = f"{tokens} token{'' if tokens == 1 else 's'}"       # QA: "(1 tokens)" under a one-token answer
    return f'<div class="ended">⋯ {html.escape(text.format(tokens=count))}</div>' if text else ""


def reply_html(segments: list[tuple[str, bool]], colour: bool = False) -> str:
    """A reply (pieces of text, each flagged when it came from the heads) as HTML."""
    source = "".join(_mark(text) if colour and from_heads else text for text, from_heads in segments)
    rendered = _markdown().render(source)
    plain = plain_text(segments)
    if plain.strip() and not html.unescape(_TAG_OR_TEXT.sub("", rendered)).strip():
        # a reply that is only Markdown syntax ("+", "#", "---") would render as an empty bubble
        return f'<div class="reply">{html.escape(plain)}</div>'
    if colour:
        rendered = _spans(rendered)
    return f'<div class="reply">{rendered.strip()}</div>'


def answer_html(segments: list[tuple[str, bool]], colour: bool = False) -> str:
    """An answer's bubble: the reply as ``reply_html`` shows it, then the answer as the model wrote it (its Markdown),
    hidden, for the answer's Copy button (app/copy_buttons.py). Gradio's sanitizer drops data attributes: the text
    rides in an element of its own, escaped like any other text."""
    return reply_html(segments, colour) + f'<div class="reply-source">{html.escape(plain_text(segments))}</div>'


def _mark(text: str) -> str:
    """Wrap the letter/digit runs of a piece in markers; leave Markdown syntax outside them."""
    def wrap(match: re.Match) -> str:
        if match.group().isdigit() and _LIST_NUMBER.search(text[:match.start()]):
            return match.group()   # "1." at a line start stays a list marker
        return f"{_OPEN}{match.group()}{_CLOSE}"
    return _WORD.sub(wrap, text)


def _spans(rendered: str) -> str:
    """Markers in text become spans; markers that ended up in a tag (a code block's language) are
    dropped, so they never reach an attribute (a link's address has none: Renderer)."""
    parts = _TAG_OR_TEXT.split(rendered)
    for i, part in enumerate(parts):
        parts[i] = _unmarked(part if i % 2 else _MARKED.sub(r'<span class="from-heads">\1</span>', part))
    return "".join(parts)


def plain_text(segments: list[tuple[str, bool]]) -> str:
    return "".join(text for text, _ in segments)
