"""The router's scheduler: profiles of filters -> weighted scorers -> picker, as config.

Pure: no grpc, etcd or vLLM. See docs/routing.md. Start-up::

    registry = default_registry()                       # once; register extra plugin types here
    env = PluginEnv(index=kv_index, rng=random.Random(seed))
    scheduler = load_profile(Path("my-profile.yaml"), registry=registry, env=env)
    # or a built-in, one file each in profiles/: build_scheduler(builtin_profile(name), ...)

and then, per request (the servicer): ``pick`` -> ``on_routed`` -> ``on_first_token`` ->
``on_finished``.
"""

from .builtins import BUILTIN_TYPES, default_registry
from .framework import Scheduler, StageTiming, Weighted
from .ledger import InFlightLedger, WorkerTally
from .params import check, parse_params
from .plugins import (
    Admission,
    Choice,
    CycleContext,
    Feedback,
    Filter,
    Matched,
    Picker,
    PluginEnv,
    PrefixIndex,
    PrefixMatchLike,
    PrefixSource,
    Scorer,
    TransferRates,
)
from .profile import (
    BUILTIN_PROFILES,
    PluginSpec,
    ProfileSpec,
    build_scheduler,
    builtin_profile,
    load_profile,
    parse_profile,
    parse_yaml,
)
from .registry import Kind, PluginType, Registry

__all__ = [
    "BUILTIN_PROFILES",
    "BUILTIN_TYPES",
    "Admission",
    "Choice",
    "CycleContext",
    "Feedback",
    "Filter",
    "InFlightLedger",
    "Kind",
    "Matched",
    "Picker",
    "PluginEnv",
    "PluginSpec",
    "PluginType",
    "PrefixIndex",
    "PrefixMatchLike",
    "PrefixSource",
    "ProfileSpec",
    "Registry",
    "Scheduler",
    "Scorer",
    "StageTiming",
    "TransferRates",
    "Weighted",
    "WorkerTally",
    "build_scheduler",
    "builtin_profile",
    "check",
    "default_registry",
    "load_profile",
    "parse_params",
    "parse_profile",
    "parse_yaml",
]
