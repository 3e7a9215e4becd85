"""The ``llama-cpp`` backend (GGUF through llama-cpp-python) as a real process under the backend
supervisor, and behind a real cluster: a frontend replica holding the worker's tunnel, a second
replica relaying to it, the official ``openai`` client.

Marker ``heavy``.  Skipped unless the ``llama`` extra is installed (``pip install
'localai-tw[llama]'``: llama-cpp-python, built from source by pip, and gguf) -- and failed instead
when ``CI=true`` (``.ci/install-heavy-extras`` installs it there).  The model is a tiny random
llama-architecture GGUF written by ``localai_tw.tinygguf.build`` (the code of ``python -m
localai_tw.tinygguf``), so nothing is fetched."""

from __future__ import annotations

import json
import os
import random
import signal

import grpc
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from localai_tw.backends import backend_pb2, backend_pb2_grpc, builtin
from localai_tw.backends.interfaces import BackendFactories
from localai_tw.backends.ports import PortAllocator
from localai_tw.backends.process import BackendSupervisor
from localai_tw.backends.record import BackendLoadFailed, READY

from .harness_backends import require_extra
from .inference_harness import ADMIN, sha256_hex, supervisor_of
from .support import backend_channel

pytestmark = pytest.mark.heavy

YES_NO = 'root ::= "yes" | "no"'


def _require_llama_extra() -> None:
    """The ``llama`` extra, or a skip (a failure in CI: ``.ci/install-heavy-extras``)."""
    require_extra("llama_cpp", "gguf", "numpy", what="the llama extra")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    _require_llama_extra()
    from localai_tw.tinygguf import build

    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    build(path)
    return path


@pytest.fixture
def supervisor():
    first = random.randrange(31000, 32500, 50)
    made = BackendSupervisor(
        reactor, PortAllocator(first, first + 49), BackendFactories([builtin.llama_cpp_backend]),
        ready_timeout=60.0, stop_grace=5.0)
    yield made
    pids = [r.pid for r in made._live.values() if r.pid]
    pytest_twisted.blockon(made.stop_all(force=True))
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _call(record, method, request):
    channel = backend_channel(record)
    try:
        return getattr(backend_pb2_grpc.BackendStub(channel), method)(request, timeout=60)
    finally:
        channel.close()


def _stream(record, request):
    channel = backend_channel(record)
    try:
        return list(backend_pb2_grpc.BackendStub(channel).PredictStream(request, timeout=60))
    finally:
        channel.close()


async def _refused(record, method, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        await deferToThread(_call, record, method, request)
    return caught.value


async def _start(supervisor, gguf_file, name="tiny", **load):
    record = await supervisor.start("llama-cpp", name, load={
        "Model": name, "ModelFile": gguf_file, "ContextSize": 128, "Threads": 1, **load})
    assert record.state == READY
    return record


def _predict(**fields):
    return backend_pb2.PredictOptions(**{"Temperature": 0, **fields})


# -- the backend process ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_generation_is_greedy_when_asked_and_a_stream_counts_what_predict_counts(
        supervisor, gguf_file):
    record = await _start(supervisor, gguf_file, NGPULayers=7)
    loaded = [line for line in supervisor.logs("tiny") if "model loaded:" in line]
    # The config's context_size, threads and gpu_layers are what llama.cpp was given.
    assert "n_ctx 128" in loaded[0] and "threads 1" in loaded[0]
    assert "gpu layers 7 requested" in loaded[0]
    prompt_ids = await deferToThread(_call, record, "TokenizeString",
                                     backend_pb2.PredictOptions(Prompt="the cat sat"))
    assert prompt_ids.length == 3
    # asked for the tokens a generation evaluates (count_tokens): the BOS too
    evaluated = await deferToThread(_call, record, "TokenizeString", backend_pb2.PredictOptions(
        Prompt="the cat sat", TokenizeAsEvaluated=True))
    assert evaluated.length == 4 and evaluated.tokens[0] == 1
    for tokens in (1, 3, 8):
        request = _predict(Prompt="the cat sat", Tokens=tokens, ModelIdentity="tiny")
        whole = await deferToThread(_call, record, "Predict", request)
        again = await deferToThread(_call, record, "Predict", request)
        assert again.message == whole.message  # greedy is deterministic
        assert whole.tokens == tokens  # the tiny model never ends early (tinygguf)
        assert whole.prompt_tokens == 4  # <s> the cat sat
        replies = await deferToThread(_stream, record, request)
        assert b"".join(r.message for r in replies) == whole.message
        assert replies[-1].tokens == whole.tokens == max(r.tokens for r in replies)
        assert {r.prompt_tokens for r in replies} == {whole.prompt_tokens}
    await supervisor.stop("tiny")


