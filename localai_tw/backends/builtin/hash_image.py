"""The ``hash-image`` backend: a test and demo backend for ``/v1/images/generations`` that draws
a deterministic PNG from the SHA-256 of its request (prompt, negative prompt, seed, steps,
size): the same request gives the same bytes, another prompt another picture.  It is not an
image model; it exists so that the route, the contract and the refusals of the images API are
tested against a real backend process without weights.  Standard library only (``zlib``).
Run as ``python -m localai_tw.backends.builtin.hash_image --addr HOST:PORT``.

RPCs: ``Health``, ``LoadModel`` (always succeeds), ``GenerateImage`` (writes the PNG to
``dst``), ``Status``, ``Free``.  ``GenerateImage`` refuses (``INVALID_ARGUMENT``) an empty
prompt, a width or height outside 1..:data:`MAX_SIDE` or more than :data:`MAX_PIXELS` pixels,
a ``dst`` that is not an absolute ``.png`` path in an existing directory, and the inputs it
cannot use (``src``, ``ref_images``, ``EnableParameters``).

What this program must never do: write anywhere but ``dst``, or draw two different pictures for
one request.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin import serving

MAX_SIDE = 4096
MAX_PIXELS = 4 * 1024 * 1024


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def png_bytes(width: int, height: int, seed: bytes) -> bytes:
    """An RGB PNG: a diagonal gradient between two colours of ``seed``, crossed by stripes
    whose period and angle come from it too."""
    c1, c2, c3 = seed[0:3], seed[3:6], seed[6:9]
    period = 4 + seed[9] % 28
    slope = 1 + seed[10] % 3
    rows = []
    span = max(width + height - 2, 1)
    for y in range(height):
        row = bytearray(b"\x00")  # filter type none
        for x in range(width):
            if ((x + slope * y) // period) % 2:
                row += c3
            else:
                t = (x + y) / span
                row += bytes(int(a + (b - a) * t) for a, b in zip(c1, c2))
        rows.append(bytes(row))
    raw = b"".join(rows)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b""))


def seed_of(request) -> bytes:
    text = "\x00".join((request.positive_prompt, request.negative_prompt, str(request.seed),
                        str(request.step), f"{request.width}x{request.height}"))
    return hashlib.sha256(text.encode("utf-8")).digest()


class HashImageServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, identity: serving.ModelIdentity | None = None):
        self.identity = identity or serving.ModelIdentity()
        self.loaded = False

    def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    def LoadModel(self, request, context):
        self.loaded = True
        self.identity.loaded = request.Model
        return backend_pb2.Result(success=True, message="hash-image ready (a test backend)")

    def Free(self, request, context):
        self.loaded = False
        self.identity.loaded = ""
        return backend_pb2.Result(success=True, message="freed")

    def Status(self, request, context):
        return serving.status_response(busy=False, loaded=self.loaded)

    def GenerateImage(self, request, context):
        if not self.loaded:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")

        def refuse(text):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)

        if not request.positive_prompt.strip():
            refuse("the prompt is empty")
        if not (1 <= request.width <= MAX_SIDE and 1 <= request.height <= MAX_SIDE) or \
                request.width * request.height > MAX_PIXELS:
            refuse(f"size {request.width}x{request.height}: each side 1..{MAX_SIDE}, at most "
                   f"{MAX_PIXELS} pixels")
        if request.src or request.ref_images or request.EnableParameters:
            refuse("hash-image draws from the prompt alone (no src, ref_images or "
                   "EnableParameters)")
        dst = request.dst
        if not os.path.isabs(dst) or not dst.endswith(".png") or \
                not os.path.isdir(os.path.dirname(dst)):
            refuse("dst must be an absolute path ending in .png in an existing directory")
        data = png_bytes(request.width, request.height, seed_of(request))
        with open(dst, "wb") as f:
            f.write(data)
        return backend_pb2.Result(success=True, message=dst)


def main() -> None:
    # Two threads: Health is answered while a request runs (the work itself is serialised).
    os.environ.setdefault(serving.MAX_WORKERS_ENV, "2")
    args = serving.argument_parser(__doc__.splitlines()[0]).parse_args()
    identity = serving.ModelIdentity()
    serving.serve(HashImageServicer(identity), identity, args.addr)


if __name__ == "__main__":
    main()
