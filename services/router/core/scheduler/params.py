"""Parsing a plugin's frozen parameters dataclass from YAML-loaded data.

Each plugin declares ``@dataclass(frozen=True, slots=True)`` parameters with a default for every
field and checks its ranges in ``__post_init__`` (raising ``InvalidArgument``). ``parse_params``
turns a mapping into that dataclass: unknown keys are errors that name the known ones (and the
closest match), and each value is checked against the field's type (``int``, ``float``, ``bool``,
``str``, a ``StrEnum``, a nested parameters dataclass, ``X | None`` or ``tuple[X, ...]``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kvmesh.errors import InvalidArgument

P = TypeVar("P")


@dataclasses.dataclass(frozen=True, slots=True)
class NoParams:
    """The parameters of a plugin that takes none (any key given is an error)."""


def relative_scores(costs: Sequence[float], floor_s: float) -> list[float]:
    """Estimated costs (seconds) as scores: ``(min + floor_s) / (cost + floor_s)``, 1 for the
    cheapest; costs within ``floor_s`` of each other score nearly alike."""
    if not costs:
        return []
    best = min(costs) + floor_s
    return [best / (c + floor_s) for c in costs]


def check(ok: bool, message: str) -> None:
    """For ``__post_init__`` range checks: raise ``InvalidArgument(message)`` unless ``ok``."""
    if not ok:
        raise InvalidArgument(message)


def unknown_key_message(where: str, key: object, known: list[str]) -> str:
    hint = difflib.get_close_matches(str(key), known, n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"{where}: unknown key {key!r}{did}; known keys: {', '.join(known) or '(none)'}"


def parse_params(cls: type[P], raw: object, where: str) -> P:
    """``cls`` built from ``raw`` (a mapping, or None for all defaults). ``where`` prefixes every
    error message, e.g. ``profile 'x' scorer 'queue' params``."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"{where}: expected a mapping of keys to values, got {_kind(raw)}")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            raise InvalidArgument(unknown_key_message(where, key, sorted(fields)))
        kwargs[key] = _convert(hints[key], value, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None


def _convert(tp: Any, value: object, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _convert(rest[0], value, where)
        raise TypeError(f"{where}: unsupported parameter type {tp!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: unsupported parameter type {tp!r}")
        if not isinstance(value, list | tuple):
            raise InvalidArgument(f"{where}: expected a list, got {_kind(value)}")
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse_params(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in tp)
            raise InvalidArgument(f"{where}: {value!r} is not one of {choices}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise InvalidArgument(f"{where}: expected true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{where}: expected an integer, got {_kind(value)}")
        return value
    if tp is float:
        return to_float(value, where)
    if tp is str:
        if not isinstance(value, str):
            raise InvalidArgument(f"{where}: expected a string, got {_kind(value)}")
        return value
    raise TypeError(f"{where}: unsupported parameter type {tp!r}")


def to_float(value: object, where: str) -> float:
    """A finite number from YAML data; strings like ``1e-5`` count (YAML 1.1 reads a number
    without a dot as a string)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InvalidArgument(f"{where}: expected a number, got {_kind(value)}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{where}: expected a number, got {_kind(value)}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"{type(value).__name__} {value!r}"
