"""What the OpenAI API tells a client about model loading, over raw HTTP with a fake router:
a request for what a model's config does not list still reaches the router (LocalAI's rule), a
streaming request that waits for a cold load gets ``: loading model ...`` comments on the
reactor's clock, and a remembered failed load answers with ``Retry-After``."""

from __future__ import annotations

import pytest
from twisted.internet import task

from localai_tw.frontend.inference.interfaces import ModelLoadFailed
from localai_tw.localai.model_config import parse_model_config
from localai_tw.localai.usecases import usecases
from localai_tw.frontend.api.openai import LOADING_NOTICE_INTERVAL

from .support_openai import Client, FakeRouter, call, make_site, model_config


@pytest.fixture
def router():
    return FakeRouter([
        model_config("chatty"),
        model_config("minilm", backend="sentence-transformers"),
        model_config("gpt", backend="transformers", template={"use_tokenizer_template": True}),
        model_config("vectors", embeddings=True),
        model_config("only-completion", known_usecases=["FLAG_COMPLETION"]),
    ])


@pytest.fixture
def clock():
    return task.Clock()


@pytest.fixture
def site(router, clock):
    return make_site(router, reactor=clock)


def chat(model="chatty", **more):
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}]}
    body.update(more)
    return body


# -- what a model is for ------------------------------------------------------------------------


@pytest.mark.parametrize("data, expected", [
    ({"backend": "transformers"}, {"chat", "completion"}),
    ({"backend": "sentence-transformers"}, {"embeddings", "rerank"}),
    ({"backend": "echo"}, {"chat", "completion", "embeddings", "rerank"}),
    ({"backend": "bert-numpy"}, {"chat", "completion", "embeddings", "rerank"}),
    ({"backend": "bert-numpy", "embeddings": True}, {"embeddings", "rerank"}),
    # known_usecases adds to the guess (LocalAI's HasUsecases), it does not replace it
    ({"backend": "external", "known_usecases": ["rerank"]},
     {"rerank", "chat", "completion", "embeddings"}),
    ({"backend": "external"}, {"chat", "completion", "embeddings"}),  # the backend decides
    ({"backend": "transformers", "embeddings": True}, {"embeddings"}),
    ({"backend": "llama-cpp"}, {"chat", "completion"}),
    ({"backend": "llama-cpp", "embeddings": True}, {"embeddings"}),
    ({"backend": "external", "embeddings": True}, {"embeddings"}),
    ({"backend": "transformers", "known_usecases": ["chat", "FLAG_EMBEDDINGS"]},
     {"chat", "completion", "embeddings"}),
    ({"backend": "echo", "known_usecases": []}, {"chat", "completion", "embeddings", "rerank"}),
    ({"backend": "llama-cpp", "known_usecases": ["chat"]}, {"chat", "completion"}),
    # score and token_classify reserve a model: nothing is guessed on top
    ({"backend": "llama-cpp", "known_usecases": ["score"]}, {"score"}),
    ({"backend": "llama-cpp", "known_usecases": ["chat", "token_classify"]},
     {"chat", "token_classify"}),
    # LocalAI's own backends, as its GuessUsecases names them
    ({"backend": "whisper"}, {"transcript"}),
    ({"backend": "whisper", "options": ["vad_only"]}, {"vad"}),
    ({"backend": "piper"}, {"tts"}),
    ({"backend": "kokoro", "known_usecases": ["tts"]}, {"tts"}),
    ({"backend": "stablediffusion-ggml"}, {"image"}),
    ({"backend": "diffusers"}, set()),
    ({"backend": "diffusers", "diffusers": {"pipeline_type": "StableDiffusionPipeline"}},
     {"image"}),
    ({"backend": "rerankers"}, {"rerank"}),
    ({"backend": "llama-cpp", "reranking": True}, {"chat", "completion", "rerank"}),
])
def test_usecases_from_the_config(data, expected):
    assert usecases(parse_model_config({"name": "m", **data})) == expected


