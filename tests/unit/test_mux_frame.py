"""The yamux frame codec: exact bytes, round trips, arbitrary splitting, and refusals."""

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from localai_tw.mux.errors import FrameError
from localai_tw.mux.frame import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    HEADER_SIZE,
    INITIAL_WINDOW,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    Frame,
    FrameDecoder,
    encode,
)


def test_header_layout_is_big_endian_version_type_flags_id_length():
    raw = encode(Frame.window_update(7, 0x01020304, FLAG_SYN | FLAG_ACK))
    assert raw == bytes([0, 1, 0, 3, 0, 0, 0, 7, 1, 2, 3, 4])
    assert HEADER_SIZE == 12


def test_known_frames_byte_for_byte():
    assert encode(Frame.ping(0xDEADBEEF)) == bytes.fromhex("0002000100000000deadbeef")
    assert encode(Frame.ping(0xDEADBEEF, ack=True)) == bytes.fromhex("0002000200000000deadbeef")
    assert encode(Frame.go_away(1)) == bytes.fromhex("000300000000000000000001")
    assert encode(Frame.data(3, b"hi", FLAG_FIN)) == bytes.fromhex("000000040000000300000002") + b"hi"


def test_encode_refuses_inconsistent_frames():
    with pytest.raises(ValueError):
        encode(Frame(TYPE_DATA, 0, 1, 5, b"abc"))
    with pytest.raises(ValueError):
        encode(Frame(TYPE_PING, 0, 0, 3, b"abc"))
    with pytest.raises(ValueError):
        encode(Frame(9, 0, 0, 0))
    with pytest.raises(ValueError):
        encode(Frame.window_update(2**32, 0))


def test_non_data_frames_never_consume_a_payload():
    # A window update with a large length followed directly by a ping: a decoder that skipped
    # ``length`` bytes would swallow the ping.
    wire = encode(Frame.window_update(1, 1_000_000)) + encode(Frame.ping(5))
    frames = FrameDecoder().feed(wire)
    assert frames == [Frame.window_update(1, 1_000_000), Frame.ping(5)]


def test_go_away_length_is_a_code_not_a_payload():
    wire = encode(Frame.go_away(2**32 - 1)) + encode(Frame.data(1, b"x"))
    assert FrameDecoder().feed(wire) == [Frame.go_away(2**32 - 1), Frame.data(1, b"x")]


def test_bad_version_is_a_frame_error():
    with pytest.raises(FrameError, match="version"):
        FrameDecoder().feed(struct.pack(">BBHII", 1, 0, 0, 1, 0))


def test_unknown_type_is_a_frame_error():
    with pytest.raises(FrameError, match="type"):
        FrameDecoder().feed(struct.pack(">BBHII", 0, 4, 0, 1, 0))


def test_data_length_above_limit_is_refused_from_the_header_alone():
    decoder = FrameDecoder(max_payload=100)
    with pytest.raises(FrameError, match="exceeds"):
        decoder.feed(struct.pack(">BBHII", 0, TYPE_DATA, 0, 1, 101))
    assert decoder.buffered == 0


def test_data_exactly_at_limit_is_fine():
    decoder = FrameDecoder(max_payload=100)
    assert decoder.feed(encode(Frame.data(1, b"a" * 100))) == [Frame.data(1, b"a" * 100)]


def test_decoder_refuses_everything_after_an_error():
    decoder = FrameDecoder()
    with pytest.raises(FrameError):
        decoder.feed(b"\x07" + b"\x00" * 11)
    with pytest.raises(FrameError):
        decoder.feed(encode(Frame.ping(1)))


def test_default_limit_is_the_initial_window():
    assert FrameDecoder().max_payload == INITIAL_WINDOW


def test_partial_frame_is_held_until_complete():
    decoder = FrameDecoder()
    raw = encode(Frame.data(5, b"payload"))
    assert decoder.feed(raw[:3]) == []
    assert decoder.feed(raw[3:14]) == []
    assert decoder.buffered == 14
    assert decoder.feed(raw[14:]) == [Frame.data(5, b"payload")]
    assert decoder.buffered == 0


frames = st.one_of(
    st.builds(Frame.data, st.integers(0, 2**32 - 1), st.binary(max_size=300),
              st.integers(0, 0xFFFF)),
    st.builds(Frame.window_update, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
              st.integers(0, 0xFFFF)),
    st.builds(Frame.ping, st.integers(0, 2**32 - 1), st.booleans()),
    st.builds(Frame.go_away, st.integers(0, 2**32 - 1)),
)


@given(frames)
def test_roundtrip(frame):
    assert FrameDecoder(max_payload=300).feed(encode(frame)) == [frame]


@given(st.lists(frames, max_size=20), st.data())
def test_arbitrary_splitting_yields_the_same_frames(frame_list, data):
    wire = b"".join(encode(f) for f in frame_list)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=30)))
    decoder = FrameDecoder(max_payload=300)
    out = []
    previous = 0
    for cut in cuts + [len(wire)]:
        out.extend(decoder.feed(wire[previous:cut]))
        previous = cut
    assert out == frame_list
    assert decoder.buffered == 0


@given(st.binary(max_size=400), st.data())
def test_garbage_either_decodes_or_raises_frame_error(garbage, data):
    decoder = FrameDecoder(max_payload=64)
    cut = data.draw(st.integers(0, len(garbage)))
    try:
        decoder.feed(garbage[:cut])
        decoder.feed(garbage[cut:])
    except FrameError:
        return
    # Whatever was not decoded is at most one header plus one bounded payload.
    assert decoder.buffered < HEADER_SIZE + 64


def test_flags_combine():
    frame = FrameDecoder().feed(encode(Frame.data(9, b"end", FLAG_SYN | FLAG_FIN)))[0]
    assert frame.has(FLAG_SYN) and frame.has(FLAG_FIN) and not frame.has(FLAG_RST)
    assert frame.type == TYPE_DATA
    assert Frame.go_away(0).type == TYPE_GO_AWAY
    assert Frame.window_update(1).type == TYPE_WINDOW_UPDATE
