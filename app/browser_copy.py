"""The conversation's copy in the browser, one per tab, so that a reload brings back that tab's own
conversation. gr.BrowserState keeps one value per page in localStorage, which every tab shares: with
two tabs open, reloading one brought back the other's conversation and system prompt. Here each tab
has an id in sessionStorage (which a reload keeps and each tab has its own of) and writes its copy
under that id in localStorage; a new tab starts from the copy written last, so the conversation also
survives closing the browser. A hidden component carries the copy between the page and the server:
READ fills it on page load, WRITE stores each value the server sets. The decoding settings are kept
the same way, beside the conversation (SETTINGS_KEY, READ_BOTH, WRITE_SETTINGS). The server keeps the
conversation as each sent message's answer ended until the browser has stored it (FinishedCopies)."""

import threading
from collections import OrderedDict
from collections.abc import Callable

KEY = "medusa-chat-conversation"
SETTINGS_KEY = "medusa-chat-settings"
KEPT_TABS = 20   # the copies of older tabs beyond these are removed: localStorage is small (5 MB)

# this tab's id (one for both copies)
_TAB = f"""
  let tab = sessionStorage.getItem("{KEY}:tab");
  if (!tab) {{
    tab = Date.now().toString(36) + Math.random().toString(36).slice(2);
    sessionStorage.setItem("{KEY}:tab", tab);
  }}"""


def _read(key: str) -> str:
    """JavaScript: this tab's copy under ``key``, or else (a new tab) the copy written last; null if none."""
    return f"""(() => {{
    const text = localStorage.getItem("{key}:" + tab) ?? localStorage.getItem("{key}:" + localStorage.getItem("{key}:last"));
    try {{ return text ? JSON.parse(text) : null; }} catch (err) {{ console.error("medusa-chat: unreadable {key}", err); return null; }}
  }})()"""


def _write(key: str) -> str:
    """JavaScript: every value the server sets, kept under this tab's id, which becomes the newest."""
    return f"""(value) => {{{_TAB}
  if (value === null || value === undefined) return;
  try {{
    localStorage.setItem("{key}:" + tab, JSON.stringify(value));
    localStorage.setItem("{key}:last", tab);
    let tabs = JSON.parse(localStorage.getItem("{key}:tabs") || "[]").filter((t) => t !== tab);
    tabs.push(tab);
    for (const old of tabs.splice(0, Math.max(0, tabs.length - {KEPT_TABS}))) localStorage.removeItem("{key}:" + old);
    localStorage.setItem("{key}:tabs", JSON.stringify(tabs));
  }} catch (err) {{ console.error("medusa-chat: could not keep {key} in this browser", err); }}
}}"""


# page load: [the conversation, the settings]
READ_BOTH = f"""() => {{{_TAB}
  return [{_read(KEY)}, {_read(SETTINGS_KEY)}];
}}"""
WRITE = _write(KEY)
WRITE_SETTINGS = _write(SETTINGS_KEY)


PENDING = "pending"     # the id a copy written at a send carries (ChatController.save_pending)


class FinishedCopies:
    """The conversation as each sent message's answer ended, by the id its copy written at the send carries.
    The browser stores the copy after an answer in a follow-up event; a reload in the moment between the
    answer's end and that copy read the copy written at the send, and called the finished answer cut off by
    the reload (QA, on a busy machine). The page load asks here first, and where the answer under that id still
    runs for a tab that has gone (a reload stops it at its next step) waits a moment for its end: what it had
    written comes back with the page. (A new tab opened beside one still answering does not wait.)
    Only the newest are kept: a copy is looked for within moments of its answer's end."""

    def __init__(self, kept: int = 64, wait_s: float = 3.0) -> None:
        self._copies: OrderedDict[str, dict] = OrderedDict()
        self._running: dict[str, Callable[[], bool]] = {}    # an answer's id: whether its tab has gone
        # an answer the reload stopped ends within one step (a CPU's tens of ms); one still reading a long
        # prompt's piece has written nothing, and its page comes back after this wait with the send's copy
        self._kept, self._wait_s = kept, wait_s
        self._changed = threading.Condition()

    def started(self, copy_id: str, gone: Callable[[], bool]) -> None:
        """An answer runs under ``copy_id``: a page load asking for it once its tab has ``gone`` waits for its end
        (``ended``)."""
        with self._changed:
            self._running[copy_id] = gone

    def ended(self, copy_id: str, copy: dict | None) -> None:
        """The answer under ``copy_id`` ended: ``copy``, the conversation as it ended, is kept; None keeps none
        (the copy written at the send stands)."""
        with self._changed:
            self._running.pop(copy_id, None)
            if copy is not None:
                self._copies[copy_id] = copy
                self._copies.move_to_end(copy_id)
                while len(self._copies) > self._kept:
                    self._copies.popitem(last=False)
            self._changed.notify_all()

    def newest(self, stored):
        """``stored``, the browser's copy, or the one its answer ended with where that is kept here."""
        copy_id = stored.get(PENDING) if isinstance(stored, dict) else None
        if not isinstance(copy_id, str):
            return stored
        with self._changed:
            gone = self._running.get(copy_id)
            if gone is not None and gone():
                self._changed.wait_for(lambda: copy_id not in self._running, timeout=self._wait_s)
            return self._copies.get(copy_id, stored)

    def still_answering(self, stored) -> bool:
        """Whether the answer ``stored``'s copy waits for still runs for a tab that is open: the page loading it is
        a new tab opened beside that one."""
        copy_id = stored.get(PENDING) if isinstance(stored, dict) else None
        with self._changed:
            gone = self._running.get(copy_id) if isinstance(copy_id, str) else None
            return gone is not None and not gone()
