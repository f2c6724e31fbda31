# Sourced by scripts/image.sh and scripts/compose-test.sh: podman settings this kind of machine
# needs. crun fails here on setrlimit(RLIMIT_NOFILE); runc works, but only with rlimits it may
# set: no higher than this shell's own open-files limit, and at most 32768 processes (podman's
# defaults, the hard maxima, are refused with "error setting rlimit ... operation not permitted").
# CONTAINERS_CONF set by the caller wins.
if [ -z "${CONTAINERS_CONF:-}" ]; then
  _kvmesh_nofile=$(ulimit -Hn); [ "$_kvmesh_nofile" = unlimited ] && _kvmesh_nofile=1048576
  _kvmesh_nproc=$(ulimit -Hu); { [ "$_kvmesh_nproc" = unlimited ] || [ "$_kvmesh_nproc" -gt 32768 ]; } && _kvmesh_nproc=32768
  CONTAINERS_CONF=${TMPDIR:-/tmp}/kvmesh-containers.conf
  cat >"$CONTAINERS_CONF" <<CONF
[containers]
default_ulimits = ["nofile=${_kvmesh_nofile}:${_kvmesh_nofile}", "nproc=${_kvmesh_nproc}:${_kvmesh_nproc}"]
[engine]
runtime = "${KVMESH_OCI_RUNTIME:-runc}"
CONF
  export CONTAINERS_CONF
  unset _kvmesh_nofile _kvmesh_nproc
fi
