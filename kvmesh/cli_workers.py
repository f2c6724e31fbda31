"""The worker flags ``kvmesh up`` passes through to every worker: data-parallel ranks and
speculative decoding, checked here (a usage error names the flag) before any process starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.models import ModelNotFound, resolve_model

__all__ = ["dp_worker_args", "speculative_config", "speculative_worker_args"]


def dp_worker_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[str, ...]:
    """The workers' --data-parallel-size / --enable-expert-parallel flags (a usage error if bad)."""
    if a.data_parallel_size < 1:
        p.error(f"--data-parallel-size must be >= 1, got {a.data_parallel_size}")
    args: tuple[str, ...] = ()
    if a.data_parallel_size > 1:
        args += ("--data-parallel-size", str(a.data_parallel_size))
    if a.enable_expert_parallel:
        args += ("--enable-expert-parallel",)
    return args


def speculative_config(p: argparse.ArgumentParser, a: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The workers' ``SpeculativeConfig`` from the --spec-* flags (a usage error if bad)."""
    from services.worker.config import SpeculativeConfig, spec_method

    try:
        return SpeculativeConfig(
            method=spec_method(a.spec_method),
            num_speculative_tokens=a.spec_num_tokens,
            draft_model=a.spec_draft_model,
            prompt_lookup_min=a.spec_prompt_lookup_min,
            prompt_lookup_max=a.spec_prompt_lookup_max,
        )
    except (ValueError, argparse.ArgumentTypeError) as exc:
        p.error(
            f"--spec-method: {exc}" if isinstance(exc, argparse.ArgumentTypeError) else str(exc)
        )


def speculative_worker_args(
    p: argparse.ArgumentParser, a: argparse.Namespace, model: Path
) -> tuple[str, ...]:
    """The worker flags of the --spec-* settings, the draft model resolved (a built-in name is
    built) and both models checked (``services.worker.speculative.check_models``)."""
    from dataclasses import replace

    from kvmesh.errors import InvalidArgument
    from services.worker.speculative import check_models

    spec = speculative_config(p, a)
    if not spec.enabled:
        if a.spec_workers >= 0:
            p.error("--spec-workers needs --spec-method")
        return ()
    try:
        if spec.draft_model:
            spec = replace(spec, draft_model=str(resolve_model(spec.draft_model)))
        check_models(spec, model)
    except InvalidArgument as exc:
        p.error(
            str(exc).replace("--model", "--spec-draft-model", 1)
            if isinstance(exc, ModelNotFound)
            else str(exc)
        )
    args = ["--spec-method", spec.method]
    for flag, value in (
        ("--spec-num-tokens", spec.num_speculative_tokens),
        ("--spec-draft-model", spec.draft_model),
        ("--spec-prompt-lookup-min", spec.prompt_lookup_min),
        ("--spec-prompt-lookup-max", spec.prompt_lookup_max),
    ):
        if value:
            args += [flag, str(value)]
    return tuple(args)
