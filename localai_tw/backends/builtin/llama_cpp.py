"""The ``llama-cpp`` backend: GGUF models through llama.cpp's Python bindings
(``llama-cpp-python``), as LocalAI's ``llama-cpp`` backend serves them.  Run as::

    python -m localai_tw.backends.builtin.llama_cpp --addr HOST:PORT

``LoadModel`` loads one ``.gguf`` file (``ModelFile``, else ``Model``).  It is checked first
(exists, a file, starts with the GGUF magic) so a missing, foreign or truncated file fails with
a message naming it and what was found, and llama.cpp's own error lines (captured from its log)
are quoted when it refuses the file.  The load honours ``ContextSize`` (when 0, LocalAI's
default: the file's trained context capped at 8192, else 4096; :mod:`.gguf_header`), ``Threads``, ``NGPULayers``, ``MMap``, ``MLock``, ``Embeddings``, ``Seed``, ``NBatch``,
``F16Memory`` (a float16 KV cache, llama.cpp's default; false keeps float16 too, as LocalAI),
``CacheTypeKey``/``CacheTypeValue``, ``FlashAttention``, ``NoKVOffload``, ``RopeFreqBase``/
``RopeFreqScale``, ``MainGPU``, ``TensorSplit``, ``NUMA``, ``LoraAdapter``/``LoraBase``/
``LoraScale``; its ``Result.message`` states the effective context, threads and GPU layers.
LocalAI's ``options:`` entries (``name:value``, or ``name`` alone for true) that llama-cpp-python
can honour override those fields (:func:`load_options`): ``mmap``/``use_mmap``, ``no_mmap``,
``mlock``/``use_mlock``, ``flash_attention``/``flash_attn``/``fa``, ``cache_type_k``/``ctk``,
``cache_type_v``/``ctv``, ``use_extra_bufts``/``extra_bufts``/``repack`` and
``no_extra_bufts``/``no_repack``, and the llama-server flags LocalAI passes through
(``--no-mmap``, ``--mlock``, ``-fa``/``--flash-attn``, ``-ctk``/``--cache-type-k``,
``-ctv``/``--cache-type-v``, ``-nr``/``--no-repack``).  Other options are ignored, as LocalAI's
backend ignores names it does not know.  llama.cpp's extra buffer types (weight repacking, the
AMX kernels on CPUs that have them) are a model parameter ``Llama(...)`` does not take: it is
set in the parameters the bindings start from (:func:`model_params_with`).  The worker's
decision in ``LOCALAI_LLAMA_EXTRA_BUFTS=0`` (its AMX fallback) wins over the options.

The first evaluation after a load is announced on stderr (``serving.FIRST_EVAL_STARTED`` with
the extra buffer types' state, then ``FIRST_EVAL_FINISHED``), so the worker can tell a crash
there from a later one.  Test hook: with ``LOCALAI_TEST_CRASH_FIRST_EVAL_WITH_EXTRA_BUFTS=1`` in
its environment the process kills itself with SIGSEGV at that point while the extra buffer types
are on, as llama.cpp's AMX defect does on AMX CPUs (tests only; nothing else sets it).

Generation (``Predict``, ``PredictStream``) runs one token loop for both, so a stream's
running ``tokens`` count ends equal to ``Predict``'s for the same output: the prompt is
``Prompt`` (rendered by the frontend), or ``Messages`` through the GGUF's own chat template
(``tokenizer.chat_template``) when ``UseTokenizerTemplate``; a file without one is answered
from ``Prompt`` when the frontend sent one too (the template was guessed, not asked for), else
refused with ``FAILED_PRECONDITION`` saying what to configure.  Sampling: ``Temperature`` (0 =
greedy), ``TopK``, ``TopP``, ``MinP``, ``TypicalP``, ``Penalty`` (repeat), ``Repeat`` (its
window), ``FrequencyPenalty``, ``PresencePenalty``, ``Mirostat*``, ``Seed``, ``IgnoreEOS``;
``Tokens`` caps the answer (0: the rest of the context); ``StopPrompts`` end it (the stop text is
not returned; a stream holds back text that may be the start of one; the reply that ends the
answer names the stop string in ``Reply.stopping_word``, localai-tw's field 1001).
``Grammar`` (GBNF) constrains sampling; a grammar llama.cpp cannot parse is
``INVALID_ARGUMENT`` quoting the parser.  ``Logprobs`` > 0 returns, in ``Reply.logprobs``,
JSON in OpenAI's chat logprobs shape (see :func:`logprob_entry`), with ``TopLogprobs``
alternatives per token.

``Embedding`` needs a model loaded with ``Embeddings`` (else ``UNIMPLEMENTED`` saying so): the
model's pooling, or the mean of the token vectors for a model without one; ``prompt_tokens``
counts the tokens evaluated.  ``TokenizeString`` (no BOS, special tokens parsed; with
``TokenizeAsEvaluated``, or ``UseTokenizerTemplate`` and ``Messages``, the tokens ``Predict``
would evaluate) and
``Detokenize`` (ids checked against the vocabulary first) use llama.cpp's tokenizer.

llama-cpp-python and numpy are imported inside this process only; the worker-side factory asks
``importlib`` whether they can be.

What this program must never do: hand llama.cpp a grammar it has not parsed (a NULL sampler in
the chain crashes the process), a token id outside the vocabulary, or a prompt longer than the
context; report a failed load as success; answer ``FAILED_PRECONDITION`` "model not loaded"
while a model is loaded (the frontend reloads on it).

One module of about 810 lines: it is one backend program, and most of it is the servicer's
gRPC methods over one loaded model (load, predict, stream, tokenize, embed, logprobs), which
share the model, its lock and its chat handler; the option parsing and the GGUF header reader
(``gguf_header.py``) are already functions or modules of their own.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import ctypes
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin import serving
from localai_tw.backends.builtin.gguf_header import default_context

GGUF_MAGIC = b"GGUF"
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_LOG_LINES = 64
MAX_QUOTED = 600
#: ggml type ids for CacheTypeKey / CacheTypeValue (llama.cpp's --cache-type-k names).
#: The crash test hook (module docstring).
CRASH_TEST_ENV = "LOCALAI_TEST_CRASH_FIRST_EVAL_WITH_EXTRA_BUFTS"
CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
               "iq4_nl": 20, "bf16": 30}


class LoadError(Exception):
    """The model cannot load; the text names the file and the reason."""


#: ggml's log levels (ggml.h ``enum ggml_log_level`` of the llama.cpp this pins; the comment in
#: llama-cpp-python's ``_logger.py`` shows an older order).
LOG_WARN, LOG_ERROR, LOG_CONT = 3, 4, 5


class LlamaLog:
    """llama.cpp's log lines, kept (the last :data:`MAX_LOG_LINES`) so a failure can quote
    them; warnings and errors are also written to stderr (the worker's backend log), the rest
    (hundreds of lines per load) is not."""

    def __init__(self):
        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=MAX_LOG_LINES)
        self._partial = ""
        self._level = 0

    def __call__(self, level: int, text: bytes, user_data) -> None:
        try:
            chunk = text.decode("utf-8", "replace") if text else ""
            if level != LOG_CONT:
                self._level = level
            self._partial += chunk
            while "\n" in self._partial:
                line, self._partial = self._partial.split("\n", 1)
                if line.strip():
                    self.lines.append((self._level, line.strip()))
                    if self._level in (LOG_WARN, LOG_ERROR):
                        os.write(2, (line + "\n").encode("utf-8", "replace"))
        except Exception:  # never raise into C
            pass

    def mark(self) -> int:
        self._partial = ""
        self.lines.clear()
        return 0

    def errors(self) -> str:
        """The error (else warning) lines since :meth:`mark`, joined and bounded."""
        wanted = [text for level, text in self.lines if level == LOG_ERROR] or \
                 [text for level, text in self.lines if level == LOG_WARN]
        joined = "; ".join(wanted)
        return joined if len(joined) <= MAX_QUOTED else joined[:MAX_QUOTED] + "..."


@contextlib.contextmanager
def captured_stderr(into: list):
    """Collect what C code writes to file descriptor 2 meanwhile (llama.cpp's grammar parser
    reports its errors with ``fprintf(stderr)``, not through the log callback); it is passed
    on to the real stderr afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            data = sink.read(64 * 1024)
            into.append(data.decode("utf-8", "replace"))
            if data:
                os.write(2, data)


@contextlib.contextmanager
def lenient_chat_templates(llama_chat_format):
    """While the bindings' ``Llama`` loads: a chat template jinja2 cannot compile no longer
    fails the whole load (``Llama.__init__`` compiles every template of the GGUF's metadata);
    the model then serves the prompts the frontend renders, and :meth:`_prompt_tokens` says
    why the GGUF's template cannot be used.  Loads are serialized, so the swap is private."""
    strict = llama_chat_format.Jinja2ChatFormatter

    class Lenient(strict):
        def __init__(self, *args, **kwargs):
            try:
                super().__init__(*args, **kwargs)
            except Exception:
                pass  # reported when the GGUF's template is asked for

    llama_chat_format.Jinja2ChatFormatter = Lenient
    try:
        yield
    finally:
        llama_chat_format.Jinja2ChatFormatter = strict


def check_gguf_file(path: str) -> None:
    """Refuse, naming ``path``, what llama.cpp would refuse with a bare "failed to load":
    a missing file, a directory, an empty file, a file that is not GGUF."""
    if not os.path.exists(path):
        raise LoadError(f"model file {path} does not exist on this worker")
    if os.path.isdir(path):
        raise LoadError(f"model file {path} is a directory; the llama-cpp backend loads one "
                        f".gguf file (name it in parameters.model)")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise LoadError(f"model file {path} cannot be read: {e.strerror or e}") from None
    if not head:
        raise LoadError(f"model file {path} is empty")
    if head[:4] != GGUF_MAGIC:
        what = "a git-lfs pointer (the model was never downloaded)" \
            if head.startswith(b"version ") else \
            "an HTML page" if head.lstrip().lower().startswith((b"<!doc", b"<html")) else \
            "an old GGML/GGJT model (convert it to GGUF)" \
            if head[:4] in (b"lmgg", b"fmgg", b"tjgg") else \
            "a safetensors or other file" if head[:1] != b"\x00" else "another kind of file"
        raise LoadError(f"model file {path} is not a GGUF file (it starts with "
                        f"{head[:4]!r}, not b'GGUF': {what})")
    if len(head) < 8:
        raise LoadError(f"model file {path} is truncated: it ends inside the GGUF header")


def _cache_type(name: str, field: str):
    if not name:
        return None
    try:
        return CACHE_TYPES[name.lower()]
    except KeyError:
        raise LoadError(f"{field} {name!r} is not a KV cache type llama.cpp knows "
                        f"({', '.join(sorted(CACHE_TYPES))})") from None


_TRUE = frozenset({"true", "1", "yes", "on", "enabled"})
_FALSE = frozenset({"false", "0", "no", "off", "disabled"})
#: options name -> (key of :func:`load_options`' answer, how its value is read)
_OPTION_NAMES = {
    "mmap": ("use_mmap", "bool"), "use_mmap": ("use_mmap", "bool"),
    "no_mmap": ("use_mmap", "not"), "--no-mmap": ("use_mmap", "not"),
    "mlock": ("use_mlock", "bool"), "use_mlock": ("use_mlock", "bool"),
    "mmlock": ("use_mlock", "bool"), "--mlock": ("use_mlock", "bool"),
    "flash_attention": ("flash_attn", "flash"), "flash_attn": ("flash_attn", "flash"),
    "fa": ("flash_attn", "flash"), "-fa": ("flash_attn", "flash"),
    "--flash-attn": ("flash_attn", "flash"),
    "cache_type_k": ("type_k", "cache"), "ctk": ("type_k", "cache"),
    "-ctk": ("type_k", "cache"), "--cache-type-k": ("type_k", "cache"),
    "cache_type_v": ("type_v", "cache"), "ctv": ("type_v", "cache"),
    "-ctv": ("type_v", "cache"), "--cache-type-v": ("type_v", "cache"),
    "use_extra_bufts": ("extra_bufts", "bool"), "extra_bufts": ("extra_bufts", "bool"),
    "repack": ("extra_bufts", "bool"), "--repack": ("extra_bufts", "bool"),
    "no_extra_bufts": ("extra_bufts", "not"), "no_repack": ("extra_bufts", "not"),
    "-nr": ("extra_bufts", "not"), "--no-repack": ("extra_bufts", "not"),
}


def _flag(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise LoadError(f"option {name!r}: {value!r} is not a boolean (true/false, on/off, 1/0)")


def _flash(name: str, value: str) -> bool:
    """llama-cpp-python's ``Llama`` takes flash attention on or off; ``auto`` (llama.cpp's own
    default) is off here."""
    if value.strip().lower() == "auto":
        return False
    return _flag(name, value)


def load_options(options, request=None) -> dict:
    """The load parameters LocalAI's ``options:`` list sets (module docstring), as
    ``{use_mmap, use_mlock, flash_attn, type_k, type_v, extra_bufts}`` (only those given).  A
    value that cannot be read refuses the load naming the option."""
    chosen: dict = {}
    for item in options:
        name, sep, value = str(item).partition(":")
        name = name.strip()
        known = _OPTION_NAMES.get(name) or _OPTION_NAMES.get(name.lower())
        if known is None:
            continue
        key, kind = known
        value = value if sep else "true"
        if kind == "bool":
            chosen[key] = _flag(name, value)
        elif kind == "not":
            chosen[key] = not _flag(name, value)
        elif kind == "flash":
            chosen[key] = _flash(name, value)
        else:
            chosen[key] = _cache_type(value.strip(), f"option {name!r}")
    return chosen


@contextlib.contextmanager
def model_params_with(llama_cpp_module, **fields):
    """While the bindings' ``Llama`` loads: the model parameters it starts from
    (``llama_model_default_params``) carry ``fields`` (e.g. ``use_extra_bufts=False``), which
    ``Llama(...)`` has no argument for.  Loads are serialized, so the swap is private."""
    low_level = llama_cpp_module.llama_cpp
    default = low_level.llama_model_default_params
    if not fields:
        yield
        return
    names = {name for name, _ in low_level.llama_model_params._fields_}
    missing = sorted(set(fields) - names)
    if missing:
        raise LoadError(f"this llama-cpp-python has no model parameter {', '.join(missing)}")

    def with_fields():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    low_level.llama_model_default_params = with_fields
    try:
        yield
    finally:
        low_level.llama_model_default_params = default


def _tensor_split(text: str):
    if not text:
        return None
    try:
        return [float(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise LoadError(f"TensorSplit {text!r} must be numbers separated by commas") from None


def logprob_entry(token_id: int, piece: bytes, logprob: float) -> dict:
    """One token of OpenAI's chat ``logprobs.content`` (LocalAI's ``LogprobContent``):
    ``{"id", "token", "bytes", "logprob"}``; ``top_logprobs`` is added to the sampled token's
    entry."""
    return {"id": int(token_id), "token": piece.decode("utf-8", "replace"),
            "bytes": list(piece), "logprob": float(logprob)}


def stop_cut(text: str, stops, start: int = 0) -> int | None:
    """The index of the earliest stop string found in ``text`` at or after ``start``."""
    found = [at for at in (text.find(s, start) for s in stops if s) if at != -1]
    return min(found) if found else None


def held_back(text: str, stops) -> int:
    """How many characters at the end of ``text`` may be the start of a stop string (a stream
    must not send them yet)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def utf8_decoder():
    """Text of the token bytes as they come: a UTF-8 sequence split across tokens waits for its
    end, invalid bytes become U+FFFD at once."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class LlamaCppServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, identity: serving.ModelIdentity):
        self.identity = identity
        self.llm = None
        self.path = ""
        self.embeddings = False
        self.chat_formatter = None
        self.template_error = ""
        self._busy = 0
        self._lock = threading.Lock()  # one llama context: one operation at a time
        self._count_lock = threading.Lock()
        self.extra_bufts = True
        self._first_evaluation = False  # True from a load until its first evaluation ends
        self.log = LlamaLog()
        self._log_callback = None  # the ctypes callback (kept referenced)

    # -- lifecycle ----------------------------------------------------------------------

    def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    def LoadModel(self, request, context):
        with self._lock:
            try:
                message = self._load(request)
            except LoadError as e:
                self._unload()
                return backend_pb2.Result(success=False, message=str(e))
            except Exception as e:  # the verdict travels in Result, as LocalAI's backends do
                self._unload()
                return backend_pb2.Result(success=False, message=f"{type(e).__name__}: {e}")
        self.identity.loaded = request.Model
        # Also in the backend's log (backend.logs): the frontend's cold load keeps only the
        # verdict, and an operator wants to see what llama.cpp was given.
        print(message, file=sys.stderr, flush=True)
        return backend_pb2.Result(success=True, message=message)

    def _install_log(self, llama_cpp) -> None:
        if self._log_callback is None:
            self._log_callback = llama_cpp.llama_log_callback(self.log)
        llama_cpp.llama_log_set(self._log_callback, ctypes.c_void_p(0))

    def _load(self, request) -> str:
        self._unload()
        path = request.ModelFile or request.Model
        if not path:
            raise LoadError("ModelOptions.ModelFile (or Model) is empty: name the .gguf file "
                            "in parameters.model")
        check_gguf_file(path)
        import llama_cpp
        from llama_cpp import llama_chat_format

        self._install_log(llama_cpp)
        threads = request.Threads if request.Threads > 0 else None
        n_ctx = request.ContextSize if request.ContextSize > 0 else default_context(path)
        lora = request.LoraAdapter
        if lora and not os.path.isabs(lora) and request.ModelPath:
            lora = os.path.join(request.ModelPath, lora)
        chosen = load_options(request.Options)
        extra_bufts = chosen.pop("extra_bufts", True)
        if os.environ.get(serving.EXTRA_BUFTS_ENV, "").strip() == "0":
            extra_bufts = False  # the worker's decision (its AMX fallback) wins
        kwargs = dict(
            model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
            n_gpu_layers=request.NGPULayers, use_mmap=request.MMap, use_mlock=request.MLock,
            embedding=request.Embeddings, numa=request.NUMA, verbose=False,
            offload_kqv=not request.NoKVOffload,
            flash_attn=request.FlashAttention.lower() in ("on", "true", "1", "enabled"),
            type_k=_cache_type(request.CacheTypeKey, "CacheTypeKey"),
            type_v=_cache_type(request.CacheTypeValue, "CacheTypeValue"),
            tensor_split=_tensor_split(request.TensorSplit),
        )
        kwargs.update(chosen)
        if request.Seed:
            kwargs["seed"] = request.Seed & 0xFFFFFFFF
        if request.NBatch > 0:
            kwargs["n_batch"] = request.NBatch
        if request.RopeFreqBase:
            kwargs["rope_freq_base"] = request.RopeFreqBase
        if request.RopeFreqScale:
            kwargs["rope_freq_scale"] = request.RopeFreqScale
        if request.MainGPU.isdigit():
            kwargs["main_gpu"] = int(request.MainGPU)
        if lora:
            kwargs.update(lora_path=lora, lora_base=request.LoraBase or None,
                          lora_scale=request.LoraScale or 1.0)
        self.log.mark()
        try:
            with lenient_chat_templates(llama_chat_format), \
                    model_params_with(llama_cpp,
                                      **({} if extra_bufts else {"use_extra_bufts": False})):
                llm = llama_cpp.Llama(**kwargs)
        except Exception as e:
            said = self.log.errors()
            raise LoadError(f"llama.cpp could not load {path}: "
                            f"{said or f'{type(e).__name__}: {e}'}") from None
        self.llm, self.path, self.embeddings = llm, path, bool(request.Embeddings)
        self.extra_bufts = extra_bufts
        self._first_evaluation = True
        template = llm.metadata.get("tokenizer.chat_template")
        self.template_error = ""
        if template:
            model = llm._model
            eos, bos = llm.token_eos(), llm.token_bos()
            try:
                self.chat_formatter = llama_chat_format.Jinja2ChatFormatter(
                    template=template,
                    eos_token=model.token_get_text(eos) if eos != -1 else "",
                    bos_token=model.token_get_text(bos) if bos != -1 else "",
                    add_generation_prompt=True)
            except Exception as e:  # the model still serves prompts the frontend renders
                self.template_error = f"{type(e).__name__}: {str(e)[:MAX_QUOTED]}"
                print(f"the chat template of {path} does not compile: {self.template_error}",
                      file=sys.stderr, flush=True)
        offload = llama_cpp.llama_supports_gpu_offload()
        gpu = (f"gpu layers {request.NGPULayers} requested" +
               ("" if offload else " (this llama.cpp build has no GPU offload: all on CPU)"))
        return (f"loaded {path} with llama.cpp: n_ctx {self._n_ctx()}, "
                f"threads {llm.n_threads}, {gpu}, mmap {kwargs['use_mmap']}, "
                f"mlock {kwargs['use_mlock']}, flash attention {kwargs['flash_attn']}, "
                f"extra buffer types {'on' if extra_bufts else 'off'}, "
                f"embeddings {self.embeddings}, chat template "
                f"{'from the GGUF' if self.chat_formatter else 'none'}")

    def _unload(self):
        llm, self.llm = self.llm, None
        self.chat_formatter = None
        self.identity.loaded = ""
        if llm is not None:
            try:
                llm.close()
            except Exception:
                pass

    def Free(self, request, context):
        with self._lock:
            self._unload()
        return backend_pb2.Result(success=True, message="freed")

    def Status(self, request, context):
        return serving.status_response(busy=bool(self._busy), loaded=self.llm is not None)

    # -- helpers --------------------------------------------------------------------------

    def _busy_enter(self):
        with self._count_lock:
            self._busy += 1

    def _busy_exit(self):
        with self._count_lock:
            self._busy -= 1

    def _require_model(self, context):
        if self.llm is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")
        return self.llm

    def _n_ctx(self) -> int:
        """The context the model was asked for: llama.cpp pads its own up (to a multiple of
        256), but the bindings keep room for the requested number of tokens only."""
        return min(self.llm.n_ctx(), len(self.llm.input_ids))

    def _piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (any length; the bindings' helper stops at 32 bytes)."""
        import llama_cpp

        vocab = self.llm._model.vocab
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, special)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def _check_ids(self, ids, context) -> None:
        n_vocab = self.llm.n_vocab()
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"token id {bad[0]} is outside this model's vocabulary "
                          f"(0..{n_vocab - 1})")

    def _prompt_tokens(self, request, context) -> list[int]:
        llm = self.llm
        if request.UseTokenizerTemplate and request.Messages and \
                (self.chat_formatter is not None or not request.Prompt):
            if self.chat_formatter is None:
                what = (f"has a chat template that does not compile ({self.template_error})"
                        if self.template_error else
                        "carries no chat template (tokenizer.chat_template)")
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{os.path.basename(self.path)} {what}: give the model config "
                              f"template.chat / template.chat_message instead of "
                              f"template.use_tokenizer_template")
            messages = []
            for m in request.Messages:
                message = {"role": m.role, "content": m.content}
                if m.name:
                    message["name"] = m.name
                if m.tool_call_id:
                    message["tool_call_id"] = m.tool_call_id
                if m.tool_calls:
                    try:
                        message["tool_calls"] = json.loads(m.tool_calls)
                    except ValueError:
                        pass
                messages.append(message)
            tools = None
            if request.Tools:
                try:
                    tools = json.loads(request.Tools)
                except ValueError:
                    tools = None
            try:
                rendered = self.chat_formatter(messages=messages, tools=tools)
            except Exception as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the GGUF's chat template refused these messages: "
                              f"{type(e).__name__}: {str(e)[:MAX_QUOTED]}")
            return llm.tokenize(rendered.prompt.encode("utf-8"),
                                add_bos=not rendered.added_special, special=True)
        return llm.tokenize(request.Prompt.encode("utf-8"), add_bos=True, special=True)

    def _grammar(self, text: str, context):
        """A parsed ``LlamaGrammar``, or ``INVALID_ARGUMENT`` quoting llama.cpp's parser."""
        if not text.strip():
            return None
        import llama_cpp
        from llama_cpp import LlamaGrammar

        self.log.mark()
        printed: list[str] = []
        with captured_stderr(printed):
            sampler = llama_cpp.llama_sampler_init_grammar(
                self.llm._model.vocab, text.encode("utf-8"), b"root")
        if not sampler:
            said = [line.split("error parsing grammar:", 1)[1].strip()
                    for line in "".join(printed).splitlines()
                    if "error parsing grammar:" in line]
            said += [line for line in [self.log.errors()]
                     if line and line != "failed to parse grammar"]
            reason = "; ".join(said) or "llama.cpp refused it"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the grammar (GBNF, root rule 'root') does not parse: "
                          f"{reason[:MAX_QUOTED]}")
        llama_cpp.llama_sampler_free(sampler)
        return LlamaGrammar.from_string(text, verbose=False)

    @contextlib.contextmanager
    def _evaluation(self):
        """Around an evaluation: the first one after a load is announced on stderr (module
        docstring), with the crash test hook."""
        first = self._first_evaluation
        if first:
            state = "on" if self.extra_bufts else "off"
            os.write(2, f"{serving.FIRST_EVAL_STARTED} {state}\n".encode())
            if self.extra_bufts and os.environ.get(CRASH_TEST_ENV) == "1":
                os.write(2, b"crashing on purpose (" + CRASH_TEST_ENV.encode() + b")\n")
                signal.raise_signal(signal.SIGSEGV)  # this thread, before anything else
                time.sleep(5)
        try:
            yield
        finally:  # an exception ended it too: only a crash leaves it unfinished
            if first:
                self._first_evaluation = False
                os.write(2, f"{serving.FIRST_EVAL_FINISHED}\n".encode())

    # -- generation ----------------------------------------------------------------------

    def _refuse_generation_on_embeddings(self, context):
        if self.embeddings:
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          "this model was loaded for embeddings (embeddings: true in its "
                          "config); text generation needs a config without it")

    def _run(self, request, context):
        """The token loop shared by ``Predict`` and ``PredictStream``: yields
        ``(delta_text, generated_tokens, prompt_tokens, logprob_entries, final, stopped)``:
        ``stopped`` is the stop string the answer ended on (on the final one; else "")."""
        import llama_cpp
        import numpy as np

        llm = self.llm
        prompt = self._prompt_tokens(request, context)
        if not prompt:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        n_prompt, n_ctx = len(prompt), self._n_ctx()
        if n_prompt >= n_ctx:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the prompt is {n_prompt} tokens; the model's context "
                          f"(context_size) is {n_ctx} tokens: shorten the prompt or raise "
                          f"context_size in the model config")
        room = n_ctx - n_prompt
        limit = min(request.Tokens, room) if request.Tokens > 0 else room
        grammar = self._grammar(request.Grammar, context)
        stops = [s for s in request.StopPrompts if s]
        longest_stop = max((len(s) for s in stops), default=0)
        want_logprobs = request.Logprobs > 0
        top_n = max(0, min(request.TopLogprobs, MAX_TOP_LOGPROBS))
        vocab = llm._model.vocab
        n_vocab = llm.n_vocab()

        llm.set_seed(request.Seed & 0xFFFFFFFF)
        llm.last_n_tokens_size = request.Repeat if request.Repeat > 0 else 64
        sampling = dict(
            temp=max(0.0, request.Temperature),
            top_k=max(0, request.TopK),
            top_p=request.TopP if 0 < request.TopP <= 1 else 1.0,
            min_p=request.MinP if 0 < request.MinP <= 1 else 0.0,
            typical_p=request.TypicalP if 0 < request.TypicalP <= 1 else 1.0,
            repeat_penalty=request.Penalty if request.Penalty > 0 else 1.0,
            frequency_penalty=request.FrequencyPenalty,
            presence_penalty=request.PresencePenalty,
            mirostat_mode=request.Mirostat if request.Mirostat in (1, 2) else 0,
            mirostat_tau=request.MirostatTAU or 5.0, mirostat_eta=request.MirostatETA or 0.1,
            grammar=grammar)

        decoder = utf8_decoder()
        cut = None
        stopped = ""
        text = ""
        sent = 0
        count = 0
        entries: list[dict] = []
        generator = llm.generate(prompt, **sampling)
        try:
            with self._evaluation():  # the prompt is evaluated before the first token
                first = next(generator, None)
            for token in itertools.chain([] if first is None else [first], generator):
                if not context.is_active():
                    return
                if llama_cpp.llama_vocab_is_eog(vocab, token) and not request.IgnoreEOS:
                    break
                count += 1
                piece = self._piece(token)
                if want_logprobs:
                    logits = np.ctypeslib.as_array(
                        llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
                    shifted = logits.astype(np.float64) - float(np.max(logits))
                    logprobs = shifted - np.log(np.sum(np.exp(shifted)))
                    entry = logprob_entry(token, piece, logprobs[token])
                    if top_n:
                        best = np.argsort(-logprobs)[:top_n]
                        entry["top_logprobs"] = [
                            logprob_entry(int(i), self._piece(int(i)), logprobs[i])
                            for i in best]
                    entries.append(entry)
                decoded = decoder.decode(piece)
                checked_from = max(0, len(text) - longest_stop)
                text += decoded
                cut = stop_cut(text, stops, checked_from) if stops else None
                if cut is not None:
                    # the earliest stop found; of two starting there, the one that matched
                    # first (the shorter one is complete while the longer is not yet)
                    stopped = min((s for s in stops if text.startswith(s, cut)), key=len)
                    text = text[:cut]
                    break
                if count >= limit:
                    break
                ready = len(text) - held_back(text, stops)
                if ready > sent or entries:
                    yield text[sent:ready], count, n_prompt, entries, False, ""
                    sent = max(sent, ready)
                    entries = []
        finally:
            generator.close()
        if cut is None:
            text += decoder.decode(b"", final=True)
        yield text[sent:], count, n_prompt, entries, True, stopped

    @staticmethod
    def _logprobs_bytes(entries) -> bytes:
        if not entries:
            return b""
        return json.dumps({"content": entries}, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")

    def Predict(self, request, context):
        self._require_model(context)
        self._refuse_generation_on_embeddings(context)
        self._busy_enter()
        try:
            with self._lock:
                self._require_model(context)
                parts, count, n_prompt, entries, stopped = [], 0, 0, [], ""
                for delta, count, n_prompt, more, _, stopped in self._run(request, context):
                    parts.append(delta)
                    entries.extend(more)
            return backend_pb2.Reply(message="".join(parts).encode("utf-8"), tokens=count,
                                     prompt_tokens=n_prompt,
                                     logprobs=self._logprobs_bytes(entries),
                                     stopping_word=stopped)
        finally:
            self._busy_exit()

    def PredictStream(self, request, context):
        self._require_model(context)
        self._refuse_generation_on_embeddings(context)
        self._busy_enter()
        try:
            with self._lock:
                self._require_model(context)
                last_count = 0
                for delta, count, n_prompt, entries, final, stopped in \
                        self._run(request, context):
                    if final and not delta and not entries and not stopped and \
                            count == last_count:
                        break  # nothing new to say: the last reply already carries the count
                    last_count = count
                    yield backend_pb2.Reply(message=delta.encode("utf-8"), tokens=count,
                                            prompt_tokens=n_prompt,
                                            logprobs=self._logprobs_bytes(entries),
                                            stopping_word=stopped)
        finally:
            self._busy_exit()

    # -- embeddings and tokens -----------------------------------------------------------

    def Embedding(self, request, context):
        llm = self._require_model(context)
        if not self.embeddings:
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          "this model was not loaded for embeddings: set embeddings: true in "
                          "its config (llama.cpp then serves it for embeddings only)")
        if request.EmbeddingTokens and not (request.Embeddings or request.Prompt):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the llama-cpp backend embeds text; token-id input is not supported")
        text = request.Embeddings or request.Prompt
        self._busy_enter()
        try:
            with self._lock, self._evaluation():
                vector, count = llm.embed(text, return_count=True)
        finally:
            self._busy_exit()
        if vector and isinstance(vector[0], list):  # no pooling: one vector per token
            n = len(vector)
            vector = [sum(column) / n for column in zip(*vector)]
        return backend_pb2.EmbeddingResult(embeddings=[float(v) for v in vector],
                                           prompt_tokens=int(count), dim=len(vector),
                                           layout=backend_pb2.EMBEDDING_LAYOUT_FINAL)

    def TokenizeString(self, request, context):
        """``Prompt``'s tokens (no BOS: ``/v1/tokenize``'s answer, as LocalAI's); a request
        with ``TokenizeAsEvaluated`` (Anthropic's ``count_tokens``), or with
        ``UseTokenizerTemplate`` and ``Messages`` (a chat turn's own options), is answered
        with the tokens a generation of the same options would evaluate: the GGUF's template
        rendered with the same messages and tools, special tokens and BOS as ``Predict``
        adds them."""
        llm = self._require_model(context)
        with self._lock:
            if request.TokenizeAsEvaluated or \
                    (request.UseTokenizerTemplate and request.Messages):
                ids = self._prompt_tokens(request, context)
            else:
                ids = llm.tokenize(request.Prompt.encode("utf-8"), add_bos=False,
                                   special=True)
        return backend_pb2.TokenizationResponse(length=len(ids), tokens=list(ids))

    def Detokenize(self, request, context):
        """The tokens' pieces joined, special tokens rendered, as LocalAI's llama.cpp backend
        answers (so a leading space of a SentencePiece word stays)."""
        self._require_model(context)
        ids = list(request.tokens)
        self._check_ids(ids, context)
        data = b"".join(self._piece(t, special=True) for t in ids)
        return backend_pb2.DetokenizeResponse(content=data.decode("utf-8", "replace"))


def main(argv=None) -> None:
    parser = serving.argument_parser("localai-tw llama.cpp (GGUF) backend")
    args = parser.parse_args(argv)
    # Two threads: Health and Status are answered while a generation holds the model.
    os.environ.setdefault(serving.MAX_WORKERS_ENV, "2")
    identity = serving.ModelIdentity()
    serving.serve(LlamaCppServicer(identity), identity, args.addr)


if __name__ == "__main__":
    main()
