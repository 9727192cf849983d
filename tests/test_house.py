"""House rules that a reader of asyncrl/ can rely on, checked on the source (AST):

* no function or method over ``MAX_FUNCTION_LINES`` lines (its ``def`` line to the last
  line of its body; decorators not counted);
* no ``Any`` in the annotations of the seams: the fields of ``Parts`` and ``Setup``,
  the signatures of ``run_loop``, ``start_parts``, ``stop_parts`` and ``prepare``,
  ``Learner.__init__``'s ``loss`` and ``advantage``, and the parameters and attributes
  of the Protocols: the plug-in contracts (the ``base.py`` files, and ``Reward``) and
  what the loop needs of the running parts (asyncrl/parts.py, asyncrl/loop.py);
* no private name (``_x``) imported from another module.

Each test fails with the list of its offenders, one per line, as ``path:line``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "asyncrl"
MAX_FUNCTION_LINES = 60

# (file, class) whose annotated fields are a seam
SEAM_FIELDS = [("asyncrl/parts.py", "Parts"), ("asyncrl/wiring.py", "Setup")]
# (file, function or Class.method, the parameters that are the seam: None for all of
# them and the return annotation)
SEAM_SIGNATURES = [
    ("asyncrl/loop.py", "run_loop", None),
    ("asyncrl/wiring.py", "start_parts", None),
    ("asyncrl/wiring.py", "stop_parts", None),
    ("asyncrl/wiring.py", "prepare", None),
    ("asyncrl/learner/learner.py", "Learner.__init__", ("loss", "advantage")),
]
# files whose Protocol classes are seams (the plug-in contracts, what the loop needs of
# the running parts), and the contract base classes that are not Protocols
CONTRACT_FILES = [
    "asyncrl/parts.py",
    "asyncrl/loop.py",
    "asyncrl/broker/base.py",
    "asyncrl/rewards/base.py",
    "asyncrl/tasks/base.py",
    "asyncrl/envs/base.py",
    "asyncrl/losses/base.py",
]
CONTRACT_CLASSES = [("asyncrl/rewards/base.py", "Reward")]


def modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), rel)


def report(what: str, offenders: list[str]) -> str:
    return f"{len(offenders)} {what}:\n  " + "\n  ".join(offenders)


# ---- function length ------------------------------------------------------------------
def long_functions() -> list[str]:
    out = []
    for rel, mod in modules():
        for node in ast.walk(mod):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    return out


def test_no_function_over_60_lines():
    offenders = long_functions()
    assert not offenders, report(f"functions over {MAX_FUNCTION_LINES} lines", offenders)


# ---- Any on the seams ------------------------------------------------------------------
def mentions_any(annotation: ast.expr | None) -> bool:
    """``Any`` anywhere in the annotation (``Any``, ``typing.Any``, ``dict[str, Any]``,
    ``"Any"`` as a string)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if mentions_any(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
    return False


def find(mod: ast.Module, dotted: str) -> ast.AST | None:
    """The class or function ``dotted`` names (``Class.method``) at module level."""
    scope: list[ast.stmt] = mod.body
    node: ast.AST | None = None
    for name in dotted.split("."):
        defs = (
            n for n in scope if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        )
        node = next((n for n in defs if n.name == name), None)
        if node is None:
            return None
        scope = getattr(node, "body", [])
    return node


def text(annotation: ast.expr | None) -> str:
    return "no annotation" if annotation is None else ast.unparse(annotation)


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    every = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
    return [p for p in every if p is not None and p.arg not in ("self", "cls")]


def annotated_fields(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    return [s for s in cls.body if isinstance(s, ast.AnnAssign)]


def is_protocol(cls: ast.ClassDef) -> bool:
    return any(
        (isinstance(b, ast.Name) and b.id == "Protocol")
        or (isinstance(b, ast.Attribute) and b.attr == "Protocol")
        for b in cls.bases
    )


def contract_offenders(rel: str, cls: ast.ClassDef) -> list[str]:
    out = [
        f"{rel}:{f.lineno} {cls.name}.{ast.unparse(f.target)}: {text(f.annotation)}"
        for f in annotated_fields(cls)
        if mentions_any(f.annotation)
    ]
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            out += [
                f"{rel}:{p.lineno} {cls.name}.{fn.name}({p.arg}: {text(p.annotation)})"
                for p in parameters(fn)
                if mentions_any(p.annotation)
            ]
    return out


def any_on_seams() -> list[str]:
    out = []
    for rel, name in SEAM_FIELDS:
        cls = find(tree(rel), name)
        if not isinstance(cls, ast.ClassDef):
            out.append(f"{rel}: class {name} not found (the seam moved: update this test)")
            continue
        out += [
            f"{rel}:{f.lineno} {name}.{ast.unparse(f.target)}: {text(f.annotation)}"
            for f in annotated_fields(cls)
            if mentions_any(f.annotation)
        ]
    for rel, name, only in SEAM_SIGNATURES:
        fn = find(tree(rel), name)
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append(f"{rel}: {name} not found (the seam moved: update this test)")
            continue
        params = [p for p in parameters(fn) if only is None or p.arg in only]
        if only is not None and {p.arg for p in params} != set(only):
            out.append(f"{rel}:{fn.lineno} {name}: parameters {only} not all found")
        out += [
            f"{rel}:{p.lineno} {name}({p.arg}: {text(p.annotation)})"
            for p in params
            if p.annotation is None or mentions_any(p.annotation)
        ]
        if only is None and (fn.returns is None or mentions_any(fn.returns)):
            out.append(f"{rel}:{fn.lineno} {name} returns {text(fn.returns)}")
    for rel in CONTRACT_FILES:
        mod = tree(rel)
        named = {c for r, c in CONTRACT_CLASSES if r == rel}
        for cls in mod.body:
            if isinstance(cls, ast.ClassDef) and (is_protocol(cls) or cls.name in named):
                out += contract_offenders(rel, cls)
    return out


def test_no_any_on_the_seams():
    offenders = any_on_seams()
    assert not offenders, report("seam annotations typed Any (or missing)", offenders)


# ---- private imports -------------------------------------------------------------------
def private_imports() -> list[str]:
    out = []
    for rel, mod in modules():
        for node in ast.walk(mod):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    where = "." * node.level + (node.module or "")
                    out.append(f"{rel}:{node.lineno} from {where} import {alias.name}")
    return out


def test_no_private_name_imported_from_another_module():
    offenders = private_imports()
    assert not offenders, report("private names imported from another module", offenders)


# ---- the checks catch what they are for ------------------------------------------------
def test_the_any_check_reads_annotations_as_written():
    def ann(src: str) -> ast.expr:
        return ast.parse(src, mode="eval").body

    assert mentions_any(ann("Any")) and mentions_any(ann("typing.Any"))
    assert mentions_any(ann("dict[str, Any] | None")) and mentions_any(ann("'Any'"))
    assert not mentions_any(ann("dict[str, float]")) and not mentions_any(ann("Loss"))
