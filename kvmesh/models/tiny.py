"""The tiny model: a random-weight Llama that vLLM serves in a second, built offline in seconds.

Everything comes from code and fixed seeds: the tokenizer is a byte-level BPE trained on text
generated here, the weights are drawn from a seeded generator. Building twice gives
byte-identical files (same torch, tokenizers and safetensors versions). The output is gibberish
by design; greedy output is deterministic, which is what tests compare.

Weights are float32 (see docs/models.md): the model is so small that speed does not matter, and
float32 avoids vLLM's CPU bf16 attention crash on short prefills over externally loaded KV and
keeps greedy argmax stable between recompute and a KV-cache hit.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvmesh.models import ensure_built

log = logging.getLogger(__name__)

TINY_VERSION = "2"
"""Bump when anything below changes what gets built; ``ensure_tiny`` caches by it."""

SEED = 20261130
VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 4096
"""Context length in tokens: enough for the ~4K-token prompts the KV tests use."""
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
INIT_STD = 0.02
DTYPE = "float32"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
"""Ids 0..4, in this order."""

CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{ text_of(messages[0]['content']) + '\\n\\n' }}"
    "{%- endif -%}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and '"
    " + 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' + \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\''
    " + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- if not (loop.first and tools and message['role'] == 'system') -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- set text = text_of(message['content']) -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<tool_response>\\n' + text + '\\n</tool_response>' }}"
    "{%- else -%}{{ text }}{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if text or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}"
    "{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; roles system, user,
assistant and tool; content as a string or OpenAI text parts) with tools the hermes / Qwen2.5
way: given ``tools``, a system block (the first system message's text, then the tools as JSON
lines inside ``<tools></tools>`` and how to call them) comes first; an assistant's tool calls
follow its content, one ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` a line;
a tool message's content is wrapped in ``<tool_response>\\n...\\n</tool_response>``."""

_WORDS = (  # noqa: SIM905 - one readable block of words, split once at import
    "the a an of to and in is it that for on with as by at from this be are was not or have "
    "model token cache block prefix worker router request prompt answer route mesh tier disk "
    "memory page hash key value store load save fetch evict hit miss warm cold fast slow small "
    "large first last next time data system user assistant tool message text reply question "
    "what when where which who how why can will would should could must may might do does did "
    "make take give find keep send read write open close start stop run wait ask tell show use "
    "river city house garden window morning evening winter summer paper letter story music "
    "green blue red bright quiet happy simple clear early late good new old long short"
).split()
_NAMES = ("x", "y", "n", "i", "key", "value", "items", "result", "count", "block", "path", "cfg")
_OPS = ("+", "-", "*", "//", "%", "==", "!=", "<", ">=")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    words[0] = words[0].capitalize()
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 4096)))
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!", ":", ";"))


def _code_line(rng: random.Random) -> str:
    a, b, c = (rng.choice(_NAMES) for _ in range(3))
    op = rng.choice(_OPS)
    indent = "    " * rng.randint(0, 2)
    forms = (
        f"def {a}_{b}({c}, {a}):",
        f"{a} = {b} {op} {rng.randint(0, 99)}",
        f"for {a} in range({b}):",
        f"if {a} {op} {b}:",
        f"return {a}[{b}] {op} {c}",
        f'{a}["{b}"] = {rng.choice(_WORDS)!r}',
        f"{{'{a}': {rng.randint(0, 9)}, '{b}': [{c}, {rng.random():.3f}]}}",
        f"# {_sentence(rng)}",
    )
    return indent + rng.choice(forms)


def training_text(lines: int = 4000, seed: int = SEED) -> Iterator[str]:
    """Deterministic synthetic English- and code-like lines the tokenizer is trained on."""
    rng = random.Random(seed)
    for _ in range(lines):
        r = rng.random()
        if r < 0.55:
            yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        elif r < 0.9:
            yield _code_line(rng)
        else:
            role = rng.choice(("system", "user", "assistant", "tool"))
            yield f"{role}\n{_sentence(rng)}"


def _build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    return tokenizer