@pytest.mark.parametrize("raw", ["chat", [1], ["no spaces allowed"]])
def test_known_usecases_must_be_a_list_of_names(raw):
    from localai_tw.localai.model_config import ModelConfigError

    with pytest.raises(ModelConfigError, match="known_usecases"):
        parse_model_config({"name": "m", "backend": "echo", "known_usecases": raw})


@pytest.mark.parametrize("path, body, model, supported", [
    ("/v1/chat/completions", chat("minilm"), "minilm", "embeddings"),
    ("/v1/chat/completions", chat("vectors", stream=True), "vectors", "embeddings"),
    ("/v1/completions", {"model": "minilm", "prompt": "x"}, "minilm", "embeddings"),
    ("/v1/embeddings", {"model": "gpt", "input": "x"}, "gpt", "chat, completion"),
    ("/v1/chat/completions", chat("only-completion"), "only-completion", "completion"),
])
def test_asking_a_model_for_what_its_config_does_not_list_reaches_its_backend(
        site, router, path, body, model, supported):
    # LocalAI never refuses a request for its use case: the backend answers what it cannot do
    assert not set(supported.split(", ")) & {path.split("/")[-1]}
    response = call(site, "POST", path, body)
    assert response.status == 200, response.raw_body
    assert [name for _, name, _ in router.calls] == [model]


def test_what_a_model_does_is_served(site, router):
    assert call(site, "POST", "/v1/embeddings", {"model": "minilm", "input": "x"}).status == 200
    assert call(site, "POST", "/v1/chat/completions", chat("gpt")).status == 200
    assert call(site, "POST", "/v1/completions",
                {"model": "only-completion", "prompt": "x"}).status == 200


# -- streaming while a cold load runs ----------------------------------------------------------------


def test_a_stream_waiting_for_a_cold_load_gets_loading_comments(site, router, clock):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    stream.loading()
    clock.advance(LOADING_NOTICE_INTERVAL)
    clock.advance(LOADING_NOTICE_INTERVAL)
    waiting = client.response()
    assert waiting.status == 200 and not waiting.complete
    assert waiting.header("content-type").startswith("text/event-stream")
    assert waiting.comments() == ["loading model chatty (3 s)", "loading model chatty (6 s)"]

    stream.start()
    stream.push(b"Hello")
    clock.advance(LOADING_NOTICE_INTERVAL * 3)  # no more comments once replies flow
    stream.end()
    response = client.response()
    assert response.complete and len(response.comments()) == 2
    events = response.events()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"]["content"] == "Hello"
    assert events[-1] == "[DONE]"
    assert clock.getDelayedCalls() == []


def test_a_quick_cold_load_sends_no_comment(site, router, clock):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    stream.loading()
    clock.advance(LOADING_NOTICE_INTERVAL - 0.5)
    stream.fail(ModelLoadFailed("chatty", "node-a", "no such weights", retry_in=30.0))
    response = client.response()
    assert response.status == 500  # nothing was sent yet: a plain JSON error
    assert response.header("retry-after") == "30"
    assert response.json()["error"]["code"] == "model_load_failed"
    assert clock.getDelayedCalls() == []


def test_a_load_failing_after_comments_is_an_error_event(site, router, clock):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    stream.loading()
    clock.advance(LOADING_NOTICE_INTERVAL)
    stream.fail(ModelLoadFailed("chatty", "node-a", "OSError: offline", retry_in=30.0))
    response = client.response()
    assert response.status == 200 and response.complete
    assert response.comments() == ["loading model chatty (3 s)"]
    [event] = response.events()
    assert event["error"]["code"] == "model_load_failed"
    assert "OSError: offline" in event["error"]["message"]
    assert clock.getDelayedCalls() == []


def test_a_client_leaving_during_the_load_stops_the_comments(site, router, clock):
    router.manual_streams = True
    client = Client(site).send("POST", "/v1/chat/completions", chat(stream=True))
    stream, = router.streams
    stream.loading()
    clock.advance(LOADING_NOTICE_INTERVAL)
    client.disconnect()
    assert stream.cancelled
    assert clock.getDelayedCalls() == []
