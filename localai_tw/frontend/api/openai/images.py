"""``POST /v1/images/generations`` -> ``GenerateImage`` on a node serving the model, once per
image (``n``), routed like every other call.  The backend writes a PNG into a scratch directory
the serving worker made (``WorkerScratch``); the bytes come back through the tunnel (at most
:data:`MAX_IMAGE_BYTES` each).

Answers: ``b64_json`` (the PNG in the JSON) or ``url`` (the default, as OpenAI's and LocalAI's):
the PNG is kept in the shared generated-files store (PostgreSQL, so every replica behind the
load balancer serves it; bounded and expiring: ``frontend/api/generated.py``) and the URL is
``<scheme>://<Host of this request>/generated-images/<random name>.png``, LocalAI's path.

Fields: ``model`` (else the first model whose config does ``image``), ``prompt`` (required;
LocalAI's ``positive|negative`` split honoured, and ``negative_prompt``), ``n`` (1 to
:data:`MAX_IMAGES`), ``size`` ``WxH`` (default 512x512, LocalAI's; each side 1 to
:data:`MAX_SIDE`, at most :data:`MAX_PIXELS` pixels), ``step`` (LocalAI; default 15),
``seed`` (image ``i`` gets ``seed + i``; without one each image draws its own),
``quality`` (``auto``/``standard`` only), ``output_format`` (``png`` only), ``user``
(accepted).  Refused with 400 rather than ignored: ``style``, ``background`` (but ``auto``),
``output_compression``, ``stream``, ``partial_images``, ``moderation`` (but ``auto``), and
any other ``response_format``.

What this module must never do: call a backend for a request it refused, keep an image beyond
the store's bounds, or put a path or node id in a URL.
"""

from __future__ import annotations

import base64
import random
import re

from localai_tw.backends import backend_pb2

from localai_tw.localai.usecases import IMAGE
from localai_tw.frontend.api.openai.context import Context
from localai_tw.frontend.api.openai.errors import OpenAIError, invalid
from localai_tw.frontend.api.openai.requests import (
    INT32_MAX,
    read_body,
    resolve_model_or_default,
    router_method,
)
from localai_tw.frontend.api.openai.responses import Exchange

MAX_IMAGES = 10
MAX_SIDE = 4096
MAX_PIXELS = 4 * 1024 * 1024
MAX_PROMPT_CHARS = 32000
#: Largest PNG read back from a worker.
MAX_IMAGE_BYTES = 16 * 1024 * 1024
DEFAULT_SIZE = (512, 512)
DEFAULT_STEP = 15
_seeds = random.SystemRandom()
_SIZE = re.compile(r"^\s*(\d{1,5})\s*x\s*(\d{1,5})\s*$")
#: OpenAI fields with a meaning this server cannot honour, and the values that mean nothing.
_REFUSED = {"style": (), "background": ("auto",), "output_compression": (), "stream": (False,),
            "partial_images": (0,), "moderation": ("auto",)}


def parse_size(raw) -> tuple[int, int]:
    if raw is None or raw == "auto":
        return DEFAULT_SIZE
    match = _SIZE.match(raw) if isinstance(raw, str) else None
    if match is None:
        raise invalid("'size' must be WIDTHxHEIGHT, e.g. 512x512", "size", code="invalid_value")
    width, height = int(match.group(1)), int(match.group(2))
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE) or width * height > MAX_PIXELS:
        raise invalid(f"'size' {width}x{height} is out of range: each side 1 to {MAX_SIDE}, "
                      f"at most {MAX_PIXELS} pixels", "size", code="invalid_value")
    return width, height


async def answer(context: Context, request, exchange: Exchange) -> None:
    """``POST /v1/images/generations``."""
    router = context.router
    body = read_body(request)
    name, _ = resolve_model_or_default(router, body, IMAGE)
    exchange.record.model = name
    prompt = body.string("prompt", required=True, nonempty=True)
    if not prompt.strip():
        raise invalid("'prompt' must describe something", "prompt", code="invalid_value")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise invalid(f"'prompt' is longer than {MAX_PROMPT_CHARS} characters", "prompt",
                      code="invalid_value")
    n = body.integer("n", 1, MAX_IMAGES) or 1
    width, height = parse_size(body.raw("size"))
    response_format = body.string("response_format") or "url"
    if response_format not in ("url", "b64_json"):
        raise invalid(f"response_format {response_format[:32]!r} is not url or b64_json",
                      "response_format", code="invalid_value")
    quality = body.string("quality")
    if quality not in (None, "auto", "standard"):
        raise invalid(f"quality {quality[:32]!r} is not supported here (auto or standard)",
                      "quality", code="unsupported_parameter")
    output_format = body.string("output_format")
    if output_format not in (None, "png"):
        raise invalid("only png images are produced here", "output_format",
                      code="unsupported_parameter")
    for field, harmless in _REFUSED.items():
        value = body.raw(field)
        if value is not None and value not in harmless:
            raise invalid(f"{field!r} is not supported here; send the request without it",
                          field, code="unsupported_parameter")
    step = body.integer("step", 1, 1000) or DEFAULT_STEP
    seed = body.integer("seed", -(2**31), INT32_MAX)
    positive, _, negative = prompt.partition("|")
    if not positive.strip():
        raise invalid("'prompt' has nothing before '|' (LocalAI's positive|negative split)",
                      "prompt", code="invalid_value")
    negative = body.string("negative_prompt") or negative
    if response_format == "url" and context.generated is None:
        raise OpenAIError(501, "this replica keeps no generated files; ask for b64_json",
                          "server_error", param="response_format", code="not_implemented")
    generate = router_method(router, "generate_image")
    data = []
    for i in range(n):
        ask = backend_pb2.GenerateImageRequest(
            width=width, height=height, step=step, positive_prompt=positive,
            negative_prompt=negative,
            seed=_image_seed(seed, i))
        served = await exchange.call(generate(name, ask, MAX_IMAGE_BYTES, context.deadline()))
        png = served.value
        if response_format == "b64_json":
            data.append({"b64_json": base64.b64encode(png).decode("ascii")})
        else:
            stored = await context.generated.put(png, "image/png", ".png")
            data.append({"url": f"{_base_url(request)}/generated-images/{stored}"})
    _, created = context.ids("img")
    exchange.send_json(200, {"created": created, "data": data})


def _image_seed(seed: int | None, index: int) -> int:
    if seed is None:
        return _seeds.randint(0, INT32_MAX)
    return ((seed + index + 2**31) % 2**32) - 2**31


def _base_url(request) -> str:
    """``scheme://host`` as the client reached this server (LocalAI's BaseURL: the request's
    own Host header, which a load balancer forwards)."""
    host = (request.getHeader(b"host") or b"").decode("latin-1")
    if not host or any(c in host for c in "/\\@ \t\r\n") or len(host) > 255:
        host = "localhost"
    forwarded = (request.getHeader(b"x-forwarded-proto") or b"").decode("latin-1").lower()
    scheme = forwarded if forwarded in ("http", "https") else (
        "https" if request.isSecure() else "http")
    return f"{scheme}://{host}"