def config_dict() -> dict[str, Any]:
    """The model's ``config.json``: a plain Llama, written by hand so that it does not depend on
    the transformers version that builds it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "dtype": DTYPE,
        "torch_dtype": DTYPE,
        "use_cache": True,
    }


SHARED_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "use_cache",
)
"""The fields of the tiny Llama's config that its relatives of other architectures (tiny-mtp,
tiny-moe) keep: the same sizes, tokens and dtype."""


def shared_config() -> dict[str, Any]:
    """The tiny Llama's ``config.json`` fields of ``SHARED_CONFIG_KEYS``."""
    llama = config_dict()
    return {k: llama[k] for k in SHARED_CONFIG_KEYS}


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)],
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }


DRAFT_LAYERS = 1
"""The tiny draft model keeps the first ``DRAFT_LAYERS`` layers of the tiny model."""


def _weights() -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * INIT_STD

    q_dim, kv_dim = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(q_dim, HIDDEN_SIZE),
            p + "self_attn.k_proj.weight": normal(kv_dim, HIDDEN_SIZE),
            p + "self_attn.v_proj.weight": normal(kv_dim, HIDDEN_SIZE),
            p + "self_attn.o_proj.weight": normal(HIDDEN_SIZE, q_dim),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.down_proj.weight": normal(HIDDEN_SIZE, INTERMEDIATE_SIZE),
            p + "input_layernorm.weight": torch.ones(HIDDEN_SIZE),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN_SIZE),
        }
    tensors["model.norm.weight"] = torch.ones(HIDDEN_SIZE)
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE)
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build_tiny(out_dir: Path) -> Path:
    """Writes the tiny model (config, generation config, safetensors weights, fast tokenizer with
    a chat template) into ``out_dir``, created if missing, and returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tokenizer.get_vocab_size()} tokens, want {VOCAB_SIZE}"
        )
    write_model_dir(out_dir, config_dict(), _weights(), tokenizer)
    log.info("built tiny model v%s in %s", TINY_VERSION, out_dir)
    return out_dir


def write_model_dir(
    out_dir: Path,
    config: dict[str, Any],
    tensors: dict[str, Any],
    tokenizer: Any = None,
) -> None:
    """Writes a model directory that uses the tiny model's tokenizer (``tokenizer``: already
    built, else built here): tokenizer, its config, ``config``, the generation config and
    ``tensors`` as safetensors. The one writer of the tiny models and their draft heads."""
    from safetensors.torch import save_file

    (tokenizer or _build_tokenizer()).save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config())
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def build_tiny_draft(out_dir: Path) -> Path:
    """Writes the tiny draft model into ``out_dir``: the tiny model cut to its first
    ``DRAFT_LAYERS`` layers (same tokenizer, embeddings, final norm and LM head), a draft model
    for speculative decoding (``--spec-method draft_model``). Sharing the target's weights, it
    often predicts the target's next token, so drafts get accepted; deterministic as the tiny
    model is."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = tuple(f"model.layers.{i}." for i in range(DRAFT_LAYERS))
    tensors = {
        k: v
        for k, v in _weights().items()
        if not k.startswith("model.layers.") or k.startswith(kept)
    }
    write_model_dir(out_dir, config_dict() | {"num_hidden_layers": DRAFT_LAYERS}, tensors)
    log.info("built tiny draft model v%s in %s", TINY_VERSION, out_dir)
    return out_dir


def ensure_tiny_draft(cache_root: Path) -> Path:
    """The tiny draft model under ``cache_root/tiny-draft-<version>``, built there if missing."""
    return ensure_built(Path(cache_root) / f"tiny-draft-{TINY_VERSION}", build_tiny_draft)


def ensure_tiny(cache_root: Path) -> Path:
    """The tiny model under ``cache_root/tiny-<version>``, built there first if missing.

    The build goes to a temporary sibling that is renamed into place, so a concurrent or aborted
    build never leaves a half model behind."""
    return ensure_built(Path(cache_root) / f"tiny-{TINY_VERSION}", build_tiny)
