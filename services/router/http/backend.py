"""How the HTTP front door reaches the router: a small protocol, and its gRPC implementation on
a channel it owns. An in-process implementation (calling the servicer directly) can replace it
without touching the HTTP side. Implementations raise domain errors (``kvmesh.errors``), never
transport errors."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

import grpc

from kvmesh import errors
from kvmesh.grpc_errors import await_status, from_rpc_error
from kvmesh.v1 import router_pb2, router_pb2_grpc


class RouterBackend(Protocol):
    def generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """An async generator over the router's stream. Closing it before the finished message
        (``aclose``, or the consuming task being cancelled) cancels the request, so the worker
        aborts it. The finished message comes once the call has ended (OK): a consumer that
        stops there, or goes away after it, cancels nothing."""
        ...

    async def list_models(self, timeout_s: float) -> router_pb2.ListModelsResponse: ...

    async def close(self) -> None: ...


def error_from_rpc(exc: grpc.aio.AioRpcError) -> errors.KvmeshError:
    mapped = from_rpc_error(exc)
    if mapped is not None:
        return mapped
    if exc.code() is grpc.StatusCode.CANCELLED:  # the router went away mid-call
        return errors.Unavailable(f"the router cancelled the call: {exc.details()}")
    return errors.KvmeshError(f"router error {exc.code().name}: {exc.details()}")


class GrpcRouterBackend:
    """kvmesh.v1.Router over a gRPC channel to ``address`` (host:port). Create it on the loop
    that will use it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for msg in call:
                if msg.HasField("finished"):  # its status first: nothing is left to cancel
                    await await_status(call)
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()  # no-op once finished; aborts the request otherwise

    async def list_models(self, timeout_s: float) -> router_pb2.ListModelsResponse:
        try:
            return await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def close(self) -> None:
        await self._channel.close()
