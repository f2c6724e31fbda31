#!/usr/bin/env bash
# Runs docker/docker-compose.yml for real with podman-compose and checks it end to end (make
# compose-test; minutes on 2 cores with the tiny model, not part of .ci/run):
#
#   1. scripts/image.sh builds kvmesh:cpu (and kvmesh-etcd:local where quay.io is unreachable);
#   2. the services start in dependency order, each waited for: etcd healthy, the model job
#      exited 0, the kvmanager healthy, then the router and both workers healthy;
#   3. through the router's published ports: a streamed gRPC Generate and an OpenAI chat
#      completion (openai SDK), each repeated: the repeat must report cached prompt tokens; a
#      long prompt (> 1024 tokens) that the router prefills on prefill-0 and decode-0 then loads
#      from the kvmanager; at least one worker's shared memory attached to the kvmanager;
#   4. `podman-compose restart kvmanager`: its disk tier must list the same blocks after the
#      restart (a new process: another epoch); then both workers restart too (their own KV cache
#      empty) and the same prompts must still come back cached, the first one's KV read from the
#      kvmanager's disk tier (Usage.cached_disk_tokens);
#   5. everything is torn down, volumes included, also on failure or Ctrl-C.
#
# Health: podman runs compose health checks from systemd timers, and where there is no systemd
# (containers, CI) nothing runs them; `podman healthcheck run` runs the image's check on demand,
# which is how this script waits. podman-compose 1.0.3 (Debian 12) ignores depends_on conditions,
# hence the explicit order.
#
# Environment: PYTHON (a Python with kvmesh's dependencies and openai; default .venv/bin/python),
# KVMESH_MODEL (default tiny), KVMESH_SKIP_IMAGE=1 (use the images already built),
# KVMESH_KEEP=1 (leave the stack running on exit, for a look), KVMESH_COMPOSE_PROJECT.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/podman-env.sh
. scripts/podman-env.sh

PROJECT=${KVMESH_COMPOSE_PROJECT:-kvmeshtest}
export KVMESH_MODEL=${KVMESH_MODEL:-tiny}
export KVMESH_KV_CPU_BYTES=${KVMESH_KV_CPU_BYTES:-512MiB}  # the kvmanager's RAM tier
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this tree's kvmesh for the host-side checks
# compose.podman.yml: one shared tmpfs /dev/shm for the kvmanager and its workers (podman-compose
# ignores `ipc:`); KVMESH_NO_SHM_OVERRIDE=1 runs the main file alone (KV bytes then go inline).
COMPOSE=(podman-compose -p "$PROJECT" -f docker/docker-compose.yml)
[ "${KVMESH_NO_SHM_OVERRIDE:-0}" = 1 ] || COMPOSE+=(-f docker/compose.podman.yml)
T0=$(date +%s)
say() { echo "[compose-test +$(($(date +%s) - T0))s] $*"; }
compose() { "${COMPOSE[@]}" "$@" >>"$LOG" 2>&1; }
LOG=${TMPDIR:-/tmp}/kvmesh-compose-test.$$.log
: >"$LOG"

# Free host ports for the router's gRPC and HTTP APIs (the defaults may be taken on a shared host).
read -r KVMESH_ROUTER_GRPC_PORT KVMESH_ROUTER_HTTP_PORT < <("$PY" -c '
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in ss))')
export KVMESH_ROUTER_GRPC_PORT KVMESH_ROUTER_HTTP_PORT
ROUTER=127.0.0.1:$KVMESH_ROUTER_GRPC_PORT
HTTP=127.0.0.1:$KVMESH_ROUTER_HTTP_PORT

container() {  # the container of a compose service
  podman ps -a --filter "label=io.podman.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1
}

teardown() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$rc" -ne 0 ]; then
    say "FAILED (exit $rc); the last lines of each service's log:"
    for s in etcd model kvmanager router prefill-0 decode-0; do
      c=$(container "$s") || true
      [ -n "$c" ] || continue
      echo "---- $s ($c: $(podman inspect -f '{{.State.Status}} exit={{.State.ExitCode}}' "$c" 2>/dev/null))"
      podman logs --tail 25 "$c" 2>&1 | cut -c1-300 || true
    done
    echo "---- podman-compose output: $LOG"
    tail -20 "$LOG"
  fi
  if [ "${KVMESH_KEEP:-0}" = 1 ]; then
    say "KVMESH_KEEP=1: left running (tear down: ${COMPOSE[*]} down -v)"
  else
    say "tearing down"
    "${COMPOSE[@]}" down -v >>"$LOG" 2>&1 || true
    # podman-compose 1.0.3's down -v leaves the named volumes; they are this project's only.
    podman volume ls -q --filter "label=io.podman.compose.project=$PROJECT" |
      xargs -r podman volume rm -f >>"$LOG" 2>&1 || true
    podman network rm -f "${PROJECT}_default" >>"$LOG" 2>&1 || true
    [ "$rc" -ne 0 ] || rm -f "$LOG"
  fi
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

