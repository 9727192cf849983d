"""Docs that cannot drift: every ``asyncrl.`` dotted name, every path into the
repository and every code symbol that README.md and docs/*.md put in backticks exists.

- ``asyncrl.x.y``: imports, attribute by attribute;
- ``asyncrl/x.py``, ``tests/test_x.py``, ``conf/x/y.yaml``, ``benchmarks/x.py``,
  ``scripts/x.sh`` (optionally ``::name``): the file exists (and defines ``name``);
- an identifier with an underscore or an inner capital (``snapshot_weights``,
  ``ReplayQueue``, ``train_step()``): a name that the code defines or uses (a def, class,
  attribute, argument, dict key or string in asyncrl/, benchmarks/, tests/ or scripts/,
  or a key in conf/).
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TICKS = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
DOTTED = re.compile(r"\basyncrl(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH = re.compile(r"^(?:\./)?((?:asyncrl|tests|conf|benchmarks|scripts|docs)/[\w./-]+)(?:::(\w+))?")
SYMBOL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?$")
CODE_DIRS = ("asyncrl", "benchmarks", "tests", "scripts")


@cache
def known_names() -> frozenset[str]:
    """Every name the code defines or uses, and every key of the shipped configs."""
    names: set[str] = set()
    for d in CODE_DIRS:
        for f in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.keyword) and node.arg:
                    names.add(node.arg)
                elif isinstance(node, ast.alias):
                    names.add((node.asname or node.name).split(".")[-1])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
        for f in (ROOT / d).rglob("*.sh"):
            names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", f.read_text()))
    for f in (ROOT / "conf").rglob("*.yaml"):
        names.update(yaml_keys(yaml.safe_load(f.read_text())))
    return frozenset(names)


def yaml_keys(node) -> set[str]:
    if isinstance(node, dict):
        return {str(k) for k in node} | set().union(*(yaml_keys(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(set(), *(yaml_keys(v) for v in node))
    if isinstance(node, str):
        return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node))
    return set()


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def is_symbol(word: str) -> bool:
    """Code-like: snake_case with an underscore or CamelCase with an inner capital (plain
    words, options and numbers in backticks are not checked)."""
    m = SYMBOL.match(word)
    if not m:
        return False
    name = m.group(1).strip("_")
    return "_" in name or bool(re.search(r"[a-z][A-Z]", name))


def spans(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text())
    return TICKS.findall(text)


def problems(doc: Path) -> list[str]:
    out = []
    text = doc.read_text()
    for dotted in sorted(set(DOTTED.findall(text))):
        if not resolves(dotted.rstrip(".")):
            out.append(f"{dotted}: no such module or attribute")
    for span in spans(doc):
        span = span.strip()
        if m := PATH.match(span):
            rel, name = m.group(1).rstrip("."), m.group(2)
            if not any(ch in rel for ch in "*{<") and not (ROOT / rel).exists():
                out.append(f"{span}: no such file")
            elif name and name not in (ROOT / rel).read_text():
                out.append(f"{span}: {rel} does not define {name}")
        elif is_symbol(span) and SYMBOL.match(span).group(1) not in known_names():
            out.append(f"{span}: not a name in the code or the configs")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_only_what_exists(doc):
    found = problems(doc)
    assert not found, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(found)
