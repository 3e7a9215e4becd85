"""LocalAI's model names, non-ASCII included (its gallery's ``voice-pt_PT-tugão-medium``),
served through a relaying replica and a real echo backend: the name is the client's
``model``, the row's and the worker's key (docs/models.md, "Names")."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest_twisted
import treq

from .harness_echo import WEIGHTS, echo_model, post
from .inference_harness import ADMIN

NAME = "voice-pt_PT-tugão-medium"


@pytest_twisted.ensureDeferred
async def test_a_non_ascii_name_is_served_listed_and_retrieved(cluster):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("tugao.yaml", echo_model(NAME))
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    await cluster.worker("w1", owner)
    base = cluster.base_url(relaying)

    status, raw = await post(base + "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "olá mundo"}]})
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["model"] == NAME and answer["choices"][0]["message"]["content"] == "olá mundo"
    [row] = await cluster.rows(NAME)
    assert row[1] == NAME and row[2] == "loaded"

    response = await treq.get(base + "/v1/models/" + quote(NAME),
                              headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.code == 200 and json.loads(await treq.content(response))["id"] == NAME
