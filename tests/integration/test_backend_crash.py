"""A backend process that dies during a request is reported as a crash (issue 22 §1): a real
frontend (and a second one relaying), a real worker and the ``echo`` backend as a subprocess,
made to die by SIGSEGV (``echo.crash_on``), by ``exit(3)`` (``echo.exit_on``), or SIGKILLed by
the test mid-request.  The official ``openai`` client with its default retries (2) sends one
request only, because the answer says ``X-Should-Retry: false``."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc

import pytest
import pytest_twisted
from twisted.internet import threads

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.record import CRASHED

from .inference_harness import ADMIN, sha256_hex, supervisor_of
from .support import eventually

openai = pytest.importorskip("openai")

WEIGHTS = b"echo weights " * 100


def crash_models(cluster) -> None:
    cluster.write_file("echo.bin", WEIGHTS)
    for name, options in (("crashy", "['echo.crash_on:boom', 'echo.exit_on:quit']"),
                          ("slow", "['echo.delay_ms:1500']"),
                          # 200 ms before each word: the words before the crash are sent
                          ("crashy-stream", "['echo.crash_on:boom', 'echo.delay_ms:200']"),
                          ("crash-load", "['echo.crash_load']")):
        cluster.write_model(f"{name}.yaml", (
            f"name: {name}\nbackend: echo\nparameters:\n  model: echo.bin\n"
            f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
            "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"
            f"options: {options}\n"))


class Counting:
    """An ``openai`` client with the SDK's default retries whose HTTP requests are counted."""

    def __init__(self, base: str):
        self.sent = 0
        self.http = openai.DefaultHttpxClient(event_hooks={"request": [self._count]}, timeout=60)
        self.client = openai.OpenAI(base_url=base, api_key=ADMIN, http_client=self.http)
        assert self.client.max_retries == 2  # the SDK's default: what users run with

    def _count(self, request):
        self.sent += 1

    def chat(self, text: str, **kwargs):
        """(answer or None, the APIStatusError or None, requests sent for this call)."""
        before = self.sent
        try:
            answer = self.client.chat.completions.create(
                model=kwargs.pop("model", "crashy"),
                messages=[{"role": "user", "content": text}], **kwargs)
            return answer, None, self.sent - before
        except openai.APIStatusError as e:
            return None, e, self.sent - before


def crashed_records(worker, model: str) -> list:
    return [r for r in supervisor_of(worker)._ended if r.model == model and r.state == CRASHED]


@pytest_twisted.ensureDeferred
async def test_a_crash_is_reported_as_a_crash_at_the_owner_and_through_the_relay(cluster):
    crash_models(cluster)
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    worker = await cluster.worker("w-crash", owner)
    assert not relaying.replica.tunnels.holds(worker.node_id)
    at_owner = Counting(cluster.base_url(owner) + "/v1")
    by_relay = Counting(cluster.base_url(relaying) + "/v1")

    def run(client, text, **kwargs):
        return threads.deferToThread(client.chat, text, **kwargs)

    answer, error, sent = await run(at_owner, "hello there")
    assert error is None and answer.choices[0].message.content == "hello there"

    for client, where in ((at_owner, "owner"), (by_relay, "relay")):
        answer, error, sent = await run(client, "please go boom now")
        assert answer is None, where
        assert sent == 1, f"{where}: the SDK retried a crash ({sent} requests)"
        assert error.status_code == 502, (where, error.status_code, error.body)
        assert error.response.headers.get("x-should-retry") == "false"
        body = error.body
        assert body["code"] == "backend_crashed", (where, body)
        message = body["message"]
        assert "'crashy'" in message and "'w-crash'" in message, message
        assert "killed by signal SIGSEGV" in message, message
        assert "echo: crashing on purpose at 'boom' (echo.crash_on)" in message, message
        assert worker.node_id not in message  # the node by name, never its id
        # the model loads again for the next request
        answer, error, sent = await run(client, "still here")
        assert error is None and answer.choices[0].message.content == "still here", where

    assert len(crashed_records(worker, "crashy")) == 2  # one crash per call: no retry anywhere

    answer, error, sent = await run(by_relay, "time to quit")
    assert sent == 1 and error.status_code == 502 and error.body["code"] == "backend_crashed"
    assert "exited with code 3" in error.body["message"]
    assert "echo.exit_on" in error.body["message"]

    # Streamed: the words before the crash went out; the stream ends with the crash error.
    def stream(client):
        chunks, failure = [], None
        try:
            for chunk in client.client.chat.completions.create(
                    model="crashy-stream", stream=True,
                    messages=[{"role": "user", "content": "one two boom three"}]):
                chunks.append(chunk)
        except openai.APIError as e:
            failure = e
        return chunks, failure

    chunks, failure = await threads.deferToThread(stream, by_relay)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two ", text
    assert failure is not None and "SIGSEGV" in str(failure.body or failure.message)


