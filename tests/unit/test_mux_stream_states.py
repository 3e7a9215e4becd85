"""The stream state table: every (state, event) pair either moves to the state docs/protocol.md
documents or is refused, leaving the state as it was."""

import re
from pathlib import Path

import pytest

from localai_tw.mux.session import Session, SessionConfig
from localai_tw.mux.stream import (
    TRANSITIONS,
    IllegalTransition,
    Stream,
    StreamEvent,
    StreamState,
)

EVENTS = ("ack-sent", "ack-received", "fin-sent", "fin-received", "reset", "session-ended")
_ = None  # refused

# Written out by hand, not derived from the code: this is what the code must do.
EXPECTED = {
    "idle":               (_, _, _, _, _, _),
    "syn-sent":           ("syn-sent", "open", "half-closed-local", "half-closed-remote",
                           "reset", "closed"),
    "syn-received":       ("open", "syn-received", "half-closed-local", "half-closed-remote",
                           "reset", "closed"),
    "open":               ("open", "open", "half-closed-local", "half-closed-remote",
                           "reset", "closed"),
    "half-closed-local":  ("half-closed-local", "half-closed-local", _, "closed",
                           "reset", "closed"),
    "half-closed-remote": ("half-closed-remote", "half-closed-remote", "closed", _,
                           "reset", "closed"),
    "closed":             ("closed", "closed", _, _, "reset", "closed"),
    "reset":              ("reset", "reset", _, _, _, "reset"),
}

PAIRS = [(state, event, EXPECTED[state][i])
         for state in EXPECTED for i, event in enumerate(EVENTS)]


def test_the_table_covers_every_state_and_event():
    assert set(EXPECTED) == {s.value for s in StreamState}
    assert set(EVENTS) == {e.value for e in StreamEvent}


@pytest.mark.parametrize("state,event,expected", PAIRS)
def test_every_pair_moves_to_the_documented_state_or_is_refused(state, event, expected):
    session = Session(True, SessionConfig())
    stream = Stream(session, 1, StreamState(state))
    if expected is None:
        with pytest.raises(IllegalTransition):
            stream._move(StreamEvent(event))
        assert stream.state is StreamState(state)
    else:
        stream._move(StreamEvent(event))
        assert stream.state is StreamState(expected)


def test_docs_protocol_md_shows_the_same_table():
    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip(" `") for c in line.strip().strip("|").split("|")]
        if len(cells) == 1 + len(EVENTS) and cells[0] in EXPECTED:
            rows[cells[0]] = tuple(None if c in ("refused", "-", "") else c for c in cells[1:])
    assert rows == EXPECTED
    assert re.search(r"\|\s*state\s*\|\s*" + r"\s*\|\s*".join(map(re.escape, EVENTS)), text)


def test_the_code_table_is_the_expected_one():
    code = {(s.value, e.value): t.value for (s, e), t in TRANSITIONS.items()}
    expected = {(s, e): t for s, e, t in PAIRS if t is not None}
    assert code == expected
