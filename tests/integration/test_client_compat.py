"""Both official OpenAI clients -- ``openai`` from PyPI and ``openai`` from npm -- making every
call of the compatibility table in ``docs/openai-api.md`` against a replica that does NOT hold
the worker's tunnel (every backend call crosses the relay), with the ``echo`` backend.

Each client's outcomes must equal :data:`EXPECTED` (and the answers :data:`VALUES`), refusals
must reach the client as its exception class with status, type, code and param, and the
client's column of the table in the docs must say what the client got.  When a change makes a
row change (a refusal that becomes an honoured call), update :data:`EXPECTED` and run this file
with ``LOCALAI_UPDATE_COMPAT_TABLE=1``: it rewrites the table's rows from what the clients got.

The Node client is the version ``tests/fixtures/node-client/package-lock.json`` pins, installed
by ``.ci/install-node-client`` (``npm ci``).  Without node or the package the Node test skips
locally and fails with ``CI=true``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from urllib.parse import urlsplit

import pytest
import pytest_twisted
from twisted.internet import threads, utils

from .inference_harness import ADMIN, sha256_hex
from .harness_media import MODELS as MEDIA_MODELS, require_media

openai = pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE_CLIENT = os.path.join(ROOT, "tests", "fixtures", "node-client")
DOC = os.path.join(ROOT, "docs", "openai-api.md")
TABLE_START = "<!-- compat-table"
TABLE_END = "<!-- /compat-table -->"
WEIGHTS = b"compat weights " * 100
MODEL, EMBED_ONLY = "echo-chat", "echo-embed"
SPEAKER, LISTENER, PAINTER = "speaker", "listener", "painter"  # espeak-ng, pocketsphinx, hash-image
MODELS = sorted([MODEL, EMBED_ONLY, SPEAKER, LISTENER, PAINTER])
SPOKEN = "one two three four five"


def heard_most(text: str) -> bool:
    """PocketSphinx on espeak-ng is not exact: most of the spoken words came back."""
    heard = text.lower().replace(",", " ").replace(".", " ").split()
    return sum(word in heard for word in SPOKEN.split()) >= 3

_TOOLS = ("the test model (echo backend) cannot take tools: no template of its renders them "
          "(docs/openai-api.md, Tools)")
_JSON = "the echo backend cannot constrain its output with a grammar (Structured output)"
_LOGPROBS = "the echo backend returns no log probabilities"
_UNSUPPORTED = ("refused", 400, "unsupported_parameter")

#: Every call of the table, in its order: "works", or ("refused", status, code, param, why).
EXPECTED = {
    "models.list": "works",
    "models.retrieve": "works",
    "chat.completions.create": "works",
    "chat.completions.create stream": "works",
    "chat.completions.create n=2": "works",
    "completions.create": "works",
    "completions.create stream": "works",
    "embeddings.create": "works",
    "embeddings.create float": "works",
    "POST /v1/tokenize (raw)": "works",
    "POST /v1/detokenize (raw)": "works",
    "POST /v1/rerank (raw)": "works",
    "GET /v1/models/capabilities (raw)": "works",
    "base URL without /v1: chat.completions.create": "works",
    "base URL without /v1: embeddings.create": "works",
    "base URL without /v1: models.list": "works",
    "audio.speech.create": "works",
    "audio.transcriptions.create": "works",
    "images.generate b64_json": "works",
    "images.generate url": "works",
    "audio.speech.create mp3": "works",
    "chat tools": (*_UNSUPPORTED, "tools", _TOOLS),
    "chat response_format json_object": (*_UNSUPPORTED, "response_format", _JSON),
    "chat response_format json_schema": (*_UNSUPPORTED, "response_format", _JSON),
    "chat logprobs": (*_UNSUPPORTED, "logprobs", _LOGPROBS),
    "completions logprobs": (*_UNSUPPORTED, "logprobs", _LOGPROBS),
    "error: unknown model": ("refused", 404, "model_not_found", "model",
                             "no config names that model"),
    "error: wrong API key": ("refused", 401, "invalid_api_key", None,
                             "keys are configured and this is not one"),
    "error: wrong field type": ("refused", 400, "invalid_type", "temperature",
                                "a field of the wrong type is named, not ignored"),
    "error: a call the model's backend lacks": ("refused", 501, "not_implemented_by_backend",
                                                None, "chat on an image model: use cases "
                                                "never refuse, its backend answers"),
}

#: What the calls that work answer (the echo backend repeats its input, word by word).
VALUES = {
    "models.list": MODELS,
    "models.retrieve": MODEL,
    "chat.completions.create": "one two three",
    "chat.completions.create stream": ["one two three", 3],
    "chat.completions.create n=2": ["a b", "a b"],
    "completions.create": "a b",
    "completions.create stream": "a b c",
    "embeddings.create": [6, 6],
    "embeddings.create float": 6,
    "POST /v1/tokenize (raw)": 3,
    "POST /v1/detokenize (raw)": "red apple pie",
    "POST /v1/rerank (raw)": [1, 0],
    "GET /v1/models/capabilities (raw)": ["chat", "completion", "embeddings", "rerank",
                                          "tokenize"],
    "base URL without /v1: chat.completions.create": "at the root",
    "base URL without /v1: embeddings.create": 6,
    "base URL without /v1: models.list": MODELS,
    "audio.speech.create": "RIFF",
    "audio.speech.create mp3": "ID3",  # ffmpeg's mp3 muxer starts with an ID3v2 header
    "audio.transcriptions.create": True,
    "images.generate b64_json": "89504e47",
    "images.generate url": "/generated-images/",
}


def python_calls(base: str) -> dict:
    """The Python client's side of ``tests/fixtures/node-client/compat.mjs`` (same keys)."""
    options = dict(api_key=ADMIN, max_retries=0, timeout=60)
    client = openai.OpenAI(base_url=base + "/v1", **options)
    root = openai.OpenAI(base_url=base, **options)

    def user(content):
        return [{"role": "user", "content": content}]

    def chat(**kwargs):
        return client.chat.completions.create(model=MODEL, **kwargs).choices[0].message.content

    def stream():
        text, usage = "", None
        for chunk in client.chat.completions.create(
                model=MODEL, messages=user("one two three"), stream=True,
                stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return [text, usage]

    def raw(method, path, body=None):
        if method == "GET":
            return client.get(path, cast_to=object)
        return client.post(path, body=body, cast_to=object)

    def detokenize():
        tokens = raw("POST", "/tokenize", {"model": MODEL, "content": "red apple pie"})["tokens"]
        return raw("POST", "/detokenize", {"model": MODEL, "tokens": tokens})["content"]

    def speech():
        return client.audio.speech.create(model=SPEAKER, voice="alloy", input=SPOKEN).content

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    calls = {
        "models.list": lambda: [m.id for m in client.models.list()],
        "models.retrieve": lambda: client.models.retrieve(MODEL).id,
        "chat.completions.create": lambda: chat(messages=user("one two three")),
        "chat.completions.create stream": stream,
        "chat.completions.create n=2": lambda: [
            c.message.content for c in client.chat.completions.create(
                model=MODEL, messages=user("a b"), n=2).choices],
        "completions.create": lambda: client.completions.create(
            model=MODEL, prompt="a b c d", max_tokens=2).choices[0].text,
        "completions.create stream": lambda: "".join(
            c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt="a b c", stream=True)),
        "embeddings.create": lambda: [len(d.embedding) for d in client.embeddings.create(
            model=MODEL, input=["x", "y z"]).data],
        "embeddings.create float": lambda: len(client.embeddings.create(
            model=MODEL, input="x", encoding_format="float").data[0].embedding),
        "POST /v1/tokenize (raw)": lambda: len(raw(
            "POST", "/tokenize", {"model": MODEL, "content": "red apple pie"})["tokens"]),
        "POST /v1/detokenize (raw)": detokenize,
        "POST /v1/rerank (raw)": lambda: [r["index"] for r in raw("POST", "/rerank", {
            "model": MODEL, "query": "red apple",
            "documents": ["green pear", "red apple pie"]})["results"]],
        "GET /v1/models/capabilities (raw)": lambda: next(
            m["capabilities"] for m in raw("GET", "/models/capabilities")["data"]
            if m["id"] == MODEL),
        "base URL without /v1: chat.completions.create": lambda: root.chat.completions.create(
            model=MODEL, messages=user("at the root")).choices[0].message.content,
        "base URL without /v1: embeddings.create": lambda: len(root.embeddings.create(
            model=MODEL, input="x").data[0].embedding),
        "base URL without /v1: models.list": lambda: [m.id for m in root.models.list()],
        "audio.speech.create": lambda: speech()[:4].decode("latin-1"),
        "audio.transcriptions.create": lambda: heard_most(client.audio.transcriptions.create(
            model=LISTENER, file=("spoken.wav", speech(), "audio/wav")).text),
        "images.generate b64_json": lambda: base64.b64decode(client.images.generate(
            model=PAINTER, prompt="a red square", size="64x64",
            response_format="b64_json").data[0].b64_json)[:4].hex(),
        "images.generate url": lambda: urlsplit(client.images.generate(
            model=PAINTER, prompt="a red square", size="64x64",
            response_format="url").data[0].url).path[:len("/generated-images/")],
        "audio.speech.create mp3": lambda: client.audio.speech.create(
            model=SPEAKER, voice="alloy", input=SPOKEN,
            response_format="mp3").content[:3].decode("latin-1"),
        "chat tools": lambda: chat(messages=user("weather?"), tools=[tool]),
        "chat response_format json_object": lambda: chat(
            messages=user("json"), response_format={"type": "json_object"}),
        "chat response_format json_schema": lambda: chat(
            messages=user("json"), response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}),
        "chat logprobs": lambda: chat(messages=user("a"), logprobs=True, top_logprobs=2),
        "completions logprobs": lambda: client.completions.create(
            model=MODEL, prompt="a b", logprobs=1).choices[0].text,
        "error: unknown model": lambda: client.chat.completions.create(
            model="no-such-model", messages=user("a")).id,
        "error: wrong API key": lambda: len(openai.OpenAI(
            base_url=base + "/v1", **{**options, "api_key": "sk-wrong"}).models.list().data),
        "error: wrong field type": lambda: client.chat.completions.create(
            model=MODEL, messages=user("a"), extra_body={"temperature": "hot"}).id,
        "error: a call the model's backend lacks": lambda: client.chat.completions.create(
            model=PAINTER, messages=user("a")).id,
    }
    results = {}
    for name, call in calls.items():
        try:
            results[name] = {"ok": True, "value": call()}
        except openai.APIStatusError as e:
            results[name] = {"ok": False, "status": e.status_code, "type": e.type,
                             "code": e.code, "param": e.param}
    return {"client": {"name": "openai (Python)", "version": openai.__version__},
            "calls": results}


