"""The tiny MTP model: the tiny model's sizes and tokenizer as a MiMo-style model with one
multi-token-prediction layer, for ``--spec-method mtp`` on vLLM (its ``MiMoMTPModel``).

vLLM serves the main model as ``MiMoForCausalLM`` (a Qwen2: q/k/v projections with biases) and,
with ``method: mtp``, the checkpoint's ``model.mtp_layers.0.*`` as the drafter: the token's
embedding and the main model's last hidden state, each RMS-normed, concatenated, projected back
to the hidden size (``input_proj``), one decoder layer, a final norm, the shared LM head. The
config says ``model_type: qwen2`` (transformers knows it; MiMo's own type needs remote code) and
``num_nextn_predict_layers: 1``, which is what vLLM keys on. Random weights from a fixed seed,
as in ``tiny.py``: deterministic, built in seconds; the MTP layer's guesses are random too, so its
drafts are almost never accepted, which is what the tests expect: greedy output the same with
and without mtp, the draft counters moving.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvmesh.models import ensure_built
from kvmesh.models import tiny as t

log = logging.getLogger(__name__)

TINY_MTP_VERSION = "1"
"""Bump when anything below changes what gets built; ``ensure_tiny_mtp`` caches by it."""

SEED = t.SEED + 16
MTP_LAYERS = 1


def config_dict() -> dict[str, Any]:
    """``config.json``: a Qwen2 of the tiny model's sizes, architecture MiMoForCausalLM."""
    return t.shared_config() | {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "num_nextn_predict_layers": MTP_LAYERS,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": t.NUM_LAYERS,
        "attention_dropout": 0.0,
    }


def _weights() -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    h, inter = t.HIDDEN_SIZE, t.INTERMEDIATE_SIZE
    q_dim, kv_dim = t.NUM_HEADS * t.HEAD_DIM, t.NUM_KV_HEADS * t.HEAD_DIM

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * t.INIT_STD

    def decoder_layer(p: str) -> dict[str, torch.Tensor]:
        return {
            p + "self_attn.q_proj.weight": normal(q_dim, h),
            p + "self_attn.q_proj.bias": normal(q_dim),
            p + "self_attn.k_proj.weight": normal(kv_dim, h),
            p + "self_attn.k_proj.bias": normal(kv_dim),
            p + "self_attn.v_proj.weight": normal(kv_dim, h),
            p + "self_attn.v_proj.bias": normal(kv_dim),
            p + "self_attn.o_proj.weight": normal(h, q_dim),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }

    tensors = {"model.embed_tokens.weight": normal(t.VOCAB_SIZE, h)}
    for i in range(t.NUM_LAYERS):
        tensors |= decoder_layer(f"model.layers.{i}.")
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(t.VOCAB_SIZE, h)
    for i in range(MTP_LAYERS):
        p = f"model.mtp_layers.{i}."
        tensors |= decoder_layer(p) | {
            p + "token_layernorm.weight": torch.ones(h),
            p + "hidden_layernorm.weight": torch.ones(h),
            p + "input_proj.weight": normal(h, 2 * h),
            p + "final_layernorm.weight": torch.ones(h),
        }
    return tensors


def build_tiny_mtp(out_dir: Path) -> Path:
    """Writes the tiny MTP model (config, generation config, safetensors weights with the MTP
    layer, the tiny model's tokenizer) into ``out_dir``, created if missing, and returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t.write_model_dir(out_dir, config_dict(), _weights())
    log.info("built tiny MTP model v%s in %s", TINY_MTP_VERSION, out_dir)
    return out_dir


def ensure_tiny_mtp(cache_root: Path) -> Path:
    """The tiny MTP model under ``cache_root/tiny-mtp-<version>``, built there if missing."""
    return ensure_built(Path(cache_root) / f"tiny-mtp-{TINY_MTP_VERSION}", build_tiny_mtp)
