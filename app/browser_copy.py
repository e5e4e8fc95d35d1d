"""The conversation's copy in the browser, one per tab, so that a reload brings back that tab's own
conversation. gr.BrowserState keeps one value per page in localStorage, which every tab shares: with
two tabs open, reloading one brought back the other's conversation and system prompt. Here each tab
has an id in sessionStorage (which a reload keeps and each tab has its own of) and writes its copy
under that id in localStorage; a new tab starts from the copy written last, so the conversation also
survives closing the browser. A hidden component carries the copy between the page and the server:
READ fills it on page load, WRITE stores each value the server sets. The decoding settings are kept
the same way, beside the conversation (SETTINGS_KEY, READ_BOTH, WRITE_SETTINGS)."""

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
