"""One registry of plugin types, built once at start-up (``default_registry()``).

A plugin type has a unique name across all kinds, a frozen parameters dataclass and a factory
``build(name, params, env) -> plugin``. Registering a name twice is an error, so two plugins
cannot silently shadow each other (vLLM's KV connector factory does the same).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvmesh.errors import InvalidArgument

from .params import parse_params
from .plugins import PluginEnv


class Kind(StrEnum):
    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"


@dataclass(frozen=True, slots=True)
class PluginType:
    name: str  # what a profile's ``type:`` says
    kind: Kind
    params: type[Any]  # a frozen dataclass with a default for every field
    build: Callable[[str, Any, PluginEnv], Any]  # (instance name, params, env) -> plugin
    doc: str = ""  # one line, for listings and error messages


class Registry:
    def __init__(self) -> None:
        self._types: dict[str, PluginType] = {}

    def register(self, plugin: PluginType) -> None:
        if plugin.name in self._types:
            have = self._types[plugin.name]
            raise InvalidArgument(
                f"plugin type {plugin.name!r} is already registered (as a {have.kind}); "
                "give the new plugin another name"
            )
        self._types[plugin.name] = plugin

    def get(self, name: str, kind: Kind, where: str) -> PluginType:
        plugin = self._types.get(name)
        if plugin is None:
            known = self.names(kind)
            hint = difflib.get_close_matches(name, known, n=1)
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise InvalidArgument(
                f"{where}: unknown {kind} type {name!r}{did}; known {kind}s: {', '.join(known)}"
            )
        if plugin.kind is not kind:
            raise InvalidArgument(
                f"{where}: {name!r} is a {plugin.kind}, not a {kind}; "
                f"known {kind}s: {', '.join(self.names(kind))}"
            )
        return plugin

    def create(
        self, name: str, kind: Kind, instance: str, raw_params: object, env: PluginEnv, where: str
    ) -> Any:
        plugin = self.get(name, kind, where)
        params = parse_params(plugin.params, raw_params, f"{where} params")
        return plugin.build(instance, params, env)

    def names(self, kind: Kind | None = None) -> list[str]:
        return sorted(n for n, p in self._types.items() if kind is None or p.kind is kind)

    def __iter__(self) -> Iterator[PluginType]:
        return iter(self._types.values())

    def __contains__(self, name: object) -> bool:
        return name in self._types
