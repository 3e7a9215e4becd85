"""The ``echo`` model a cluster serves (its weights file and config) and a JSON POST with the
admin key (``test_metrics.py``, ``test_traces.py``)."""

from __future__ import annotations

import json

import treq

from .inference_harness import ADMIN, sha256_hex


WEIGHTS = b"echo weights " * 100


def echo_model(name: str, backend: str = "echo") -> str:
    return (f"name: {name}\nbackend: {backend}\nparameters:\n  model: echo.bin\n"
            f"  max_tokens: 64\nfiles:\n  - path: echo.bin\n"
            f"    sha256: '{sha256_hex(WEIGHTS)}'\n"
            "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"
            "options: ['echo.dim:6']\n")


async def post(url: str, body: dict, key: str = ADMIN):
    response = await treq.post(url, json.dumps(body).encode(),
                               headers={"Authorization": f"Bearer {key}",
                                        "Content-Type": "application/json"})
    return response.code, await treq.content(response)
