"""The media backends' models (speech, transcription, images) and the check that the speech
tools are installed: skipped locally, failed with ``CI=true`` (``test_media_endpoints.py``,
``test_client_compat.py``)."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
import uuid

import pytest

from .inference_harness import ADMIN


def require_media() -> None:
    import importlib.util

    missing = []
    if shutil.which("espeak-ng") is None:
        missing.append("espeak-ng (apt-get install espeak-ng)")
    if shutil.which("ffmpeg") is None or shutil.which("ffprobe") is None:
        missing.append("ffmpeg (apt-get install ffmpeg)")
    if importlib.util.find_spec("pocketsphinx") is None:
        missing.append("pocketsphinx (pip install 'localai-tw[speech]')")
    if not missing:
        return
    message = f"the speech backends need {', '.join(missing)}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " [failing because CI=true]", pytrace=False)
    pytest.skip(message)


MODELS = {
    "speech.yaml": "name: speaker\nbackend: espeak-ng\nparameters:\n  model: speaker\n",
    "listen.yaml": "name: listener\nbackend: pocketsphinx\nparameters:\n  model: listener\n",
    "draw.yaml": "name: painter\nbackend: hash-image\nparameters:\n  model: painter\n",
}


SENTENCE = "one two three four five"


async def relaying_cluster(cluster):
    for filename, text in MODELS.items():
        cluster.write_model(filename, text)
    owner = await cluster.frontend("replica-owner")
    relay = await cluster.frontend("replica-relay")
    worker = await cluster.worker("w-media", owner)
    assert await cluster.owner_of(worker.node_id) == "replica-owner"
    return owner, relay, worker


def post(url, body: bytes, content_type: str, timeout=120, key=ADMIN):
    headers = {"Content-Type": content_type}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def post_json(url, body: dict):
    return post(url, json.dumps(body).encode(), "application/json")


def multipart(fields: dict, file: tuple[str, bytes, str] | None, file_field="file",
              boundary: str | None = None) -> tuple[bytes, str]:
    boundary = boundary or "b-" + uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        for item in (value if isinstance(value, list) else [value]):
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'
                         f"\r\n\r\n{item}\r\n".encode())
    if file is not None:
        filename, data, content_type = file
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; '
                     f'filename="{filename}"\r\nContent-Type: {content_type}\r\n\r\n'.encode()
                     + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def scratch_dirs(worker) -> list[str]:
    root = os.path.join(worker.data_dir, "staging", "scratch")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []
