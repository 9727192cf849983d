"""The trusted side of the result format: ``[type name, payload]`` trees (written by
``_harness.encode`` inside the sandbox) turned into canonical strings, and the exact
comparison the grader makes on them.

Nothing from the sandbox is ever built into a Python set, dict or object here: a tree is
read once, bottom up, into a self-delimiting string (``<tag>:<length>:<text>`` for a
scalar, ``<tag>[<n>]`` followed by the members for a container; a set's members and a
dict's items sorted as strings). So decoding is linear in the tree's size (plus the sort
of each set or dict), whatever its values hash to, and two values are equal exactly when
their strings are: same type at every level (``True`` is not ``1``, ``1.0`` is not ``1``,
a tuple is not a list, also as set members and dict keys), floats by ``repr`` (``-0.0`` is
not ``0.0``; every NaN equals every NaN)."""

from __future__ import annotations

import math
import re
from typing import Any

MAX_DEPTH = 100  # same bound as the harness's encoder
MAX_INT_DIGITS = 4000  # below Python's int/str conversion limit (4300)
PLAIN_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, set, frozenset, dict)
CONTAINERS = ("list", "tuple", "set", "frozenset", "dict")
INT_TEXT = re.compile(r"-?(0|[1-9][0-9]*)")
HEX_TEXT = re.compile(r"([0-9a-f]{2})*")
SHOW_CHARS = 200  # of a value's display text


class BadValue(ValueError):
    """A result tree that is not the harness's format: the case fails."""


def canon(tree: Any, depth: int = 0) -> str:
    """The canonical string of an untrusted ``[type, payload]`` tree (BadValue if it is
    not one)."""
    if depth > MAX_DEPTH:
        raise BadValue("nested too deeply")
    if not (type(tree) is list and len(tree) == 2 and type(tree[0]) is str):
        raise BadValue(f"not a [type, payload] pair: {str(tree)[:80]}")
    tag, p = tree
    if tag in CONTAINERS:
        if type(p) is not list:
            raise BadValue("container payload is not a list")
        if tag == "dict":
            items = [_pair(x, depth + 1) for x in p]
        else:
            items = [canon(x, depth + 1) for x in p]
        return _container(tag, items)
    text = _scalar(tag, p)
    return f"{tag}:{len(text)}:{text}"


def _pair(x: Any, depth: int) -> str:
    if not (type(x) is list and len(x) == 2):
        raise BadValue("dict item is not a pair")
    key = canon(x[0], depth)
    return f"{len(key)}:{key}{canon(x[1], depth)}"


def _container(tag: str, items: list[str]) -> str:
    if tag in ("set", "frozenset"):
        items.sort()  # a repeated member (only a forged tree has one) counts once
        items = [x for i, x in enumerate(items) if i == 0 or x != items[i - 1]]
    elif tag == "dict":
        items.sort()  # items with one key share the prefix "<len>:<key>": neighbours
        keys = [x[: x.index(":") + 1 + int(x[: x.index(":")])] for x in items]
        if any(keys[i] == keys[i - 1] for i in range(1, len(keys))):
            raise BadValue("a dict with a repeated key")
    return f"{tag}[{len(items)}]" + "".join(items)


def _scalar(tag: str, p: Any) -> str:
    if tag == "NoneType" and p is None:
        return ""
    if tag == "bool" and type(p) is bool:
        return "1" if p else "0"
    if tag == "str" and type(p) is str:
        return p
    if type(p) is not str:
        raise BadValue(f"bad payload for a {tag[:40]!r}")
    if tag == "int":
        if len(p) > MAX_INT_DIGITS + 1 or not INT_TEXT.fullmatch(p) or p == "-0":
            raise BadValue("bad int")
        return p
    if tag == "float":
        try:
            return "nan" if math.isnan(f := float(p)) else repr(f)
        except ValueError:
            raise BadValue("bad float") from None
    if tag == "bytes":
        if not HEX_TEXT.fullmatch(p):
            raise BadValue("bad bytes")
        return p
    raise BadValue(f"unknown type tag {tag[:40]!r}")


def encode(v: Any, depth: int = 0) -> list:
    """A trusted plain value (an expected value) as the harness writes it."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    t = type(v)
    if v is None or t is bool or t is str:
        return [t.__name__, v]
    if t is int:
        return ["int", str(v)]
    if t is float:
        return ["float", repr(v)]
    if t is bytes:
        return ["bytes", v.hex()]
    if t in (list, tuple, set, frozenset):
        return [t.__name__, [encode(x, depth + 1) for x in v]]
    if t is dict:
        return ["dict", [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]]
    raise ValueError(f"not a plain value: {t.__name__}")


def is_plain(v: Any, depth: int = 0) -> bool:
    """True if ``v`` (an expected value) is made only of the types the grader compares."""
    if depth > MAX_DEPTH or type(v) not in PLAIN_TYPES:
        return False
    if type(v) is int and len(str(abs(v))) > MAX_INT_DIGITS:
        return False
    if type(v) in (list, tuple, set, frozenset):
        return all(is_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(is_plain(k, depth + 1) and is_plain(x, depth + 1) for k, x in v.items())
    return True


def same(a: Any, b: Any) -> bool:
    """Exact equality of two plain values (the rule of the module docstring)."""
    return canon(encode(a)) == canon(encode(b))


def show(tree: Any, limit: int = SHOW_CHARS) -> str:
    """A short repr-like text of an untrusted tree (for ``CaseResult.got``): reads at most
    about ``limit`` characters' worth of it."""
    out: list[str] = []
    _show(tree, out, [limit])
    return "".join(out)[:limit]


def _show(tree: Any, out: list[str], left: list[int]) -> None:
    if left[0] <= 0:
        return
    if not (type(tree) is list and len(tree) == 2 and type(tree[0]) is str):
        text = "?"
    elif tree[0] in CONTAINERS and type(tree[1]) is list:
        out.append(tree[0] + "(")
        for i, x in enumerate(tree[1][: left[0]]):
            out.append(", " if i else "")
            for j, y in enumerate(x if tree[0] == "dict" and type(x) is list else [x]):
                out.append(": " if j else "")
                _show(y, out, left)
        text = ")"
    elif tree[0] in ("int", "float") and type(tree[1]) is str:
        text = tree[1][: left[0]]
    elif tree[0] == "bytes" and type(tree[1]) is str:
        text = f"bytes.fromhex({tree[1][: left[0]]!r})"
    else:
        text = repr(tree[1] if tree[0] != "NoneType" else None)[: left[0]]
    out.append(text)
    left[0] -= len(text) + 1
