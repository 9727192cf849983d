"""The web tasks of ``env=browser``: small sites in the spirit of MiniWoB, built from a
seed, each with its goal, its grader and a scripted solution.

A site is pure data (JSON-able, it travels in ``Prompt.meta["site"]``)::

    {"kind": "click_button", "instruction": "...", "start": "home",
     "pages": {"home": [{"role": "button", "name": "Delta", "field": "button"}, ...]},
     "gates": {"login": {"user": "ada", "password": "kiwi"}},   # page -> fields to pass
     "next": {"login": "plan"},                                 # passed gate -> next page
     "goal": {"page": "home", "fields": {"button": "Delta"}},
     "solution": ["click(2)"]}

Every page is one HTML form that posts to the task server; a button submits it with its
own ``name=value``. A submission of a gated page whose fields match the gate redirects
to the gate's next page; any other submission is the episode's final one. The grade
reads only what the server received (:func:`grade`): 1 when the final submission came
from the goal's page and carries every goal field, else 0.

Element ids: every element of a page is numbered 1, 2, ... in document order, the same
numbers the browser's tree gives (``asyncrl/envs/browser/tree.py``), so a scripted
solution and :func:`demonstrations` know them without a browser.
"""

from __future__ import annotations

import html
import random
from collections.abc import Callable, Mapping
from typing import Any

from asyncrl.envs.browser.actions import parse_action
from asyncrl.envs.browser.tree import render

Site = dict[str, Any]
Element = dict[str, Any]

WORDS = [
    "Alpha", "Bravo", "Cedar", "Delta", "Ember", "Fjord", "Gamma", "Heron",
    "Indigo", "Juniper", "Kiwi", "Lotus", "Maple", "Nova", "Onyx", "Pearl",
]  # fmt: skip
NAMES = ["ada", "bob", "cyd", "dee", "eli", "fay", "gus", "ivy", "jon", "kai"]
CITIES = ["oslo", "lima", "rome", "kyiv", "doha", "baku", "riga", "bern"]
COLOURS = ["red", "green", "blue", "amber", "violet", "teal"]
SECTIONS = ["Orders", "Billing", "Profile", "Support", "Reports"]
VERBS = ["Open", "Archive", "Delete", "Share"]
PLANS = ["basic", "plus", "pro", "team"]


def button(name: str) -> Element:
    return {"role": "button", "name": name, "field": "button"}


def textbox(name: str, field: str) -> Element:
    return {"role": "textbox", "name": name, "field": field}


def combobox(name: str, field: str, options: list[str]) -> Element:
    return {"role": "combobox", "name": name, "field": field, "options": list(options)}


def link(name: str, page: str) -> Element:
    return {"role": "link", "name": name, "page": page}


def _site(kind: str, instruction: str, pages: dict, goal: dict, solution: list[str]) -> Site:
    return {
        "kind": kind, "instruction": instruction, "start": "home", "pages": pages,
        "gates": {}, "next": {}, "goal": goal, "solution": solution,
    }  # fmt: skip


def _click_button(rng: random.Random) -> Site:
    labels = rng.sample(WORDS, rng.randint(3, 5))
    target = rng.randrange(len(labels))
    return _site(
        "click_button",
        f'Click the button "{labels[target]}".',
        {"home": [button(x) for x in labels]},
        {"page": "home", "fields": {"button": labels[target]}},
        [f"click({target + 1})"],
    )


def _fill_form(rng: random.Random) -> Site:
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    page = [textbox("Name", "name"), textbox("City", "city"), button("Submit")]
    return _site(
        "fill_form",
        f'Enter the name "{name}" and the city "{city}", then submit.',
        {"home": page},
        {"page": "home", "fields": {"name": name, "city": city, "button": "Submit"}},
        [f'type(1, "{name}")', f'type(2, "{city}")', "click(3)"],
    )


def _dropdown(rng: random.Random) -> Site:
    options = rng.sample(COLOURS, 4)
    target = rng.choice(options[1:])  # never the preselected first option
    return _site(
        "dropdown",
        f'Choose "{target}" as the colour and submit.',
        {"home": [combobox("Colour", "colour", options), button("Submit")]},
        {"page": "home", "fields": {"colour": target, "button": "Submit"}},
        [f'select(1, "{target}")', "click(2)"],
    )


def _follow_link(rng: random.Random) -> Site:
    sections = rng.sample(SECTIONS, 3)
    target, verb = rng.randrange(3), rng.choice(VERBS)
    pages: dict[str, list[Element]] = {"home": [link(s, s.lower()) for s in sections]}
    for s in sections:
        pages[s.lower()] = [button(v) for v in rng.sample(VERBS, len(VERBS))]
    at = [e["name"] for e in pages[sections[target].lower()]].index(verb)
    return _site(
        "follow_link",
        f'Go to "{sections[target]}" and click "{verb}" there.',
        pages,
        {"page": sections[target].lower(), "fields": {"button": verb}},
        [f"click({target + 1})", f"click({at + 1})"],
    )


