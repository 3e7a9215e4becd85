"""The ``transformers`` and ``sentence-transformers`` backends: one ``backend.Backend`` program
over Hugging Face libraries.  Run as::

    python -m localai_tw.backends.builtin.huggingface --kind transformers --addr HOST:PORT
    python -m localai_tw.backends.builtin.huggingface --kind sentence-transformers --addr ...

It behaves like LocalAI's own ``backend/python/transformers`` for the subset a worker uses
(contract sheet §4.6): ``LoadModel`` prefers ``ModelFile`` when it exists on disk (then loads
with ``local_files_only``), else ``Model`` (a hub id or a path); ``Type`` picks the model class
(``AutoModelForCausalLM`` by default; ``SentenceTransformer`` — also forced by
``--kind sentence-transformers`` — loads a sentence-transformers model); a failed load is
``success=false`` with the reason, never a gRPC error; a ``Model`` that is neither an existing
path nor loadable from the hub fails with what to do (point ``parameters.model`` at a local
directory, or give the worker the hub), not only the library's text.  Generation on a loaded
sentence-transformers model is ``UNIMPLEMENTED`` (never "model not loaded", which makes the
frontend reap and reload the model).  ``Predict``/``PredictStream`` generate from ``Prompt``
(or from ``Messages`` through the tokenizer's chat template when ``UseTokenizerTemplate``),
honouring ``Tokens``, ``Temperature`` (0 = greedy), ``TopP``,
``TopK``, ``Seed`` and ``StopPrompts``; ``Tools`` go to the chat template (``tools=``) with
the messages' ``tool_calls`` / ``tool_call_id`` (``INVALID_ARGUMENT`` when the template never
reads ``tools``: they would be ignored); ``Logprobs`` / ``TopLogprobs`` fill
``Reply.logprobs`` (LocalAI's JSON, the chat shape) from the scores the sampler saw, each
stream reply carrying the entries of the tokens resolved since the last (the last token's in a
final empty reply).  ``Grammar`` is not honoured (the frontend refuses what needs it).
``Embedding`` answers one pooled vector (layout FINAL):
the sentence-transformers encoding, or the attention-mask mean of the last hidden state.
``TokenizeString`` answers ids without special tokens; ``Detokenize`` decodes ids back to text
with the same tokenizer (special tokens kept, no clean-up, as llama.cpp joins token pieces; an
id outside the vocabulary is ``INVALID_ARGUMENT``).
``Rerank`` (sentence-transformers models only) is bi-encoder reranking: the cosine similarity
of the query's and each document's embedding, best first (as ``bert-numpy`` ranks).

torch, transformers and sentence-transformers are imported inside this process only, lazily,
so the worker's base install never needs them.  The worker-side factories check that they are
importable and say which extra to install when they are not.

What this program must never do: hand proto ``Message`` objects to ``apply_chat_template``
(transformers 5 rejects them; plain dicts are built instead), or report a failed load as
success.
"""

from __future__ import annotations

import gc
import json
import os
import threading

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin import serving

KINDS = ("transformers", "sentence-transformers")
SENTENCE_TRANSFORMER = "SentenceTransformer"
DEFAULT_MAX_NEW_TOKENS = 256


def parse_options(options) -> dict[str, str]:
    parsed = {}
    for item in options:
        key, sep, value = item.partition(":")
        parsed[key.strip()] = value.strip() if sep else "true"
    return parsed


class RemoteCodeRefused(Exception):
    """The config asks for ``trust_remote_code`` and the worker does not allow it."""


class HubLoadFailed(Exception):
    """Loading ``source`` as a Hugging Face hub id failed; says what the user can do."""

    def __init__(self, source: str, cause: BaseException):
        self.source = source
        self.cause = cause
        super().__init__(
            f"{type(cause).__name__}: {' '.join(str(cause).split())} -- localai-tw: "
            f"parameters.model {source!r} is not a directory on this worker, so it was looked "
            f"up on the Hugging Face hub, and that failed. Either point parameters.model at a "
            f"local directory holding the model and its tokenizer (python -m "
            f"localai_tw.tinychat DIR writes a tiny offline one), or let this worker reach the "
            f"hub: unset HF_HUB_OFFLINE, and set HF_ENDPOINT (a mirror), HF_TOKEN or HF_HOME "
            f"(the download cache) as your hub needs.")


def _looks_like_a_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~"))


