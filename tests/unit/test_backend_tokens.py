"""How a replica learns the gRPC token of a backend process (``frontend/inference/backend_client.py``
``BackendTokens``): asked once per (node, port) over the control channel, remembered, asked
again once forgotten; an older worker that does not serve ``backend.token`` gets the
registration token its backends were started with."""

from __future__ import annotations

from twisted.internet import defer

from localai_tw import errors
from localai_tw.frontend.inference.backend_client import BackendTokens


class Control:
    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    def call(self, node_id, verb, body, timeout=None):
        self.calls.append((node_id, verb, body))
        if isinstance(self.answer, Exception):
            return defer.fail(self.answer)
        return defer.succeed(self.answer)


def _value(d):
    results = []
    d.addBoth(results.append)
    [result] = results
    return result


def test_a_token_is_asked_once_and_asked_again_when_forgotten():
    control = Control({"token": "t-1", "error": ""})
    tokens = BackendTokens(control, fallback="registration")
    assert _value(tokens.get("n1", 50001)) == "t-1"
    assert _value(tokens.get("n1", 50001)) == "t-1"
    assert control.calls == [("n1", "backend.token", {"port": 50001})]
    tokens.forget("n1", 50001)
    control.answer = {"token": "t-2", "error": ""}
    assert _value(tokens.get("n1", 50001)) == "t-2"
    assert len(control.calls) == 2


def test_a_token_answered_by_backend_start_is_not_asked():
    control = Control({"token": "unused"})
    tokens = BackendTokens(control)
    tokens.remember("n1", 50002, "from-start")
    assert _value(tokens.get("n1", 50002)) == "from-start"
    assert control.calls == []
    tokens.forget("n1")  # a node forgotten: all its ports
    assert _value(tokens.get("n1", 50002)) == "unused"


def test_no_backend_on_the_port_is_no_token_and_is_not_remembered():
    control = Control({"token": "", "error": "no backend is running on port 50003"})
    tokens = BackendTokens(control, fallback="registration")
    assert _value(tokens.get("n1", 50003)) == ""
    assert _value(tokens.get("n1", 50003)) == ""
    assert len(control.calls) == 2


def test_an_older_worker_gets_the_registration_token_asked_once():
    control = Control(errors.VerbNotServed("n1", "backend.token"))
    tokens = BackendTokens(control, fallback="registration")
    assert _value(tokens.get("n1", 50004)) == "registration"
    assert _value(tokens.get("n1", 50004)) == "registration"
    assert len(control.calls) == 1
