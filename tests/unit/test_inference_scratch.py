"""The router's file-carrying calls (``tts``, ``transcribe``, ``generate_image``) keep the four
conditions apart: a route failure while making the node's scratch directory (before any backend
ran) is served from another node and reaps nothing; a worker's answer is raised and reaps
nothing; a backend's success=false is its answer; the directory is removed whatever happened.
Fakes for the chooser, the bridges and ``WorkerScratch``; no I/O."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, task

from localai_tw import errors
from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.router import InferenceRouter
from localai_tw.localai.model_config import parse_model_config
from localai_tw.frontend.inference.placement import Placement
from localai_tw.frontend.inference.scratch import AudioConversionFailed, BackendOutputTooLarge


class Catalog:
    models_dir = "/nowhere"

    def __init__(self, *configs):
        self._configs = {c.name: c for c in configs}

    def get(self, name):
        return self._configs.get(name)


class Chooser:
    def __init__(self, nodes):
        self.nodes = list(nodes)
        self.reaped = []
        self.gone = []

    async def loaded_placement(self, config, exclude):
        for node in self.nodes:
            if node not in exclude:
                return Placement(config.name, node, "127.0.0.1:5000", config.name)
        return None

    async def reap(self, placement, evidence):
        self.reaped.append((placement.node_id, evidence))
        return True

    async def mark_gone(self, node_id):
        self.gone.append(node_id)

    def touch(self, placement):
        pass

    def forget(self, placement):  # the warm-path cache's hook (no cache here)
        pass


class Client:
    def __init__(self, node_id, log):
        self.node_id = node_id
        self.log = log

    def call(self, method, request, deadline):
        self.log.append((self.node_id, method, request.dst))
        if method == "TTS":
            return defer.succeed(backend_pb2.Result(success=self.node_id != "refuses",
                                                    message="espeak-ng failed: no voice"))
        return defer.succeed(backend_pb2.TranscriptResult(text="one two"))


class Clients:
    def __init__(self):
        self.log = []

    def client(self, node_id, port):
        return Client(node_id, self.log)


class Directory:
    def __init__(self, scratch, node_id):
        self.scratch = scratch
        self.node_id = node_id
        self.path = f"/data/{node_id}/staging/scratch/" + "a" * 32

    def path_of(self, name):
        return f"{self.path}/{name}"

    async def put(self, local_path, name):
        return self.path_of(name)

    async def fetch(self, name, max_bytes):
        if self.scratch.fetch_error is not None:
            raise self.scratch.fetch_error
        self.scratch.fetched.append(name)
        return b"RIFF....WAVE"

    async def convert(self, src, dst, output_format, max_bytes, *, input_format=None):
        self.scratch.converted.append((src, dst, output_format, input_format))
        if self.scratch.convert_error is not None:
            raise self.scratch.convert_error
        return self.path_of(dst)


class Using:
    def __init__(self, scratch, node_id):
        self.scratch = scratch
        self.node_id = node_id

    async def __aenter__(self):
        failure = self.scratch.create_errors.get(self.node_id)
        if failure is not None:
            raise failure
        self.scratch.made.append(self.node_id)
        return Directory(self.scratch, self.node_id)

    async def __aexit__(self, *exc):
        self.scratch.removed.append(self.node_id)
        return False


class Scratch:
    def __init__(self, create_errors=None, fetch_error=None, convert_error=None):
        self.create_errors = dict(create_errors or {})
        self.fetch_error = fetch_error
        self.convert_error = convert_error
        self.converted = []
        self.fetched = []
        self.made = []
        self.removed = []

    def directory(self, node_id, deadline=None):
        return Using(self, node_id)


SPEAKER = parse_model_config({"name": "speaker", "backend": "espeak-ng"})
LISTENER = parse_model_config({"name": "listener", "backend": "pocketsphinx"})


def router(nodes, scratch):
    chooser = Chooser(nodes)
    clients = Clients()
    return InferenceRouter(Catalog(SPEAKER, LISTENER), chooser, None, None, clients,
                           task.Clock(), scratch), chooser, clients


@pytest_twisted.ensureDeferred
async def test_tts_writes_in_the_workers_scratch_and_reads_it_back():
    scratch = Scratch()
    r, chooser, clients = router(["a"], scratch)
    served = await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024)
    assert served.value == b"RIFF....WAVE" and served.served_by == "a"
    assert clients.log == [("a", "TTS", "/data/a/staging/scratch/" + "a" * 32 + "/speech.wav")]
    assert scratch.made == scratch.removed == ["a"]


@pytest.mark.parametrize("condition", [
    errors.WorkerUnroutable("a", "no route"),
    errors.AbsentWithinGrace("a", "reconnecting"),
])
@pytest_twisted.ensureDeferred
async def test_a_route_failure_making_the_directory_is_served_elsewhere(condition):
    scratch = Scratch(create_errors={"a": condition})
    r, chooser, clients = router(["a", "b"], scratch)
    served = await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024)
    assert served.served_by == "b"
    assert chooser.reaped == []  # nothing about a backend was learned on "a"
    assert [node for node, _, _ in clients.log] == ["b"]


@pytest_twisted.ensureDeferred
async def test_an_unreachable_peer_is_raised_never_acted_on():
    scratch = Scratch(create_errors={"a": errors.PeerUnreachable("replica-x", "down")})
    r, chooser, clients = router(["a", "b"], scratch)
    with pytest.raises(errors.PeerUnreachable):
        await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024)
    assert chooser.reaped == [] and chooser.gone == [] and clients.log == []


@pytest_twisted.ensureDeferred
async def test_a_worker_that_does_not_serve_scratch_is_its_answer_not_a_reason_to_reap():
    scratch = Scratch(create_errors={"a": errors.VerbNotServed("a", "scratch.create")})
    r, chooser, clients = router(["a", "b"], scratch)
    with pytest.raises(errors.VerbNotServed):
        await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024)
    assert chooser.reaped == [] and clients.log == []


@pytest_twisted.ensureDeferred
async def test_output_too_large_is_raised_after_the_call_and_the_directory_removed():
    scratch = Scratch(fetch_error=BackendOutputTooLarge("a", "too big"))
    r, chooser, clients = router(["a", "b"], scratch)
    with pytest.raises(BackendOutputTooLarge):
        await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024)
    assert len(clients.log) == 1 and chooser.reaped == []  # the call ran: never repeated
    assert scratch.removed == ["a"]


@pytest_twisted.ensureDeferred
async def test_success_false_is_the_backends_answer():
    scratch = Scratch()
    r, chooser, clients = router(["refuses"], scratch)
    with pytest.raises(errors.BackendAnswer) as caught:
        await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024)
    assert "no voice" in caught.value.details and chooser.reaped == []
    assert scratch.removed == ["refuses"]


@pytest_twisted.ensureDeferred
async def test_transcription_puts_the_audio_and_sends_its_worker_path():
    scratch = Scratch()
    r, chooser, clients = router(["a"], scratch)
    served = await r.transcribe("listener", backend_pb2.TranscriptRequest(), "/tmp/x",
                                "audio.wav")
    assert served.value.text == "one two"
    assert clients.log == [("a", "AudioTranscription",
                            "/data/a/staging/scratch/" + "a" * 32 + "/audio.wav")]
    assert scratch.removed == ["a"]


@pytest_twisted.ensureDeferred
async def test_a_model_whose_config_lists_no_transcript_is_still_asked():
    # LocalAI's rule: use cases never refuse a request, the backend serving the model answers
    scratch = Scratch()
    r, chooser, clients = router(["a"], scratch)
    await r.transcribe("speaker", backend_pb2.TranscriptRequest(), "/tmp/x", "audio.wav")
    assert [(node, method) for node, method, _ in clients.log] == [("a", "AudioTranscription")]
    assert scratch.made == ["a"] and scratch.removed == ["a"]


@pytest_twisted.ensureDeferred
async def test_a_route_failure_after_the_backend_answered_is_never_retried():
    """Reading the output back failed on the route: the work ran, so no other node repeats it
    (and nothing is reaped)."""
    scratch = Scratch(fetch_error=errors.WorkerUnroutable("a", "the tunnel went away"))
    r, chooser, clients = router(["a", "b"], scratch)
    with pytest.raises(errors.WorkerUnroutable):
        await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024)
    assert [node for node, _, _ in clients.log] == ["a"] and chooser.reaped == []
    assert scratch.removed == ["a"]


@pytest_twisted.ensureDeferred
async def test_tts_in_another_format_is_converted_on_the_serving_node():
    scratch = Scratch()
    r, chooser, clients = router(["a"], scratch)
    served = await r.tts("speaker", backend_pb2.TTSRequest(text="hi"), 1024,
                         response_format="mp3")
    assert served.served_by == "a"
    assert scratch.converted == [("speech.wav", "speech.mp3", "mp3", None)]
    assert scratch.fetched == ["speech.mp3"] and scratch.removed == ["a"]


@pytest_twisted.ensureDeferred
async def test_a_non_wav_upload_is_converted_and_the_wav_sent_to_the_backend():
    scratch = Scratch()
    r, chooser, clients = router(["a"], scratch)
    await r.transcribe("listener", backend_pb2.TranscriptRequest(), "/tmp/x", "upload.mp3",
                       convert_from="mp3")
    assert scratch.converted == [("upload.mp3", "audio.wav", "wav16k", "mp3")]
    assert clients.log == [("a", "AudioTranscription",
                            "/data/a/staging/scratch/" + "a" * 32 + "/audio.wav")]


@pytest_twisted.ensureDeferred
async def test_a_failed_conversion_is_raised_reaps_nothing_and_reaches_no_backend():
    failure = AudioConversionFailed("a", "ffmpeg-missing", "ffmpeg is not installed", True)
    scratch = Scratch(convert_error=failure)
    r, chooser, clients = router(["a", "b"], scratch)
    with pytest.raises(AudioConversionFailed):
        await r.transcribe("listener", backend_pb2.TranscriptRequest(), "/tmp/x",
                           "upload.ogg", convert_from="ogg")
    assert clients.log == [] and chooser.reaped == [] and scratch.removed == ["a"]
