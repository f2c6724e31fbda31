"""The tiny EAGLE head: an EAGLE-1 draft head for the tiny model (``--spec-method eagle``).

An EAGLE head is one decoder layer that drafts from the target's last hidden state: the next
token's embedding and that hidden state, concatenated, projected back to the hidden size
(``fc``), then the layer (whose input norm EAGLE drops); vLLM shares the target's embedding and
LM head with it when the head has none of its own, as this one does not. The checkpoint follows
EAGLE's layout (``fc.weight``, ``layers.0.*``, no ``model.`` prefix) and the config is the tiny
model's Llama config with one layer, which vLLM turns into ``EagleLlamaForCausalLM``. Random
weights from a fixed seed: deterministic, built in a second; its drafts are seldom right.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvmesh.models import ensure_built
from kvmesh.models import tiny as t

log = logging.getLogger(__name__)

TINY_EAGLE_VERSION = "1"
"""Bump when anything below changes what gets built; ``ensure_tiny_eagle`` caches by it."""

SEED = t.SEED + 17


def config_dict() -> dict[str, Any]:
    """``config.json``: the tiny model's, with one layer."""
    return t.config_dict() | {"num_hidden_layers": 1}


def _weights() -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    h, inter = t.HIDDEN_SIZE, t.INTERMEDIATE_SIZE
    q_dim, kv_dim = t.NUM_HEADS * t.HEAD_DIM, t.NUM_KV_HEADS * t.HEAD_DIM

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * t.INIT_STD

    p = "layers.0."
    return {
        "fc.weight": normal(h, 2 * h),
        p + "self_attn.q_proj.weight": normal(q_dim, h),
        p + "self_attn.k_proj.weight": normal(kv_dim, h),
        p + "self_attn.v_proj.weight": normal(kv_dim, h),
        p + "self_attn.o_proj.weight": normal(h, q_dim),
        p + "mlp.gate_proj.weight": normal(inter, h),
        p + "mlp.up_proj.weight": normal(inter, h),
        p + "mlp.down_proj.weight": normal(h, inter),
        p + "post_attention_layernorm.weight": torch.ones(h),
    }


def build_tiny_eagle(out_dir: Path) -> Path:
    """Writes the tiny EAGLE head (config, safetensors weights, the tiny model's tokenizer)
    into ``out_dir``, created if missing, and returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t.write_model_dir(out_dir, config_dict(), _weights())
    log.info("built tiny EAGLE head v%s in %s", TINY_EAGLE_VERSION, out_dir)
    return out_dir


def ensure_tiny_eagle(cache_root: Path) -> Path:
    """The tiny EAGLE head under ``cache_root/tiny-eagle-<version>``, built there if missing."""
    return ensure_built(Path(cache_root) / f"tiny-eagle-{TINY_EAGLE_VERSION}", build_tiny_eagle)
