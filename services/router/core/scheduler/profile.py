"""Scheduler profiles as config: parse YAML into a ``ProfileSpec``, build a ``Scheduler``.

A profile file::

    name: precise-sticky              # required; RouteDecision.policy
    description: free text            # optional
    filters: [serving, model, role]   # optional (this is the default); [] for none
    scorers:                          # optional; each entry: type, weight (default 1), name, params
      - type: cost-model
        weight: 3.0
        params: {prefill_s_per_token: 2.5e-5}
      - type: precise-prefix
        weight: 0.5
    picker: max-score                 # optional (this is the default)

An entry is a plugin type's name or a mapping with ``type`` (required), ``name`` (default: the
type; names are unique within a profile), ``params`` (the plugin's own keys; unknown keys are
errors) and, for scorers only, ``weight`` (>= 0; 0 keeps a prefix scorer as a source only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvmesh.errors import InvalidArgument

from .builtins import default_registry
from .framework import Scheduler, Weighted
from .params import to_float, unknown_key_message
from .plugins import PluginEnv
from .registry import Kind, Registry

DEFAULT_FILTERS = ("serving", "model", "role")
DEFAULT_PICKER = "max-score"
_PROFILE_KEYS = ["description", "filters", "name", "picker", "scorers"]
_ENTRY_KEYS = {
    Kind.FILTER: ["name", "params", "type"],
    Kind.SCORER: ["name", "params", "type", "weight"],
    Kind.PICKER: ["name", "params", "type"],
}


@dataclass(frozen=True, slots=True)
class PluginSpec:
    type: str
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0  # scorers only


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    name: str
    filters: tuple[PluginSpec, ...]
    scorers: tuple[PluginSpec, ...]
    picker: PluginSpec
    description: str = ""


# ---- parsing ------------------------------------------------------------------------------------
def parse_profile(data: object, where: str = "profile") -> ProfileSpec:
    """A ``ProfileSpec`` from YAML-loaded data; every error names the key and what to fix."""
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{where}: expected a mapping with keys {', '.join(_PROFILE_KEYS)}")
    for key in data:
        if key not in _PROFILE_KEYS:
            raise InvalidArgument(unknown_key_message(where, key, _PROFILE_KEYS))
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: 'name' is required: a non-empty string naming the profile")
    where = f"profile {name!r}"
    description = data.get("description", "")
    if not isinstance(description, str):
        raise InvalidArgument(f"{where}: 'description' must be a string")
    raw_filters = data.get("filters", list(DEFAULT_FILTERS))
    raw_scorers = data.get("scorers", [])
    for key, value in (("filters", raw_filters), ("scorers", raw_scorers)):
        if not isinstance(value, list):
            raise InvalidArgument(f"{where}: '{key}' must be a list of entries (or [] for none)")
    filters = tuple(
        _entry(e, Kind.FILTER, f"{where} filters[{i}]") for i, e in enumerate(raw_filters)
    )
    scorers = tuple(
        _entry(e, Kind.SCORER, f"{where} scorers[{i}]") for i, e in enumerate(raw_scorers)
    )
    picker = _entry(data.get("picker", DEFAULT_PICKER), Kind.PICKER, f"{where} picker")
    return ProfileSpec(name, filters, scorers, picker, description)


def _entry(raw: object, kind: Kind, where: str) -> PluginSpec:
    if isinstance(raw, str):
        return PluginSpec(type=raw, name=raw)
    if not isinstance(raw, Mapping):
        raise InvalidArgument(
            f"{where}: expected a plugin type name or a mapping with 'type', got {raw!r}"
        )
    known = _ENTRY_KEYS[kind]
    for key in raw:
        if key not in known:
            msg = unknown_key_message(where, key, known)
            if key == "weight":
                msg += " (only scorers have a weight)"
            elif key not in ("type", "name", "params"):
                msg += " (plugin parameters go under 'params')"
            raise InvalidArgument(msg)
    type_ = raw.get("type")
    if not isinstance(type_, str) or not type_:
        raise InvalidArgument(f"{where}: 'type' is required: the plugin type's name")
    name = raw.get("name", type_)
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: 'name' must be a non-empty string")
    params = raw.get("params") or {}
    if not isinstance(params, Mapping):
        raise InvalidArgument(f"{where}: 'params' must be a mapping of the plugin's keys")
    weight = to_float(raw.get("weight", 1.0), f"{where} weight")
    if weight < 0:
        raise InvalidArgument(f"{where}: 'weight' is {weight!r}; use a number >= 0")
    return PluginSpec(type=type_, name=name, params=dict(params), weight=weight)


def parse_yaml(text: str, where: str = "profile") -> ProfileSpec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{where}: not valid YAML: {exc}") from None
    return parse_profile(data, where)


# ---- building -----------------------------------------------------------------------------------
def build_scheduler(
    spec: ProfileSpec, registry: Registry | None = None, env: PluginEnv | None = None
) -> Scheduler:
    reg = registry if registry is not None else default_registry()
    env = env if env is not None else PluginEnv()
    where = f"profile {spec.name!r}"
    filters = [
        reg.create(s.type, Kind.FILTER, s.name, s.params, env, f"{where} filter {s.name!r}")
        for s in spec.filters
    ]
    scorers = [
        Weighted(
            reg.create(s.type, Kind.SCORER, s.name, s.params, env, f"{where} scorer {s.name!r}"),
            s.weight,
        )
        for s in spec.scorers
    ]
    p = spec.picker
    picker = reg.create(p.type, Kind.PICKER, p.name, p.params, env, f"{where} picker {p.name!r}")
    return Scheduler(spec.name, filters, scorers, picker)


def load_profile(
    source: str | Path, *, registry: Registry | None = None, env: PluginEnv | None = None
) -> Scheduler:
    """A scheduler from a profile: a ``Path`` (or a string ending in .yaml/.yml with no newline)
    is read as a file; any other string is YAML text. Call once at start-up."""
    if isinstance(source, str) and not ("\n" not in source and source.endswith((".yaml", ".yml"))):
        return build_scheduler(parse_yaml(source), registry, env)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read scheduler profile {str(path)!r}: {exc}") from None
    return build_scheduler(parse_yaml(text, f"profile file {str(path)!r}"), registry, env)


# ---- the built-ins: one YAML file each in profiles/ (shipped with the package) -------------------
def _builtin_texts() -> dict[str, str]:
    root = resources.files(__package__).joinpath("profiles")
    texts = {
        entry.name.removesuffix(".yaml"): entry.read_text(encoding="utf-8")
        for entry in root.iterdir()
        if entry.name.endswith(".yaml")
    }
    return dict(sorted(texts.items()))


BUILTIN_PROFILES: dict[str, str] = _builtin_texts()
"""Built-in profile name -> its YAML (``profiles/NAME.yaml``, the only copy)."""


def builtin_profile(name: str) -> ProfileSpec:
    text = BUILTIN_PROFILES.get(name)
    if text is None:
        raise InvalidArgument(
            f"unknown scheduler profile {name!r}; choose one of {sorted(BUILTIN_PROFILES)} "
            "or give a profile file (.yaml)"
        )
    return parse_yaml(text, f"built-in profile {name!r}")
