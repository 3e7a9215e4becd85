"""The backends shipped with localai-tw, as :class:`~localai_tw.backends.interfaces.IBackendFactory`
providers (exposed to ``twisted.plugin`` by ``localai_tw/plugins/localai_builtin_backends.py``).

- ``external``: any LocalAI-compatible backend program, started as
  ``<command...> --addr 127.0.0.1:<port>`` (the flag last, as LocalAI does).  Options:
  ``command`` (a list, or a string split like a shell would), ``cwd``, ``env`` (a dict).
- ``echo``: the deterministic test backend (``builtin/echo.py``), no dependencies.
- ``bert-numpy``: sentence embeddings of a local BERT sentence-transformers model directory
  (the default all-MiniLM-L6-v2) in numpy (``builtin/bert_numpy.py``); needs the ``embeddings``
  extra (numpy, tokenizers, safetensors), no torch.
- ``espeak-ng``: text to speech with Debian's ``espeak-ng`` program (``builtin/espeak_ng.py``);
  needs that program on PATH (``apt-get install espeak-ng``).
- ``pocketsphinx``: US English speech to text with PocketSphinx (``builtin/pocketsphinx_asr.py``);
  needs the ``speech`` extra (the ``pocketsphinx`` wheel, which ships its model).
- ``hash-image``: a test/demo image backend drawing a deterministic PNG from the request's
  hash (``builtin/hash_image.py``), no dependencies.
- ``sentence-transformers`` / ``transformers``: ``builtin/huggingface.py``; they need the
  ``sentence-transformers`` / ``transformers`` extras (torch and the Hugging Face libraries) in the
  interpreter that runs them.  Option ``python`` names another interpreter (a venv with those
  libraries); then the worker does not check the libraries itself.
- ``llama-cpp``: GGUF models through llama.cpp's Python bindings (``builtin/llama_cpp.py``, LocalAI's
  backend name); needs the ``llama`` extra (llama-cpp-python, built from source by pip).

Python programs are started with the worker's own interpreter unless ``python`` says
otherwise, with ``PYTHONPATH`` led by the directory that holds ``localai_tw``, so they import
this package whether or not it is installed.

What this module must never do: import torch, transformers, sentence-transformers, llama_cpp or
numpy (it
only asks ``importlib`` whether they could be imported), or put anything but ``--addr <address>``
after an operator's command line.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from typing import Mapping, Sequence

from zope.interface import implementer

from localai_tw.backends.interfaces import IBackendFactory

#: The directory that holds the ``localai_tw`` package (put first on a child's PYTHONPATH).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def _string_env(env, what: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{what} must be an object of strings")
    return dict(env)


@implementer(IBackendFactory)
class ExternalBackendFactory:
    """Any LocalAI-compatible backend executable (``run.sh`` of an installed LocalAI backend,
    a Go or C++ backend binary, a script)."""

    name = "external"
    description = "a LocalAI-compatible backend program: <command...> --addr 127.0.0.1:<port>"

    def unavailable_reason(self) -> str | None:
        return None

    def command(self, address: str, options: Mapping) -> Sequence[str]:
        raw = options.get("command")
        if isinstance(raw, str):
            argv = shlex.split(raw)
        elif isinstance(raw, list) and all(isinstance(a, str) for a in raw):
            argv = list(raw)
        else:
            raise ValueError("the external backend needs options.command: the program and "
                             "its arguments (a list of strings, or one string); a model config "
                             "cannot give one: register the program on the worker with "
                             "--external-grpc-backends NAME:PATH and use backend: NAME")
        if not argv:
            raise ValueError("options.command is empty")
        program = argv[0]
        if os.sep in program:
            if not os.access(program, os.X_OK):
                raise ValueError(f"backend program {program} is not an executable file")
        elif shutil.which(program) is None:
            raise ValueError(f"backend program {program!r} is not on PATH")
        return [*argv, "--addr", address]

    def environment(self, options: Mapping) -> Mapping[str, str]:
        return _string_env(options.get("env"), "options.env")

    def servicer(self, options: Mapping):
        raise NotImplementedError("the external backend always runs a process")


@implementer(IBackendFactory)
class PythonProgramFactory:
    """A backend program of this package, run with ``python -m <module> [args] --addr``."""

    def __init__(self, name: str, description: str, module: str, args: Sequence[str] = (),
                 required_modules: Sequence[str] = (), extra: str | None = None):
        self.name = name
        self.description = description
        self.module = module
        self.args = tuple(args)
        self.required_modules = tuple(required_modules)
        self.extra = extra

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def unavailable_reason(self) -> str | None:
        missing = [m for m in self.required_modules if importlib.util.find_spec(m) is None]
        if not missing:
            return None
        return (f"backend {self.name} needs {', '.join(missing)}, not installed in "
                f"{sys.executable}: pip install 'localai-tw[{self.extra}]' "
                f"(or give options.python, an interpreter that has them)")

    def command(self, address: str, options: Mapping) -> Sequence[str]:
        python = options.get("python")
        if python is None:
            reason = self.unavailable_reason()
            if reason is not None:
                raise ValueError(reason)
            python = sys.executable
        elif not isinstance(python, str) or not os.access(python, os.X_OK):
            raise ValueError(f"options.python must name an executable interpreter, "
                             f"not {python!r}")
        return [python, "-m", self.module, *self.args, "--addr", address]

    def environment(self, options: Mapping) -> Mapping[str, str]:
        env = _string_env(options.get("env"), "options.env")
        inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, inherited) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def servicer(self, options: Mapping):
        raise NotImplementedError(f"backend {self.name} always runs a process")


external_backend = ExternalBackendFactory()
echo_backend = PythonProgramFactory(
    "echo", "deterministic test backend: echoes the prompt word by word",
    "localai_tw.backends.builtin.echo")
bert_numpy_backend = PythonProgramFactory(
    "bert-numpy", "BERT sentence embeddings (all-MiniLM-L6-v2) in numpy, without torch",
    "localai_tw.backends.builtin.bert_numpy", (),
    ("numpy", "tokenizers", "safetensors"), "embeddings")
sentence_transformers_backend = PythonProgramFactory(
    "sentence-transformers", "sentence embeddings with sentence-transformers",
    "localai_tw.backends.builtin.huggingface", ("--kind", "sentence-transformers"),
    ("torch", "sentence_transformers"), "sentence-transformers")
transformers_backend = PythonProgramFactory(
    "transformers", "text generation and embeddings with Hugging Face transformers",
    "localai_tw.backends.builtin.huggingface", ("--kind", "transformers"),
    ("torch", "transformers"), "transformers")
llama_cpp_backend = PythonProgramFactory(
    "llama-cpp", "GGUF models (text generation, grammar, embeddings) with llama.cpp",
    "localai_tw.backends.builtin.llama_cpp", (), ("llama_cpp", "numpy"), "llama")



@implementer(IBackendFactory)
class PythonProgramWithToolFactory(PythonProgramFactory):
    """A backend program of this package that also runs a system program (on PATH)."""

    def __init__(self, *args, program: str, install: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.program = program
        self.install = install

    def unavailable_reason(self) -> str | None:
        if shutil.which(self.program) is None:
            return (f"backend {self.name} needs the program {self.program}, not on PATH: "
                    f"{self.install}")
        return super().unavailable_reason()


espeak_ng_backend = PythonProgramWithToolFactory(
    "espeak-ng", "text to speech with espeak-ng (formant synthesis, many languages)",
    "localai_tw.backends.builtin.espeak_ng", program="espeak-ng",
    install="apt-get install espeak-ng")
pocketsphinx_backend = PythonProgramFactory(
    "pocketsphinx", "US English speech to text with PocketSphinx (its wheel ships the model)",
    "localai_tw.backends.builtin.pocketsphinx_asr", (), ("pocketsphinx",), "speech")
hash_image_backend = PythonProgramFactory(
    "hash-image", "test/demo image backend: a deterministic PNG from the request's hash",
    "localai_tw.backends.builtin.hash_image")

# Named *_backend: a bare ``echo`` would be replaced by the submodule ``builtin.echo`` as soon
# as that module is imported (the import system sets submodules as package attributes).
BUILTIN_FACTORIES = (external_backend, echo_backend, bert_numpy_backend,
                     sentence_transformers_backend, transformers_backend, llama_cpp_backend,
                     espeak_ng_backend, pocketsphinx_backend, hash_image_backend)
