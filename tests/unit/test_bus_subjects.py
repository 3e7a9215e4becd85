"""Pure parts of the bus: subjects, channels, the envelope encoder and the inline decision."""

import json

import pytest
from hypothesis import given, strategies as st

from localai_tw.bus.pgbus import (
    MAX_BROADCAST_BYTES,
    NOTIFY_LIMIT_BYTES,
    ROOTS,
    InvalidSubject,
    PayloadNotJSON,
    PayloadTooLarge,
    UnservedSubject,
    channel_for,
    encode_envelope,
    fits_inline,
    subject_matches,
)


def test_channel_is_per_root_from_a_closed_set():
    assert channel_for("jobs.42.progress") == "localai_jobs"
    assert channel_for("prefixcache.observe") == "localai_prefixcache"
    assert channel_for("claims.wake") == "localai_claims"
    assert channel_for("state") == "localai_state"
    with pytest.raises(UnservedSubject):
        channel_for("jobs2.x")
    with pytest.raises(UnservedSubject):
        channel_for("*.x", pattern=True)
    assert {"jobs", "agent", "gallery", "cache", "staging", "prefixcache", "responses",
            "state"} <= ROOTS


@pytest.mark.parametrize("bad", ["", "jobs.", ".jobs", "jobs..x", "jobs.>", "jobs.a>",
                                 "jobs.a b", "jobs." + "x" * 300])
def test_malformed_subjects_are_refused(bad):
    with pytest.raises(InvalidSubject):
        channel_for(bad, pattern=True)


def test_publish_subjects_may_not_hold_wildcards():
    with pytest.raises(InvalidSubject):
        channel_for("jobs.*")
    assert channel_for("jobs.*", pattern=True) == "localai_jobs"


@pytest.mark.parametrize("pattern,subject,expected", [
    ("jobs.a.progress", "jobs.a.progress", True),
    ("jobs.*.progress", "jobs.a.progress", True),
    ("jobs.*.progress", "jobs.a.result", False),
    ("jobs.*", "jobs.a.progress", False),
    ("jobs.*.*", "jobs.a.progress", True),
    ("jobs.*.progress", "jobs.progress", False),
    ("jobs", "jobs", True),
])
def test_subject_matching(pattern, subject, expected):
    assert subject_matches(pattern, subject) is expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(subject=st.from_regex(r"jobs(\.[a-z0-9_-]{1,8}){0,3}", fullmatch=True),
       payload=json_values)
def test_envelope_is_compact_json_of_subject_and_payload(subject, payload):
    text = encode_envelope(subject, payload)
    assert text == json.dumps({"s": subject, "d": payload}, separators=(",", ":"))
    assert text.isascii()
    assert json.loads(text) == {"s": subject, "d": payload}
    assert fits_inline(subject, payload) is (len(text.encode()) < NOTIFY_LIMIT_BYTES)


def test_fits_inline_boundary_is_8000_encoded_bytes():
    subject = "cache.invalidate.models"
    overhead = len(encode_envelope(subject, ""))
    assert fits_inline(subject, "a" * (7999 - overhead))
    assert not fits_inline(subject, "a" * (8000 - overhead))
    # non-ASCII is escaped, so it counts six bytes a character
    assert not fits_inline(subject, "é" * ((7999 - overhead) // 6 + 1))


def test_payload_errors_are_clear():
    with pytest.raises(PayloadNotJSON):
        fits_inline("jobs.x", object())
    with pytest.raises(PayloadNotJSON):
        fits_inline("jobs.x", float("nan"))
    with pytest.raises(PayloadTooLarge):
        fits_inline("jobs.x", "a" * MAX_BROADCAST_BYTES)