# -- the cluster ---------------------------------------------------------------------------------


async def relaying_replica(cluster) -> str:
    """Two replicas and one worker on the first; the URL (no /v1) of the second."""
    cluster.write_file("echo.bin", WEIGHTS)
    files = f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
    cluster.write_model("chat.yaml", (
        f"name: {MODEL}\nbackend: echo\nparameters:\n  model: echo.bin\n{files}"
        "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"
        "options: ['echo.dim:6']\n"))
    cluster.write_model("embed.yaml", (
        f"name: {EMBED_ONLY}\nbackend: echo\nembeddings: true\nparameters:\n"
        f"  model: echo.bin\n{files}"))
    for filename, text in MEDIA_MODELS.items():
        cluster.write_model(filename, text)
    owner = await cluster.frontend("replica-owner")
    relaying = await cluster.frontend("replica-relaying")
    worker = await cluster.worker("w-compat", owner)
    assert not relaying.replica.tunnels.holds(worker.node_id)
    return cluster.base_url(relaying)


# -- checks and the table ------------------------------------------------------------------------


def check(report: dict) -> None:
    got = report["calls"]
    assert list(got) == list(EXPECTED), "the client made other calls than the table's"
    for name, expected in EXPECTED.items():
        outcome = got[name]
        if expected == "works":
            assert outcome["ok"], (report["client"], name, outcome)
            assert name in VALUES, f"{name} works now: add what it answers to VALUES"
            assert outcome["value"] == VALUES[name], (report["client"], name, outcome)
        else:
            _, status, code, param, _ = expected
            assert not outcome["ok"], (report["client"], name, outcome)
            # the OpenAI error shape reached the client's exception: status, type, code, param
            assert (outcome["status"], outcome["code"], outcome["param"]) == \
                (status, code, param), (report["client"], name, outcome)
            assert outcome["type"], (report["client"], name, outcome)