wait_healthy() {  # SERVICE TIMEOUT_S: until the image's health check passes
  local c deadline=$(($(date +%s) + $2)) start=$(date +%s)
  c=$(container "$1")
  [ -n "$c" ] || { say "$1: no container"; return 1; }
  until podman healthcheck run "$c" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      say "$1: not healthy after $2 s"; return 1
    fi
    sleep 2
  done
  say "$1 healthy ($(($(date +%s) - start)) s)"
}

wait_exited_ok() {  # SERVICE TIMEOUT_S: a one-shot job that must exit 0
  local c code start=$(date +%s)
  c=$(container "$1")
  code=$(timeout "$2" podman wait "$c") || { say "$1: still running after $2 s"; return 1; }
  [ "$code" = 0 ] || { say "$1 exited $code"; return 1; }
  say "$1 done ($(($(date +%s) - start)) s)"
}

kv_info() {  # GetInfo from inside the kvmanager's container (its port is not published)
  podman exec -i "$(container kvmanager)" python3 - kv-info 127.0.0.1:50071 <scripts/compose_check.py
}

disk_blocks() { "$PY" -c 'import json, sys; print(json.loads(sys.argv[1])["tiers"].get("KV_TIER_DISK", {}).get("blocks", 0))' "$1"; }
epoch() { "$PY" -c 'import json, sys; print(json.loads(sys.argv[1])["epoch"])' "$1"; }

if [ "${KVMESH_SKIP_IMAGE:-0}" != 1 ]; then
  say "building the images (scripts/image.sh)"
  scripts/image.sh
fi
if ! podman image exists quay.io/coreos/etcd:v3.5.17 && podman image exists kvmesh-etcd:local; then
  export KVMESH_ETCD_IMAGE=${KVMESH_ETCD_IMAGE:-kvmesh-etcd:local}
fi
say "project $PROJECT, model $KVMESH_MODEL, etcd ${KVMESH_ETCD_IMAGE:-quay.io/coreos/etcd:v3.5.17}, router $ROUTER (gRPC) $HTTP (HTTP); podman-compose log $LOG"

up() { compose up -d --no-build --no-deps "$@"; }
if [ "${KVMESH_NO_SHM_OVERRIDE:-0}" != 1 ]; then  # podman-compose 1.0.3 ignores driver_opts
  podman volume create --label "io.podman.compose.project=$PROJECT" --opt type=tmpfs \
    --opt device=tmpfs --opt o=uid=10001,gid=10001,mode=0700 "${PROJECT}_kv-shm" >>"$LOG"
fi
up etcd && wait_healthy etcd 60
up model && wait_exited_ok model 300
up kvmanager && wait_healthy kvmanager 120
up router prefill-0 decode-0
for s in router prefill-0 decode-0; do wait_healthy "$s" 600; done

say "round 1: streamed gRPC and OpenAI requests, each repeated; a long prompt split prefill/decode"
"$PY" scripts/compose_check.py requests --router "$ROUTER" --http "$HTTP" --model "$KVMESH_MODEL" --tag 1 --pd-tokens 1100
before=$(kv_info)
say "kvmanager before restart: $before"
[ "$(disk_blocks "$before")" -gt 0 ] || { say "the disk tier holds no blocks"; exit 1; }
shm_attached() { podman logs "$(container kvmanager)" 2>&1 | grep -c "attached shared memory" || true; }
say "shared-memory segments the kvmanager attached: $(shm_attached)"
if [ "${KVMESH_NO_SHM_OVERRIDE:-0}" != 1 ] && [ "$(shm_attached)" -lt 1 ]; then
  say "no worker attached shared memory: KV bytes went inline"; exit 1
fi

say "podman-compose restart kvmanager"
start=$(date +%s)
compose restart kvmanager
wait_healthy kvmanager 120
after=$(kv_info)
say "kvmanager after restart ($(($(date +%s) - start)) s): $after"
[ "$(epoch "$after")" != "$(epoch "$before")" ] || { say "same epoch: the kvmanager did not restart"; exit 1; }
[ "$(disk_blocks "$after")" -ge "$(disk_blocks "$before")" ] || {
  say "the disk tier lost blocks over the restart"; exit 1; }

say "restarting both workers (their own KV caches empty): round 1's prompts must come from the kvmanager's disk tier"
compose restart prefill-0 decode-0
for s in prefill-0 decode-0 router; do wait_healthy "$s" 600; done
"$PY" scripts/compose_check.py requests --router "$ROUTER" --http "$HTTP" --model "$KVMESH_MODEL" --tag 1 --min-cached-first 32 --min-disk-first 32
say "kvmanager at the end: $(kv_info); segments attached since its restart: $(shm_attached)"
say "PASSED in $(($(date +%s) - T0)) s"
