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


# ---- the baselines ------------------------------------------------------------------------------
BUILTIN_PROFILES: dict[str, str] = {
    "round-robin": """\
name: round-robin
description: Each serving worker in turn, blind to caches and load (a baseline).
filters: [serving, model, role]
scorers: []
picker: round-robin
""",
    "random": """\
name: random
description: A serving worker at random (a baseline).
filters: [serving, model, role]
scorers: []
picker: random
""",
    "least-loaded": """\
name: least-loaded
description: Fewest outstanding and queued requests, then most free KV cache; blind to caches.
filters: [serving, model, role]
scorers:
  - {type: in-flight, weight: 1.0}
  - {type: queue, weight: 1.0}
  - {type: kv-usage, weight: 0.1}
picker: max-score
""",
    "approximate-prefix": """\
name: approximate-prefix
description: >-
  Longest prefix per the router's own record of what it sent where (engines without KV events),
  weighed against load.
filters: [serving, model, role]
scorers:
  - {type: approximate-prefix, weight: 2.0, params: {stride_blocks: 4, blocks_per_worker: 65536}}
  - {type: queue, weight: 1.0}
  - {type: in-flight, weight: 1.0}
  - {type: kv-usage, weight: 0.1}
picker: max-score
""",
    "precise-prefix": """\
name: precise-prefix
description: >-
  Longest tier-weighted prefix per the KV block index the workers' events feed, weighed against
  load (llm-d's precise prefix-cache profile).
filters: [serving, model, role]
scorers:
  - type: precise-prefix
    weight: 2.0
    params:
      tier_weights: {gpu: 1.0, cpu: 0.8, disk: 0.5}
      degraded_factor: 0.5
  - {type: queue, weight: 1.0}
  - {type: in-flight, weight: 1.0}
  - {type: kv-usage, weight: 0.1}
picker: max-score
""",
    "precise-active": """\
name: precise-active
description: >-
  Precise prefix affinity plus an even share of the live sessions' contexts (active-context):
  agent sessions resend their whole context each turn, so a worker's future load is the sum of
  the contexts living on it. A session moves (recomputing once) only when the other sessions on
  its worker carry far more context than another worker's; its next turns follow the prefix.
  For fleets serving long agent sessions; see docs/routing.md for the replay numbers.
filters: [serving, model, role]
scorers:
  - type: precise-prefix
    weight: 2.0
    params:
      tier_weights: {gpu: 1.0, cpu: 0.8, disk: 0.5}
      degraded_factor: 0.5
  - type: active-context
    weight: 5.5
    params: {idle_requests: 400, fork_share: 0.0}
  - {type: queue, weight: 1.0}
  - {type: in-flight, weight: 0.5}
picker: max-score
""",
    "precise-balanced": """\
name: precise-balanced
description: >-
  Precise prefix affinity plus an even share of routed tokens: cold sessions go where recent
  routed volume is lowest, and a worker whose share runs far above the fleet's mean sheds warm
  sessions too (recomputing them). For busy fleets; on a mostly idle fleet prefer precise-sticky.
filters: [serving, model, role]
scorers:
  - type: precise-prefix
    weight: 2.0
    params:
      tier_weights: {gpu: 1.0, cpu: 0.8, disk: 0.5}
      degraded_factor: 0.5
  - type: routed-volume
    weight: 4.5
    params: {half_life_requests: 400, yield_to_prefix: 0.3}
  - {type: queue, weight: 1.0}
  - {type: in-flight, weight: 0.5}
picker: max-score
""",
    "precise-cost": """\
name: precise-cost
description: >-
  Measured time to first token over every tier and peer (ttft-cost): per worker, the wait for
  its queue + the fetch of the prefix it lacks from its node's kvmanager tiers or the best
  peer's + the prefill of what nobody holds, at the prefill rate each engine measures; a session
  moves, with its cache, when that is cheaper than waiting where it is. Prefix affinity, an even
  share of routed tokens (routed-volume) and of the live sessions' contexts (active-context)
  price the load the next requests will bring, which the cost of this one does not.
filters: [serving, model, role]
scorers:
  - type: ttft-cost
    weight: 1.0
  - type: precise-prefix
    weight: 2.0
    params:
      tier_weights: {gpu: 1.0, cpu: 0.8, disk: 0.5}
      degraded_factor: 0.5
  - type: routed-volume
    weight: 4.5
    params: {half_life_requests: 400, yield_to_prefix: 0.3}
  - type: active-context
    weight: 5.5
    params: {idle_requests: 400, fork_share: 0.0}
  - {type: queue, weight: 1.0}
  - {type: in-flight, weight: 0.5}
picker: max-score
""",
    "precise-sticky": """\
name: precise-sticky
description: >-
  Sticky until saturated: the worker holding the prefix keeps the request while its queue costs
  less than recomputing the prompt elsewhere (cost model of time to first token), with session
  affinity and load as tie-breakers.
filters: [serving, model, role]
scorers:
  - type: cost-model
    weight: 3.0
    params:
      prefill_s_per_token: 2.5e-5
      queued_request_s: 0.5
      cpu_s_per_token: 2.0e-6
      disk_s_per_token: 1.0e-5
      floor_s: 0.05
  - type: precise-prefix
    weight: 0.5
    params:
      tier_weights: {gpu: 1.0, cpu: 0.8, disk: 0.5}
      degraded_factor: 0.5
  - type: session-affinity
    weight: 0.5
    params: {max_sessions: 100000, max_waiting: 4, max_kv_usage: 0.95}
  - {type: in-flight, weight: 0.2}
  - {type: kv-usage, weight: 0.1}
picker: max-score
""",
}


def builtin_profile(name: str) -> ProfileSpec:
    text = BUILTIN_PROFILES.get(name)
    if text is None:
        raise InvalidArgument(
            f"unknown scheduler profile {name!r}; choose one of {sorted(BUILTIN_PROFILES)} "
            "or give a profile file (.yaml)"
        )
    return parse_yaml(text, f"built-in profile {name!r}")
