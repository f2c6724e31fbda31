"""kvmesh: a KV-cache-centric LLM serving mesh.

This package holds what every service shares: the generated gRPC stubs (``kvmesh.v1``), etcd
discovery, errors, telemetry, the built-in models and the ``kvmesh`` command line. The services
themselves live in ``services/``.
"""

__version__ = "0.1.0"
