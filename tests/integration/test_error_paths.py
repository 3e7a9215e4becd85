"""Issue 21 §7: an error body names what the caller knows (a model's files by their names in
the models directory), never an absolute path of a replica's or a worker's disk.  A real
frontend and worker (the ``cluster`` fixture), the API asked as a client would."""

from __future__ import annotations

import json
import re

import pytest_twisted

from .harness_echo import echo_model, post

#: An absolute path of two or more components, as an error text would carry it.
ABSOLUTE_PATH = re.compile(r"(?<![\w:/.])/[^\s'\"/]+/")


@pytest_twisted.ensureDeferred
async def test_a_missing_model_file_is_named_without_the_models_directory(cluster):
    """The models directory's absolute path was in the answer ("... does not exist in the
    models directory /srv/...")."""
    cluster.write_model("lost.yaml", echo_model("lost"))  # echo.bin is not there
    frontend = await cluster.frontend("replica-a")
    await cluster.worker("w1", frontend)
    status, raw = await post(cluster.base_url(frontend) + "/v1/completions",
                             {"model": "lost", "prompt": "x"})
    message = json.loads(raw)["error"]["message"]
    assert status == 500 and "echo.bin" in message, message
    assert cluster.models_dir not in message and not ABSOLUTE_PATH.search(message), message
