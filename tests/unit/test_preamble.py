"""The preamble codec: every code of both vocabularies, the framing bounds, and that the reader
never takes a byte that belongs to the carried protocol."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from localai_tw import errors
from localai_tw.tunnel import preamble as p


def payload_of(frame: bytes) -> bytes:
    payload, rest = p.split_frame(frame)
    assert rest == b""
    return payload


# -- framing --------------------------------------------------------------------------------------


def test_frame_is_big_endian_length_then_payload():
    assert p.encode_request("grpc", "127.0.0.1:50051") == b"\x00\x14grpc 127.0.0.1:50051"
    assert p.encode_accepted() == b"\x00\x02ok"
    assert p.encode_relay_accepted() == b"\x00\x08relay-ok"


def test_largest_payload_is_accepted_and_one_more_is_refused_by_the_writer():
    assert len(p.encode_frame(b"x" * 1024)) == 1026
    with pytest.raises(ValueError):
        p.encode_frame(b"x" * 1025)


def test_oversized_length_is_refused_before_any_body_arrives():
    reader = p.FrameReader()
    with pytest.raises(errors.TunnelProtocolError):
        reader.feed(struct.pack(">H", 1025))
    assert reader.buffered_bytes == 0


def test_oversized_length_is_refused_even_one_byte_at_a_time():
    reader = p.FrameReader()
    assert reader.feed(b"\xff") == (None, b"")
    with pytest.raises(errors.TunnelProtocolError):
        reader.feed(b"\xff")


def test_truncated_frame_is_a_transport_failure_not_a_refusal():
    reader = p.FrameReader()
    reader.feed(p.encode_accepted()[:3])
    with pytest.raises(errors.TransportFailure) as caught:
        reader.eof()
    assert "3 of 4" in str(caught.value)
    assert not errors.may_act_on(caught.value)


def test_eof_inside_the_length_and_before_anything_are_transport_failures():
    half_length = p.FrameReader()
    half_length.feed(b"\x00")
    with pytest.raises(errors.TransportFailure):
        half_length.eof()
    with pytest.raises(errors.TransportFailure):
        p.FrameReader().eof()


def test_eof_after_the_frame_is_fine():
    reader = p.FrameReader()
    reader.feed(p.encode_accepted())
    reader.eof()


def test_empty_payload_is_a_frame():
    assert p.FrameReader().feed(b"\x00\x00rest") == (b"", b"rest")


def test_a_spent_reader_refuses_more_bytes():
    reader = p.FrameReader()
    reader.feed(p.encode_accepted())
    with pytest.raises(RuntimeError):
        reader.feed(b"x")


@given(
    payload=st.binary(max_size=p.MAX_PAYLOAD),
    trailing=st.binary(max_size=3000),
    cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=8),
)
def test_any_split_yields_the_frame_and_exactly_the_remainder(payload, trailing, cuts):
    stream = p.encode_frame(payload) + trailing
    points = sorted({min(cut, len(stream)) for cut in cuts} | {0, len(stream)})
    pieces = [stream[a:b] for a, b in zip(points, points[1:])]
    reader = p.FrameReader()
    got = None
    remainder = b""
    for index, piece in enumerate(pieces):
        if got is None:
            got, remainder = reader.feed(piece)
            if got is not None:
                # Bytes the reader never saw are the caller's too.
                remainder += b"".join(pieces[index + 1 :])
                break
        assert reader.buffered_bytes <= p.HEADER_SIZE + p.MAX_PAYLOAD
    assert got == payload
    assert remainder == trailing


# -- the stream preamble ----------------------------------------------------------------------


def test_request_round_trip_splits_on_the_first_space():
    request = p.parse_request(payload_of(p.encode_request("http", "a b c")))
    assert request == p.StreamRequest("http", "a b c")


def test_request_with_empty_target_is_well_formed():
    assert p.parse_request(b"http ") == p.StreamRequest("http", "")


@pytest.mark.parametrize(
    "payload",
    [b"", b"grpc", b" 127.0.0.1:1", b"gr\xc3\xa9c x", b"grpc 127.0.0.1:1\n", b"\x00 x", b"grpc \xff"],
)
def test_malformed_requests_are_protocol_errors(payload):
    with pytest.raises(errors.TunnelProtocolError):
        p.parse_request(payload)


@pytest.mark.parametrize("tag", ["", "a b", "gr\u00e9c", "x\n"])
def test_writer_refuses_a_bad_tag(tag):
    with pytest.raises(ValueError):
        p.encode_request(tag, "t")


def test_writer_refuses_a_target_that_would_overflow_the_frame():
    with pytest.raises(ValueError):
        p.encode_request("http", "x" * 1020)


def test_ok_reply():
    reply = p.parse_reply(payload_of(p.encode_accepted()))
    assert reply.accepted and not reply.is_evidence


@pytest.mark.parametrize("code", ["unknown-tag", "unavailable", "bad-request"])
def test_evidence_codes_are_the_workers_answer(code):
    reply = p.parse_reply(payload_of(p.encode_refused(code, "no such thing")))
    assert (reply.code, reply.text) == (code, "no such thing")
    assert reply.is_evidence and not reply.accepted
    error = reply.as_error("node-1")
    assert isinstance(error, errors.StreamRefused)
    assert (error.code, error.text, error.node_id) == (code, "no such thing", "node-1")
    assert errors.condition_of(error) == "worker-answer"


def test_not_served_is_not_evidence():
    reply = p.parse_reply(payload_of(p.encode_refused("not-served", "header timeout")))
    assert reply.code == "not-served" and not reply.is_evidence
    error = reply.as_error("node-1")
    assert not isinstance(error, errors.WorkerAnswer)
    assert isinstance(error, errors.WorkerUnroutable)


def test_refusal_with_empty_text_round_trips():
    assert p.parse_reply(payload_of(p.encode_refused("unavailable", ""))) == p.StreamReply(
        "unavailable", ""
    )
    assert p.parse_reply(b"err unavailable") == p.StreamReply("unavailable", "")


def test_newlines_in_refusal_text_become_spaces():
    reply = p.parse_reply(payload_of(p.encode_refused("unavailable", "dial\nfailed\r\n")))
    assert reply.text == "dial failed  "


def test_long_refusal_text_is_truncated_to_the_frame_on_a_character_boundary():
    frame = p.encode_refused("unavailable", "\u00e9" * 2000)  # two bytes each
    payload = payload_of(frame)
    assert len(payload) <= p.MAX_PAYLOAD
    reply = p.parse_reply(payload)
    assert set(reply.text) == {"\u00e9"}
    # "err unavailable " is 16 bytes, leaving 1008 = 504 whole characters.
    assert len(reply.text) == 504


@given(st.text(max_size=1500))
def test_any_refusal_text_fits_and_decodes(text):
    payload = payload_of(p.encode_refused("bad-request", text))
    assert len(payload) <= p.MAX_PAYLOAD
    reply = p.parse_reply(payload)
    assert reply.code == "bad-request"
    assert "\n" not in reply.text


@pytest.mark.parametrize(
    "payload",
    [
        b"err not-a-code text",
        b"err unavailable-ish x",
        b"err",
        b"err ",
        b"OK",
        b"ok ",
        b"nope",
        b"err unavailable \xff",
        b"relay-ok",
        b"err relay-not-owner elsewhere",
    ],
)
def test_unknown_or_foreign_replies_are_protocol_errors_never_a_near_code(payload):
    with pytest.raises(errors.TunnelProtocolError) as caught:
        p.parse_reply(payload)
    assert not errors.may_act_on(caught.value)


def test_writer_refuses_an_unknown_code():
    with pytest.raises(ValueError):
        p.encode_refused("relay-not-owner", "x")


# -- the relay preamble -------------------------------------------------------------------------


@pytest.mark.parametrize("lane", ["inference", "bulk", "bulk-only"])
def test_relay_request_round_trip(lane):
    payload = payload_of(p.encode_relay_request("node-7", lane, 1500))
    assert payload == f"node-7 {lane} 1500".encode()
    assert p.parse_relay_request(payload) == p.RelayRequest("node-7", lane, 1500)


def test_relay_budget_is_clamped_at_a_day_on_both_sides():
    day = 24 * 3600 * 1000
    assert p.parse_relay_request(payload_of(p.encode_relay_request("n", "bulk", day * 3))) == (
        p.RelayRequest("n", "bulk", day)
    )
    assert p.parse_relay_request(b"n bulk 999999999999").budget_ms == day


def test_budget_from_remaining_time_rounds_up_and_zero_means_unstated():
    assert p.budget_ms(None) == 0
    assert p.budget_ms(0.0001) == 1
    assert p.budget_ms(1.0001) == 1001
    assert p.budget_ms(2.0) == 2000
    assert p.budget_ms(10**9) == p.MAX_BUDGET_MS
    with pytest.raises(errors.CallerDeadlineExceeded):
        p.budget_ms(0)
    with pytest.raises(errors.CallerDeadlineExceeded):
        p.budget_ms(-1)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"n inference",
        b"n inference 1 extra",
        b" inference 1",
        b"n fast 1",
        b"n inference -1",
        b"n inference +1",
        b"n inference 1.5",
        b"n inference ",
        b"n inference 1234567890123",
        b"n  inference 1",
        b"n\xc3\xa9 inference 1",
    ],
)
def test_malformed_relay_requests_are_protocol_errors(payload):
    with pytest.raises(errors.TunnelProtocolError):
        p.parse_relay_request(payload)


@pytest.mark.parametrize(
    "args", [("", "bulk", 1), ("a b", "bulk", 1), ("n", "fast", 1), ("n", "bulk", -1), ("n", "bulk", 1.5)]
)
def test_relay_writer_refuses_bad_fields(args):
    with pytest.raises(ValueError):
        p.encode_relay_request(*args)


def test_relay_ok():
    assert p.parse_relay_reply(payload_of(p.encode_relay_accepted())).accepted


@pytest.mark.parametrize("code", ["relay-not-owner", "relay-unavailable", "relay-bad-request"])
def test_relay_refusals_are_routing_facts(code):
    reply = p.parse_relay_reply(payload_of(p.encode_relay_refused(code, "why\nnot")))
    assert (reply.code, reply.text) == (code, "why not")
    error = reply.as_error("node-2")
    assert isinstance(error, errors.WorkerUnroutable)
    assert not isinstance(error, errors.WorkerAnswer)


@pytest.mark.parametrize(
    "payload", [b"ok", b"err unavailable x", b"err not-served x", b"err relay-gone x", b"relay-ok "]
)
def test_relay_reader_refuses_stream_replies_and_unknown_codes(payload):
    with pytest.raises(errors.TunnelProtocolError):
        p.parse_relay_reply(payload)


def test_relay_writer_refuses_stream_codes():
    with pytest.raises(ValueError):
        p.encode_relay_refused("unavailable", "x")
