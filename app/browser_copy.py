"""The conversation's copy in the browser, one per tab, so that a reload brings back that tab's own
conversation. gr.BrowserState keeps one value per page in localStorage, which every tab shares: with
two tabs open, reloading one brought back the other's conversation and system prompt. Here each tab
has an id in sessionStorage (which a reload keeps and each tab has its own of) and writes its copy
under that id in localStorage; a new tab starts from the copy written last, so the conversation also
survives closing the browser. A hidden component carries the copy between the page and the server:
READ fills it on page load, WRITE stores each value the server sets."""

KEY = "medusa-chat-conversation"
KEPT_TABS = 20   # the copies of older tabs beyond these are removed: localStorage is small (5 MB)

_TAB = f"""
  const key = "{KEY}";
  let tab = sessionStorage.getItem(key + ":tab");
  if (!tab) {{
    tab = Date.now().toString(36) + Math.random().toString(36).slice(2);
    sessionStorage.setItem(key + ":tab", tab);
  }}"""

# page load: this tab's own copy, or else (a new tab) the copy written last
READ = f"""() => {{{_TAB}
  const text = localStorage.getItem(key + ":" + tab) ?? localStorage.getItem(key + ":" + localStorage.getItem(key + ":last"));
  try {{ return text ? JSON.parse(text) : null; }} catch (err) {{ console.error("medusa-chat: unreadable saved conversation", err); return null; }}
}}"""

# every value the server sets: kept under this tab's id, which becomes the newest
WRITE = f"""(value) => {{{_TAB}
  if (value === null || value === undefined) return;
  try {{
    localStorage.setItem(key + ":" + tab, JSON.stringify(value));
    localStorage.setItem(key + ":last", tab);
    let tabs = JSON.parse(localStorage.getItem(key + ":tabs") || "[]").filter((t) => t !== tab);
    tabs.push(tab);
    for (const old of tabs.splice(0, Math.max(0, tabs.length - {KEPT_TABS}))) localStorage.removeItem(key + ":" + old);
    localStorage.setItem(key + ":tabs", JSON.stringify(tabs));
  }} catch (err) {{ console.error("medusa-chat: could not save the conversation in this browser", err); }}
}}"""
