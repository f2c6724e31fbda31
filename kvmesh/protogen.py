"""Generates the gRPC stubs in ``kvmesh/v1`` from ``protos/``: ``python -m kvmesh.protogen``.

The stubs are committed; ``tests/unit/test_protos_fresh.py`` regenerates them into a temporary
directory and fails when the committed ones differ (someone edited a .proto and forgot this).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "kvmesh" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    generate(args.out)
    print(f"generated stubs for {len(proto_files())} protos under {args.out / 'kvmesh' / 'v1'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
