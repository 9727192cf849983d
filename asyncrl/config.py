"""Start-up checks: every config mistake stops the run before Ray starts, with one
message naming the key to change."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import importlib
import inspect
import json
import math
import re
import socket
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

if TYPE_CHECKING:
    from omegaconf import DictConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is wrong; the message names the key and what to do."""


def build(key: str, node: Any) -> Any:
    """``hydra.utils.instantiate`` with errors that name ``key``, the class and the
    arguments it accepts. The built-ins go through exactly this path too."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    spec = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else dict(node)
    target = spec.get("_target_") if isinstance(spec, dict) else None
    if not target:
        raise ConfigError(f"{key}._target_ is missing: set it to a class path like my_pkg.MyClass")
    cls = locate_target(key, target)
    accepted = accepted_kwargs(cls)
    given = [k for k in spec if k != "_target_"]
    for k in given:
        check_finite(f"{key}.{k}", spec[k])
    if accepted is not None:
        unknown = [k for k in given if k not in accepted]
        if unknown:
            raise ConfigError(
                f"{key}: {target} takes no argument(s) {unknown}; it accepts {sorted(accepted) or 'none'}"
            )
    try:
        return instantiate(spec, _convert_="all")
    except Exception as e:
        cause = e.__cause__ or e
        if isinstance(cause, ConfigError):  # the class named the key itself
            raise cause from None
        raise ConfigError(
            f"{key}: building {target}({', '.join(f'{k}={spec[k]!r}' for k in given)}) failed: "
            f"{type(cause).__name__}: {cause}. It accepts {sorted(accepted or [])}"
        ) from e


def check_finite(key: str, value: Any) -> None:
    """ConfigError naming ``key`` (or the entry inside it) for a NaN or an inf anywhere in
    ``value``: a class's argument that means "no limit" takes null, never inf."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    if isinstance(value, Mapping):
        for k, v in value.items():
            check_finite(f"{key}.{k}", v)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_finite(f"{key}[{i}]", v)


def locate_target(key: str, target: str) -> Any:
    mod_name, _, attr = target.rpartition(".")
    if not mod_name:
        raise ConfigError(f"{key}._target_={target!r} is not a dotted path like my_pkg.MyClass")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}._target_={target!r}: cannot import module {mod_name!r} ({e})"
        ) from e
    if not hasattr(mod, attr):
        raise ConfigError(f"{key}._target_={target!r}: module {mod_name!r} has no {attr!r}")
    return getattr(mod, attr)


