"""Command-line flags, environment variables and a config file, generated from the config
dataclasses: one place says what a setting is (its field: type, default, a doc with units) and
the flag, the variable and the file key follow from it.

A field declares itself with ``setting(default, "doc")`` (``flag=`` when its flag is not its
name with dashes; ``prefix=`` on a nested config, for its fields' flags). ``add_config_flags``
adds one flag per field (booleans as ``--x`` / ``--no-x``) and ``--config FILE``;
``load_config`` builds the config with the precedence of STYLE.md:

    defaults < config file (YAML: the config tree by field names) < environment
    (``<PREFIX><FLAG>``: ``KVMESH_ROUTER_ETCD_TTL_S=5``) < flags

Values are checked by the dataclasses themselves (``__post_init__``); a bad one is a usage
error naming where it came from. Library code never reads ``os.environ``: ``main()`` passes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import KvmeshError
from kvmesh.units import parse_bytes

_KEY = "kvmesh.setting"
_T = typing.TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Setting:
    """What a config field says about itself (``dataclasses.field`` metadata)."""

    doc: str  # one line, with the unit
    # The flag: after the prefix, without "--" (empty: the field name, dashed); with "--", the
    # whole flag, no prefix (a nested config's switch named as the config: --disagg).
    flag: str = ""
    parse: Callable[[str], Any] | None = None  # text -> value; None: from the field's type
    choices: tuple[str, ...] = ()  # the values a text flag takes, when a closed set
    metavar: str | None = None
    repeat: bool = False  # the flag may be given many times, one item each
    hidden: bool = False  # not in --help (set by launchers, not people)
    prefix: str | None = None  # a nested config: what its fields' flags start with


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    **how: Any,
) -> Any:
    """A config field with its doc (and, optionally, how its flag is made: ``Setting``)."""
    meta = {_KEY: Setting(doc, **how)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Option:
    """One leaf setting of a config tree, as a flag."""

    path: tuple[str, ...]  # field names from the root: ("disagg", "placement", "mode")
    flag: str  # without "--": "disagg-placement"
    doc: str
    default: Any
    kind: Any  # the field's type, resolved
    spec: Setting

    @property
    def dest(self) -> str:
        return "__".join(self.path)

    @property
    def is_bool(self) -> bool:
        return self.kind is bool

    def env_name(self, prefix: str) -> str:
        return prefix + self.flag.upper().replace("-", "_")

    def parse(self, text: str) -> Any:
        """The value of one flag argument (one item of a repeated flag)."""
        if self.spec.parse is not None:
            return self.spec.parse(text)
        return _parser_of(self.kind, self.spec.choices)(text)


def options(cls: type, prefix: str = "", path: tuple[str, ...] = ()) -> list[Option]:
    """The leaf settings of config class ``cls`` (nested configs flattened), in field order.
    A field without a ``setting()`` doc is an error: every field has a doc and a flag."""
    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if not isinstance(spec, Setting) or not spec.doc:
            raise TypeError(f"{cls.__name__}.{f.name} has no setting(..., doc): document it")
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            sub = prefix + (spec.prefix if spec.prefix is not None else "")
            out += options(kind, sub, (*path, f.name))  # type: ignore[arg-type]
            continue
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if spec.flag.startswith("--"):
            flag = spec.flag[2:]
        else:
            flag = prefix + (spec.flag or f.name.replace("_", "-"))
        if kind is int and f.name.endswith("_bytes") and spec.parse is None:
            spec = dataclasses.replace(spec, parse=parse_bytes)  # 268435456, 256MiB, 4G
        out.append(Option((*path, f.name), flag, spec.doc, default, kind, spec))
    return out


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> list[Option]:
    """Adds ``--config FILE`` and one flag per setting of ``cls`` to ``parser``; given flags
    only land in the namespace (``load_config`` fills in the rest)."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="YAML file with settings by field name (nested as the config tree); the "
        "environment and flags override it",
    )
    opts = options(cls)
    for opt in opts:
        help_ = argparse.SUPPRESS if opt.spec.hidden else _help(opt)
        if opt.is_bool:
            parser.add_argument(
                f"--{opt.flag}",
                dest=opt.dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_,
            )
            continue
        parser.add_argument(
            f"--{opt.flag}",
            dest=opt.dest,
            type=_usage_errors(opt.parse),
            action="append" if opt.spec.repeat else "store",
            default=argparse.SUPPRESS,
            metavar=opt.spec.metavar or _metavar(opt),
            help=help_,
        )
    return opts


def load_config(
    parser: argparse.ArgumentParser,
    cls: type[_T],
    args: argparse.Namespace,
    opts: Sequence[Option],
    environ: Mapping[str, str],
    env_prefix: str,
) -> tuple[_T, set[str]]:
    """The config from defaults < ``--config`` file < ``environ`` < flags in ``args``, and the
    flags of the settings that were set (by any of the three). Bad values: ``parser.error``."""
    values: dict[tuple[str, ...], Any] = {}
    given: set[str] = set()
    by_path = {o.path: o for o in opts}
    if (path := getattr(args, "config", None)) is not None:
        for key, raw in _read_file(parser, path, opts).items():
            opt = by_path.get(key)
            if opt is None:
                parser.error(f"{path}: unknown setting {'.'.join(key)!r}")
            values[key] = _from_file(parser, opt, raw, f"{path}: {'.'.join(key)}")
            given.add(opt.flag)
    for opt in opts:
        name = opt.env_name(env_prefix)
        if name in environ:
            values[opt.path] = _from_text(parser, opt, environ[name], name)
            given.add(opt.flag)
    for opt in opts:
        if hasattr(args, opt.dest):
            raw = getattr(args, opt.dest)
            values[opt.path] = _collect(opt, raw) if opt.spec.repeat else raw
            given.add(opt.flag)
    try:
        return _build(cls, values, ()), given
    except (KvmeshError, ValueError, TypeError) as exc:
        parser.error(str(exc))


