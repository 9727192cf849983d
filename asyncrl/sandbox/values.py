"""The trusted side of the result format: ``[type name, payload]`` trees (written by
``_harness.encode`` inside the sandbox) decoded into plain builtins, and the exact
comparison the grader makes. Nothing here calls code that came from the sandbox: the
decoded values are built by this module from JSON, so an object with a custom
``__eq__`` cannot reach the grader."""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 100  # same bound as the harness's encoder
MAX_INT_DIGITS = 4000  # below Python's int/str conversion limit (4300)
PLAIN_TYPES = (type(None), bool, int, float, str, bytes, list, tuple, set, frozenset, dict)


class BadValue(ValueError):
    """A result tree that is not the harness's format: the case fails."""


def decode(tree: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise BadValue("nested too deeply")
    if not (isinstance(tree, list) and len(tree) == 2 and isinstance(tree[0], str)):
        raise BadValue(f"not a [type, payload] pair: {str(tree)[:80]}")
    tag, p = tree
    scalar = _SCALARS.get(tag)
    if scalar is not None:
        return scalar(p)
    if tag in ("list", "tuple", "set", "frozenset"):
        items = [decode(x, depth + 1) for x in _list(p)]
        try:
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        except TypeError as e:  # an unhashable member of a set
            raise BadValue(str(e)) from None
    if tag == "dict":
        out = {}
        for pair in _list(p):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise BadValue("dict item is not a pair")
            key = decode(pair[0], depth + 1)
            try:
                out[key] = decode(pair[1], depth + 1)
            except TypeError as e:
                raise BadValue(str(e)) from None
        return out
    raise BadValue(f"unknown type tag {tag[:40]!r}")


def _list(p: Any) -> list:
    if not isinstance(p, list):
        raise BadValue("container payload is not a list")
    return p


def _typed(kind: type):
    def check(p: Any) -> Any:
        if type(p) is not kind:
            raise BadValue(f"payload of a {kind.__name__} is a {type(p).__name__}")
        return p

    return check


def _int(p: Any) -> int:
    s = _typed(str)(p)
    if len(s.lstrip("-")) > MAX_INT_DIGITS or not s.lstrip("-").isdigit():
        raise BadValue("bad int")
    return int(s)


def _float(p: Any) -> float:
    try:
        return float(_typed(str)(p))
    except ValueError:
        raise BadValue("bad float") from None


def _none(p: Any) -> None:
    if p is not None:
        raise BadValue("NoneType payload is not null")


def _bytes(p: Any) -> bytes:
    try:
        return bytes.fromhex(_typed(str)(p))
    except ValueError:
        raise BadValue("bad bytes") from None


_SCALARS = {
    "NoneType": _none,
    "bool": _typed(bool),
    "str": _typed(str),
    "int": _int,
    "float": _float,
    "bytes": _bytes,
}


def is_plain(v: Any, depth: int = 0) -> bool:
    """True if ``v`` (an expected value) is made only of the types the grader compares."""
    if depth > MAX_DEPTH or type(v) not in PLAIN_TYPES:
        return False
    if type(v) in (list, tuple, set, frozenset):
        return all(is_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(is_plain(k, depth + 1) and is_plain(x, depth + 1) for k, x in v.items())
    return True


def same(a: Any, b: Any) -> bool:
    """Exact equality: same type at every level (bool is not int, 1.0 is not 1, a tuple
    is not a list), floats equal bit for bit in value (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        if len(a) != len(b):
            return False
        keyed = {(type(k), k): v for k, v in b.items()}
        return all((type(k), k) in keyed and same(v, keyed[(type(k), k)]) for k, v in a.items())
    if type(a) in (set, frozenset):
        return {(type(x), x) for x in a} == {(type(x), x) for x in b}
    return a == b
