"""The OpenAI-compatible HTTP front door of the router (docs/openai.md).

``translate`` (OpenAI JSON <-> kvmesh.v1 messages) and ``errors`` (domain errors -> HTTP) are
pure; ``backend`` reaches the router (gRPC today), ``server`` is the aiohttp edge."""

from .backend import GrpcRouterBackend, RouterBackend
from .server import OpenAIServer

__all__ = ["GrpcRouterBackend", "OpenAIServer", "RouterBackend"]
