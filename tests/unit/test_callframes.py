"""The ``call`` stream codec: round trips, the method table from the service descriptor, and
truncated, oversize and garbage input answered with ``CallProtocolError`` (never another
exception, never an allocation beyond the bound)."""

from __future__ import annotations

import random
import struct

import pytest

from localai_tw import errors
from localai_tw.backends import backend_pb2, callframes
from localai_tw.backends.grpcoptions import MAX_MESSAGE_BYTES
from localai_tw.backends.callframes import (
    MESSAGE,
    REQUEST,
    STATUS,
    CallProtocolError,
    FrameDecoder,
)


def frames_of(data: bytes, kinds) -> list[tuple[int, bytes]]:
    decoder = FrameDecoder(kinds)
    decoder.feed(data)
    out = []
    while (frame := decoder.next_frame()) is not None:
        out.append(frame)
    return out


def test_the_method_table_comes_from_the_service_descriptor():
    predict = callframes.METHODS["Predict"]
    assert predict.path == "/backend.Backend/Predict"
    assert predict.request_type is backend_pb2.PredictOptions
    assert predict.response_type is backend_pb2.Reply
    assert not predict.server_streaming
    assert callframes.METHODS["PredictStream"].server_streaming
    assert callframes.METHODS["Embedding"].response_type is backend_pb2.EmbeddingResult
    service = backend_pb2.DESCRIPTOR.services_by_name["Backend"]
    assert set(callframes.METHODS) == {m.name for m in service.methods}


def test_a_request_round_trips():
    body = backend_pb2.PredictOptions(Prompt="hello").SerializeToString()
    [(kind, payload)] = frames_of(callframes.encode_request("Predict", 1500, body), {REQUEST})
    request = callframes.parse_request(payload)
    assert kind == REQUEST
    assert request.method.name == "Predict" and request.timeout_ms == 1500
    assert request.body == body


def test_messages_and_a_status_round_trip_in_pieces():
    data = (callframes.encode_message(b"one") + callframes.encode_message(b"")
            + callframes.encode_status(9, "model not loaded"))
    decoder = FrameDecoder({MESSAGE, STATUS})
    got = []
    for i in range(len(data)):  # one byte at a time
        decoder.feed(data[i:i + 1])
        while (frame := decoder.next_frame()) is not None:
            got.append(frame)
    assert got[:2] == [(MESSAGE, b"one"), (MESSAGE, b"")]
    status = callframes.parse_status(got[2][1])
    assert (status.code, status.details, status.ok) == (9, "model not loaded", False)
    assert decoder.buffered_bytes == 0 and decoder.eof() is None


def test_the_encoder_refuses_what_the_peer_would_refuse():
    with pytest.raises(ValueError, match="not a method"):
        callframes.encode_request("Nope", 0, b"")
    with pytest.raises(ValueError, match="message cap"):
        callframes.encode_request("Predict", 0, b"x" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ValueError, match="non-negative"):
        callframes.encode_request("Predict", -1, b"")
    with pytest.raises(ValueError, match="status code"):
        callframes.encode_status(17)


def test_a_long_timeout_is_clamped_to_a_day():
    [(_, payload)] = frames_of(callframes.encode_request("Health", 10 ** 9, b""), {REQUEST})
    assert callframes.parse_request(payload).timeout_ms == callframes.MAX_TIMEOUT_MS


def test_long_details_are_cut_on_a_character_boundary():
    frame = callframes.encode_status(13, "é" * 5000)
    [(_, payload)] = frames_of(frame, {STATUS})
    details = callframes.parse_status(payload).details
    assert len(details.encode()) <= callframes.MAX_DETAILS_BYTES
    assert set(details) == {"é"}


def test_an_oversize_length_is_refused_at_the_header():
    decoder = FrameDecoder({MESSAGE})
    with pytest.raises(CallProtocolError, match="more than the limit"):
        decoder.feed(struct.pack(">BI", MESSAGE, callframes.MAX_PAYLOAD + 1))
    assert issubclass(CallProtocolError, errors.TunnelProtocolError)


def test_a_kind_this_side_never_receives_is_refused():
    with pytest.raises(CallProtocolError, match="kind 'request' on this side"):
        FrameDecoder({MESSAGE, STATUS}).feed(callframes.encode_request("Health", 0, b""))
    with pytest.raises(CallProtocolError, match="kind 200"):
        FrameDecoder({MESSAGE}).feed(b"\xc8\x00\x00\x00\x00")


def test_truncation_anywhere_is_named_at_eof():
    data = callframes.encode_message(b"abcdef")
    for cut in range(1, len(data)):
        decoder = FrameDecoder({MESSAGE})
        decoder.feed(data[:cut])
        assert decoder.next_frame() is None
        assert "ended inside" in decoder.eof()


@pytest.mark.parametrize("payload, match", [
    (b"", "empty"),
    (b"\x00", "malformed"),
    (b"\x07Predict\x00\x00", "malformed"),
    (b"\x04Nope\x00\x00\x00\x00", "names no method"),
    (b"\x07Predic\xff\x00\x00\x00\x00", "names no method"),
    (b"\x06Health" + struct.pack(">I", callframes.MAX_TIMEOUT_MS + 1), "exceeds one day"),
])
def test_malformed_requests_are_protocol_errors(payload, match):
    with pytest.raises(CallProtocolError, match=match):
        callframes.parse_request(payload)


@pytest.mark.parametrize("payload, match", [
    (b"", "empty"),
    (b"\x11", "not a gRPC status"),
    (b"\x02" + b"x" * (callframes.MAX_DETAILS_BYTES + 1), "exceed"),
])
def test_malformed_statuses_are_protocol_errors(payload, match):
    with pytest.raises(CallProtocolError, match=match):
        callframes.parse_status(payload)


def test_garbage_is_a_protocol_error_or_a_frame_never_a_crash():
    rng = random.Random(2512)
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        decoder = FrameDecoder({MESSAGE, STATUS}, max_payload=64)
        try:
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                if frame[0] == STATUS:
                    callframes.parse_status(frame[1])
            decoder.eof()
        except CallProtocolError:
            pass
        try:
            callframes.parse_request(data)
        except CallProtocolError:
            pass
