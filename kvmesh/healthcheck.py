"""The containers' health check: ``grpc.health.v1.Health/Check`` for service ``""`` at
``$KVMESH_HEALTH_ADDRESS`` (default ``127.0.0.1:50051``); exit 0 only on ``SERVING``, so a
draining process reports unhealthy. Router, worker and kvmanager all serve it.

    python3 -m kvmesh.healthcheck

One short command, the same in docker/Dockerfile's ``HEALTHCHECK`` and in the compose file's
``CMD-SHELL`` test: podman-compose 1.0.3 (Debian 12) re-quotes a multi-word ``CMD`` list into one
word, so the check never ran; a shell string survives every Compose implementation.
"""

from __future__ import annotations

import os
import sys

DEFAULT_ADDRESS = "127.0.0.1:50051"
TIMEOUT_S = 4.0  # under the check's own timeout (5 s in the image and compose)


def main() -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = os.environ.get("KVMESH_HEALTH_ADDRESS", DEFAULT_ADDRESS)
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S
            )
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else type(exc).__name__
            print(f"{address}: {code}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"{address}: {status}", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
