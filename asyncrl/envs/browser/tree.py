"""The observation of ``env=browser``: the page's accessibility tree as text, one line
per element, with the element ids that actions name::

    [1] textbox "Name" value="ada"
    [2] combobox "Colour" value="red" options="red|green|blue"
    [3] button "Submit"
    [4] link "Orders"

``WALK_JS`` runs in the page: it numbers the page's buttons, text fields, lists and links
in document order (``data-aid``; an element keeps its number for the page's life, a new
one gets the next) and reports each one's role, accessible name and live value.
:func:`render` formats those records; :func:`asyncrl.envs.browser.sites.records` builds
the same records from a site without a browser (the prompt's first observation and the
scripted demonstrations).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

WALK_JS = """() => {
  const els = document.querySelectorAll('button, input, select, textarea, a[href]');
  let next = window.__aidNext || 1;
  const out = [];
  for (const el of els) {
    if (!el.dataset.aid) { el.dataset.aid = String(next++); }
    const tag = el.tagName.toLowerCase();
    let role = 'textbox';
    if (tag === 'button') role = 'button';
    else if (tag === 'select') role = 'combobox';
    else if (tag === 'a') role = 'link';
    const name = (el.getAttribute('aria-label') || el.innerText || '').trim();
    const r = {id: Number(el.dataset.aid), role: role, name: name};
    if (role === 'textbox' || role === 'combobox') r.value = el.value;
    if (role === 'combobox') r.options = Array.from(el.options).map(o => o.text);
    out.push(r);
  }
  window.__aidNext = next;
  return out;
}"""

MAX_NAME_CHARS = 60  # a longer name or value is cut (no runaway observations)


def _quoted(s: str) -> str:
    s = str(s)[:MAX_NAME_CHARS]
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def render(recs: Iterable[Mapping[str, Any]]) -> str:
    """Records as the observation's lines (no trailing newline)."""
    lines = []
    for r in recs:
        line = f"[{int(r['id'])}] {r['role']} {_quoted(r['name'])}"
        if "value" in r:
            line += f" value={_quoted(r['value'])}"
        if "options" in r:
            line += " options=" + _quoted("|".join(r["options"]))
        lines.append(line)
    return "\n".join(lines)
