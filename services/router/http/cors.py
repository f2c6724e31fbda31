"""CORS for the OpenAI front door, as vLLM's ``--allowed-origins / --allowed-methods /
--allowed-headers / --allow-credentials`` (Starlette's ``CORSMiddleware``) answer it, without
the web framework: ``CorsPolicy`` says which headers a preflight or an actual request gets.

Default: no origin is allowed, so no response carries CORS headers (vLLM 0.32's default too);
``*`` allows every origin. A preflight (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) from an allowed origin asking an allowed method and headers
gets 200 with the allow headers; otherwise 400 without ``Access-Control-Allow-Origin``, so the
browser blocks the call.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from kvmesh import errors, settings
from kvmesh.settings import setting

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what "*" stands for
PREFLIGHT_MAX_AGE_S = 600  # how long a browser may cache a preflight answer (Starlette's)


def parse_list(flag: str, raw: str) -> tuple[str, ...]:
    """A flag's list: a JSON list of strings (vLLM's form, ``'["https://a.example"]'``) or
    comma-separated values (``settings.parse_list``). ``InvalidArgument`` naming ``flag``
    otherwise."""
    try:
        return settings.parse_list(raw)
    except argparse.ArgumentTypeError as exc:
        raise errors.InvalidArgument(f"{flag}: {exc}") from None


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = setting(
        (),
        "CORS origins allowed to call the HTTP API (scheme://host[:port]), a JSON list as vLLM "
        "takes it or comma-separated; '*': any; none: no CORS headers",
        parse=lambda text: parse_list("--allowed-origins", text),
    )
    allowed_methods: tuple[str, ...] = setting(
        ("*",),
        "CORS methods allowed, JSON list or comma-separated; '*': every method",
        parse=lambda text: parse_list("--allowed-methods", text),
    )
    allowed_headers: tuple[str, ...] = setting(
        ("*",),
        "CORS request headers allowed, JSON list or comma-separated; '*': what the preflight asks",
        parse=lambda text: parse_list("--allowed-headers", text),
    )
    allow_credentials: bool = setting(
        False, "CORS: allow credentials (cookies, Authorization) from the allowed origins"
    )

    def __post_init__(self) -> None:
        for origin in self.allowed_origins:
            if origin != "*" and ("://" not in origin or origin.endswith("/")):
                raise errors.InvalidArgument(
                    f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], no "
                    "path) nor '*'"
                )

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def _allow_origin(self, origin: str) -> dict[str, str]:
        # "*" goes back as "*" unless credentials are allowed (browsers refuse "*" then).
        if "*" in self.allowed_origins and not self.allow_credentials:
            out = {"Access-Control-Allow-Origin": "*"}
        else:
            out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    def simple(self, origin: str | None) -> dict[str, str]:
        """Headers for an actual (non-preflight) response to a request from ``origin``."""
        if origin is None or not self.enabled or not self.origin_allowed(origin):
            return {}
        return self._allow_origin(origin)

    def preflight(
        self, origin: str, method: str, request_headers: str
    ) -> tuple[int, dict[str, str]]:
        """Status and headers answering a preflight: ``method`` from
        Access-Control-Request-Method, ``request_headers`` from Access-Control-Request-Headers."""
        methods = ALL_METHODS if "*" in self.allowed_methods else self.allowed_methods
        asked = [h.strip().lower() for h in request_headers.split(",") if h.strip()]
        allowed = {h.lower() for h in self.allowed_headers}
        ok = (
            self.enabled
            and self.origin_allowed(origin)
            and method.upper() in {m.upper() for m in methods}
            and ("*" in allowed or all(h in allowed for h in asked))
        )
        if not ok:
            return 400, {"Vary": "Origin"}
        headers = self._allow_origin(origin)
        headers["Access-Control-Allow-Methods"] = ", ".join(methods)
        headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_S)
        if "*" in allowed:
            if request_headers.strip():
                headers["Access-Control-Allow-Headers"] = request_headers
        else:
            headers["Access-Control-Allow-Headers"] = ", ".join(self.allowed_headers)
        return 200, headers

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
        return (
            method == "OPTIONS"
            and "Origin" in headers
            and "Access-Control-Request-Method" in headers
        )
