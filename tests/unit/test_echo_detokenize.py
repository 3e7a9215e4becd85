"""The echo backend's ``Detokenize``: ids its ``TokenizeString`` answered read back as the
words, an id it never answered is ``INVALID_ARGUMENT`` (never a made-up word), and what it
remembers is bounded."""

from __future__ import annotations

import grpc
import pytest

from localai_tw.backends import backend_pb2
from localai_tw.backends.builtin import echo


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code = code


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


@pytest.fixture
def servicer():
    made = echo.EchoServicer()
    made.LoadModel(backend_pb2.ModelOptions(Model="m"), Context())
    return made


def test_tokenized_ids_read_back_as_their_words(servicer):
    ids = servicer.TokenizeString(backend_pb2.PredictOptions(Prompt="héllo big wörld"),
                                  Context()).tokens
    answer = servicer.Detokenize(backend_pb2.DetokenizeRequest(tokens=list(ids)[::-1]),
                                 Context())
    assert answer.content == "wörld big héllo"


def test_an_id_never_answered_is_invalid_argument(servicer):
    known = servicer.TokenizeString(backend_pb2.PredictOptions(Prompt="a"), Context()).tokens[0]
    unknown = next(i for i in range(50000) if i != known)
    with pytest.raises(Aborted) as caught:
        servicer.Detokenize(backend_pb2.DetokenizeRequest(tokens=[known, unknown]), Context())
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(unknown) in str(caught.value)


def test_before_load_it_is_model_not_loaded():
    with pytest.raises(Aborted) as caught:
        echo.EchoServicer().Detokenize(backend_pb2.DetokenizeRequest(tokens=[1]), Context())
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_the_vocabulary_is_bounded_oldest_forgotten(servicer, monkeypatch):
    monkeypatch.setattr(echo, "VOCABULARY_MAX", 3)
    ids = servicer.TokenizeString(backend_pb2.PredictOptions(Prompt="w1 w2 w3 w4"),
                                  Context()).tokens
    assert len(servicer._vocabulary) == 3
    assert servicer.Detokenize(backend_pb2.DetokenizeRequest(tokens=ids[1:]),
                               Context()).content == "w2 w3 w4"
    with pytest.raises(Aborted):
        servicer.Detokenize(backend_pb2.DetokenizeRequest(tokens=ids[:1]), Context())
