"""The JSON error answer every HTTP surface of this project gives: ``{"error": {"message",
"type", "code"?, "field"?}}`` with a message naming the cause (:class:`APIError`), and the
refusals the listener and every API share."""

from __future__ import annotations

import re
from typing import Any, Mapping

#: An absolute POSIX path of two or more components, not part of a URL (``host/a/b``,
#: ``file:///a/b``): group 1 is its last component.
_HOST_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s'\"/:,;()<>]+/)+([^\s'\"/:,;()<>]+)")


def hide_host_paths(text: str) -> str:
    """``text`` with each absolute path of the machine that wrote it cut to its last component
    (``/srv/llm/models/x.gguf`` -> ``x.gguf``, a worker's interpreter ``/opt/venv/bin/python3``
    -> ``python3``): an API client knows models by their names in the models directory, and
    the layout of a frontend's or a worker's disk is none of its business (the log keeps the
    whole text)."""
    return _HOST_PATH.sub(r"\1", text)


class APIError(Exception):
    """A refusal to answer with ``status`` and a JSON error body.

    :param type_: a stable machine-readable kind (``invalid_request``, ``unauthorized``, ...).
    :param field: the request field at fault, when there is one.
    :param code: an optional finer machine-readable code.
    """

    def __init__(self, status: int, message: str, type_: str, *, field: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.field = field
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.type, field=self.field, code=self.code)


def error_body(message: str, type_: str, *, field: str | None = None,
               code: str | None = None) -> dict:
    error: dict[str, Any] = {"message": message, "type": type_}
    if code is not None:
        error["code"] = code
    if field is not None:
        error["field"] = field
    return {"error": error}


def bad_request(message: str, field: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request", field=field)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "unauthorized", headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str) -> APIError:
    return APIError(404, message, "not_found")


def conflict(message: str, code: str | None = None) -> APIError:
    return APIError(409, message, "conflict", code=code)


def not_ready(message: str) -> APIError:
    return APIError(503, message, "not_ready", headers={"Retry-After": "5"})


#: This replica's own database is away (or its pool closed while stopping).  Not one of the four


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than the limit of {limit} bytes",
                    "request_too_large")



def bodies_busy(source_share: int | None = None) -> APIError:
    """503 for a body over the listener's budget, or (``source_share``: bytes) over the share
    of it one client address may hold."""
    if source_share is not None:
        return APIError(503, f"this address already sends {source_share} bytes of request "
                        "bodies to this replica (its share of the bodies in flight); finish "
                        "or close those requests, then retry", "service_unavailable",
                        code="too_many_bodies_from_source", headers={"Retry-After": "5"})
    return APIError(503, "this replica is receiving too many request bodies at once; try again "
                    "in a few seconds", "service_unavailable", code="too_many_bodies_in_flight",
                    headers={"Retry-After": "5"})


def too_many_connections(limit: int) -> APIError:
    """The answer to a request other than a probe on a connection beyond the cap."""
    return APIError(503, f"this replica already holds its cap of {limit} connections that are "
                    "not authorized tunnels; only /healthz and /readyz are served beyond it; "
                    "try again in a few seconds", "service_unavailable",
                    code="too_many_connections", headers={"Retry-After": "2"})


def too_many_connections_from_source(limit: int) -> APIError:
    """The answer to a connection whose source holds its share of the connection cap, every
    one of them in the middle of a request."""
    return APIError(503, f"this address already holds {limit} connections to this replica "
                    "(its share of the connection cap), each in the middle of a request; "
                    "finish or close some, then retry", "service_unavailable",
                    code="too_many_connections_from_source", headers={"Retry-After": "2"})


def request_timeout(what: str, seconds: float) -> APIError:
    return APIError(408, f"the request {what} did not arrive within {seconds:g} seconds",
                    "request_timeout", code="request_timeout")
