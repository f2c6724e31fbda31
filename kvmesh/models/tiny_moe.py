"""The tiny MoE model: the tiny model's sizes and tokenizer as a Qwen3-MoE (``Qwen3MoeForCausalLM``),
for data-parallel and expert-parallel tests on vLLM (``--data-parallel-size``,
``--enable-expert-parallel``).

Every layer is sparse (``decoder_sparse_step: 1``, no ``mlp_only_layers``): a router
(``mlp.gate``) over ``NUM_EXPERTS`` experts, ``EXPERTS_PER_TOKEN`` of them per token, each a small
SwiGLU MLP (``moe_intermediate_size``). Attention is Qwen3's: no biases, RMS norms on q and k per
head (``q_norm``, ``k_norm``). Random weights from a fixed seed, as in ``tiny.py``: deterministic,
built in seconds; the output is gibberish, greedy output deterministic.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvmesh.models import ensure_built
from kvmesh.models import tiny as t

log = logging.getLogger(__name__)

TINY_MOE_VERSION = "1"
"""Bump when anything below changes what gets built; ``ensure_tiny_moe`` caches by it."""

SEED = t.SEED + 32
NUM_EXPERTS = 4
"""A multiple of 2, so that expert parallelism over 2 data-parallel ranks gives each rank 2."""
EXPERTS_PER_TOKEN = 2
MOE_INTERMEDIATE_SIZE = 64


def config_dict() -> dict[str, Any]:
    """``config.json``: a Qwen3-MoE of the tiny model's sizes, every layer sparse."""
    return t.shared_config() | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "moe_intermediate_size": MOE_INTERMEDIATE_SIZE,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": t.NUM_LAYERS,
    }


def _weights() -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    h, inter = t.HIDDEN_SIZE, MOE_INTERMEDIATE_SIZE
    q_dim, kv_dim = t.NUM_HEADS * t.HEAD_DIM, t.NUM_KV_HEADS * t.HEAD_DIM

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * t.INIT_STD

    tensors = {"model.embed_tokens.weight": normal(t.VOCAB_SIZE, h)}
    for i in range(t.NUM_LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(q_dim, h),
            p + "self_attn.k_proj.weight": normal(kv_dim, h),
            p + "self_attn.v_proj.weight": normal(kv_dim, h),
            p + "self_attn.o_proj.weight": normal(h, q_dim),
            p + "self_attn.q_norm.weight": torch.ones(t.HEAD_DIM),
            p + "self_attn.k_norm.weight": torch.ones(t.HEAD_DIM),
            p + "mlp.gate.weight": normal(NUM_EXPERTS, h),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
        for e in range(NUM_EXPERTS):
            q = f"{p}mlp.experts.{e}."
            tensors |= {
                q + "gate_proj.weight": normal(inter, h),
                q + "up_proj.weight": normal(inter, h),
                q + "down_proj.weight": normal(h, inter),
            }
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(t.VOCAB_SIZE, h)
    return tensors


def build_tiny_moe(out_dir: Path) -> Path:
    """Writes the tiny MoE model (config, generation config, safetensors weights, the tiny
    model's tokenizer) into ``out_dir``, created if missing, and returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t.write_model_dir(out_dir, config_dict(), _weights())
    log.info("built tiny MoE model v%s in %s", TINY_MOE_VERSION, out_dir)
    return out_dir


def ensure_tiny_moe(cache_root: Path) -> Path:
    """The tiny MoE model under ``cache_root/tiny-moe-<version>``, built there if missing."""
    return ensure_built(Path(cache_root) / f"tiny-moe-{TINY_MOE_VERSION}", build_tiny_moe)
