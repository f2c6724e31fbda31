"""The router's server-side state for the OpenAI Responses API: stored responses (what
``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns), behind one small
interface (``records.ResponseStore``) with two implementations: embedded SQLite (one host; the
router processes of ``--processes`` share its file) and Redis (routers on several hosts)."""

from .records import ResponsesConfig, ResponseStore, StoredResponse, StoreKind, open_store

__all__ = ["ResponseStore", "ResponsesConfig", "StoreKind", "StoredResponse", "open_store"]
