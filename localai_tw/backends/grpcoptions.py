"""The gRPC options of every channel to a backend and of every backend's server, in one place.

Clients: the worker's supervisor (loopback, to the processes it starts) and the frontend (to a
local bridge spliced onto a tunnel stream).  Both must agree on the message cap with the
backends' servers, never go through an HTTP proxy named in the environment, and reconnect
soon: a backend still importing torch, or a worker that reconnected, is used again within a
second instead of after gRPC's 1-120 s backoff.  That backoff also paces grpcio's own redials of
a channel whose connect failed, which go on with no call at all: the frontend closes such a
channel while no call of it is in flight (``frontend/inference/backend_client.py``), so a dead
worker is not redialled every second forever.

``grpc.min_reconnect_backoff_ms`` is deliberately absent: gRPC core reads it as the minimum
*connect timeout*.  At 100 ms a loaded replica whose tunnel handshake took longer saw
UNAVAILABLE with no dial error recorded, read it as the backend's answer, and reaped a healthy
model (``tests/unit/test_grpc_channel_options.py``).
"""

from __future__ import annotations

#: The largest message either side sends or accepts (an embedding batch, an image).
MAX_MESSAGE_BYTES = 50 * 1024 * 1024

#: Every client channel to a backend.
CLIENT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

#: Every backend's server (``backends/builtin/serving.py``): the same cap, and a port that no
#: second process can bind beside it.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