def accepted_kwargs(cls: Any) -> set[str] | None:
    """Keyword names the constructor takes; None when it takes **kwargs."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {
        n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def check_model_dir(path: str) -> Path:
    """A usable local HF causal-LM directory, or a ConfigError of one line saying what is
    wrong. Checked: config.json is a readable JSON object with a ``model_type``; weights
    (``*.safetensors``, else ``*.bin``) and a tokenizer are there; the sizes are positive
    integers and head_dim >= 32 (what vLLM-CPU's attention runs); every weight file is
    readable and non-empty, a safetensors one at least as long as its header announces."""
    p, key = Path(path).expanduser(), f"model.path={path}"
    if not p.is_dir():
        raise ConfigError(f"{key}: no such directory")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"{key}: no config.json (not a Hugging Face model directory)")
    try:
        conf = json.loads(cfg.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"{key}: config.json cannot be read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        raise ConfigError(f"{key}: config.json is not valid JSON ({why})") from None
    if not isinstance(conf, dict):
        raise ConfigError(f"{key}: config.json is not a JSON object: {json.dumps(conf)[:40]}")
    if not isinstance(conf.get("model_type"), str):
        raise ConfigError(f"{key}: config.json has no model_type")
    weights = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin"))
    if not weights:
        raise ConfigError(f"{key}: no weights (*.safetensors or *.bin)")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ConfigError(f"{key}: no tokenizer (tokenizer.json / tokenizer_config.json)")
    sizes = {k: conf.get(k) for k in ("num_attention_heads", "hidden_size", "head_dim")}
    for k, v in sizes.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{key}: config.json {k}={v!r}: expected a positive integer")
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    head_dim = sizes["head_dim"] or (hidden // heads if heads and hidden else None)
    if head_dim is not None and head_dim < 32:
        raise ConfigError(f"{key}: head_dim {head_dim} < 32, which vLLM-CPU's attention cannot run")
    for w in weights:
        try:
            size = w.stat().st_size
            with w.open("rb") as f:
                head = f.read(8)  # a safetensors file opens with its header's length
        except OSError as e:
            raise ConfigError(
                f"{key}: weights file {w.name} cannot be read ({e.strerror or e})"
            ) from None
        if size == 0:
            raise ConfigError(f"{key}: weights file {w.name} is empty (0 bytes)")
        if w.suffix == ".safetensors" and (
            len(head) < 8 or int.from_bytes(head, "little") > size - 8
        ):
            raise ConfigError(
                f"{key}: weights file {w.name} is truncated ({size} bytes, less than its "
                "safetensors header announces)"
            )
    return p


def check_ray_address(address: str, timeout_s: float) -> None:
    """Fail fast, naming the address, when nothing listens there (ray.init would
    otherwise retry for a long time)."""
    if address in ("auto", "local") or address.startswith("ray://") is False and ":" not in address:
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"ray.address={address}: nothing answers there ({e}). Start a head with "
            f"`ray start --head` or set ray.address=null for a local Ray"
        ) from e


# ---- the defaults: conf/ composed as `asyncrl-train` composes it ----------------------------
def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The config ``asyncrl-train <overrides>`` runs with (conf/, Hydra's compose; the
    ``hydra`` node left out), interpolations resolved. A fresh copy on every call (the
    composition itself is cached per ``overrides``); a bad override is a ConfigError."""
    from omegaconf import OmegaConf

    return OmegaConf.create(copy.deepcopy(_composed(tuple(overrides))))


@functools.lru_cache(maxsize=32)
def _composed(overrides: tuple[str, ...]) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from asyncrl.confdir import conf_dir

    backup = get_gh_backup()  # Hydra already set up (inside @hydra.main, a test's compose)
    if backup is not None:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(hydra_error_line(e)) from e
    finally:
        if backup is not None:
            restore_gh_from_backup(backup)
    return OmegaConf.to_container(cfg, resolve=True)


def defaults(key: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The settings ``asyncrl-train <overrides>`` runs with at the dotted ``key``
    (``"learner"``, ``"actor.sampling"``), as a plain dict the caller may change: conf/
    is the only source of every default (docs/architecture.md, Defaults)."""
    node: Any = _composed(tuple(overrides))
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{key}: no such settings in the composed config")
        node = node[part]
    if not isinstance(node, dict):
        raise ConfigError(f"{key}={node!r}: a single value, not a group of settings")
    return copy.deepcopy(node)


# ---- ranges: every numeric setting has one ---------------------------------------------------
@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: ``low``/``high`` (None: unbounded), each
    bound itself accepted unless ``*_open``. NaN is never accepted; inf only with
    ``inf`` (a setting where "no limit" is a meaningful value)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    inf: bool = False

    def accepts(self, v: float) -> bool:
        if math.isnan(v) or (math.isinf(v) and not self.inf):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def __str__(self) -> str:
        lo, hi = self.low, self.high
        if lo is not None and hi is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_num(lo)}, {_num(hi)}{right}"
        if lo is not None:
            return f"{'>' if self.low_open else '>='} {_num(lo)}"
        if hi is not None:
            return f"{'<' if self.high_open else '<='} {_num(hi)}"
        return "that is finite"


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) and abs(x) < 1e16 else f"{x:g}"


_RANGE = re.compile(
    r"^\s*(?:(?P<op>>=|>|<=|<)\s*(?P<bound>[^,\s]+)"
    r"|(?P<lb>[\[(])\s*(?P<lo>[^,\s]+)\s*,\s*(?P<hi>[^,\s\])]+)\s*(?P<rb>[\])]))\s*$"
)


def parse_range(text: str, inf: bool = False) -> Range:
    """``">= 1"``, ``"> 0"``, ``"<= 1"``, ``"[0, 1]"``, ``"(0, 1]"``, ``""`` (any finite
    number) as a :class:`Range`; bounds are numbers (``1e6``, ``2**20``)."""
    m = _RANGE.match(text)
    if not text.strip():
        return Range(inf=inf)
    if m is None:
        raise ValueError(f"not a range: {text!r}")

    def num(s: str) -> float:
        base, _, exp = s.partition("**")
        return float(base) ** float(exp) if exp else float(s)

    if m["op"]:
        b, op = num(m["bound"]), m["op"]
        if op[0] == ">":
            return Range(low=b, low_open=op == ">", inf=inf)
        return Range(high=b, high_open=op == "<", inf=inf)
    return Range(num(m["lo"]), num(m["hi"]), m["lb"] == "(", m["rb"] == ")", inf)


def setting(accepts: str = "", *, inf: bool = False) -> Any:
    """A config key's dataclass field: no default (conf/ holds it) and the range its
    value must lie in (:func:`parse_range`; NaN never, inf only with ``inf``)."""
    return dataclasses.field(metadata={"range": parse_range(accepts, inf)})


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # any wait longer than a week is a mistake (and 1e10 s
#   overflows the C timeouts of threads, sockets and collectives)
TIMEOUT_S = f"(0, {MAX_TIMEOUT_S:g}]"  # the range of every timeout in seconds


def check_ranges(obj: Any, prefix: str) -> None:
    """ConfigError naming ``<prefix>.<field>`` for a number outside its field's range
    (``setting(...)``), or any float field holding NaN or inf without one."""
    for f in dataclasses.fields(obj):
        check_range(f"{prefix}.{f.name}" if prefix else f.name, getattr(obj, f.name), f)


def check_range(key: str, value: Any, f: dataclasses.Field) -> None:
    """ConfigError naming ``key`` when ``value`` is a number outside ``f``'s range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    r = f.metadata.get("range", Range())
    if not r.accepts(value):
        kind = "an integer" if isinstance(value, int) else "a number"
        raise ConfigError(f"{key}={value!r}: expected {kind} {r}")


class Settings:
    """Base of the settings dataclasses. ``KEY``: where the class's values sit in the
    composed config (``"learner.optim"``). Its config-key fields have no defaults:
    :meth:`defaults` takes them from conf/, as ``asyncrl-train`` does. Every instance,
    however built, has its numbers checked against their ranges (:func:`check_ranges`)."""

    KEY: ClassVar[str] = ""
    # The overrides that select the conf/ group holding this class's values, when the
    # default composition picks another (``("env=openenv",)``); the class then takes only
    # its own keys of that group (the rest belong to the group's other settings).
    PRESET: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_ranges(self, self.KEY)

    def check(self) -> None:
        """ConfigError naming the key of a value no run could use (here: a number outside
        its range, also after a field was changed); a subclass adds its own rules."""
        check_ranges(self, self.KEY)

    @classmethod
    def from_config(cls, node: Any) -> Self:
        """From a config node (DictConfig or dict) holding every key; None: the defaults."""
        if node is None:
            return cls.defaults()
        return settings_from(cls, node, cls.KEY)

    @classmethod
    def defaults(cls, **values: Any) -> Self:
        """The settings ``asyncrl-train`` runs with (conf/ composed, no overrides), with
        ``values`` on top: a mapping merges into a nested settings group (``optim={"lr":
        1e-3}``), anything else replaces the value (a dataclass instance included)."""
        node = defaults(cls.KEY, cls.PRESET)
        if cls.PRESET:
            own = {f.name for f in dataclasses.fields(cls)}
            node = {k: v for k, v in node.items() if k in own}
        return cls.from_config(merged(cls, node, values))


def merged(cls: type, node: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``node`` with ``values`` on top; a mapping given for a field typed as a settings
    dataclass merges into that group, key by key (other mappings replace)."""
    out = dict(node)
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    for k, v in values.items():
        sub = _dataclass_in(hints.get(k))
        if sub is not None and isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = merged(sub, out[k], v)
        else:
            out[k] = v
    return out


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass ``hint`` is (or is an Optional of), else None."""
    for h in (hint, *typing.get_args(hint)):
        if isinstance(h, type) and dataclasses.is_dataclass(h):
            return h
    return None


# ---- typed settings ------------------------------------------------------------------------
def settings_from(cls: type[T], node: Any, prefix: str) -> T:
    """A settings dataclass from a config node, every value checked against the field's
    type: unknown keys, missing keys, wrong types, values outside an Enum and numbers
    outside the field's range (NaN and inf included) raise a ConfigError naming
    ``<prefix>.<key>``. Nested dataclass fields recurse (an instance of the field's class
    is taken as it is). The class's own ``check()`` (if any) runs last and raises
    ConfigError itself."""
    from omegaconf import DictConfig, OmegaConf

    raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix}: expected a mapping of settings, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known) - {"_target_"})
    if unknown:
        raise ConfigError(f"{prefix or 'config'}: unknown key(s) {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for name, f in known.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key} is missing")
            continue
        values[name] = _typed(key, raw[name], hints[name])
        check_range(key, values[name], f)
    out = cls(**values)
    check = getattr(out, "check", None)
    if check is not None:
        check()
    return out


