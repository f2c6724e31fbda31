"""Greedy completions straight from a vLLM engine, no kvmesh in between: the reference the e2e
tests compare the mesh's output with. Run as a separate process (vLLM wants its environment set
before import):

    python tests/e2e/reference_engine.py MODEL_DIR MAX_MODEL_LEN MAX_TOKENS < prompts.json
prints a JSON list of generated token-id lists, one per prompt (a list of token-id lists).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, max_model_len, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prompts = json.load(sys.stdin)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=model,
        max_model_len=max_model_len,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    print("REFERENCE " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)


if __name__ == "__main__":
    main()
