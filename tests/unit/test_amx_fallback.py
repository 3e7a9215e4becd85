"""The AMX fallback's decisions (``backends/amx_fallback.py``) without processes: which crashes
arm it, that it arms once per model, and what the CPU check reads.  The fallback with a real
backend process is in tests/integration/test_backend_llama_cpp.py."""

from __future__ import annotations

import signal

from localai_tw.backends.amx_fallback import (
    ASSUME_AMX_ENV,
    ExtraBuftsFallback,
    cpu_has_amx,
    crashed_on_first_evaluation,
)
from localai_tw.backends.builtin.serving import (
    EXTRA_BUFTS_ENV,
    FIRST_EVAL_FINISHED,
    FIRST_EVAL_STARTED,
)
from localai_tw.backends.record import BackendProcess, CRASHED, OutputRing, STOPPED

STARTED_ON = f"{FIRST_EVAL_STARTED} on"
STARTED_OFF = f"{FIRST_EVAL_STARTED} off"


def crashed(lines, *, model="m", backend="llama-cpp", sig=signal.SIGSEGV, code=None,
            state=CRASHED) -> BackendProcess:
    record = BackendProcess(f"{model}#0", model, backend, OutputRing())
    for line in lines:
        record.output.feed("stderr", line.encode() + b"\n")
    record.exit_signal, record.exit_code, record.state = sig, code, state
    record._ended = True
    return record


def test_cpu_flags_and_the_override(tmp_path):
    intel = tmp_path / "intel"
    intel.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n")
    amd = tmp_path / "amd"
    amd.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 sha_ni\n")
    assert cpu_has_amx({}, str(intel)) and not cpu_has_amx({}, str(amd))
    assert cpu_has_amx({ASSUME_AMX_ENV: "1"}, str(amd))
    assert not cpu_has_amx({ASSUME_AMX_ENV: "0"}, str(intel))
    assert not cpu_has_amx({}, str(tmp_path / "missing"))


def test_only_a_crash_inside_the_first_evaluation_with_extra_buffer_types_on_counts():
    assert crashed_on_first_evaluation(["loaded", STARTED_ON])
    assert not crashed_on_first_evaluation(["loaded", STARTED_ON, FIRST_EVAL_FINISHED, "x"])
    assert not crashed_on_first_evaluation(["loaded", STARTED_OFF])
    assert not crashed_on_first_evaluation(["loaded"])


def test_the_fallback_is_armed_once_then_every_start_of_the_model_has_it():
    fallback = ExtraBuftsFallback(has_amx=lambda: True)
    assert fallback.start_environment("llama-cpp", "m") == ({}, None)
    first = crashed(["loaded", STARTED_ON, "Segmentation fault"])
    fallback.on_exit(first)
    assert first.fallback and "extra buffer types off" in first.fallback
    env, note = fallback.start_environment("llama-cpp", "m")
    assert env == {EXTRA_BUFTS_ENV: "0"} and "SIGSEGV" in note and "AMX" in note
    assert fallback.start_environment("llama-cpp", "other") == ({}, None)
    # a second crash on a first evaluation (whatever it says) arms nothing more
    again = crashed(["loaded", STARTED_ON])
    fallback.on_exit(again)
    assert again.fallback is None
    assert fallback.start_environment("llama-cpp", "m") == (env, note)


def test_crashes_that_are_not_the_defect_change_nothing():
    fallback = ExtraBuftsFallback(has_amx=lambda: True)
    for record in (
        crashed(["loaded", STARTED_ON, FIRST_EVAL_FINISHED]),   # a later evaluation
        crashed(["loaded", STARTED_OFF]),                       # extra buffer types were off
        crashed(["loaded", STARTED_ON], sig=None, code=1),      # an exit code, not a signal
        crashed(["loaded", STARTED_ON], backend="echo"),        # another backend
        crashed(["loaded", STARTED_ON], state=STOPPED),         # a stop that was asked for
    ):
        fallback.on_exit(record)
        assert record.fallback is None
    assert fallback.applied == {}


def test_no_fallback_without_amx():
    asked = []
    fallback = ExtraBuftsFallback(has_amx=lambda: asked.append(1) or False)
    record = crashed(["loaded", STARTED_ON])
    fallback.on_exit(record)
    fallback.on_exit(crashed(["loaded", STARTED_ON]))
    assert record.fallback is None and fallback.applied == {} and asked == [1]
