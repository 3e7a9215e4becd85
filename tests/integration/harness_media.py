"""The media backends' models (speech, transcription, images) and the check that the speech
tools are installed: skipped locally, failed with ``CI=true`` (``test_media_endpoints.py``,
``test_client_compat.py``)."""

from __future__ import annotations

import os
import shutil

import pytest


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
