"""``frontend/inference/honoured.py``: a stream asking for log probabilities is held until its
first reply that carries them, then delivered in order; one that never carries them, with
text, is refused before anything was delivered."""

from __future__ import annotations

import pytest
import pytest_twisted

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.honoured import HeldUntilLogprobs, check_reply
from localai_tw.frontend.inference.interfaces import CapabilityNotHonoured

ASKED = backend_pb2.PredictOptions(Logprobs=1)


def reply(text: str, logprobs: bytes = b"") -> backend_pb2.Reply:
    return backend_pb2.Reply(message=text.encode(), logprobs=logprobs)


async def feed(gate: HeldUntilLogprobs, replies) -> None:
    for r in replies:
        outcome = gate.reply(r)
        if outcome is not None:
            await outcome
    await gate.end()


@pytest_twisted.ensureDeferred
async def test_replies_wait_for_the_first_log_probabilities_then_go_in_order():
    delivered = []
    gate = HeldUntilLogprobs("m", ASKED, "n1", lambda r: delivered.append(r.message))
    # the built-in transformers sends a token's entry one reply late
    await feed(gate, [reply("a"), reply("b", b'{"content":[1]}'), reply("c")])
    assert delivered == [b"a", b"b", b"c"]


@pytest_twisted.ensureDeferred
async def test_a_stream_with_text_and_no_log_probabilities_delivers_nothing():
    delivered = []
    gate = HeldUntilLogprobs("m", ASKED, "n1", lambda r: delivered.append(r.message))
    with pytest.raises(CapabilityNotHonoured, match="does not honour logprobs"):
        await feed(gate, [reply("a"), reply("b")])
    assert delivered == []


@pytest_twisted.ensureDeferred
async def test_without_logprobs_asked_nothing_is_held_or_checked():
    delivered = []
    gate = HeldUntilLogprobs("m", backend_pb2.PredictOptions(), "n1",
                             lambda r: delivered.append(r.message))
    await feed(gate, [reply("a"), reply("b")])
    assert delivered == [b"a", b"b"]
    check_reply("m", backend_pb2.PredictOptions(), reply("a"), "n1")  # not asked: no check
    check_reply("m", ASKED, reply(""), "n1")  # no text (a closing usage reply): no check
    with pytest.raises(CapabilityNotHonoured):
        check_reply("m", ASKED, reply("a"), "n1")