def cell(outcome: dict) -> str:
    if outcome["ok"]:
        return "works"
    param = f", param `{outcome['param']}`" if outcome["param"] else ""
    return f"refused: {outcome['status']} `{outcome['code']}`{param}"


def _table_lines(text: str) -> tuple[int, int, list[str]]:
    start = text.index(TABLE_START)
    end = text.index(TABLE_END)
    body_start = text.index("\n", start) + 1
    return body_start, end, text[body_start:end].strip("\n").split("\n")


def _row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def check_doc_column(report: dict, column: int) -> None:
    """Column ``column`` (1: Python, 2: Node) of the table holds what ``report`` got; with
    ``LOCALAI_UPDATE_COMPAT_TABLE=1``, rewrite that column (and the version it names)."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    body_start, end, lines = _table_lines(text)
    header, rule, rows = _row(lines[0]), lines[1], [_row(line) for line in lines[2:]]
    table = {r[0].strip("`"): r for r in rows}
    wanted = {name: cell(report["calls"][name]) for name in EXPECTED}
    if os.environ.get("LOCALAI_UPDATE_COMPAT_TABLE") == "1":
        header[column] = f"{report['client']['name']} {report['client']['version']}"
        new_rows = []
        for name, expected in EXPECTED.items():
            row = table.get(name, [f"`{name}`", "", "", ""])
            row = (row + ["", "", "", ""])[:4]
            row[0] = f"`{name}`"
            row[column] = wanted[name]
            row[3] = "-" if expected == "works" else expected[4]
            new_rows.append(row)
        lines = ["| " + " | ".join(header) + " |", rule] + \
            ["| " + " | ".join(r) + " |" for r in new_rows]
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(text[:body_start] + "\n".join(lines) + "\n" + text[end:])
        return
    assert list(table) == list(EXPECTED), \
        "the table's rows are not the calls made; run with LOCALAI_UPDATE_COMPAT_TABLE=1"
    for name in EXPECTED:
        assert table[name][column] == wanted[name], \
            f"{name}: the table says {table[name][column]!r}, the client got " \
            f"{wanted[name]!r}; run with LOCALAI_UPDATE_COMPAT_TABLE=1"


# -- the two clients ---------------------------------------------------------------------------


@pytest.fixture
def node_binary() -> str:
    """The node binary, with the pinned package installed; else skip, or fail with CI=true
    (before the cluster is built)."""
    node = shutil.which("node")
    package = os.path.join(NODE_CLIENT, "node_modules", "openai", "package.json")
    missing = None
    if node is None:
        missing = "node is not on PATH"
    elif not os.path.exists(package):
        missing = f"the openai npm package is not installed in {NODE_CLIENT} " \
                  "(run .ci/install-node-client)"
    if missing is None:
        with open(os.path.join(NODE_CLIENT, "package-lock.json"), encoding="utf-8") as f:
            pinned = json.load(f)["packages"]["node_modules/openai"]["version"]
        with open(package, encoding="utf-8") as f:
            installed = json.load(f)["version"]
        if installed != pinned:
            missing = f"openai {installed} is installed in {NODE_CLIENT}, the lock pins " \
                      f"{pinned} (run .ci/install-node-client)"
    if missing is None:
        return node
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(missing + " [failing because CI=true]", pytrace=False)
    pytest.skip(missing)


@pytest_twisted.ensureDeferred
async def test_the_python_client_through_a_relaying_replica(cluster):
    require_media()
    base = await relaying_replica(cluster)
    report = await threads.deferToThread(python_calls, base)
    check(report)
    check_doc_column(report, 1)


@pytest_twisted.ensureDeferred
async def test_the_node_client_through_a_relaying_replica(node_binary, cluster):
    node = node_binary
    require_media()
    base = await relaying_replica(cluster)
    env = {"PATH": os.environ.get("PATH", ""), "LOCALAI_BASE": base, "LOCALAI_KEY": ADMIN,
           "LOCALAI_MODEL": MODEL, "LOCALAI_EMBED_MODEL": EMBED_ONLY,
           "LOCALAI_SPEAKER": SPEAKER, "LOCALAI_LISTENER": LISTENER, "LOCALAI_PAINTER": PAINTER,
           "LOCALAI_SPOKEN": SPOKEN}
    out, err, code = await utils.getProcessOutputAndValue(
        node, [os.path.join(NODE_CLIENT, "compat.mjs")], env=env, path=NODE_CLIENT)
    assert code == 0, err.decode("utf-8", "replace")[-4000:]
    report = json.loads(out)
    check(report)
    check_doc_column(report, 2)


def test_the_table_names_every_call_once():
    with open(DOC, encoding="utf-8") as f:
        _, _, lines = _table_lines(f.read())
    rows = [_row(line) for line in lines[2:]]
    assert [row[0].strip("`") for row in rows] == list(EXPECTED)
    assert all(len(row) == 4 and all(row) for row in rows), "a cell of the table is empty"
