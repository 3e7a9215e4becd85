"""The job kinds shipped with localai-tw (exposed as plugins by
``localai_tw/plugins/localai_builtin_jobs.py``).

- ``chat``: one chat completion.  Input: the body of ``POST /v1/chat/completions`` without
  ``stream`` (``model`` and ``messages`` required).  Result: the completion object the API
  answered.
- ``embed-batch``: ``{"model": str, "texts": [str, ...]}`` (1-1024 texts) to
  ``{"model", "dimensions", "count", "vectors": [[float, ...], ...]}``, in the order of
  ``texts``, asked in batches of 64 with a progress event after each; the result is the file
  of vectors (``GET /api/jobs/{id}/result`` serves it as a download).

Both run on an agent worker and call the cluster's own ``/v1`` (``jobs/api.py``): the request
takes the same inference path as a user's.  Both are safe to repeat (a re-run asks again).
"""

from __future__ import annotations

from typing import Any

from zope.interface import implementer

from .kinds import IJobKind, InvalidJobInput, JobFailed, JobRun

MAX_MESSAGES = 256
MAX_TEXTS = 1024
EMBED_BATCH = 64
_CHAT_FIELDS_REFUSED = ("stream", "stream_options")


def _model_of(input: dict) -> str:
    model = input.get("model")
    if not isinstance(model, str) or not model or len(model) > 255:
        raise InvalidJobInput("input.model must be the name of a model (GET /v1/models)",
                              field="input.model")
    return model


@implementer(IJobKind)
class ChatJob:
    name = "chat"
    description = ("one chat completion through the cluster's /v1/chat/completions; input is "
                   "its request body without stream")

    def validate(self, input: Any) -> dict:
        if not isinstance(input, dict):
            raise InvalidJobInput("input must be a JSON object: a /v1/chat/completions body",
                                  field="input")
        _model_of(input)
        messages = input.get("messages")
        if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
            raise InvalidJobInput(f"input.messages must be a list of 1-{MAX_MESSAGES} message "
                                  "objects", field="input.messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidJobInput("each message must be an object with a role",
                                      field=f"input.messages[{index}]")
        for name in _CHAT_FIELDS_REFUSED:
            if name in input:
                raise InvalidJobInput(f"input.{name} is not accepted: a job stores one result "
                                      "(its progress events say how it went)",
                                      field=f"input.{name}")
        return input

    async def run(self, job: JobRun) -> Any:
        await job.progress({"event": "calling", "endpoint": "/v1/chat/completions",
                            "model": job.input["model"]})
        answer = await job.api.post_json("/v1/chat/completions", job.input)
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        await job.progress({"event": "answered",
                            "completion_tokens": usage.get("completion_tokens")})
        return answer


@implementer(IJobKind)
class EmbedBatchJob:
    name = "embed-batch"
    description = (f"embeddings of up to {MAX_TEXTS} texts through the cluster's /v1/embeddings; "
                   "the result is the list of vectors")

    def validate(self, input: Any) -> dict:
        if not isinstance(input, dict):
            raise InvalidJobInput('input must be {"model": str, "texts": [str, ...]}',
                                  field="input")
        unknown = sorted(set(input) - {"model", "texts"})
        if unknown:
            raise InvalidJobInput(f"unknown field input.{unknown[0]}; expected model and texts",
                                  field=f"input.{unknown[0]}")
        _model_of(input)
        texts = input.get("texts")
        if not isinstance(texts, list) or not texts or len(texts) > MAX_TEXTS:
            raise InvalidJobInput(f"input.texts must be a list of 1-{MAX_TEXTS} strings",
                                  field="input.texts")
        for index, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise InvalidJobInput("each text must be a non-empty string",
                                      field=f"input.texts[{index}]")
        return input

    async def run(self, job: JobRun) -> Any:
        model, texts = job.input["model"], job.input["texts"]
        vectors: list[list[float]] = []
        for start in range(0, len(texts), EMBED_BATCH):
            batch = texts[start:start + EMBED_BATCH]
            answer = await job.api.post_json("/v1/embeddings", {"model": model, "input": batch})
            data = answer.get("data")
            if not isinstance(data, list) or len(data) != len(batch):
                raise JobFailed(f"the cluster API answered {len(data or [])} embeddings for "
                                f"{len(batch)} texts")
            for item in sorted(data, key=lambda d: d.get("index", 0)):
                vector = item.get("embedding") if isinstance(item, dict) else None
                if not isinstance(vector, list):
                    raise JobFailed("the cluster API answered an embedding that is not a list")
                vectors.append(vector)
            await job.progress({"event": "embedded", "done": len(vectors),
                                "total": len(texts)})
        dimensions = len(vectors[0]) if vectors else 0
        return {"model": model, "dimensions": dimensions, "count": len(vectors),
                "vectors": vectors}


chat_job = ChatJob()
embed_batch_job = EmbedBatchJob()
