"""Speculative decoding settings as vLLM takes them, and the checks that need the models.

``vllm_speculative_config`` turns the worker's ``SpeculativeConfig`` into vLLM's
``speculative_config`` dict (AsyncEngineArgs). ``check_models`` reads the models' ``config.json``
before the engine starts, so a setting the models cannot serve is one usage error naming the
flag to fix instead of an engine traceback: ``mtp`` on a model without MTP layers, a draft model
that is not a model directory or has another vocabulary. Imports no vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvmesh.errors import InvalidArgument

from .config import SPEC_DRAFT_METHODS, SpeculativeConfig

DEFAULT_NUM_TOKENS = 3
"""Tokens drafted per step when ``--spec-num-tokens`` is 0 (methods other than mtp)."""

MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
"""config.json keys that count a model's MTP layers (DeepSeek V3, MiMo, GLM-4.5, Qwen3-Next
and Ernie say num_nextn_predict_layers; Qwen3.5 mtp_num_hidden_layers)."""


def vllm_speculative_config(spec: SpeculativeConfig, mtp_layers: int = 0) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``spec``; None when speculation is off.
    ``mtp_layers``: the model's MTP layer count (``mtp_layer_count``), the default number of
    tokens for mtp."""
    if not spec.enabled:
        return None
    n = spec.num_speculative_tokens
    if not n:
        n = mtp_layers if spec.method == "mtp" and mtp_layers > 0 else DEFAULT_NUM_TOKENS
    out: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": n}
    if spec.method in SPEC_DRAFT_METHODS:
        out["model"] = spec.draft_model
    if spec.method == "ngram":
        lo = spec.prompt_lookup_min or spec.prompt_lookup_max
        hi = spec.prompt_lookup_max or spec.prompt_lookup_min
        if lo:
            out["prompt_lookup_min"], out["prompt_lookup_max"] = lo, hi
    out.update(spec.extra or {})
    return out


def read_model_config(model: str | Path, flag: str) -> dict[str, Any]:
    """A model directory's ``config.json``; ``InvalidArgument`` naming ``flag`` otherwise."""
    path = Path(model) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(
            f"{flag} {str(model)!r} is not a Hugging Face model directory (no config.json)"
        ) from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{flag} {str(model)!r}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{flag} {str(model)!r}: {path} is not a JSON object")
    return data


def mtp_layer_count(config: Mapping[str, Any]) -> int:
    """MTP layers a model's ``config.json`` declares (0: none), its text config's included."""
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, Mapping):
            continue
        for key in MTP_LAYER_KEYS:
            n = cfg.get(key)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
    return 0


def _vocab_size(config: Mapping[str, Any]) -> int | None:
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, Mapping) and isinstance(cfg.get("vocab_size"), int):
            return int(cfg["vocab_size"])
    return None


def check_models(spec: SpeculativeConfig, model: str | Path) -> int:
    """Checks that ``model`` (the target, ``--model``) and the draft can serve ``spec``;
    returns the target's MTP layer count (0 unless ``mtp``). Raises ``InvalidArgument``, the
    message naming the flag to fix."""
    if not spec.enabled:
        return 0
    if spec.method == "mtp":
        target = read_model_config(model, "--model")
        layers = mtp_layer_count(target)
        if not layers:
            raise InvalidArgument(
                f"--spec-method mtp: model {str(model)!r} has no MTP layers (no "
                f"{' / '.join(MTP_LAYER_KEYS)} in its config.json); use --spec-method ngram or "
                "draft_model, or a model with MTP layers"
            )
        return layers
    if spec.method in SPEC_DRAFT_METHODS:
        draft = read_model_config(spec.draft_model, "--spec-draft-model")
        if spec.method == "draft_model":
            theirs, ours = _vocab_size(draft), _vocab_size(read_model_config(model, "--model"))
            if theirs is not None and ours is not None and theirs != ours:
                raise InvalidArgument(
                    f"--spec-draft-model {spec.draft_model!r} has a vocabulary of {theirs} "
                    f"tokens, --model {ours}; use a draft model with the target's tokenizer"
                )
    return 0