def _login_plan(rng: random.Random) -> Site:
    user, password = rng.choice(NAMES), rng.choice(WORDS).lower()
    plans = rng.sample(PLANS, 3)
    plan = rng.choice(plans[1:])
    home = [textbox("Username", "user"), textbox("Password", "password"), button("Sign in")]
    site = _site(
        "login_plan",
        f'Sign in as "{user}" with password "{password}", then choose the plan "{plan}" '
        "and confirm.",
        {"home": home, "plan": [combobox("Plan", "plan", plans), button("Confirm")]},
        {"page": "plan", "fields": {"plan": plan, "button": "Confirm"}},
        [f'type(1, "{user}")', f'type(2, "{password}")', "click(3)",
         f'select(1, "{plan}")', "click(2)"],
    )  # fmt: skip
    site["gates"] = {"home": {"user": user, "password": password, "button": "Sign in"}}
    site["next"] = {"home": "plan"}
    return site


KINDS: dict[str, Callable[[random.Random], Site]] = {
    "click_button": _click_button,
    "fill_form": _fill_form,
    "dropdown": _dropdown,
    "follow_link": _follow_link,
    "login_plan": _login_plan,
}


def make_site(kind: str, rng: random.Random) -> Site:
    """One site of ``kind`` (a key of :data:`KINDS`), drawn from ``rng``."""
    if kind not in KINDS:
        raise ValueError(f"task.kinds: unknown kind {kind!r}; expected some of {sorted(KINDS)}")
    return KINDS[kind](rng)


def page_html(site: Site, page: str, action: str) -> str:
    """The page as HTML: one form posting to ``action``; links point to sibling pages
    (relative URLs: ``p/<page>`` beside the form's ``submit/<page>``)."""
    rows = []
    for e in site["pages"][page]:
        name = html.escape(e["name"])
        if e["role"] == "button":
            rows.append(f'<button type="submit" name="{e["field"]}" value="{name}">{name}</button>')
        elif e["role"] == "textbox":
            rows.append(f'<label>{name} <input type="text" name="{e["field"]}" '
                        f'aria-label="{name}" autocomplete="off"></label>')  # fmt: skip
        elif e["role"] == "combobox":
            opts = "".join(f"<option>{html.escape(o)}</option>" for o in e["options"])
            rows.append(
                f'<label>{name} <select name="{e["field"]}" aria-label="{name}">{opts}</select>'
                "</label>"
            )
        elif e["role"] == "link":
            rows.append(f'<a href="{html.escape(e["page"])}">{name}</a>')
        else:
            raise ValueError(f"site {site['kind']}: unknown role {e['role']!r}")
    body = "\n".join(f"<div>{r}</div>" for r in rows)
    return (
        '<!doctype html><html><head><meta charset="utf-8"><title>task</title></head><body>'
        f'<form method="post" action="{html.escape(action)}">\n{body}\n</form></body></html>'
    )


def initial_values(site: Site, page: str) -> dict[int, str]:
    """Element id -> value when ``page`` loads (a textbox is empty, a list shows its
    first option)."""
    out = {}
    for i, e in enumerate(site["pages"][page], 1):
        if e["role"] == "textbox":
            out[i] = ""
        elif e["role"] == "combobox":
            out[i] = e["options"][0]
    return out


def records(site: Site, page: str, values: Mapping[int, str]) -> list[dict[str, Any]]:
    """The page's tree records as the browser reports them (tree.py ``WALK_JS``)."""
    out = []
    for i, e in enumerate(site["pages"][page], 1):
        r = {"id": i, "role": e["role"], "name": e["name"]}
        if i in values:
            r["value"] = values[i]
        if e["role"] == "combobox":
            r["options"] = list(e["options"])
        out.append(r)
    return out


def submission_outcome(site: Site, page: str, fields: Mapping[str, str]) -> str | None:
    """The page a submission of ``page`` leads to (a passed gate), or None: final."""
    gate = site["gates"].get(page)
    if gate is not None and all(fields.get(k) == v for k, v in gate.items()):
        return site["next"][page]
    return None


def grade(site: Site, final: tuple[str, Mapping[str, str]] | None) -> float:
    """1.0 when the final submission ``(page, fields)`` is the goal, else 0.0 (None:
    nothing was submitted)."""
    if final is None:
        return 0.0
    page, fields = final
    goal = site["goal"]
    return float(
        page == goal["page"] and all(fields.get(k) == v for k, v in goal["fields"].items())
    )


def observation(site: Site, page: str, values: Mapping[int, str] | None = None) -> str:
    """The tree text of ``page`` with ``values`` (None: as it loads), as the env shows it."""
    return render(records(site, page, initial_values(site, page) if values is None else values))


def demonstrations(site: Site) -> list[tuple[str, str]]:
    """(observation, action) pairs of the site's scripted solution: the tree the policy
    sees before each action (the first is the prompt's), simulated without a browser
    (the same text the env shows: tests/test_browser_env.py checks it)."""
    page, values = site["start"], initial_values(site, site["start"])
    out = []
    for text in site["solution"]:
        out.append((observation(site, page, values), text))
        action = parse_action(text)
        if isinstance(action, str):
            raise ValueError(f"site {site['kind']}: bad scripted action {text!r}: {action}")
        elements = site["pages"][page]
        e = elements[action.target - 1] if action.kind in ("click", "type", "select") else None
        if action.kind in ("type", "select"):
            values = {**values, action.target: action.text}
        elif e is not None and e["role"] == "link":
            page = e["page"]
            values = initial_values(site, page)
        elif e is not None and e["role"] == "button":
            fields = {elements[i - 1]["field"]: v for i, v in values.items()}
            fields[e["field"]] = e["name"]
            nxt = submission_outcome(site, page, fields)
            if nxt is None:
                break
            page, values = nxt, initial_values(site, nxt)
    return out