# ---- building -------------------------------------------------------------------------------
def _build(cls: Any, values: Mapping[tuple[str, ...], Any], path: tuple[str, ...]) -> Any:
    """``cls`` with the given values (its defaults for the rest); nested configs are built
    only when one of their settings is given, so their own defaults stay theirs."""
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = (*path, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            if any(k[: len(key)] == key for k in values):
                kwargs[f.name] = _build(hints[f.name], values, key)
        elif key in values:
            kwargs[f.name] = values[key]
    return cls(**kwargs)


def _collect(opt: Option, items: list[Any]) -> Any:
    """A repeated flag's items as the field's type (a tuple, or a dict of KEY=VALUE pairs)."""
    if _origin(opt.kind) in (dict, Mapping):
        return dict(items)
    return tuple(items)


# ---- parsing text ----------------------------------------------------------------------------
def _parser_of(kind: Any, choices: tuple[str, ...] = ()) -> Callable[[str], Any]:
    inner = _unoptional(kind)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return _enum(inner)
    if choices:
        return _choice(choices)
    if inner is bool:
        return parse_bool
    if inner is int:
        return int
    if inner is float:
        return float
    if inner is Path:
        return lambda text: Path(text) if text else None
    origin = _origin(inner)
    if origin is tuple:
        (item, *_) = typing.get_args(inner)
        return lambda text: tuple(item(v) for v in parse_list(text))
    if origin in (dict, Mapping):
        return parse_json_object
    return str


def _usage_errors(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with domain errors as argparse's (a usage error naming the flag)."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except KvmeshError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


def _from_text(parser: argparse.ArgumentParser, opt: Option, text: str, where: str) -> Any:
    try:
        if opt.is_bool:
            return parse_bool(text)
        if opt.spec.repeat:
            return _collect(opt, [opt.parse(v) for v in parse_list(text)])
        return opt.parse(text)
    except (KvmeshError, ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{where}={text!r}: {exc}")


def _from_file(parser: argparse.ArgumentParser, opt: Option, raw: Any, where: str) -> Any:
    """A YAML value: text is parsed as the flag's argument; lists and numbers are taken."""
    if isinstance(raw, str):
        return _from_text(parser, opt, raw, where)
    if isinstance(raw, list) and _origin(_unoptional(opt.kind)) is tuple:
        return tuple(opt.parse(v) if isinstance(v, str) else v for v in raw)
    if isinstance(raw, bool) != opt.is_bool and not (raw is None or isinstance(raw, dict)):
        parser.error(f"{where}: want {'true or false' if opt.is_bool else 'a value'}, got {raw!r}")
    if isinstance(raw, int) and not isinstance(raw, bool) and _unoptional(opt.kind) is float:
        return float(raw)
    return raw


def _read_file(
    parser: argparse.ArgumentParser, path: Path, opts: Sequence[Option]
) -> dict[tuple[str, ...], Any]:
    """The file's settings by path; a mapping is walked into only where a nested config is."""
    import yaml

    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(tree, dict):
        parser.error(f"--config {path}: want a mapping of settings, got {type(tree).__name__}")
    nested = {o.path[:i] for o in opts for i in range(1, len(o.path))}
    out: dict[tuple[str, ...], Any] = {}

    def walk(node: Mapping[str, Any], path_: tuple[str, ...]) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and (*path_, str(key)) in nested:
                walk(value, (*path_, str(key)))
            else:
                out[(*path_, str(key))] = value

    walk(tree, ())
    return out


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def parse_list(text: str) -> tuple[str, ...]:
    """A list: a JSON list of strings (``'["a", "b"]'``, vLLM's form) or comma-separated."""
    text = text.strip()
    if not text:
        return ()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"want a JSON list of strings, got {text!r}")
        return tuple(v.strip() for v in value if v.strip())
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("want a JSON object ({...})")
    return value


def parse_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (a repeated flag's item of a mapping)."""
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, got {text!r}")
    return key, value


def _enum(cls: type[enum.Enum]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return cls(text)
        except ValueError:
            values = ", ".join(str(m.value) for m in cls)
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {values})"
            ) from None

    return parse


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(choices)})"
            )
        return text

    return parse


# ---- help ------------------------------------------------------------------------------------
def _help(opt: Option) -> str:
    default = opt.default
    if isinstance(default, enum.Enum):
        default = default.value
    elif isinstance(default, tuple):
        default = ",".join(str(v) for v in default)
    shown = "unset" if default in (None, "", (), {}) else default
    return f"{opt.doc} (default: {shown})".replace("%", "%%")


def _metavar(opt: Option) -> str:
    inner = _unoptional(opt.kind)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return "{" + ",".join(str(m.value) for m in inner) + "}"
    if opt.spec.choices:
        return "{" + ",".join(opt.spec.choices) + "}"
    if opt.path[-1].endswith("_bytes"):
        return "BYTES"
    if opt.path[-1].endswith("_s"):
        return "SECONDS"
    if inner is Path:
        return "PATH"
    names = {int: "N", float: "NUMBER", tuple: "LIST", dict: "JSON", Mapping: "JSON"}
    return names.get(_origin(inner) or inner, "TEXT")


def _unoptional(kind: Any) -> Any:
    """``X`` of ``X | None``."""
    if isinstance(kind, types.UnionType) or _origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def _origin(kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return Mapping if origin is not dict else dict
    return origin