def _typed(key: str, value: Any, hint: Any) -> Any:
    """``value`` as type ``hint`` (int, float, bool, str, an Enum, a dataclass, a list or
    dict, or an Optional of one), or a ConfigError naming ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _typed(key, value, inner[0])
        for a in inner:
            try:
                return _typed(key, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r}: expected one of the types {inner}")
    if dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else settings_from(hint, value, key)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        accepted = [m.value for m in hint]
        if value not in accepted:
            raise ConfigError(f"{key}={value!r}: expected one of {accepted}")
        return hint(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    base = origin or hint
    if base in (list, tuple, dict) and not isinstance(
        value, base if base is not tuple else list | tuple
    ):
        raise ConfigError(f"{key}={value!r}: expected a {base.__name__}")
    return value


def hydra_error_line(e: Exception) -> str:
    """One line for an override Hydra could not compose, naming the key or group and
    what it accepts (``foo=1``: the keys there are; ``loss=x``: the group's options)."""
    options = getattr(e, "options", None)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", str(e))
    if missing and options is not None:
        group, name = missing.groups()
        return (
            f"{group}={name}: no such option in config group {group!r}; accepted: {sorted(options)}"
        )
    unknown = re.search(r"Could not override '([^']+)'", str(e))
    if unknown:
        key = unknown.group(1)
        return (
            f"{key}: no such key; accepted here: {_keys_beside(key)} (to add a new key: +{key}=...)"
        )
    first = str(e).split("\n\n")[0]  # Hydra appends the search path after a blank line
    return " ".join(first.split())


def _keys_beside(key: str) -> list[str] | str:
    """The keys of the default config at ``key``'s parent (what a typo was meant to be)."""
    try:
        node: Any = _composed(())
        for part in key.split(".")[:-1]:
            node = node[part]
        return sorted(str(k) for k in node)
    except Exception:  # the line still names the key
        return "see conf/"


def positive(key: str, value: float, strict: bool = True) -> None:
    """ConfigError naming ``key`` unless ``value`` > 0 (>= 0 with ``strict=False``)."""
    if value <= 0 if strict else value < 0:
        raise ConfigError(f"{key}={value!r}: must be {'>' if strict else '>='} 0")