@pytest_twisted.ensureDeferred
async def test_a_backend_sigkilled_mid_request_is_reported_with_its_signal(cluster):
    crash_models(cluster)
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    worker = await cluster.worker("w-kill", owner)
    by_relay = Counting(cluster.base_url(relaying) + "/v1")

    answer, error, _ = await threads.deferToThread(by_relay.chat, "warm", model="slow")
    assert error is None
    supervisor = supervisor_of(worker)
    record = supervisor.find("slow")

    def kill_when_busy():
        """SIGKILL once the backend says it runs the request (its answer takes 9 s)."""
        channel = grpc.insecure_channel(record.address)
        stub = backend_pb2_grpc.BackendStub(channel)
        try:
            for _ in range(600):
                status = stub.Status(backend_pb2.HealthMessage(), timeout=5,
                                     metadata=(("authorization",
                                                f"Bearer {record.grpc_token}"),))
                if status.state == backend_pb2.StatusResponse.BUSY:
                    break
                time.sleep(0.05)
        finally:
            channel.close()
        os.kill(record.pid, signal.SIGKILL)

    def killed_mid_request():
        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        try:
            return by_relay.chat("a b c d e f", model="slow")
        finally:
            killer.join()

    answer, error, sent = await threads.deferToThread(killed_mid_request)
    assert answer is None and sent == 1
    assert error.status_code == 502 and error.body["code"] == "backend_crashed", error.body
    assert "killed by signal SIGKILL" in error.body["message"]
    assert error.response.headers.get("x-should-retry") == "false"
    await eventually(lambda: crashed_records(worker, "slow"), what="the crash recorded")
    answer, error, _ = await threads.deferToThread(by_relay.chat, "again", model="slow")
    assert error is None and answer.choices[0].message.content == "again"


@pytest_twisted.ensureDeferred
async def test_the_node_client_does_not_retry_a_crash_either(cluster):
    """The official Node client (tests/fixtures/node-client, pinned) with its default retries,
    through the relay: one request, 502 backend_crashed, ``x-should-retry: false``."""
    import json
    import shutil

    from twisted.internet import utils

    NODE_CLIENT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                               "node-client")

    node = shutil.which("node")
    if node is None or not os.path.exists(os.path.join(NODE_CLIENT, "node_modules", "openai")):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("node or the openai npm package is missing (run "
                        ".ci/install-node-client) [failing because CI=true]", pytrace=False)
        pytest.skip("node or the openai npm package is missing (run .ci/install-node-client)")
    crash_models(cluster)
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    worker = await cluster.worker("w-node", owner)
    env = {"PATH": os.environ.get("PATH", ""), "LOCALAI_BASE": cluster.base_url(relaying),
           "LOCALAI_KEY": ADMIN, "LOCALAI_MODEL": "crashy", "LOCALAI_PROMPT": "boom"}
    out, err, code = await utils.getProcessOutputAndValue(
        node, [os.path.join(NODE_CLIENT, "crash.mjs")], env=env, path=NODE_CLIENT)
    assert code == 0, err.decode("utf-8", "replace")[-4000:]
    report = json.loads(out)
    assert report["maxRetries"] == 2  # the client's default
    assert report["outcome"] == "error" and report["sent"] == 1, report
    assert report["status"] == 502 and report["code"] == "backend_crashed", report
    assert report["shouldRetry"] == "false" and "SIGSEGV" in report["message"], report
    assert len(crashed_records(worker, "crashy")) == 1


@pytest_twisted.ensureDeferred
async def test_a_crash_while_loading_is_a_load_failure_remembered_as_before(cluster):
    crash_models(cluster)
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    worker = await cluster.worker("w-load", owner)
    by_relay = Counting(cluster.base_url(relaying) + "/v1")
    for attempt in range(2):
        answer, error, sent = await threads.deferToThread(by_relay.chat, "hi",
                                                          model="crash-load")
        assert sent == 1 and error.status_code == 500, (attempt, error.body)
        assert error.body["code"] == "model_load_failed"
        assert "killed by signal SIGSEGV while loading the model" in error.body["message"]
        assert "echo: crashing on purpose while loading" in error.body["message"]
    # the second request got the remembered failure: one backend process crashed, not two
    assert len(crashed_records(worker, "crash-load")) == 1
