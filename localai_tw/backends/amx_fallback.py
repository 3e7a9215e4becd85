"""The AMX fallback of the ``llama-cpp`` backend: a model whose backend dies by a signal on its
first evaluation after loading, on a CPU with AMX, is started again with llama.cpp's extra
buffer types off, once.

Why: llama.cpp's AMX extra buffer type (``ggml_backend_amx_mul_mat``) crashes with SIGSEGV on
some quantized models (a known upstream defect; issue 22 §1 saw it with a Q4_1 GGUF on an
Intel Xeon), on the first prompt longer than one token.  With the extra buffer types off
(``use_extra_bufts=false`` in the model parameters) the same file answers correctly, somewhat
slower on such a CPU.

How, on the worker:

- the backend announces its first evaluation after a load on stderr with the state of the
  extra buffer types (``serving.FIRST_EVAL_STARTED ... on``) and its end
  (``FIRST_EVAL_FINISHED``), so :func:`crashed_on_first_evaluation` reads the process's last
  output;
- :meth:`ExtraBuftsFallback.on_exit` (a supervisor exit listener) arms the fallback for that
  model when the process crashed by a signal between the two lines with the extra buffer types
  on, on a CPU with AMX; it says so in the worker log and in the record's ``fallback`` (quoted
  in the ``backend.exit`` answer, so the frontend knows the next start differs);
- :meth:`ExtraBuftsFallback.start_environment` (a supervisor start-environment provider) gives
  every later start of that model ``LOCALAI_LLAMA_EXTRA_BUFTS=0`` and a note, which
  ``backend.start`` answers and the frontend keeps in the model's ``node_models`` row (shown by
  ``/api/nodes``).

Once: a model falls back at most once per worker run; a crash with the extra buffer types
already off is logged as such and changes nothing more.  The decision lives in the worker's
memory: after a worker restart the first crash happens again and is handled the same way.

AMX is read from ``/proc/cpuinfo`` (flags ``amx_tile``, ``amx_int8``, ``amx_bf16``).
``LOCALAI_ASSUME_AMX=1`` (or ``0``) overrides what the CPU says: for tests on machines without
AMX, and for operators who want the fallback (or not) whatever the flags say.

What this module must never do: fall back twice for one model; act on a crash that was not on
the first evaluation, not by a signal, or with the extra buffer types already off; read more
than :data:`MAX_CPUINFO_BYTES` of ``/proc/cpuinfo``.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Mapping

from twisted.logger import Logger

from localai_tw.backends.builtin.serving import (
    EXTRA_BUFTS_ENV,
    FIRST_EVAL_FINISHED,
    FIRST_EVAL_STARTED,
)

log = Logger()

ASSUME_AMX_ENV = "LOCALAI_ASSUME_AMX"
AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
#: Backends whose crashes this fallback handles (the built-in llama.cpp backend).
FALLBACK_BACKENDS = frozenset({"llama-cpp"})
MAX_CPUINFO_BYTES = 4 << 20
#: Output lines read back to find the first-evaluation lines.
LINES_READ = 200

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def cpu_has_amx(environ: Mapping[str, str] | None = None,
                cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX (``LOCALAI_ASSUME_AMX`` overrides, module docstring)."""
    forced = (os.environ if environ is None else environ).get(ASSUME_AMX_ENV, "")
    forced = forced.strip().lower()
    if forced in _TRUE:
        return True
    if forced in _FALSE:
        return False
    try:
        with open(cpuinfo, "rb") as f:
            text = f.read(MAX_CPUINFO_BYTES).decode("ascii", "replace")
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and AMX_FLAGS & set(value.split()):
            return True
    return False


def crashed_on_first_evaluation(lines: Iterable[str]) -> bool:
    """Whether the last output of a process ends inside its first evaluation after a load, with
    the extra buffer types on."""
    inside = False
    for line in lines:
        if line.startswith(FIRST_EVAL_STARTED):
            inside = line[len(FIRST_EVAL_STARTED):].strip() == "on"
        elif line.startswith(FIRST_EVAL_FINISHED):
            inside = False
    return inside


class ExtraBuftsFallback:
    """The fallback's state on one worker (module docstring).  ``has_amx`` is asked once, at
    the first crash that qualifies."""

    def __init__(self, has_amx: Callable[[], bool] = cpu_has_amx):
        self._has_amx = has_amx
        self._amx: bool | None = None
        #: model -> the note every later start of it carries
        self.applied: dict[str, str] = {}

    def amx(self) -> bool:
        if self._amx is None:
            self._amx = bool(self._has_amx())
        return self._amx

    def on_exit(self, record) -> None:
        from localai_tw.backends.process import CRASHED

        if record.backend not in FALLBACK_BACKENDS or record.state != CRASHED \
                or record.exit_signal is None:
            return
        if not crashed_on_first_evaluation(record.output.lines(LINES_READ)):
            return
        how = record.exit_description()
        if record.model in self.applied:
            log.warn("backend {key} ({backend}) {how} on its first evaluation with llama.cpp's "
                     "extra buffer types already off: no further fallback", key=record.key,
                     backend=record.backend, how=how)
            return
        if not self.amx():
            return
        self.applied[record.model] = (
            f"llama.cpp extra buffer types off (use_extra_bufts=false): the backend was {how} "
            "on its first evaluation on a CPU with AMX")
        record.fallback = ("the worker loads the model again with llama.cpp's extra buffer "
                           "types off (AMX fallback, once)")
        log.warn("backend {key} ({backend}) {how} on its first evaluation after loading, on a "
                 "CPU with AMX (a known llama.cpp defect of its AMX extra buffer type): the "
                 "next start of model {model} loads it with extra buffer types off, once",
                 key=record.key, backend=record.backend, how=how, model=record.model)

    def start_environment(self, backend: str, model: str):
        if backend in FALLBACK_BACKENDS and model in self.applied:
            log.info("starting model {model} with llama.cpp's extra buffer types off (AMX "
                     "fallback)", model=model)
            return {EXTRA_BUFTS_ENV: "0"}, self.applied[model]
        return {}, None

    def install(self, supervisor) -> "ExtraBuftsFallback":
        supervisor.add_exit_listener(self.on_exit)
        supervisor.add_start_environment(self.start_environment)
        return self
