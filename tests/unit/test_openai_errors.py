"""Every failure the router can report maps to one HTTP answer (the table in
docs/openai-api.md), both from error_for and end to end through the resource."""

from __future__ import annotations

import pytest

from localai_tw.db import pool as db_pool
from localai_tw.errors import (
    AbsentWithinGrace,
    BackendAnswer,
    BackendCrashed,
    CallerDeadlineExceeded,
    ControlVerbFailed,
    PeerRejected,
    PeerUnreachable,
    PoolClosed,
    StreamRefused,
    TransportFailure,
    TunnelProtocolError,
    WorkerBusy,
    WorkerGone,
    WorkerUnroutable,
)
from localai_tw.frontend.inference.interfaces import (
    ModelDownloadFailed,
    ModelFileMismatch,
    ModelLoadFailed,
    ModelNotFound,
    NoNodeAvailable,
)
from localai_tw.frontend.api.openai import OpenAIError, error_for
from localai_tw.frontend.inference.scratch import AudioConversionFailed

from .support_openai import FakeRouter, call, make_site, model_config

CASES = [
    # (error, status, type, code, retry-after, text the message must hold)
    (ModelNotFound("m"), 404, "invalid_request_error", "model_not_found", None, "'m'"),
    (NoNodeAvailable("m", "no backend node matches the selector"), 503,
     "service_unavailable", "no_node_available", None, "no route"),
    (WorkerUnroutable("n1", "not held here and no live owner"), 503, "service_unavailable",
     "no_route", None, "no route"),
    (WorkerGone("n1", 30), 503, "service_unavailable", "no_route", None, "departed"),
    (AbsentWithinGrace("n1", "reconnecting"), 503, "service_unavailable",
     "worker_reconnecting", "5", "reconnect"),
    (PeerUnreachable("r2", "connection refused"), 503, "service_unavailable",
     "peer_unreachable", "2", "retry"),
    (PoolClosed(), 503, "service_unavailable", "peer_unreachable", "2", "shutting down"),
    (PeerRejected("r2", "401"), 500, "server_error", "peer_rejected", None,
     "configuration"),
    (ModelLoadFailed("m", "n1", "out of memory loading weights"), 500, "server_error",
     "model_load_failed", None, "out of memory loading weights"),
    (ModelFileMismatch("model m: file w.bin has sha256 aa, the config says bb"), 500,
     "server_error", "model_file_mismatch", None, "w.bin has sha256 aa, the config says bb"),
    (ModelDownloadFailed("model m: downloading w.bin from https://h/w.bin: the connection "
                         "broke"), 502, "upstream_error", "model_download_failed", "5",
     "the connection broke"),
    (BackendAnswer("n1", "INVALID_ARGUMENT", "prompt too long"), 400,
     "invalid_request_error", "backend_refused_request", None, "prompt too long"),
    (BackendAnswer("n1", "UNIMPLEMENTED", "no Embedding"), 501, "server_error",
     "not_implemented_by_backend", None, "no Embedding"),
    (BackendAnswer("n1", "DEADLINE_EXCEEDED", "slow"), 504, "timeout_error", "timeout", None,
     "slow"),
    (BackendAnswer("n1", "UNKNOWN", "Unexpected <class 'ValueError'>: boom"), 500,
     "server_error", "backend_error", None, "boom"),
    (BackendAnswer("n1", "FAILED_PRECONDITION", "model not loaded"), 500,
     "server_error", "backend_error", None, "model not loaded"),
    (BackendAnswer("n1", "UNAVAILABLE", "socket closed"), 503, "service_unavailable",
     "backend_unavailable", "1", "socket closed"),
    (BackendAnswer("n1", "RESOURCE_EXHAUSTED", "queue full"), 503, "service_unavailable",
     "backend_unavailable", "1", "queue full"),
    (BackendCrashed("5b1c2a34-0d1e-4f5a-8b9c-0a1b2c3d4e5f", "m", "killed by signal SIGSEGV",
                    ["loading", "Segmentation fault in ggml_backend_amx_mul_mat\x1b[0m"],
                    node_name="gpu-1", signal="SIGSEGV"), 502, "upstream_error",
     "backend_crashed", None,
     "the backend of model 'm' on node 'gpu-1' crashed during the call: killed by signal "
     "SIGSEGV; its last output: loading | Segmentation fault in ggml_backend_amx_mul_mat?[0m"),
    (AudioConversionFailed("n1", "ffmpeg-missing", "ffmpeg is not installed on worker w1; "
                           "install Debian's ffmpeg there", of_input=False), 400,
     "invalid_request_error", "ffmpeg_not_installed", None, "ffmpeg is not installed on worker"),
    (AudioConversionFailed("n1", "failed", "ffmpeg could not convert the audio: Invalid data",
                           of_input=True), 400, "invalid_request_error",
     "unsupported_audio_format", None, "Invalid data"),
    (AudioConversionFailed("n1", "failed", "ffmpeg could not convert the audio: no encoder",
                           of_input=False), 500, "server_error", "audio_conversion_failed",
     None, "no encoder"),
    (AudioConversionFailed("n1", "timeout", "ffmpeg took longer than 300 s", of_input=False),
     504, "timeout_error", "timeout", None, "longer than 300 s"),
    (WorkerBusy("n1"), 503, "service_unavailable", "worker_busy", "1", "no free slot"),
    (StreamRefused("n1", "unavailable", "backend port closed"), 502, "upstream_error",
     "worker_error", None, "backend port closed"),
    (StreamRefused("n1", "bad-request", "malformed stream header"), 500, "server_error",
     "worker_error", None, "malformed stream header"),
    (ControlVerbFailed("n1", "backend.start", "no such backend"), 500, "server_error",
     "worker_error", None, "no such backend"),
    (CallerDeadlineExceeded("waiting for the model to load"), 504, "timeout_error",
     "timeout", None, "deadline"),
    (TransportFailure("stream reset"), 502, "upstream_error", "transport_failure", None,
     "nothing is known"),
    (TunnelProtocolError("bad frame"), 502, "upstream_error", "protocol_error", None,
     "bad frame"),
    (db_pool.DatabaseUnavailable("cannot connect to PostgreSQL at host=db.internal"), 503,
     "service_unavailable", "database_unavailable", "5", "database is unavailable"),
    (db_pool.PoolClosed("database pool closed"), 503, "service_unavailable",
     "database_unavailable", "5", "database is unavailable"),
    (RuntimeError("secret internal detail"), 500, "server_error", "internal_error", None,
     "see the frontend log"),
]


