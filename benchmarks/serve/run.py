"""Runs the loads of ``kvmesh bench serve`` against one started target, counting CPU time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.launcher import child_env

from .targets import REPO, Running, cpu_seconds


@dataclass(frozen=True, slots=True)
class Load:
    """One ``vllm bench serve`` run: a dataset at a concurrency and a request rate."""

    dataset: str  # random or prefix_repetition
    frontend: str  # http (vllm bench serve itself) or grpc (grpc_load, same requests)
    concurrency: int = 8
    request_rate: float = math.inf
    num_prompts: int = 48
    input_len: int = 512  # random
    output_len: int = 128
    prefix_len: int = 256  # prefix_repetition
    suffix_len: int = 256
    num_prefixes: int = 10

    def flags(self, model: str, tokenizer: Path) -> list[str]:
        common = [
            "--model", model,
            "--served-model-name", model,
            "--tokenizer", str(tokenizer),
            "--dataset-name", self.dataset,
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency),
            "--request-rate", "inf" if math.isinf(self.request_rate) else str(self.request_rate),
            "--ignore-eos",
            "--seed", str(self.seed),
        ]  # fmt: skip
        if self.dataset == "random":
            return [
                *common,
                "--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len),
            ]  # fmt: skip
        return [
            *common,
            "--prefix-repetition-prefix-len", str(self.prefix_len),
            "--prefix-repetition-suffix-len", str(self.suffix_len),
            "--prefix-repetition-num-prefixes", str(self.num_prefixes),
            "--prefix-repetition-output-len", str(self.output_len),
        ]  # fmt: skip

    @property
    def seed(self) -> int:
        """The dataset seed: one per frontend, so that the gRPC run after the HTTP run on the
        same target gets prompts of the same mix that are not in the engine's prefix cache
        already (the same seed would make every one of them a full cache hit)."""
        return {"http": 0, "grpc": 1}.get(self.frontend, 2)

    @property
    def name(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"{self.dataset} c={self.concurrency} rate={rate}"


def run_load(target: Running, load: Load, tokenizer: Path, out_dir: Path) -> dict[str, Any]:
    """One load against ``target``; the result JSON plus CPU seconds per role (router, worker,
    engine, kvmanager; vllm: all of vllm serve's processes) spent during the run."""
    name = (
        f"{target.spec.label}-{load.frontend}-{load.dataset}-{load.request_rate:g}-{time.time_ns()}"
    )
    result_file = out_dir / f"{name}.json"
    flags = [
        *load.flags(target.served_model, tokenizer),
        "--result-dir", str(out_dir),
        "--result-filename", result_file.name,
    ]  # fmt: skip
    if load.frontend == "http":
        cmd = [
            sys.executable, "-m", "benchmarks.serve.vllm_entry", "bench", "serve",
            "--backend", "openai",
            "--base-url", target.http_base_url,
            "--endpoint", "/v1/completions",
            "--save-result",
            "--save-detailed",  # per-request TTFTs, to read a saturated run's waves
            "--disable-tqdm",
            *flags,
        ]  # fmt: skip
    elif load.frontend == "grpc":
        if not target.grpc_address:
            raise ValueError(f"{target.spec.label} has no gRPC API")
        cmd = [
            sys.executable, "-m", "benchmarks.serve.grpc_load",
            "--router", target.grpc_address,
            *flags,
        ]  # fmt: skip
    else:
        raise ValueError(f"unknown frontend {load.frontend!r}")
    before = {role: cpu_seconds(pids) for role, pids in target.roles.items()}
    log = out_dir / f"{name}.log"
    with open(log, "wb") as logf:
        proc = subprocess.run(
            cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **child_env()}
        )
    cpu = {role: cpu_seconds(pids) - before[role] for role, pids in target.roles.items()}
    if proc.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"load {load.name} on {target.spec.label} failed; see {log}")
    result: dict[str, Any] = json.loads(result_file.read_text())
    result["cpu_s"] = cpu
    return result
