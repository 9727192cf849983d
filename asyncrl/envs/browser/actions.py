"""The actions of ``env=browser``: text the policy writes, one action per turn.

    click(<id>)              click the element (a button submits its page's form)
    type(<id>, "<text>")     replace a text field's value
    select(<id>, "<option>") choose a list's option by its text
    press("<key>")           a key on the focused element (Enter, Tab, Escape, ...)
    scroll(<dy>)             scroll the page by dy pixels (negative: up)

Strings are double-quoted with ``\\"`` and ``\\\\`` escapes. Anything else is malformed:
:func:`parse_action` returns the error text the env shows as the observation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STRING = r'"((?:[^"\\]|\\.)*)"'
PATTERNS = {
    "click": re.compile(r"click\(\s*(\d{1,4})\s*\)"),
    "type": re.compile(rf"type\(\s*(\d{{1,4}})\s*,\s*{STRING}\s*\)"),
    "select": re.compile(rf"select\(\s*(\d{{1,4}})\s*,\s*{STRING}\s*\)"),
    "press": re.compile(rf"press\(\s*{STRING}\s*\)"),
    "scroll": re.compile(r"scroll\(\s*(-?\d{1,5})\s*\)"),
}
MAX_TEXT = 200  # characters typed by one action
KEYS = {"Enter", "Tab", "Escape", "Backspace", "Delete", "Space", "ArrowUp", "ArrowDown",
        "ArrowLeft", "ArrowRight", "PageUp", "PageDown", "Home", "End"}  # fmt: skip


@dataclass(frozen=True)
class Action:
    kind: str  # a key of PATTERNS
    target: int = 0  # the element id (click, type, select)
    text: str = ""  # typed text, option, key
    dy: int = 0  # scroll


def _unquote(s: str) -> str:
    return re.sub(r"\\(.)", r"\1", s)


def parse_action(text: str) -> Action | str:
    """The action ``text`` names (surrounding whitespace ignored), or an error line."""
    text = text.strip()
    kind = text.split("(", 1)[0].strip()
    pattern = PATTERNS.get(kind)
    m = None if pattern is None else pattern.fullmatch(text)
    if m is None:
        return f"malformed action {text[:40]!r}: expected one of " + ", ".join(
            ["click(<id>)", 'type(<id>, "<text>")', 'select(<id>, "<option>")',
             'press("<key>")', "scroll(<dy>)"]
        )  # fmt: skip
    if kind == "click":
        return Action(kind, target=int(m.group(1)))
    if kind in ("type", "select"):
        value = _unquote(m.group(2))
        if len(value) > MAX_TEXT:
            return f"{kind}: text longer than {MAX_TEXT} characters"
        return Action(kind, target=int(m.group(1)), text=value)
    if kind == "press":
        key = _unquote(m.group(1))
        return Action(kind, text=key) if key in KEYS else f"press: unknown key {key[:20]!r}"
    return Action(kind, dy=int(m.group(1)))