@pytest_twisted.ensureDeferred
async def test_a_stop_sequence_ends_the_answer_before_it_in_predict_and_stream(
        supervisor, gguf_file):
    record = await _start(supervisor, gguf_file)
    free = await deferToThread(_call, record, "Predict",
                               _predict(Prompt="hello you", Tokens=16))
    text = free.message.decode()
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    expected = text[:text.index(stop)]
    request = _predict(Prompt="hello you", Tokens=16, StopPrompts=["zzz-never", stop])
    stopped = await deferToThread(_call, record, "Predict", request)
    assert stopped.message.decode() == expected
    assert stopped.tokens < free.tokens
    assert stopped.stopping_word == stop and free.stopping_word == ""  # which one, said
    replies = await deferToThread(_stream, record, request)
    assert b"".join(r.message for r in replies).decode() == expected
    assert replies[-1].tokens == stopped.tokens
    assert replies[-1].stopping_word == stop
    assert not any(r.stopping_word for r in replies[:-1])


def _cancel_after(record, request, replies: int) -> list:
    channel = backend_channel(record)
    try:
        call = backend_pb2_grpc.BackendStub(channel).PredictStream(request, timeout=60)
        got = [next(call) for _ in range(replies)]
        call.cancel()
        return got
    finally:
        channel.close()


@pytest_twisted.ensureDeferred
async def test_a_cancelled_stream_leaves_the_model_serving(supervisor, gguf_file):
    record = await _start(supervisor, gguf_file, ContextSize=4096)
    got = await deferToThread(_cancel_after, record,
                              _predict(Prompt="the cat", Tokens=4000), 2)
    assert [r.tokens for r in got] == [1, 2]
    # The stream's generator is closed with its client (the model's lock released): the next
    # request is answered and the backend is idle again.
    reply = await deferToThread(_call, record, "Predict",
                                _predict(Prompt="hello", Tokens=3))
    assert reply.tokens == 3
    status = await deferToThread(_call, record, "Status", backend_pb2.HealthMessage())
    assert status.state == backend_pb2.StatusResponse.READY


@pytest_twisted.ensureDeferred
async def test_a_grammar_constrains_what_a_random_model_says(supervisor, gguf_file):
    record = await _start(supervisor, gguf_file)
    answers = set()
    for seed in range(6):
        reply = await deferToThread(_call, record, "Predict", _predict(
            Prompt="is it a good day", Tokens=20, Temperature=1.5, Seed=seed, Grammar=YES_NO))
        answers.add(reply.message.decode())
    assert answers <= {"yes", "no"} and answers, answers
    free = await deferToThread(_call, record, "Predict",
                               _predict(Prompt="is it a good day", Tokens=20))
    assert free.message.decode() not in ("yes", "no")  # it was the grammar
    digits = 'root ::= "{\\"n\\": " [1-9] [0-9]? "}"'
    reply = await deferToThread(_call, record, "Predict", _predict(
        Prompt="the cat", Tokens=20, Grammar=digits))
    assert 1 <= json.loads(reply.message.decode())["n"] <= 99
    streamed = await deferToThread(_stream, record, _predict(
        Prompt="the cat", Tokens=20, Grammar=digits))
    assert b"".join(r.message for r in streamed) == reply.message