@pytest.mark.parametrize("error, status, type_, code, retry, text", CASES,
                         ids=[type(c[0]).__name__ + "-" + str(c[3]) for c in CASES])
def test_error_for(error, status, type_, code, retry, text):
    answer = error_for(error)
    assert isinstance(answer, OpenAIError)
    assert (answer.status, answer.type, answer.code) == (status, type_, code)
    assert answer.headers.get("Retry-After") == retry
    assert text in answer.message


#: Answers the same request would get again: the official clients must not retry them.
DETERMINISTIC = {"model_load_failed", "not_implemented_by_backend", "backend_error",
                 "peer_rejected", "model_config_invalid", "template_error",
                 "model_file_mismatch", "backend_crashed", "audio_conversion_failed"}


@pytest.mark.parametrize("error, status, type_, code, retry, text", CASES,
                         ids=[type(c[0]).__name__ + "-" + str(c[3]) for c in CASES])
def test_deterministic_failures_tell_clients_not_to_retry(error, status, type_, code, retry,
                                                          text):
    # Both official SDKs retry every 5xx twice unless X-Should-Retry says false; a transient
    # condition (no route, reconnecting, busy, unreachable peer) must stay retryable.
    answer = error_for(error)
    deterministic = code in DETERMINISTIC or (code == "worker_error" and status == 500)
    assert answer.headers.get("X-Should-Retry") == ("false" if deterministic else None)
    assert deterministic or status != 500 or code == "internal_error"


