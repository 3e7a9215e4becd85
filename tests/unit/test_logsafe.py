"""Untrusted values reach a log line escaped, on one line, bounded."""

from localai_tw.logsafe import MAX_LOGGED_CHARS, untrusted


def test_control_characters_become_visible_escapes():
    assert untrusted("w1\r\n2026 [-] forged\x1b[31m\x00") == "w1\\x0d\\x0a2026 [-] forged\\x1b[31m\\x00"


def test_lone_surrogates_and_bytes_are_escaped():
    assert untrusted("a\ud800b") == "a\\ud800b"
    assert untrusted(b"id\xff\n") == "id\\xff\\x0a"


def test_long_values_are_cut_and_say_by_how_much():
    text = untrusted("x" * 5000)
    assert text == "x" * MAX_LOGGED_CHARS + f"...(+{5000 - MAX_LOGGED_CHARS} chars)"


def test_ordinary_names_are_unchanged():
    assert untrusted("gpu-node-7 é") == "gpu-node-7 é"
