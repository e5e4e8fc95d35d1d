"""The exported conversation (app/transcript.py): a reply cut off inside a code block (max new
tokens reached, or Stop) must not turn the rest of the Markdown file into code, while the JSON
export keeps every text exactly as it was."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from app.session import Turn
from app.transcript import write_exports

LATER = Turn(user="And a tuple?", reply="Use `tuple(x)`.")


def rendered(markdown: str) -> str:
    return MarkdownIt("commonmark").render(markdown)


def export(tmp_path: Path, turns: list[Turn], system: str = "") -> tuple[str, dict]:
    as_json, as_md = write_exports(turns, 0, tmp_path, system)
    return Path(as_md).read_text(encoding="utf-8"), json.loads(Path(as_json).read_text(encoding="utf-8"))


def assert_later_turn_renders_normally(html: str) -> None:
    assert "<p><strong>User:</strong></p>\n<p>And a tuple?</p>" in html, html
    assert "<p><strong>Assistant:</strong></p>\n<p>Use <code>tuple(x)</code>.</p>" in html, html


CLOSED = "Sort it:\n\n```python\nsorted(x)\n```\n\nor ``` inline ```, and then\n\n"   # a block that is finished


@pytest.mark.parametrize("cut", [
    "```python\nmy_list = [[",            # the tester's reply, cut by max new tokens
    "~~~\nmy_list = [[\n",                # a tilde fence, cut after a newline
    "````markdown\n```python\nx = 1\n```\n",   # a longer fence: the ``` inside does not close it
])
def test_a_reply_cut_off_inside_a_code_block_leaves_the_rest_of_the_markdown_normal(tmp_path, cut):
    reply = CLOSED + cut
    markdown, saved = export(tmp_path, [Turn(user="How do I nest lists?", reply=reply), LATER])
    html = rendered(markdown)
    assert_later_turn_renders_normally(html)
    assert f"**Assistant:**\n\n{reply}" in markdown          # the reply itself is as written, with a fence added
    assert html.count("<pre>") == 2 and "sorted(x)" in html, html   # the cut code is still shown as code
    assert saved["turns"][0]["reply"] == reply                # the JSON keeps the raw text


@pytest.mark.parametrize("reply", [
    "Put <br> where the line should break, and wrap bold text in <b>...</b>.",
    "The header:\n\n<!-- TODO: the header goes here",      # cut off inside a comment: it hid every later turn
    "<pre>\nx = 1",                                          # or inside a <pre> block
    "Write `<div>` or ``a ` <b>`` here; see <https://example.com>.\n\n```html\n<div>\n```",
])
def test_an_answers_html_exports_as_the_text_the_page_shows(tmp_path, reply):
    """Review: the page shows an answer's raw HTML as text (its Markdown is read with HTML off); the export let a
    viewer read it as HTML, which hid the tags, and a reply cut inside '<!--' or '<pre>' hid the turns after it."""
    from app.transcript import NO_HTML

    markdown, saved = export(tmp_path, [Turn(user="How?", reply=reply), LATER])
    html = rendered(markdown)
    assert_later_turn_renders_normally(html)
    assert NO_HTML.render(reply) in html, html     # the answer as the page reads it
    assert saved["turns"][0]["reply"] == reply


def test_html_in_any_answer_renders_in_the_export_as_on_the_page():
    """The same for 3,000 random replies made of the pieces that start HTML, code and links."""
    import random

    from app.transcript import NO_HTML, VIEWER, html_as_text

    pieces = ["<", ">", "`", "``", "```", "\\", "b", "div", " ", "\n", "\n\n", "    ", "<!--", "-->", "<pre>", "</b>",
              "<a href='x'>", "- ", "> ", "1. ", "https://x.y", "<?", "<![CDATA[", "&lt;", "*", "|"]
    draw = random.Random(1)
    for _ in range(3000):
        reply = "".join(draw.choice(pieces) for _ in range(draw.randint(1, 14)))
        assert VIEWER.render(html_as_text(reply)) == NO_HTML.render(reply), reply


def test_a_block_cut_inside_a_list_item_is_closed_inside_the_item(tmp_path):
    """A closing fence at the left margin would end the list item and open a new block there."""
    turns = [Turn(user="Steps?", reply="1. Install it:\n\n   ```bash\n   pip install"),
             Turn(user="Code?", reply="```python\nx = [["), LATER]
    html = rendered(export(tmp_path, turns)[0])
    assert "<p><strong>User:</strong></p>\n<p>Code?</p>" in html, html
    assert_later_turn_renders_normally(html)
    assert html.count("<pre>") == 2, html


def test_user_messages_baseline_answers_and_the_system_prompt_are_closed_too(tmp_path):
    cut = "```js\nconst a = ["
    turns = [Turn(user=cut), Turn(user="Compare:", reply="Fine.", baseline=cut), LATER]
    markdown, saved = export(tmp_path, turns, system="Answer in code:\n```")
    html = rendered(markdown)
    assert "<p><strong>User:</strong></p>\n<p>Compare:</p>" in html, html
    assert "<p><strong>Assistant (plain decoding):</strong></p>" in html
    assert_later_turn_renders_normally(html)
    assert saved["system"] == "Answer in code:\n```" and saved["turns"][1]["baseline"] == cut


@pytest.mark.parametrize("typed", [
    "# not a heading", "1. first\n2. second", "*not bold* and _not italic_", "<b>not bold</b>", "a ~~b~~ c",
    "a | b\n--|--\n1 | 2", "```python\nx = [", "a fence ```` of four inside\n```", "    indented",
    "line one\nline two", 'plain words, "quoted" & fine.', "a ~b~ c", "I :heart: it",
])
def test_what_the_user_typed_exports_as_the_page_shows_it(tmp_path, typed):
    """The page shows a message and the system prompt literally; the Markdown export showed a typed
    '# x' as a heading, a list as a list, and joined lines."""
    markdown, _ = export(tmp_path, [Turn(user=typed, reply="Fine."), LATER], system=typed)
    page = rendered(markdown)
    shown = html.escape(typed, quote=False).replace('"', "&quot;")
    as_block = f'<pre><code class="language-text">{shown}\n</code></pre>'
    if "\n" in typed:     # a viewer joins the lines of a paragraph: only the block keeps them
        assert f"<p><strong>User:</strong></p>\n{as_block}" in page, page
    assert (f"<p><strong>User:</strong></p>\n<p>{shown}</p>" in page
            or f"<p><strong>User:</strong></p>\n{as_block}" in page), page
    assert (f"<p><strong>System:</strong> {shown}</p>" in page
            or f"<p><strong>System:</strong></p>\n{as_block}" in page), page
    assert "<p><strong>Assistant:</strong></p>\n<p>Fine.</p>" in page, page
    assert_later_turn_renders_normally(page)


def test_an_exported_answer_shows_the_speed_the_page_showed():
    """The export's figures are the readout's, digit for digit: rounded once for the page's raw output and
    again for the export, 11.952 tokens/s read 12.0 on the page and 11.9 in the Markdown. A one-token answer
    has no speed (no decoding step), not a speed of 0."""
    from app.readout import Stats, render_live
    from app.transcript import answered_line

    for tokens, steps, per_second in ((13, 8, 11.952), (13, 8, 11.948), (40, 16, 7.2549)):
        stats = Stats(tokens=tokens, steps=steps, decode_seconds=(tokens - 1) / per_second, finish_reason="eos")
        page = render_live(stats)
        line = answered_line(stats.as_dict(), {"mode": "greedy"})
        rate, per_step = f"{stats.tokens_per_second:.1f}", f"{stats.tokens_per_step:.2f}"
        assert f"| {rate} | {per_step} |" in page, page
        assert f"{rate} tokens/s after the first · {per_step} tokens/step" in line, (line, page)
    one = Stats(tokens=1, steps=0, ttft=0.2, finish_reason="length").as_dict()
    assert one["tokens_per_second"] is None and one["mean_accepted"] is None, one
    assert answered_line(one, {"mode": "greedy"}) == "*Medusa · greedy: 1 token (max new tokens reached)*"


def test_an_exported_answer_names_the_sampling_settings_that_shaped_it():
    """QA: a typical answer's ε and δ, and a sampled one's top-p, were in the JSON export but not the Markdown."""
    from app.transcript import answered_line

    figures = {"label": "Medusa", "tokens": 8}
    typical = {"mode": "typical", "temperature": 0.7, "top_p": 0.9, "epsilon": 0.5, "delta": 0.9}
    assert answered_line(figures, typical) == "*Medusa · typical at temperature 0.7, ε 0.5, δ 0.9: 8 tokens*"
    sampled = {**typical, "mode": "sample", "top_k": 0, "seed": 7}
    assert answered_line(figures, sampled) == "*Medusa · sample at temperature 0.7, top-p 0.9, seed 7: 8 tokens*"
    assert answered_line(figures, {**sampled, "top_p": 1.0, "top_k": 40}) == \
        "*Medusa · sample at temperature 0.7, top-k 40, seed 7: 8 tokens*"


def test_an_export_says_how_each_answer_was_made_and_under_which_system_prompt(tmp_path):
    """Each answer's figures (mode, tree, speed) are under it, and a system prompt changed mid-conversation
    shows where it changed: the first answer, given as a pirate, was exported under the last prompt."""
    from app.transcript import answered_line, from_saved

    figures = {"label": "Medusa", "tree": "small-8", "tree_size": 9, "tokens": 40, "steps": 16,
               "tokens_per_second": 12.3, "mean_accepted": 2.44}
    sampled = {"mode": "sample", "temperature": 0.7}
    turns = [Turn(user="Hi", reply="Arr.", system="Talk like a pirate.",
                  answered={"settings": sampled, "medusa": figures, "baseline": None}),
             Turn(user="Again", reply="Hello.", system="Be terse.",
                  answered={"settings": {"mode": "greedy"}, "medusa": {**figures, "tokens": 1, "steps": 0,
                                                                       "finish_reason": "cancelled"},
                            "baseline": None})]
    markdown, saved = export(tmp_path, turns, system="Be kind.")
    order = ["**System:** Talk like a pirate.", "Arr.",
             "*Medusa · tree small-8 (9 nodes) · sample at temperature 0.7: 40 tokens · 12.3 tokens/s after the "
             "first · 2.44 tokens/step*", "**System:** Be terse.", "Hello.",
             "*Medusa · tree small-8 (9 nodes) · greedy: 1 token (stopped)*",     # the readout said why it ended
             "**System (for the next message):** Be kind."]
    places = [markdown.index(text) for text in order]
    assert places == sorted(places), markdown
    assert saved["turns"][0]["answered"]["medusa"] == figures and saved["turns"][1]["system"] == "Be terse."
    restored, _ = from_saved(saved)        # the browser's copy keeps them across a reload
    assert [(t.system, t.answered) for t in restored] == [(t.system, t.answered) for t in turns]
    # sampling or typical acceptance at temperature 0 runs greedy, and says so (as the API's medusa.mode does)
    for mode in ("sample", "typical"):
        assert answered_line(figures, {"mode": mode, "temperature": 0}).startswith(
            "*Medusa · tree small-8 (9 nodes) · greedy: 40 tokens"), mode


@pytest.mark.parametrize("answered", [
    {"settings": "x", "medusa": {"tokens": 3}}, {"settings": ["greedy"], "medusa": {"tokens": 3, "steps": 2}},
    {"medusa": {"tokens": 3, "steps": 2}}, {"medusa": {"tokens": "3", "steps": 2, "tokens_per_second": "9"}},
    {"medusa": {"tokens": 3, "steps": 2, "tokens_per_second": None, "tree_size": "9", "tree": 5}},
    {"medusa": [1, 2], "baseline": "x"}, "answered", [],
    # a sampled answer whose temperature is missing or no number (review: the greedy check raised on it)
    {"settings": {"mode": "sample"}, "medusa": {"tokens": 3}},
    {"settings": {"mode": "typical", "temperature": "hot"}, "medusa": {"tokens": 3}},
])
def test_a_damaged_saved_record_of_an_answer_still_exports(tmp_path, answered):
    """The browser's copy is read back on page load and the exports are written from it at once: an
    older or damaged record must leave out what it lacks, never raise."""
    from app.transcript import from_saved

    saved = {"format": "medusa-chat/1", "first_turn": 0, "system": "", "compare": False,
             "turns": [{"user": "Hi", "reply": "Hello.", "system": 7, "answered": answered}]}
    turns, _ = from_saved(saved)
    markdown, _ = export(tmp_path, turns)
    assert "Hello." in markdown and "None" not in markdown, markdown


def test_a_message_a_reload_cut_off_mid_comparison_shows_no_answer_in_either_pane():
    """After a reload during a comparison, the cut-off message has the reload's note in both panes and no
    answer: the plain pane said that compare was off (an empty bubble counted as Medusa's answer)."""
    from app.chat_controller import INTERRUPTED, NOT_COMPARED, ChatController
    from app.render import note_html
    from app.session import Session
    from app.transcript import to_saved

    answered = Turn(user="Hi", reply="Hello!", baseline="Hello!")
    saved = to_saved([answered, Turn(user="Tell me a long story.")], 0, compare=True)
    # an empty answer (the model ended at once) shows its note and no empty bubble, as the live page does
    empty = Turn(user="Say nothing.", reply="", note="the model ended its answer at once")
    medusa, baseline, _, _, _ = ChatController(None).restored(Session(), to_saved([empty], 0), "")
    assert [part["text"] for message in medusa for part in message["content"]][1:] == [note_html(empty.note)]
    assert not any(NOT_COMPARED in part["text"] for message in baseline for part in message["content"])
    medusa, baseline, _, compare, box = ChatController(None).restored(Session(), saved, "")
    for pane in (medusa, baseline):
        texts = [part["text"] for message in pane for part in message["content"]]
        assert len(texts) == 4 and "Hello!" in texts[1] and "Tell me a long story." in texts[2], texts
        assert INTERRUPTED in texts[3] and not any(NOT_COMPARED in text for text in texts), texts
    assert compare is True and box == {"__type__": "update"}, "the box is left as it is"
    # a new tab opened while another tab still answers that message: said so, not a reload (QA)
    from app.browser_copy import PENDING
    from app.chat_controller import ELSEWHERE

    chat = ChatController(None)
    chat.finished.started("answering", lambda: False)
    medusa, *_ = chat.restored(Session(), {**saved, PENDING: "answering"}, "")
    assert note_html(ELSEWHERE) in medusa[-1]["content"][0]["text"], medusa[-1]


def test_a_message_back_in_the_box_goes_back_there_after_a_reload():
    """A refused message (or one stopped before its first token) went back to the box, and a resend replaces
    it. After a reload it came back in the chat with the box empty, under a note saying it was in the box,
    and stayed in the conversation for good: the next message was added after it."""
    from app.chat_controller import ChatController
    from app.session import Session
    from app.transcript import to_saved

    refused = Turn(user="Second message", note="tree 'banana' is unknown: pick one from the list", in_box=True)
    session = Session()
    *_, box = ChatController(None).restored(session, to_saved([Turn(user="Hi", reply="Hello!"), refused], 0), "")
    assert box == "Second message"
    # resent: the copy kept while it is answered holds it once (the refused turn came back for good after a
    # reload mid-answer)
    pending, *_ = ChatController.save_pending(session, "Second message, edited", "", False)
    assert [t["user"] for t in pending["turns"]] == ["Hi", "Second message, edited"]
    session.drop_resent()                    # what the send does first
    assert [(t.user, t.reply) for t in session.turns] == [("Hi", "Hello!")]


def test_a_reloaded_conversations_readout_shows_its_last_answers_figures_or_the_hint():
    from app.chat_controller import restored_readouts
    from app.layout import READOUT_HINT
    from app.readout import Stats, render_live
    from app.transcript import from_saved, to_saved

    stats = Stats(label="Medusa", tree="small-8", tree_size=8, tree_depth=3, tokens=21, steps=9,
                  accepted=(1, 4, 2, 3, 1, 2, 4, 2, 1), from_heads=11, ttft=0.0094996, decode_seconds=1.6667,
                  finish_reason="eos")
    answered = {"settings": {}, "medusa": stats.as_dict(), "baseline": None}
    turns, _ = from_saved(to_saved([Turn(user="Hi", reply="Hello!", answered=answered)], 0))
    assert restored_readouts(turns) == (render_live(stats), "")
    older = {k: v for k, v in stats.as_dict().items() if k != "tree_depth"}      # copies saved before it was kept
    turns, _ = from_saved(to_saved([Turn(user="Hi", reply="Hello!", answered={**answered, "medusa": older})], 0))
    assert restored_readouts(turns)[0] == render_live(stats)       # its deepest accepted step stands in
    for damaged in ({**stats.as_dict(), "tokens": "21"}, {**stats.as_dict(), "tokens_per_second": None},
                    {**stats.as_dict(), "last_accepted": [1, None]}, "figures"):
        turns, _ = from_saved(to_saved([Turn(user="Hi", reply="Hello!", answered={**answered, "medusa": damaged})], 0))
        assert restored_readouts(turns) == (READOUT_HINT, ""), damaged
    # the last exchange cut off by the reload has no figures: the hint, not the exchange before's
    turns, _ = from_saved(to_saved([Turn(user="Hi", reply="Hello!", answered=answered), Turn(user="More")], 0))
    assert restored_readouts(turns) == (READOUT_HINT, "")


def test_a_reloaded_answer_cut_short_still_says_why_under_it():
    """The mark under an answer that ended early (Max new tokens, the context, Stop) comes from its figures, which
    the browser's copy keeps: a reload shows it again. An answer that ended itself has none, nor one whose
    figures a damaged copy lost."""
    from app.chat_controller import display
    from app.transcript import from_saved, to_saved

    def shown(reason, tokens=256) -> str:
        figures = {"tokens": tokens, "finish_reason": reason}
        answered = {"settings": {}, "medusa": figures, "baseline": figures}
        turns, _ = from_saved(to_saved([Turn(user="Hi", reply="Hello", baseline="Hello", answered=answered)], 0))
        panes = [html.unescape(display(turns, pane)[-1]["content"][0]["text"]) for pane in ("medusa", "baseline")]
        assert panes[0] == panes[1], panes
        return panes[0]

    assert "⋯ cut at Max new tokens (256 tokens)" in shown("length")
    assert "⋯ cut at Max new tokens (1 token):" in shown("length", 1)          # QA: "(1 tokens)"
    assert "⋯ cut where the model's context window filled, after 8000 tokens" in shown("context", 8000)
    assert "⋯ stopped" in shown("cancelled")
    for ends_itself in (shown("eos"), shown(None), shown(["length"]), shown("length", "256")):
        assert "⋯" not in ends_itself and "Hello" in ends_itself, ends_itself


def test_a_comparisons_line_comes_back_after_a_reload_and_is_in_the_markdown_export(tmp_path):
    """The line under the readouts (the speedup, its spread, whether greedy answers matched) is not in either
    pass's figures: kept with the answer as the page showed it, a reload shows it again (the readouts came back,
    it did not), and the Markdown export has it under the two answers."""
    from app.chat_controller import restored_comparison
    from app.transcript import from_saved, to_saved

    line = "**Speedup: 1.32×** (whole answers: Medusa 52.1 vs plain 39.4 tokens/s) · greedy answers are **identical**"
    answered = {"settings": {"mode": "greedy"}, "medusa": None, "baseline": None, "comparison": line}
    compared = Turn(user="Hi", reply="Hello", baseline="Hello", answered=answered)
    turns, _ = from_saved(to_saved([compared], 0))
    assert restored_comparison(turns) == line
    markdown, _ = export(tmp_path, [compared])
    assert f"Comparison: {line}" in markdown, markdown
    # the last exchange was not compared, or a damaged copy lost the line: none
    later = Turn(user="More", reply="Sure", answered={"settings": {}, "medusa": None, "baseline": None})
    for last in (later, Turn(user="Hi", reply="Hello", answered={**answered, "comparison": ["x"]})):
        turns, _ = from_saved(to_saved([compared, last], 0))
        assert restored_comparison(turns) == "", last
    assert restored_comparison([]) == ""


def test_a_system_prompt_typed_before_the_first_message_or_after_clear_comes_back_after_a_reload():
    """QA: a system prompt typed and not yet sent, or left in the box after Clear, was gone after a reload, where
    the decoding settings set the same way came back. An empty box with no conversation gives the prompt the app
    was started with (launch.py --system-prompt) back instead of keeping "nothing"."""
    from app.transcript import saved_system, to_saved

    assert saved_system(to_saved([], 0, "You are a pirate.")) == "You are a pirate."
    assert saved_system(to_saved([], 0, "")) is None
    assert saved_system(to_saved([Turn(user="Hi", reply="Arr.")], 0, "")) == "", "a conversation held without one"
    assert saved_system(to_saved([Turn(user="Hi", reply="Arr.")], 0, "Be terse.")) == "Be terse."
    assert saved_system({"turns": [], "system": 7}) is None and saved_system(None) is None