def test_a_crash_quotes_the_last_output_lines_within_a_bound_and_no_node_id():
    lines = [f"line {i} " + "x" * 290 for i in range(10)]
    crash = BackendCrashed("5b1c2a34-0d1e-4f5a-8b9c-0a1b2c3d4e5f", "m", "exited with code 3",
                           lines, node_name="w1", fallback="the next start turns X off")
    answer = error_for(crash)
    assert "line 9 " in answer.message and "line 0 " not in answer.message
    assert len(answer.message) < 1600
    assert "5b1c2a34" not in answer.message
    assert answer.message.endswith("the next start turns X off")


def test_internal_errors_never_leak_their_text():
    assert "secret" not in error_for(RuntimeError("secret internal detail")).message
    outage = db_pool.DatabaseUnavailable("cannot connect to PostgreSQL at host=db.internal")
    assert "db.internal" not in error_for(outage).message


@pytest.mark.parametrize("error, status, type_, code, retry, text",
                         [c for c in CASES if not isinstance(c[0], ModelNotFound)],
                         ids=[type(c[0]).__name__ + "-" + str(c[3]) for c in CASES
                              if not isinstance(c[0], ModelNotFound)])
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "m", "stream": True,
                              "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"model": "m", "prompt": "x"}),
    ("/v1/embeddings", {"model": "m", "input": "x"}),
], ids=["chat", "chat-stream", "completions", "embeddings"])
def test_each_condition_end_to_end(error, status, type_, code, retry, text, path, body):
    router = FakeRouter([model_config("m")])
    router.fail_with = error
    response = call(make_site(router), "POST", path, body)
    assert response.status == status
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["type"] == type_
    assert response.header("retry-after") == retry


def test_model_removed_between_lookup_and_call_is_404():
    router = FakeRouter([model_config("m")])
    router.fail_with = ModelNotFound("m")
    response = call(make_site(router), "POST", "/v1/completions", {"model": "m", "prompt": "x"})
    assert response.status == 404 and response.json()["error"]["code"] == "model_not_found"


NODE = "3f2c9a4e-8d1b-4c7a-9e0f-1a2b3c4d5e6f"  # node ids are UUIDs
PEER = "replica-b"


@pytest.mark.parametrize("error", [
    NoNodeAvailable("m", f"no healthy backend node (skipped gone nodes: {NODE})"),
    WorkerUnroutable(NODE, f"relay refused (not-held): {PEER} does not hold {NODE}"),
    WorkerGone(NODE, 30),
    AbsentWithinGrace(NODE, "reconnecting", RuntimeError(f"owner {PEER} says so")),
    PeerUnreachable(PEER, "connection refused"),
    PeerRejected(PEER, "401"),
    ModelLoadFailed("m", NODE, "out of memory"),
    BackendAnswer(NODE, "UNKNOWN", "boom"),
    BackendAnswer(NODE, "DEADLINE_EXCEEDED", "slow"),
    WorkerBusy(NODE),
    StreamRefused(NODE, "unavailable", "backend port closed"),
    ControlVerbFailed(NODE, "backend.start", "no such backend"),
    CallerDeadlineExceeded(f"Predict on worker {NODE} port 30001"),
    TransportFailure(f"grpc stream to worker {NODE} port 30001: reset"),
    TunnelProtocolError(f"backend.start on {NODE} answered an unusable address 'x'"),
], ids=lambda e: type(e).__name__)
def test_messages_name_the_condition_never_a_node_or_replica_id(error):
    message = error_for(error).message
    assert NODE not in message and PEER not in message, message
    assert "worker " + NODE not in message
