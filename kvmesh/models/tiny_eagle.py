"""The tiny EAGLE heads: an EAGLE-1 draft head for the tiny model (``--spec-method eagle``),
and an EAGLE-3 head (``--spec-method eagle3``, ``build_tiny_eagle3``: it reads the hidden states
of several target layers, fused by ``fc``, and has its own LM head).

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


TINY_EAGLE3_VERSION = "1"
"""Bump when the EAGLE-3 head below changes what gets built; ``ensure_tiny_eagle3`` caches by it."""

EAGLE3_AUX_LAYERS = (0, 1)
"""The target layers whose inputs the EAGLE-3 head reads (vLLM's default for Llama, layers
2, L/2 and L-3, does not exist in a 2-layer model), so ``fc`` takes 2 x hidden."""


def eagle3_config_dict() -> dict[str, Any]:
    """``config.json`` of the EAGLE-3 head: one layer, vLLM's ``LlamaForCausalLMEagle3``, the full
    vocabulary as its draft vocabulary (no ``d2t`` map), the aux layers above."""
    return t.config_dict() | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": t.VOCAB_SIZE,
        "target_hidden_size": t.HIDDEN_SIZE,
        "eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS),
        "num_aux_hidden_states": len(EAGLE3_AUX_LAYERS),
    }


def _eagle3_weights() -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    h, inter = t.HIDDEN_SIZE, t.INTERMEDIATE_SIZE
    q_dim, kv_dim = t.NUM_HEADS * t.HEAD_DIM, t.NUM_KV_HEADS * t.HEAD_DIM

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * t.INIT_STD

    # EAGLE-3's checkpoint names: ``midlayer.*``; its attention reads the token's embedding
    # and the fused hidden state concatenated (2 x hidden); its own final norm and LM head.
    p = "midlayer."
    return {
        "fc.weight": normal(h, len(EAGLE3_AUX_LAYERS) * h),
        p + "input_layernorm.weight": torch.ones(h),
        p + "hidden_norm.weight": torch.ones(h),
        p + "self_attn.q_proj.weight": normal(q_dim, 2 * h),
        p + "self_attn.k_proj.weight": normal(kv_dim, 2 * h),
        p + "self_attn.v_proj.weight": normal(kv_dim, 2 * h),
        p + "self_attn.o_proj.weight": normal(h, q_dim),
        p + "mlp.gate_proj.weight": normal(inter, h),
        p + "mlp.up_proj.weight": normal(inter, h),
        p + "mlp.down_proj.weight": normal(h, inter),
        p + "post_attention_layernorm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": normal(t.VOCAB_SIZE, h),
    }


def build_tiny_eagle3(out_dir: Path) -> Path:
    """Writes the tiny EAGLE-3 head (``--spec-method eagle3``) into ``out_dir``, created if
    missing, and returns it. Random weights from a fixed seed: deterministic."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t.write_model_dir(out_dir, eagle3_config_dict(), _eagle3_weights())
    log.info("built tiny EAGLE-3 head v%s in %s", TINY_EAGLE3_VERSION, out_dir)
    return out_dir


def ensure_tiny_eagle3(cache_root: Path) -> Path:
    """The tiny EAGLE-3 head under ``cache_root/tiny-eagle3-<version>``, built there if missing."""
    return ensure_built(Path(cache_root) / f"tiny-eagle3-{TINY_EAGLE3_VERSION}", build_tiny_eagle3)