@pytest_twisted.ensureDeferred
async def test_a_grammar_that_does_not_parse_is_a_bad_request_naming_the_problem(
        supervisor, gguf_file):
    record = await _start(supervisor, gguf_file)
    for grammar, problem in (("root ::= answer", "Undefined rule identifier 'answer'"),
                             ('root ::= "yes', "unexpected end of input"),
                             ('answer ::= "yes"', "root")):
        error = await _refused(record, "Predict",
                               _predict(Prompt="x", Tokens=2, Grammar=grammar))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, grammar
        assert "grammar (GBNF" in error.details() and problem in error.details(), \
            error.details()
    # The process lived through it (a NULL grammar sampler would have crashed it).
    reply = await deferToThread(_call, record, "Predict",
                                _predict(Prompt="x", Tokens=2, Grammar=YES_NO))
    assert reply.message in (b"yes", b"no")


@pytest_twisted.ensureDeferred
async def test_logprobs_come_in_openais_chat_shape(supervisor, gguf_file):
    record = await _start(supervisor, gguf_file)
    request = _predict(Prompt="the dog", Tokens=5, Logprobs=1, TopLogprobs=3)
    reply = await deferToThread(_call, record, "Predict", request)
    content = json.loads(reply.logprobs)["content"]
    assert len(content) == reply.tokens == 5
    assert "".join(e["token"] for e in content) == reply.message.decode()
    for entry in content:
        assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert bytes(entry["bytes"]).decode() == entry["token"] and entry["logprob"] <= 0
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert entry["top_logprobs"][0]["id"] == entry["id"]  # greedy took the best
    replies = await deferToThread(_stream, record, request)
    streamed = [e for r in replies if r.logprobs for e in json.loads(r.logprobs)["content"]]
    assert [(e["id"], e["token"]) for e in streamed] == [(e["id"], e["token"]) for e in content]
    # (the second run reuses the cached prompt: the same numbers up to float noise)
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content],
                                                             abs=1e-4)
    plain = await deferToThread(_call, record, "Predict",
                                _predict(Prompt="the dog", Tokens=5))
    assert plain.logprobs == b"" and plain.message == reply.message


@pytest_twisted.ensureDeferred
async def test_chat_messages_go_through_the_ggufs_own_template(supervisor, gguf_file,
                                                               tmp_path):
    record = await _start(supervisor, gguf_file)
    messages = [backend_pb2.Message(role="user", content="hello")]
    chat = await deferToThread(_call, record, "Predict", _predict(
        UseTokenizerTemplate=True, Messages=messages, Tokens=4))
    # tinygguf's template renders "<s>user : hello assistant : " (<s> read as the BOS token)
    rendered = await deferToThread(
        _call, record, "TokenizeString",
        backend_pb2.PredictOptions(Prompt="<s>user : hello assistant : "))
    assert rendered.tokens[0] == 1 and chat.prompt_tokens == rendered.length
    # the same options tokenized: the tokens the generation evaluated (count_tokens)
    counted = await deferToThread(_call, record, "TokenizeString", backend_pb2.PredictOptions(
        UseTokenizerTemplate=True, Messages=messages, TokenizeAsEvaluated=True))
    assert list(counted.tokens) == list(rendered.tokens)
    again = await deferToThread(_call, record, "Predict", _predict(
        UseTokenizerTemplate=True, Messages=messages, Tokens=4))
    assert again.message == chat.message and chat.tokens == 4
    # A GGUF without a chat template says what to configure instead (and is not "not loaded").
    from localai_tw.tinygguf import build

    bare = str(tmp_path / "bare.gguf")
    await deferToThread(build, bare, chat_template=None)
    record = await _start(supervisor, bare, name="bare")
    error = await _refused(record, "Predict", _predict(
        UseTokenizerTemplate=True, Messages=messages, Tokens=4))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "carries no chat template" in error.details() and "not loaded" not in \
        error.details()
    # A guessed template (a llama-cpp config with none) sends the plain prompt as well: a file
    # without a template is answered from it, as before the guess.
    guessed = await deferToThread(_call, record, "Predict", _predict(
        UseTokenizerTemplate=True, Messages=messages, Prompt="hello", Tokens=4))
    plain = await deferToThread(_call, record, "Predict", _predict(
        Prompt="hello", Tokens=4))
    assert guessed.message == plain.message and guessed.prompt_tokens == plain.prompt_tokens
    # A template that does not compile leaves the model serving rendered prompts.
    broken = str(tmp_path / "broken.gguf")
    await deferToThread(build, broken, chat_template="{% for m in messages %}{{ m['content'] }")
    record = await _start(supervisor, broken, name="broken")
    error = await _refused(record, "Predict", _predict(
        UseTokenizerTemplate=True, Messages=messages, Tokens=4))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "chat template that does not compile (TemplateSyntaxError" in error.details()
    reply = await deferToThread(_call, record, "Predict",
                                _predict(Prompt="user : hello", Tokens=2))
    assert reply.tokens == 2


