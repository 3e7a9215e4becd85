"""The failure table of backend_client.classify_rpc_failure, row by row (with negatives)."""

from __future__ import annotations

import grpc
import pytest
from twisted.internet import defer
from twisted.python.failure import Failure

from localai_tw import errors
from localai_tw.frontend.inference.backend_client import classify_rpc_failure


class FakeBridge:
    def __init__(self, last=None, events=0, latest=None):
        self.last_dial_error = last
        self.route_events = events
        self.last_route_failure = latest

    def route_failure_since(self, snapshot):
        if self.route_events > snapshot and self.last_route_failure is not None:
            return self.last_route_failure
        return self.last_dial_error


class Rpc(grpc.RpcError):
    def __init__(self, code, details="d"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def classify(exc, bridge, snapshot=0, passed=False):
    return classify_rpc_failure(Failure(exc), bridge, snapshot, "n1", "Predict", passed).value


def test_unavailable_with_a_recorded_dial_error_is_that_condition():
    for condition in (errors.WorkerUnroutable("n1", "x"), errors.AbsentWithinGrace("n1", "r"),
                      errors.PeerUnreachable("p", "x"), errors.StreamRefused("n1", "unavailable",
                                                                             "refused")):
        assert classify(Rpc(grpc.StatusCode.UNAVAILABLE), FakeBridge(condition)) is condition


def test_unavailable_with_a_clean_route_is_the_backends_answer():
    result = classify(Rpc(grpc.StatusCode.UNAVAILABLE, "Socket closed"), FakeBridge())
    assert isinstance(result, errors.BackendAnswer) and result.code == "UNAVAILABLE"


def test_a_route_event_during_the_call_wins_over_a_cleared_dial_error():
    broke = errors.TransportFailure("stream broke")
    result = classify(Rpc(grpc.StatusCode.INTERNAL), FakeBridge(None, 3, broke), snapshot=2)
    assert result is broke
    # ... but an INTERNAL with no event since the call started is the backend's
    assert isinstance(classify(Rpc(grpc.StatusCode.INTERNAL), FakeBridge(None, 3, broke), 3),
                      errors.BackendAnswer)


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN,
                                  grpc.StatusCode.FAILED_PRECONDITION])
def test_other_statuses_are_backend_answers_even_with_a_dial_error_recorded(code):
    result = classify(Rpc(code), FakeBridge(errors.WorkerUnroutable("n1", "x")))
    assert isinstance(result, errors.BackendAnswer) and result.code == code.name


def test_deadlines_and_cancellation_belong_to_the_caller():
    assert isinstance(classify(Rpc(grpc.StatusCode.DEADLINE_EXCEEDED), FakeBridge()),
                      errors.CallerDeadlineExceeded)
    assert isinstance(classify(defer.CancelledError(), FakeBridge(), passed=True),
                      errors.CallerDeadlineExceeded)
    assert isinstance(classify(defer.CancelledError(), FakeBridge()), defer.CancelledError)
