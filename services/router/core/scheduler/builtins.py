"""The built-in plugin types and ``default_registry()``, which the router builds once."""

from __future__ import annotations

from typing import Any

from . import filters, load, pickers
from .active_context import ActiveContextParams, ActiveContextScorer
from .affinity import SessionAffinityScorer, SessionParams
from .cost import CostModelScorer, CostParams
from .params import NoParams
from .plugins import PluginEnv
from .prefix import ApproxParams, ApproxPrefixScorer, PreciseParams, PrecisePrefixScorer
from .registry import Kind, PluginType, Registry
from .reserve import ReserveFilter, ReserveParams
from .ttft import TtftCostScorer, TtftParams


def _simple(cls: Any) -> Any:
    def build(name: str, params: Any, env: PluginEnv) -> Any:
        return cls(name, params)

    return build


BUILTIN_TYPES: tuple[PluginType, ...] = (
    # filters
    PluginType(
        "serving",
        Kind.FILTER,
        NoParams,
        _simple(filters.ServingFilter),
        "workers in state serving",
    ),
    PluginType(
        "model",
        Kind.FILTER,
        NoParams,
        _simple(filters.ModelFilter),
        "workers serving the request's model",
    ),
    PluginType(
        "role",
        Kind.FILTER,
        filters.RoleParams,
        _simple(filters.RoleFilter),
        "workers whose role runs the request's stage",
    ),
    PluginType(
        "volume-bound",
        Kind.FILTER,
        filters.VolumeBoundParams,
        _simple(filters.VolumeBoundFilter),
        "drops workers past max_over_mean x the mean routed volume (routed-volume's count)",
    ),
    PluginType(
        "reserve",
        Kind.FILTER,
        ReserveParams,
        _simple(ReserveFilter),
        "workers reserved per priority band: no lower band on them while the band is active",
    ),
    # scorers
    PluginType(
        "precise-prefix",
        Kind.SCORER,
        PreciseParams,
        PrecisePrefixScorer.build,
        "tier-weighted matched prefix per the KV block index",
    ),
    PluginType(
        "approximate-prefix",
        Kind.SCORER,
        ApproxParams,
        ApproxPrefixScorer.build,
        "matched prefix per the router's record of what it sent where",
    ),
    PluginType(
        "cost-model",
        Kind.SCORER,
        CostParams,
        _simple(CostModelScorer),
        "least estimated time to first token (queue + recompute): sticky until saturated",
    ),
    PluginType(
        "ttft-cost",
        Kind.SCORER,
        TtftParams,
        TtftCostScorer.build,
        "least estimated time to first token: queue + fetch from the best tier or peer + "
        "recompute, at measured prefill rates",
    ),
    PluginType(
        "session-affinity",
        Kind.SCORER,
        SessionParams,
        SessionAffinityScorer.build,
        "the session's last worker unless saturated",
    ),
    PluginType(
        "queue",
        Kind.SCORER,
        load.QueueParams,
        _simple(load.QueueScorer),
        "fewer requests waiting in the worker's queue",
    ),
    PluginType(
        "in-flight",
        Kind.SCORER,
        load.InFlightParams,
        _simple(load.InFlightScorer),
        "fewer outstanding requests",
    ),
    PluginType(
        "in-flight-tokens",
        Kind.SCORER,
        load.InFlightTokensParams,
        _simple(load.InFlightTokensScorer),
        "fewer prompt tokens in flight from this router",
    ),
    PluginType(
        "routed-volume",
        Kind.SCORER,
        load.RoutedVolumeParams,
        _simple(load.RoutedVolumeScorer),
        "less recent routed volume (decayed prompt tokens) relative to the fleet",
    ),
    PluginType(
        "active-context",
        Kind.SCORER,
        ActiveContextParams,
        _simple(ActiveContextScorer),
        "smaller sum of the live sessions' contexts (the worker's future load)",
    ),
    PluginType(
        "kv-usage",
        Kind.SCORER,
        NoParams,
        _simple(load.KvUsageScorer),
        "more free KV cache",
    ),
    # pickers
    PluginType(
        "max-score",
        Kind.PICKER,
        pickers.MaxScoreParams,
        pickers.MaxScorePicker.build,
        "best total, random among ties",
    ),
    PluginType(
        "round-robin",
        Kind.PICKER,
        NoParams,
        _simple(pickers.RoundRobinPicker),
        "each candidate in turn",
    ),
    PluginType(
        "random",
        Kind.PICKER,
        pickers.SeedParams,
        pickers.RandomPicker.build,
        "uniformly at random",
    ),
)


def default_registry() -> Registry:
    """A registry holding the built-in plugin types. Build it once at start-up and register
    out-of-tree plugins on it before loading profiles."""
    reg = Registry()
    for t in BUILTIN_TYPES:
        reg.register(t)
    return reg
