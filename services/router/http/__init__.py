"""The OpenAI-compatible HTTP front door of the router (docs/openai.md).

``parsing`` (OpenAI request JSON -> kvmesh.v1 requests, with ``params`` for the shared fields and
``extensions`` for the kvmesh headers), ``rendering`` (kvmesh.v1 answers -> OpenAI JSON and SSE
chunks) and ``errors`` (domain errors -> HTTP) are pure; ``backend`` reaches the router (gRPC or
in-process), ``server`` is the aiohttp edge."""

from .backend import GrpcRouterBackend, RouterBackend
from .server import OpenAIServer

__all__ = ["GrpcRouterBackend", "OpenAIServer", "RouterBackend"]
