"""LocalAI backend directories (``--backends-path``) and ``--external-grpc-backends``: how a
name is resolved, how the program is started (argv, cwd, environment), and each bad directory
answered with a message naming the file (``localai_tw/backends/directory.py``)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from twisted.python import usage

from localai_tw.backends import builtin
from localai_tw.backends.directory import (
    BackendsDirectory,
    LocalAIBackends,
    RunFileBackend,
    parse_external_backend,
)
from localai_tw.backends.interfaces import BackendFactories, UnknownBackend
from localai_tw.worker import tap
from localai_tw.worker.service import worker_backends_path


def install(root, name, *, run=True, mode=0o755, metadata=None):
    d = root / name
    d.mkdir(parents=True)
    if run:
        (d / "run.sh").write_text("#!/bin/sh\nexec true\n")
        (d / "run.sh").chmod(mode)
    if metadata is not None:
        (d / "metadata.json").write_text(metadata if isinstance(metadata, str)
                                         else json.dumps(metadata))
    return d


def registry(tmp_path, external=()):
    return LocalAIBackends(BackendFactories(builtin.BUILTIN_FACTORIES), str(tmp_path / "b"),
                           external, models_dir="/models")


def test_a_directory_with_run_sh_is_started_as_localai_starts_it(tmp_path):
    d = install(tmp_path / "b", "vllm")
    backend = registry(tmp_path).lookup("vllm")
    assert isinstance(backend, RunFileBackend)
    assert backend.unavailable_reason() is None
    assert backend.command("127.0.0.1:30001", {}) == [str(d / "run.sh"), "--addr",
                                                      "127.0.0.1:30001"]
    assert backend.working_directory({}) == str(d)


def test_environment_sets_the_hf_caches_to_the_models_dir_when_unset(tmp_path, monkeypatch):
    install(tmp_path / "b", "vllm")
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("TRANSFORMERS_CACHE", "/mine")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    env = registry(tmp_path).lookup("vllm").environment({})
    assert env == {"HF_HOME": "/models", "HUGGINGFACE_HUB_CACHE": "/models"}


def test_bundled_vulkan_icd_manifests_are_named_in_the_environment(tmp_path):
    d = install(tmp_path / "b", "llama-vk")
    (d / "vulkan" / "icd.d").mkdir(parents=True)
    (d / "vulkan" / "icd.d" / "b.json").write_text("{}")
    (d / "vulkan" / "icd.d" / "a.json").write_text("{}")
    env = registry(tmp_path).lookup("llama-vk").environment({})
    expected = f"{d}/vulkan/icd.d/a.json{os.pathsep}{d}/vulkan/icd.d/b.json"
    assert env["VK_DRIVER_FILES"] == env["VK_ICD_FILENAMES"] == expected


def test_a_directory_replaces_the_builtin_of_its_name_but_never_external(tmp_path):
    d = install(tmp_path / "b", "transformers")
    install(tmp_path / "b", "external")
    backends = registry(tmp_path)
    assert backends.lookup("transformers").run_file == str(d / "run.sh")
    assert backends.lookup("external") is builtin.external_backend
    assert backends.lookup("echo") is builtin.echo_backend  # no directory: the built-in


def test_external_grpc_backends_come_before_the_directory(tmp_path):
    install(tmp_path / "b", "mine")
    program = tmp_path / "opt" / "server"
    backends = registry(tmp_path, [("mine", str(program))])
    found = backends.lookup("mine")
    assert found.run_file == str(program)
    assert found.working_directory({}) == str(tmp_path / "opt")
    assert "does not exist" in found.unavailable_reason()
    assert str(program) in found.unavailable_reason()


def test_a_meta_backend_runs_the_directory_it_names(tmp_path):
    concrete = install(tmp_path / "b", "cpu-transformers", metadata={"alias": "transformers"})
    install(tmp_path / "b", "transformers", run=False,
            metadata={"meta_backend_for": "cpu-transformers", "name": "transformers"})
    found = registry(tmp_path).lookup("transformers")
    assert found.run_file == str(concrete / "run.sh")
    assert found.working_directory({}) == str(concrete)
    assert found.unavailable_reason() is None


def test_an_alias_finds_the_first_directory_that_claims_it(tmp_path):
    install(tmp_path / "b", "cuda12-whisper", metadata={"alias": "whisper"})
    cpu = install(tmp_path / "b", "cpu-whisper", metadata={"alias": "whisper"})
    install(tmp_path / "b", "a-broken", run=False, metadata={"alias": "whisper"})
    assert registry(tmp_path).lookup("whisper").run_file == str(cpu / "run.sh")


def test_a_directory_without_run_sh_is_an_error_naming_the_file(tmp_path):
    d = install(tmp_path / "b", "transformers", run=False)
    (d / "backend.py").write_text("")
    found = registry(tmp_path).lookup("transformers")  # never the built-in behind it
    reason = found.unavailable_reason()
    assert f"{d}/run.sh does not exist" in reason
    assert "not an installed LocalAI backend" in reason


def test_a_run_sh_that_is_not_executable_is_an_error_saying_so(tmp_path):
    d = install(tmp_path / "b", "vllm", mode=0o644)
    reason = registry(tmp_path).lookup("vllm").unavailable_reason()
    assert reason == (f"backend 'vllm': {d}/run.sh is not executable (backend directory {d});"
                      f" make it so with chmod +x {d}/run.sh")


def test_a_meta_backend_naming_a_missing_directory_says_which(tmp_path):
    install(tmp_path / "b", "transformers", run=False,
            metadata={"meta_backend_for": "cpu-transformers"})
    reason = registry(tmp_path).lookup("transformers").unavailable_reason()
    assert f"{tmp_path}/b/cpu-transformers/run.sh does not exist" in reason
    assert "meta backend" in reason


@pytest.mark.parametrize("metadata, says", [
    ("{not json", "is not valid JSON"),
    ("[1]", "is not a JSON object"),
    (json.dumps({"meta_backend_for": "../etc"}), "is not a backend directory name"),
    ("x" * (64 * 1024 + 1), "is larger than 65536 bytes"),
])
def test_unusable_metadata_is_an_error_naming_the_file(tmp_path, metadata, says):
    d = install(tmp_path / "b", "broken", run=False, metadata=metadata)
    reason = registry(tmp_path).lookup("broken").unavailable_reason()
    assert str(d / "metadata.json") in reason and says in reason


@pytest.mark.parametrize("name", ["..", ".hidden", "a/b", "", "x" * 200])
def test_names_that_are_not_directory_names_never_become_paths(tmp_path, name):
    (tmp_path / "b").mkdir()
    assert BackendsDirectory(str(tmp_path / "b")).resolve(name) is None


def test_unknown_names_say_where_to_install(tmp_path):
    with pytest.raises(UnknownBackend) as e:
        registry(tmp_path).lookup("nope")
    assert "unknown backend 'nope'" in str(e.value)
    assert f"no backend directory {tmp_path}/b/nope either" in str(e.value)


def test_names_lists_builtins_directories_and_external(tmp_path):
    install(tmp_path / "b", "vllm")
    names = registry(tmp_path, [("mine", "/opt/x")]).names()
    assert {"vllm", "mine", "echo", "external"} <= set(names)


def test_parse_external_backend():
    assert parse_external_backend("my-llm:/opt/llm/run.sh", "--x") == ("my-llm",
                                                                       "/opt/llm/run.sh")
    assert parse_external_backend("a:/b:c", "--x") == ("a", "/b:c")
    for bad, says in [("nocolon", "is not NAME:PATH"), ("x:", "is not NAME:PATH"),
                      ("a b:/x", "must be letters"), ("external:/x", "built-in backend"),
                      ("x:127.0.0.1:5000", "NAME:HOST:PORT"), ("x:localhost", "not a path")]:
        with pytest.raises(usage.UsageError, match=says):
            parse_external_backend(bad, "--external-grpc-backends")


def test_worker_options_default_the_backends_path_under_the_data_dir(tmp_path):
    options = tap.Options({"LOCALAI_EXTERNAL_GRPC_BACKENDS": "a:/x/run.sh,b:/y/run.sh"})
    options.parseOptions(["--register-to", "http://f", "--data-dir", str(tmp_path)])
    assert options["backends-path"] is None
    assert worker_backends_path(options) == str(tmp_path / "backends")
    assert options["external-grpc-backends"] == [("a", "/x/run.sh"), ("b", "/y/run.sh")]
    options = tap.Options({"LOCALAI_BACKENDS_PATH": str(tmp_path / "lb")})
    options.parseOptions(["--register-to", "http://f"])
    assert worker_backends_path(options) == str(tmp_path / "lb")
    with pytest.raises(usage.UsageError, match="given twice"):
        tap.Options({}).parseOptions(["--register-to", "http://f", "--external-grpc-backends",
                                      "a:/x", "--external-grpc-backends", "a:/y"])


def test_external_without_a_command_says_how_a_config_reaches_a_program():
    with pytest.raises(ValueError, match="--external-grpc-backends NAME:PATH and use backend: "
                                         "NAME"):
        builtin.external_backend.command("127.0.0.1:1", {})


def test_the_frontends_local_worker_gets_the_backend_options(tmp_path):
    from localai_tw.frontend import tap as frontend_tap
    from localai_tw.frontend.localworker import LocalWorkerService

    class Frontend:
        readiness_gates: list = []

    options = frontend_tap.Options({})
    options.parseOptions(["--local-worker", "--data-dir", str(tmp_path), "--backends-path",
                          str(tmp_path / "lb"), "--external-grpc-backends", "x:/opt/x/run.sh"])
    local = LocalWorkerService(Frontend(), options, reactor=object(), hostname="h")
    worker = local.worker_options("http://127.0.0.1:1")
    assert worker["backends-path"] == str(tmp_path / "lb")
    assert worker["external-grpc-backends"] == [("x", "/opt/x/run.sh")]
    options = frontend_tap.Options({})
    options.parseOptions(["--local-worker", "--data-dir", str(tmp_path)])
    worker = LocalWorkerService(Frontend(), options, reactor=object(),
                                hostname="h").worker_options("http://127.0.0.1:1")
    assert worker_backends_path(worker) == str(tmp_path / "local-worker" / "backends")


def test_a_backend_installed_while_the_worker_runs_is_found(tmp_path):
    (tmp_path / "b").mkdir()
    backends = registry(tmp_path)
    with pytest.raises(UnknownBackend):
        backends.lookup("whisper")
    d = install(tmp_path / "b", "cpu-whisper", metadata={"alias": "whisper"})
    assert backends.lookup("whisper").run_file == str(d / "run.sh")  # the alias map was reread
    install(tmp_path / "b", "vllm")
    assert backends.lookup("vllm").run_file == str(tmp_path / "b" / "vllm" / "run.sh")


def test_a_name_with_a_trailing_newline_is_not_a_directory_name(tmp_path):
    install(tmp_path / "b", "vllm")
    assert BackendsDirectory(str(tmp_path / "b")).resolve("vllm\n") is None
    with pytest.raises(usage.UsageError):
        parse_external_backend("x\n:/opt/x", "--x")


def test_a_failed_start_is_one_escaped_bounded_log_line():
    from localai_tw.backends.record import one_line

    message = ("backend x#0 (/b/x/run.sh) exited with code 3 before it was ready; last output:\n"
               "Traceback ...\n  File 'a'\nImportError: no \x1b[31mtorch\x1b[0m\n")
    assert one_line(message) == ("backend x#0 (/b/x/run.sh) exited with code 3 before it was "
                                  "ready; last output: ImportError: no \\x1b[31mtorch\\x1b[0m")
    assert len(one_line("x" * 5000)) < 600


def test_a_working_directory_never_makes_twisted_fork_the_worker(tmp_path):
    # spawnProcess(path=...) makes Twisted fork() instead of posix_spawn(); a fork of a process
    # with live gRPC channels can abort the child (grpc/grpc#43055): the wrapper enters the
    # directory itself.
    from localai_tw.backends.process import SPAWN_EXEC, BackendSupervisor
    from localai_tw.backends.record import BackendProcess, OutputRing

    calls = []

    class Reactor:
        def spawnProcess(self, protocol, executable, args, env=None, path=None, **kwargs):
            calls.append((args, path))

            class Transport:
                pid = 12345
            return Transport()

    supervisor = BackendSupervisor(Reactor(), ports=None, factories=None)
    record = BackendProcess("m#0", "m", "vllm", OutputRing())
    supervisor._spawn(record, [str(tmp_path / "run.sh"), "--addr", "127.0.0.1:1"], {},
                      str(tmp_path))
    (args, path), = calls
    assert path is None
    assert args[4] == SPAWN_EXEC and args[6] == str(tmp_path)
    assert args[7:] == [str(tmp_path / "run.sh"), "--addr", "127.0.0.1:1"]


def test_the_wrapper_enters_the_directory_or_says_why_not(tmp_path):
    import subprocess

    from localai_tw.backends.process import SPAWN_EXEC

    def run(cwd):
        return subprocess.run([sys.executable, "-I", "-S", "-c", SPAWN_EXEC, str(os.getpid()),
                               cwd, "/bin/sh", "-c", "pwd"], capture_output=True, text=True)

    done = run(str(tmp_path))
    assert (done.returncode, done.stdout.strip()) == (0, str(tmp_path))
    missing = run(str(tmp_path / "gone"))
    assert missing.returncode == 71
    assert f"cannot enter the working directory {tmp_path}/gone" in missing.stderr