def _is_hub_failure(error: BaseException) -> bool:
    """A failure to fetch from the hub (offline, unreachable, unknown id, gated), as opposed
    to a bad option or a broken model."""
    top = type(error).__module__.split(".")[0]
    return isinstance(error, OSError) or top in ("huggingface_hub", "requests", "httpx",
                                                 "urllib3")


class HuggingFaceServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, kind: str, identity: serving.ModelIdentity):
        self.kind = kind
        self.identity = identity
        self.model = None
        self.tokenizer = None
        self.sentence_model = None
        self.device = "cpu"
        self._busy = 0
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------

    def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    def LoadModel(self, request, context):
        try:
            message = self._load(request)
        except HubLoadFailed as e:
            self._unload()
            return backend_pb2.Result(success=False, message=str(e))
        except Exception as e:  # the verdict travels in Result, as LocalAI's backends do
            self._unload()
            return backend_pb2.Result(success=False,
                                      message=f"{type(e).__name__}: {e}")
        self.identity.loaded = request.Model
        return backend_pb2.Result(success=True, message=message)

    def _load(self, request) -> str:
        if request.TrustRemoteCode and os.environ.get(serving.REMOTE_CODE_ENV) != "1":
            raise RemoteCodeRefused(
                "trust_remote_code is set in the model config, but this worker does not run a "
                "model's own code: its operator starts it with --allow-remote-code (env "
                "LOCALAI_ALLOW_REMOTE_CODE=1) to allow it, or remove trust_remote_code")
        import torch  # noqa: F401  (fail here, with the reason, if torch is missing)

        self._unload()
        source = request.Model
        local = False
        if request.ModelFile and os.path.exists(request.ModelFile):
            source, local = request.ModelFile, True
        elif source and os.path.exists(source):
            local = True
        if not source:
            raise ValueError("ModelOptions.Model (or ModelFile) is empty")
        if not local and _looks_like_a_path(source):
            raise FileNotFoundError(f"parameters.model {source!r} is not a directory on this "
                                    f"worker (a local model directory must exist where the "
                                    f"worker runs)")
        try:
            return self._load_from(request, source, local)
        except Exception as e:
            if local or not _is_hub_failure(e):
                raise
            raise HubLoadFailed(source, e) from e

    def _load_from(self, request, source: str, local: bool) -> str:
        options = parse_options(request.Options)
        self.device = options.get("device") or request.MainGPU or self._default_device()
        trust = bool(request.TrustRemoteCode)
        kind = request.Type or ("SentenceTransformer" if self.kind == "sentence-transformers"
                                else "AutoModelForCausalLM")
        if self.kind == "sentence-transformers" or kind == SENTENCE_TRANSFORMER:
            from sentence_transformers import SentenceTransformer

            self.sentence_model = SentenceTransformer(
                source, device=self.device, trust_remote_code=trust,
                local_files_only=local)
            return f"loaded sentence-transformers model {source} on {self.device}"
        import transformers

        model_class = getattr(transformers, kind, None)
        if model_class is None or not hasattr(model_class, "from_pretrained"):
            raise ValueError(f"unknown model Type {kind!r} (a transformers Auto* class)")
        dtype = self._dtype(request)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(
            source, local_files_only=local, trust_remote_code=trust)
        kwargs = {"local_files_only": local, "trust_remote_code": trust}
        if dtype is not None:
            kwargs["dtype"] = dtype
        self.model = model_class.from_pretrained(source, **kwargs)
        self.model.to(self.device)
        self.model.eval()
        return f"loaded {kind} {source} on {self.device}"

    def _default_device(self) -> str:
        import torch

        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return "mps"
        return "cpu"

    def _dtype(self, request):
        import torch

        if self.device == "cpu":
            return None  # float32: half precision on CPU is slow or unsupported
        return torch.bfloat16 if request.F16Memory else torch.float16

    def _unload(self):
        self.model = self.tokenizer = self.sentence_model = None
        self.identity.loaded = ""
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass

    def Free(self, request, context):
        self._unload()
        return backend_pb2.Result(success=True, message="freed")

    def Status(self, request, context):
        return serving.status_response(busy=bool(self._busy), loaded=self.model is not None or self.sentence_model is not None)

    # -- inference ----------------------------------------------------------------------

    def _busy_enter(self):
        with self._lock:
            self._busy += 1

    def _busy_exit(self):
        with self._lock:
            self._busy -= 1

    def Rerank(self, request, context):
        """Bi-encoder reranking (module docstring); ``UNIMPLEMENTED`` on a transformers model
        (never "model not loaded", which would make the frontend reload it)."""
        model = self.sentence_model
        if model is None:
            if self.model is not None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED,
                              "rerank needs a sentence-transformers model; this backend holds "
                              "a transformers model")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")
        from sentence_transformers import util

        texts = [request.query] + list(request.documents)
        self._busy_enter()
        try:
            vectors = model.encode(texts, convert_to_tensor=True)
            scores = util.cos_sim(vectors[0:1], vectors[1:])[0].tolist()
            evaluated = int(model.tokenize(texts)["attention_mask"].sum())
        finally:
            self._busy_exit()
        return serving.rerank_result(texts[1:], scores, request.top_n, evaluated)

    def _require_generator(self, context):
        if self.sentence_model is not None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          "this backend holds a sentence-transformers model, which answers "
                          "embeddings only; text generation needs a transformers model")
        if self.model is None or self.tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")

    def _prompt_ids(self, request, context=None):
        if request.UseTokenizerTemplate and request.Messages:
            kwargs = {}
            tools = template_tools(request.Tools)
            if tools:
                if not template_reads_tools(self.tokenizer):
                    # tools the template never renders would be silently ignored
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  "this model's chat template does not render tools (it never "
                                  "reads 'tools'); give the model a tokenizer whose template "
                                  "does, or render the prompt with a template.function in "
                                  "its config")
                kwargs["tools"] = tools
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in request.Messages], tokenize=False,
                add_generation_prompt=True, **kwargs)
        else:
            text = request.Prompt
        encoded = self.tokenizer(text, return_tensors="pt")
        return {k: v.to(self.device) for k, v in encoded.items()}

    def _generate_kwargs(self, request, inputs) -> dict:
        import torch

        prompt_len = inputs["input_ids"].shape[-1]
        if request.Tokens > 0:
            max_new = request.Tokens
        else:
            limit = getattr(self.model.config, "max_position_embeddings", None)
            max_new = max(1, limit - prompt_len) if limit else DEFAULT_MAX_NEW_TOKENS
        kwargs = dict(inputs, max_new_tokens=max_new)
        if request.Temperature > 0:
            top_p = request.TopP if 0 < request.TopP <= 1 else 1.0
            kwargs.update(do_sample=True, temperature=request.Temperature, top_p=top_p,
                          top_k=request.TopK if request.TopK > 0 else 50)
            if request.Seed:
                torch.manual_seed(request.Seed)
        else:
            kwargs.update(do_sample=False)
        if request.StopPrompts:
            kwargs["stop_strings"] = list(request.StopPrompts)
            kwargs["tokenizer"] = self.tokenizer
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token_id is not None:
            kwargs["pad_token_id"] = self.tokenizer.eos_token_id
        return kwargs

    @staticmethod
    def _cut_at_stop(text: str, stops) -> str:
        cut = len(text)
        for stop in stops:
            at = text.find(stop) if stop else -1
            if at != -1:
                cut = min(cut, at)
        return text[:cut]

    def _recorder(self, request, kwargs):
        """A :class:`LogprobRecorder` added to the generation when ``Logprobs`` is asked."""
        if request.Logprobs <= 0:
            return None
        from transformers import LogitsProcessorList

        recorder = make_recorder(self.tokenizer, max(0, min(request.TopLogprobs, 20)))
        kwargs["logits_processor"] = LogitsProcessorList([recorder])
        return recorder

    def Predict(self, request, context):
        self._require_generator(context)
        import torch

        self._busy_enter()
        try:
            inputs = self._prompt_ids(request, context)
            prompt_len = inputs["input_ids"].shape[-1]
            kwargs = self._generate_kwargs(request, inputs)
            recorder = self._recorder(request, kwargs)
            with torch.no_grad():
                output = self.model.generate(**kwargs)
            new_tokens = output[0][prompt_len:]
            text = self.tokenizer.decode(new_tokens, skip_special_tokens=True)
            text = self._cut_at_stop(text, request.StopPrompts)
            logprobs = b""
            if recorder is not None:
                recorder.finish(output)
                logprobs = logprobs_json(recorder.take())
            return backend_pb2.Reply(message=text.encode("utf-8"), tokens=len(new_tokens),
                                     prompt_tokens=prompt_len, logprobs=logprobs)
        finally:
            self._busy_exit()

    def PredictStream(self, request, context):
        self._require_generator(context)
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        class StopWhenAbandoned(StoppingCriteria):
            """Ends generation once the client left or a stop string was reached."""

            def __init__(self, event):
                self.event = event

            def __call__(self, input_ids, scores, **kwargs):
                import torch

                return torch.full((input_ids.shape[0],), self.event.is_set(),
                                  dtype=torch.bool, device=input_ids.device)

        abandoned = threading.Event()
        self._busy_enter()
        try:
            inputs = self._prompt_ids(request, context)
            prompt_len = inputs["input_ids"].shape[-1]
            class CountingStreamer(TextIteratorStreamer):
                """Counts the generated tokens (its text pieces are not tokens: a piece may
                hold several, and the last flush none), so a stream's usage equals
                ``Predict``'s for the same output."""

                generated = 0

                def put(self, value):
                    if not (self.skip_prompt and self.next_tokens_are_prompt):
                        self.generated += int(value.numel())
                    super().put(value)

            streamer = CountingStreamer(self.tokenizer, skip_prompt=True,
                                        skip_special_tokens=True)
            kwargs = self._generate_kwargs(request, inputs)
            kwargs["streamer"] = streamer
            kwargs["stopping_criteria"] = StoppingCriteriaList([StopWhenAbandoned(abandoned)])
            recorder = self._recorder(request, kwargs)
            failure: list[BaseException] = []
            done: list = []

            def generate():
                import torch

                try:
                    with torch.no_grad():
                        done.append(self.model.generate(**kwargs))
                except BaseException as e:  # reported to the client below
                    failure.append(e)
                    streamer.end()

            worker = threading.Thread(target=generate, name="generate", daemon=True)
            worker.start()
            produced = ""
            for piece in streamer:
                if not context.is_active():
                    break
                count = streamer.generated  # tokens generated so far (never fewer than shown)
                combined = produced + piece
                kept = self._cut_at_stop(combined, request.StopPrompts)
                delta = kept[len(produced):]
                produced = kept
                logprobs = logprobs_json(recorder.take()) if recorder is not None else b""
                yield backend_pb2.Reply(message=delta.encode("utf-8"), tokens=count,
                                        prompt_tokens=prompt_len, logprobs=logprobs)
                if len(kept) < len(combined):
                    break  # a stop string was reached
            abandoned.set()
            worker.join()
            if failure:
                context.abort(grpc.StatusCode.UNKNOWN,
                              f"Unexpected {type(failure[0])}: {failure[0]}")
            if recorder is not None and done and context.is_active():
                recorder.finish(done[0])
                rest = recorder.take()
                if rest:  # the last token's entry (known once generation ended)
                    yield backend_pb2.Reply(message=b"", tokens=streamer.generated,
                                            prompt_tokens=prompt_len,
                                            logprobs=logprobs_json(rest))
        finally:
            abandoned.set()  # also when the client cancelled and the generator was closed
            self._busy_exit()

    def Embedding(self, request, context):
        import torch

        text = request.Embeddings or request.Prompt
        if self.sentence_model is not None:
            if request.EmbeddingTokens and not text:
                # encode() takes text only; embedding "" instead would be a silent wrong answer
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "this sentence-transformers model takes text input; token-id "
                              "input is not supported")
            self._busy_enter()
            try:
                vector = self.sentence_model.encode(text)
                # usage: the tokens the model evaluated (special tokens included, truncated to
                # its max_seq_length), as the transformers path below reports them
                evaluated = self.sentence_model.tokenize([text])["input_ids"].shape[-1]
            finally:
                self._busy_exit()
            return backend_pb2.EmbeddingResult(embeddings=[float(v) for v in vector],
                                               prompt_tokens=int(evaluated),
                                               layout=backend_pb2.EMBEDDING_LAYOUT_FINAL)
        self._require_generator(context)
        self._busy_enter()
        try:
            if request.EmbeddingTokens:
                ids = torch.tensor([list(request.EmbeddingTokens)], device=self.device)
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            else:
                encoded = self.tokenizer(text, return_tensors="pt")
                inputs = {k: v.to(self.device) for k, v in encoded.items()}
            with torch.no_grad():
                out = self.model(**inputs, output_hidden_states=True)
            hidden = out.hidden_states[-1]
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
            return backend_pb2.EmbeddingResult(
                embeddings=[float(v) for v in pooled[0].tolist()],
                prompt_tokens=int(inputs["input_ids"].shape[-1]),
                layout=backend_pb2.EMBEDDING_LAYOUT_FINAL)
        finally:
            self._busy_exit()

    def _loaded_tokenizer(self, context):
        tokenizer = self.tokenizer
        if tokenizer is None and self.sentence_model is not None:
            tokenizer = self.sentence_model.tokenizer
        if tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")
        return tokenizer

    def TokenizeString(self, request, context):
        tokenizer = self._loaded_tokenizer(context)
        ids = tokenizer.encode(request.Prompt, add_special_tokens=False)
        return backend_pb2.TokenizationResponse(length=len(ids), tokens=list(ids))

    def Detokenize(self, request, context):
        tokenizer = self._loaded_tokenizer(context)
        ids = serving.token_ids_in_range(request.tokens, len(tokenizer), context)
        text = tokenizer.decode(ids, skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        return backend_pb2.DetokenizeResponse(content=text)


def template_tools(raw: str) -> list | None:
    """``PredictOptions.Tools`` (OpenAI's tools as JSON text) for ``apply_chat_template``."""
    if not raw:
        return None
    try:
        tools = json.loads(raw)
    except ValueError:
        return None
    return tools if isinstance(tools, list) and tools else None


def template_reads_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template(s) refer to ``tools`` at all."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "tools" in t for t in texts)


def template_message(message) -> dict:
    """A proto ``Message`` as the plain dict chat templates read (never the proto object):
    tool calls with their arguments decoded (templates ``tojson`` them), the tool result's
    ``tool_call_id`` and ``name``."""
    out = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        try:
            calls = json.loads(message.tool_calls)
        except ValueError:
            calls = []
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
        out["tool_calls"] = calls
    return out


def make_recorder(tokenizer, top: int):
    """A logits processor that records each generated token's log probability (and the
    ``top`` most likely), from the scores the sampler sees, as LocalAI's
    ``Reply.logprobs`` entries.  Step t's scores are kept until step t+1 shows which token
    was chosen, so one vocabulary row is held at a time."""
    import math

    import torch
    from transformers import LogitsProcessor

    special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id])
        return {"id": token_id, "token": token,
                "logprob": logprob if math.isfinite(logprob) else -9999.0,
                "bytes": list(token.encode("utf-8"))}

    class LogprobRecorder(LogitsProcessor):
        def __init__(self):
            self.pending = None
            self.entries: list[dict] = []
            self.sent = 0
            self.lock = threading.Lock()

        def __call__(self, input_ids, scores):
            if self.pending is not None:
                self._resolve(int(input_ids[0, -1]))
            self.pending = torch.log_softmax(scores[0].float(), dim=-1)
            return scores

        def _resolve(self, token_id: int) -> None:
            row, self.pending = self.pending, None
            if token_id in special:
                return
            item = entry(token_id, float(row[token_id]))
            tops = []
            if top:
                values, ids = torch.topk(row, min(top, row.shape[-1]))
                tops = [entry(int(i), float(v)) for v, i in zip(values, ids)
                        if math.isfinite(float(v))]
            item["top_logprobs"] = tops
            with self.lock:
                self.entries.append(item)

        def finish(self, sequences) -> None:
            """Resolve the last step with the final sequence's last token."""
            if self.pending is not None:
                self._resolve(int(sequences[0, -1]))

        def take(self) -> list[dict]:
            """The entries not taken yet."""
            with self.lock:
                out, self.sent = self.entries[self.sent:], len(self.entries)
            return out

    return LogprobRecorder()


def logprobs_json(entries: list[dict]) -> bytes:
    """``Reply.logprobs``: LocalAI's JSON (``{"content": [...]}``), or empty."""
    if not entries:
        return b""
    return json.dumps({"content": entries}, separators=(",", ":")).encode("utf-8")


def main(argv=None) -> None:
    parser = serving.argument_parser("localai-tw Hugging Face backend")
    parser.add_argument("--kind", choices=KINDS, default="transformers")
    args = parser.parse_args(argv)
    identity = serving.ModelIdentity()
    serving.serve(HuggingFaceServicer(args.kind, identity), identity, args.addr)


if __name__ == "__main__":
    main()
