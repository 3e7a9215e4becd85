"""The cluster's own OpenAI-compatible API, as an agent worker calls it for a job.

An agent worker runs no model.  A ``chat`` or ``embed-batch`` job asks the cluster, through
the same ``/v1`` a user would call (``--api-url``, by default the ``--register-to`` URL, with
``--api-token``), so the request takes the cluster's inference path: placement, cold load,
the tunnel to a backend worker.  That is what LocalAI's agent workers do (``LOCALAI_API_URL``,
``LOCALAI_API_TOKEN``).

What this module must never do: read an unbounded reply, log the token, or turn an answer of
the API into anything but :class:`~.kinds.JobFailed` with the API's own message.
"""

from __future__ import annotations

import json
from typing import Any

from treq.client import HTTPClient
from twisted.internet import defer
from twisted.web.client import Agent, HTTPConnectionPool

from localai_tw.web.readers import ResponseTooLarge, read_bounded

from .kinds import JobFailed

#: Largest reply read from the API (an embedding batch of 256 x 4096 floats fits).
MAX_API_REPLY_BYTES = 32 * 1024 * 1024
#: Seconds one API call may take (a cold load of a model included).
API_TIMEOUT_SECONDS = 600.0


class ClusterAPI:
    """``post_json(path, body)`` against ``base_url`` (``http(s)://host:port``)."""

    def __init__(self, base_url: str, token: str = "", reactor=None,
                 timeout: float = API_TIMEOUT_SECONDS):
        if reactor is None:
            from twisted.internet import reactor as _reactor
            reactor = _reactor
        self.base_url = base_url.rstrip("/")
        for prefix in ("ws://", "wss://"):  # --register-to may name the tunnel's scheme
            if self.base_url.startswith(prefix):
                self.base_url = "http" + self.base_url[2:]
        self._token = token
        self._reactor = reactor
        self._timeout = timeout
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.retryAutomatically = False
        self._http = HTTPClient(Agent(reactor, pool=self._pool))

    def __repr__(self) -> str:  # never the token
        return f"ClusterAPI({self.base_url!r})"

    async def post_json(self, path: str, body: dict) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        posting = self._http.post(self.base_url + path, data=json.dumps(body).encode("utf-8"),
                                  headers=headers)
        posting.addTimeout(self._timeout, self._reactor)
        try:
            response = await posting
            raw = await read_bounded(response, MAX_API_REPLY_BYTES)
        except ResponseTooLarge:
            raise JobFailed(f"the cluster API answered {path} with more than "
                            f"{MAX_API_REPLY_BYTES} bytes") from None
        except defer.TimeoutError:
            raise JobFailed(f"the cluster API did not answer {path} within "
                            f"{self._timeout:g}s") from None
        except defer.CancelledError:
            raise
        except Exception as e:
            raise JobFailed(f"the cluster API at {self.base_url} could not be reached for "
                            f"{path}: {e.__class__.__name__}") from None
        try:
            decoded = json.loads(raw)
        except ValueError:
            decoded = None
        if response.code != 200:
            message = ""
            if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
                message = str(decoded["error"].get("message", ""))[:1024]
            raise JobFailed(f"the cluster API answered {path} with {response.code}"
                            + (f": {message}" if message else ""))
        if not isinstance(decoded, dict):
            raise JobFailed(f"the cluster API answered {path} with a body that is not a JSON "
                            "object")
        return decoded

    def close(self) -> defer.Deferred:
        return self._pool.closeCachedConnections()