@pytest_twisted.ensureDeferred
async def test_tokenize_and_detokenize_use_llamas_vocabulary(supervisor, gguf_file):
    record = await _start(supervisor, gguf_file)
    ids = await deferToThread(_call, record, "TokenizeString",
                              backend_pb2.PredictOptions(Prompt="the cat sat"))
    back = await deferToThread(_call, record, "Detokenize",
                               backend_pb2.DetokenizeRequest(tokens=list(ids.tokens)))
    assert back.content == " the cat sat"  # SentencePiece's word-start space, as LocalAI's
    with_bos = await deferToThread(_call, record, "Detokenize",
                                   backend_pb2.DetokenizeRequest(tokens=[1, *ids.tokens]))
    assert with_bos.content == "<s> the cat sat"  # special tokens rendered, as LocalAI's
    error = await _refused(record, "Detokenize",
                           backend_pb2.DetokenizeRequest(tokens=[3, 10 ** 6]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside this model's vocabulary" in error.details()


@pytest_twisted.ensureDeferred
async def test_embeddings_need_a_model_loaded_for_them(supervisor, gguf_file):
    generator = await _start(supervisor, gguf_file)
    error = await _refused(generator, "Embedding",
                           backend_pb2.PredictOptions(Embeddings="the cat"))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED  # never "model not loaded"
    assert "embeddings: true" in error.details()
    embedder = await _start(supervisor, gguf_file, name="tiny-embed", Embeddings=True)
    first = await deferToThread(_call, embedder, "Embedding",
                                backend_pb2.PredictOptions(Embeddings="the cat"))
    second = await deferToThread(_call, embedder, "Embedding",
                                 backend_pb2.PredictOptions(Embeddings="a dog ran"))
    assert len(first.embeddings) == len(second.embeddings) == first.dim == 64
    assert first.embeddings != second.embeddings
    assert first.prompt_tokens == 3 and second.prompt_tokens == 4  # with <s>
    assert first.layout == backend_pb2.EMBEDDING_LAYOUT_FINAL
    error = await _refused(embedder, "Predict", _predict(Prompt="x"))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest_twisted.ensureDeferred
async def test_guards_identity_and_context(supervisor, gguf_file):
    record = await _start(supervisor, gguf_file, ContextSize=16)
    error = await _refused(record, "Predict",
                           _predict(Prompt="x", ModelIdentity="another-model"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "model identity mismatch" in error.details()
    error = await _refused(record, "Predict",
                           _predict(Prompt=" ".join(["the cat sat"] * 10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "31 tokens" in error.details() and "is 16 tokens" in error.details()
    assert "context_size" in error.details()
    reply = await deferToThread(_call, record, "Predict", _predict(Prompt="the cat"))
    assert reply.tokens == 16 - 3  # without max tokens: the rest of the context


@pytest_twisted.ensureDeferred
async def test_a_bad_gguf_is_a_load_failure_naming_the_file(supervisor, gguf_file, tmp_path):
    data = open(gguf_file, "rb").read()
    bad = {
        "truncated.gguf": (data[:len(data) // 2], "data is not within the file bounds"),
        "header.gguf": (data[:6], "truncated: it ends inside the GGUF header"),
        "model.safetensors": (b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "is not a GGUF file"),
        "pointer.gguf": (b"version https://git-lfs.github.com/spec/v1\n", "git-lfs pointer"),
        "empty.gguf": (b"", "is empty"),
    }
    for name, (content, reason) in bad.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(BackendLoadFailed) as caught:
            await supervisor.start("llama-cpp", name, load={"Model": name,
                                                            "ModelFile": str(path)})
        assert str(path) in str(caught.value) and reason in str(caught.value), name
    for path, reason in ((tmp_path / "missing.gguf", "does not exist on this worker"),
                         (tmp_path, "is a directory")):
        with pytest.raises(BackendLoadFailed) as caught:
            await supervisor.start("llama-cpp", path.name, load={"Model": "other",
                                                                 "ModelFile": str(path)})
        assert str(path) in str(caught.value) and reason in str(caught.value)
    # The supervisor (the worker) goes on: a good file loads.
    record = await _start(supervisor, gguf_file)
    reply = await deferToThread(_call, record, "Predict", _predict(Prompt="hi",
                                                                           Tokens=2))
    assert reply.tokens == 2


# -- behind a cluster: a replica holding the worker's tunnel, a second one relaying ----------


def _gguf_model(name: str, file: str, digest: str, extra: str = "") -> str:
    return (f"name: {name}\nbackend: llama-cpp\nparameters:\n  model: {file}\n"
            f"  max_tokens: 8\n  temperature: 0\n"
            f"files:\n  - path: {file}\n    sha256: '{digest}'\n{extra}")


async def _post(url: str, body: dict):
    response = await treq.post(url, json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    return response.code, json.loads(await treq.content(response))


@pytest_twisted.ensureDeferred
async def test_a_gguf_model_served_through_a_relaying_replica(cluster, gguf_file):
    import openai

    data = open(gguf_file, "rb").read()
    cluster.write_file("tiny.gguf", data)
    digest = sha256_hex(data)
    cluster.write_model("tiny.yaml", _gguf_model(
        "tiny-gguf", "tiny.gguf", digest,
        "context_size: 96\nthreads: 1\ngpu_layers: 5\nmmap: true\n"
        "template:\n  use_tokenizer_template: true\n"))
    cluster.write_model("yes-no.yaml", _gguf_model(  # the config's own templates this time
        "tiny-yes-no", "tiny.gguf", digest,
        f"grammar: '{YES_NO}'\ntemplate:\n  chat_message: '{{{{.RoleName}}}} : {{{{.Content}}}}'\n"
        "  chat: '{{.Input}} assistant :'\n"))
    cluster.write_model("embed.yaml", _gguf_model("tiny-embed", "tiny.gguf", digest,
                                                  "embeddings: true\n"))
    holder = await cluster.frontend("replica-ga")
    relay = await cluster.frontend("replica-gb")
    worker = await cluster.worker("w-gguf", holder)
    base = cluster.base_url(relay) + "/v1"

    def use_the_api():
        client = openai.OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=120)
        completion = client.completions.create(model="tiny-gguf", prompt="the cat sat",
                                               max_tokens=6, temperature=0)
        text = completion.choices[0].text
        stop = " " + text.split()[2]
        stopped = client.completions.create(model="tiny-gguf", prompt="the cat sat",
                                            max_tokens=6, temperature=0, stop=[stop])
        messages = [{"role": "user", "content": "hello you"}]
        chat = client.chat.completions.create(model="tiny-gguf", messages=messages,
                                              temperature=0, max_tokens=5, seed=7)
        chunks = list(client.chat.completions.create(
            model="tiny-gguf", messages=messages, temperature=0, max_tokens=5, seed=7,
            stream=True, stream_options={"include_usage": True}))
        answers = {client.chat.completions.create(
            model="tiny-yes-no", messages=[{"role": "user", "content": "is it a good day?"}],
            temperature=1.5, seed=seed).choices[0].message.content for seed in range(4)}
        embedded = client.embeddings.create(model="tiny-embed", input=["the cat", "a dog ran"])
        return completion, text, stop, stopped, chat, chunks, answers, embedded

    completion, text, stop, stopped, chat, chunks, answers, embedded = \
        await deferToThread(use_the_api)
    assert completion.usage.completion_tokens == 6 and completion.usage.prompt_tokens == 4
    assert completion.choices[0].finish_reason == "length"
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content and streamed
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    assert answers <= {"yes", "no"} and answers  # the config's grammar reached llama.cpp
    assert [len(d.embedding) for d in embedded.data] == [64, 64]
    assert embedded.usage.prompt_tokens == 3 + 4
    code, tokens = await _post(cluster.base_url(relay) + "/v1/tokenize",
                               {"model": "tiny-gguf", "content": "the cat sat"})
    assert code == 200 and len(tokens["tokens"]) == 3
    # context_size, threads, gpu_layers and mmap of the config are what llama.cpp was given
    loaded = [line for line in supervisor_of(worker).logs("tiny-gguf")
              if "with llama.cpp: n_ctx" in line]
    assert "n_ctx 96, threads 1, gpu layers 5 requested" in loaded[0], loaded
    assert "mmap True" in loaded[0]


@pytest_twisted.ensureDeferred
async def test_a_bad_gguf_is_a_clear_error_for_the_api_user_and_the_worker_goes_on(
        cluster, gguf_file):
    data = open(gguf_file, "rb").read()
    truncated = data[:len(data) // 2]
    cluster.write_file("tiny.gguf", data)
    cluster.write_file("cut.gguf", truncated)
    cluster.write_file("page.gguf", b"<!DOCTYPE html><html>not found</html>")
    cluster.write_model("cut.yaml", _gguf_model("cut", "cut.gguf", sha256_hex(truncated)))
    cluster.write_model("page.yaml", _gguf_model(
        "page", "page.gguf", sha256_hex(b"<!DOCTYPE html><html>not found</html>")))
    cluster.write_model("tiny.yaml", _gguf_model("tiny-gguf", "tiny.gguf", sha256_hex(data)))
    holder = await cluster.frontend("replica-ba")
    relay = await cluster.frontend("replica-bb")
    worker = await cluster.worker("w-bad-gguf", holder)
    chat = cluster.base_url(relay) + "/v1/chat/completions"
    ask = {"messages": [{"role": "user", "content": "hello"}]}
    for model, reason in (("cut", "data is not within the file bounds"),
                          ("page", "is not a GGUF file")):
        code, answer = await _post(chat, {"model": model, **ask})
        assert code == 500 and answer["error"]["code"] == "model_load_failed", answer
        message = answer["error"]["message"]
        assert f"{model}.gguf" in message and reason in message, message
        assert "Traceback" not in message
        # Asked again at once: the remembered failure, not another load (no retry storm).
        code, again = await _post(chat, {"model": model, **ask})
        assert code == 500 and "remembers this failure" in again["error"]["message"]
        starts = [r for r in supervisor_of(worker).list(include_ended=True)
                  if r["model"] == model]
        assert len(starts) == 1, starts
    # The worker goes on serving.
    code, answer = await _post(chat, {"model": "tiny-gguf", **ask})
    assert code == 200 and answer["usage"]["completion_tokens"] == 8


@pytest_twisted.ensureDeferred
async def test_localais_options_reach_llama_cpp(supervisor, gguf_file):
    await _start(supervisor, gguf_file, Options=[
        "no_mmap", "mlock:false", "flash_attention:on", "cache_type_k:f16", "-ctv:f16",
        "--no-repack", "an_option_this_backend_does_not_know:1"])
    loaded = [line for line in supervisor.logs("tiny") if "with llama.cpp: n_ctx" in line]
    assert "mmap False, mlock False, flash attention True, extra buffer types off" \
        in loaded[0], loaded
    await supervisor.stop("tiny")
    with pytest.raises(BackendLoadFailed) as caught:
        await _start(supervisor, gguf_file, name="bad", Options=["mmap:maybe"])
    assert "option 'mmap': 'maybe' is not a boolean" in str(caught.value)


@pytest_twisted.ensureDeferred
async def test_a_crash_on_the_first_evaluation_on_an_amx_cpu_falls_back_once(
        cluster, gguf_file, monkeypatch):
    """The backend dies by SIGSEGV on its first evaluation while llama.cpp's extra buffer types
    are on (the test hook standing in for the AMX defect; ``LOCALAI_ASSUME_AMX=1`` standing in
    for the CPU).  The request that crashed is served by one transparent retry on a backend
    started with the extra buffer types off; the worker log and ``/api/nodes`` say so; nothing
    crashes again and nothing falls back twice."""
    import openai
    from twisted.logger import formatEvent, globalLogPublisher

    from localai_tw.backends.builtin.llama_cpp import CRASH_TEST_ENV
    from localai_tw.backends.record import CRASHED

    monkeypatch.setenv("LOCALAI_ASSUME_AMX", "1")
    monkeypatch.setenv(CRASH_TEST_ENV, "1")  # inherited by the backend processes
    logged: list[str] = []

    def observe(event):
        logged.append(formatEvent(event) or "")

    globalLogPublisher.addObserver(observe)
    try:
        data = open(gguf_file, "rb").read()
        cluster.write_file("tiny.gguf", data)
        cluster.write_model("tiny.yaml", _gguf_model("tiny-amx", "tiny.gguf", sha256_hex(data),
                                                     "context_size: 96\nthreads: 1\n"))
        holder = await cluster.frontend("replica-amx-a")
        relay = await cluster.frontend("replica-amx-b")
        worker = await cluster.worker("w-amx", holder)
        sent = []
        client = openai.OpenAI(
            base_url=cluster.base_url(relay) + "/v1", api_key=ADMIN, timeout=120,
            http_client=openai.DefaultHttpxClient(event_hooks={"request": [sent.append]}))

        def ask():
            return client.completions.create(model="tiny-amx", prompt="the cat sat",
                                             max_tokens=4, temperature=0)

        first = await deferToThread(ask)
        assert first.usage.completion_tokens == 4 and len(sent) == 1
        second = await deferToThread(ask)
        assert second.choices[0].text == first.choices[0].text and len(sent) == 2

        supervisor = supervisor_of(worker)
        crashes = [r for r in supervisor._ended if r.model == "tiny-amx"]
        assert [(r.state, r.signal_name()) for r in crashes] == [(CRASHED, "SIGSEGV")]
        live = supervisor.find("tiny-amx", include_ended=False)
        assert live.note and "extra buffer types off" in live.note
        assert any("extra buffer types off" in line for line in supervisor.logs("tiny-amx"))
        assert any("on its first evaluation after loading, on a CPU with AMX" in line
                   for line in logged), logged[-20:]

        code, nodes = await _get(cluster.base_url(relay) + "/api/nodes")
        assert code == 200
        entry, = [m for n in nodes["nodes"] for m in n["models"]
                  if m["model_name"] == "tiny-amx"]
        assert entry["state"] == "loaded"
        assert "extra buffer types off (use_extra_bufts=false)" in entry["note"]
        assert "killed by signal SIGSEGV on its first evaluation" in entry["note"]
    finally:
        globalLogPublisher.removeObserver(observe)


async def _get(url: str):
    response = await treq.get(url, headers={"Authorization": f"Bearer {ADMIN}"})
    return response.code, json.loads(await treq.content(response))
