"""Options from flags and LOCALAI_* variables: precedence, validation messages, help text.

Also the frontend's /healthz and /readyz resources, driven with a stub database service, since
they are part of what ``makeService`` builds from these options.  No I/O.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from localai_tw import config
from localai_tw.frontend import tap as frontend_tap
from localai_tw.worker import tap as worker_tap


def parse(options_class, args, environ=None):
    options = options_class(environ=environ or {})
    options.parseOptions(args)
    return options


def flat(text: str) -> str:
    """Help text with wrapping undone (the wrapper may break lines after a hyphen)."""
    return " ".join(text.split()).replace("- ", "-")


# -- the generic machinery ----------------------------------------------------------------


class Sample(config.EnvOptions):
    settings = (
        config.value("grace", "LOCALAI_TEST_GRACE", "Grace.", default="90s",
                     parse=config.parse_duration),
        config.value("token", "LOCALAI_TEST_TOKEN", "Token.", parse=config.parse_secret,
                     secret=True),
        config.flag("single", "LOCALAI_TEST_SINGLE", "Single."),
        config.repeatable("label", "LOCALAI_TEST_LABELS", "Label.", parse=config.parse_label),
        config.repeatable("key", "LOCALAI_TEST_KEYS", "Key.", parse=config.parse_secret,
                          secret=True),
    )


def test_flag_beats_environment_beats_default():
    assert parse(Sample, [])["grace"] == 90.0
    assert parse(Sample, []).sources["grace"] == "default"
    from_env = parse(Sample, [], {"LOCALAI_TEST_GRACE": "2m"})
    assert from_env["grace"] == 120.0 and from_env.sources["grace"] == "env"
    from_flag = parse(Sample, ["--grace", "5s"], {"LOCALAI_TEST_GRACE": "2m"})
    assert from_flag["grace"] == 5.0 and from_flag.sources["grace"] == "flag"


def test_empty_environment_variable_counts_as_unset():
    options = parse(Sample, [], {"LOCALAI_TEST_GRACE": "", "LOCALAI_TEST_TOKEN": ""})
    assert options["grace"] == 90.0
    assert options["token"] is None


def test_flags_from_environment_take_boolean_words():
    assert parse(Sample, [])["single"] is False
    assert parse(Sample, ["--single"])["single"] is True
    for word in ("1", "true", "YES", "on"):
        assert parse(Sample, [], {"LOCALAI_TEST_SINGLE": word})["single"] is True
    for word in ("0", "false", "no", "Off"):
        assert parse(Sample, [], {"LOCALAI_TEST_SINGLE": word})["single"] is False
    with pytest.raises(usage.UsageError, match=r"--single \(from LOCALAI_TEST_SINGLE\)"):
        parse(Sample, [], {"LOCALAI_TEST_SINGLE": "maybe"})


def test_repeatable_options_replace_the_comma_separated_variable():
    env = {"LOCALAI_TEST_LABELS": "gpu=a100, zone=eu ,", "LOCALAI_TEST_KEYS": "k1,k2"}
    options = parse(Sample, [], env)
    assert options["label"] == [("gpu", "a100"), ("zone", "eu")]
    assert options["key"] == ["k1", "k2"]
    options = parse(Sample, ["--label", "a=1", "--label", "b=2"], env)
    assert options["label"] == [("a", "1"), ("b", "2")]
    assert options["key"] == ["k1", "k2"]


def test_describe_masks_secrets_and_names_sources():
    options = parse(Sample, ["--token", "s3cret", "--key", "abc", "--key", "def"],
                    {"LOCALAI_TEST_LABELS": "gpu=a100"})
    described = {name: (shown, source) for name, shown, source in options.describe()}
    assert described["--token"] == ("<set>", "flag")
    assert described["--key"] == ("<2 set>", "flag")
    assert described["--label"] == ("gpu=a100", "env")
    assert described["--grace"] == ("90s", "default")
    assert "s3cret" not in repr(options.describe())


def test_help_lists_environment_variable_and_default():
    text = flat(str(Sample(environ={})))
    assert "--grace= Grace. [env: LOCALAI_TEST_GRACE, default: 90s]" in text
    assert "[env: LOCALAI_TEST_SINGLE, default: off]" in text
    assert "Label. Repeatable. [env: LOCALAI_TEST_LABELS, default: none]" in text


# -- validators ---------------------------------------------------------------------------


@pytest.mark.parametrize("raw, seconds", [
    ("90", 90.0), ("90s", 90.0), ("1m", 60.0), ("1m30s", 90.0), ("1.5m", 90.0),
    ("500ms", 0.5), ("2h", 7200.0), (" 10S ", 10.0), ("0", 0.0),
])
def test_duration_forms(raw, seconds):
    assert config.parse_duration(raw, "--x") == seconds


@pytest.mark.parametrize("raw", ["", "s", "-5s", "5x", "1m 30s", "m1", "90s5"])
def test_bad_durations_name_the_option(raw):
    with pytest.raises(usage.UsageError, match=r"^--reconnect-grace: .*duration"):
        config.parse_duration(raw, "--reconnect-grace")


def test_ports_and_port_ranges():
    assert config.parse_port("8080", "--p") == 8080
    for bad in ("0", "65536", "http", "-1"):
        with pytest.raises(usage.UsageError, match=r"^--p: "):
            config.parse_port(bad, "--p")
    assert config.parse_port_range("30000-30999", "--r") == config.PortRange(30000, 30999)
    assert 30500 in config.PortRange(30000, 30999)
    for bad in ("30999-30000", "30000", "a-b", "1-70000"):
        with pytest.raises(usage.UsageError, match=r"^--r: "):
            config.parse_port_range(bad, "--r")


def test_host_port():
    assert config.parse_host_port("10.0.0.5:8080", "--a") == ("10.0.0.5", 8080)
    assert config.parse_host_port("node.example:443", "--a") == ("node.example", 443)
    assert config.parse_host_port("[fd00::1]:8080", "--a") == ("fd00::1", 8080)
    for bad in ("10.0.0.5", "host:", ":80", "fd00::1:80", "[nothex]:80", "h:99999"):
        with pytest.raises(usage.UsageError, match=r"^--a: "):
            config.parse_host_port(bad, "--a")


def test_loopback_hosts():
    for host in ("127.0.0.1", "127.9.9.9", "::1", "localhost", "0.0.0.0", "::"):
        assert config.is_loopback_host(host)
    for host in ("10.0.0.1", "fd00::1", "node.example"):
        assert not config.is_loopback_host(host)


def test_urls_need_a_known_scheme_and_a_host():
    for good in ("http://f:8080", "https://f.example/base", "ws://10.0.0.1:80", "wss://f"):
        assert config.parse_url(good, "--register-to") == good
    for bad in ("f:8080", "ftp://f", "http://", "http://f:notaport", "//f:80"):
        with pytest.raises(usage.UsageError, match=r"^--register-to: "):
            config.parse_url(bad, "--register-to")


def test_labels():
    assert config.parse_label("gpu=a100", "--label") == ("gpu", "a100")
    assert config.parse_label("topology.kubernetes.io/zone=eu", "--label")[0] == \
        "topology.kubernetes.io/zone"
    assert config.parse_label("empty=", "--label") == ("empty", "")
    for bad in ("novalue", "=v", "sp ace=v"):
        with pytest.raises(usage.UsageError, match=r"^--label: "):
            config.parse_label(bad, "--label")


def test_secrets_are_never_quoted_in_errors():
    with pytest.raises(usage.UsageError) as info:
        config.parse_database_url("http://user:hunter2@db/x", "--database-url")
    assert "hunter2" not in str(info.value)
    assert str(info.value).startswith("--database-url: ")
    with pytest.raises(usage.UsageError) as info:
        config.parse_database_url("host='unterminated password=hunter2", "--database-url")
    assert "hunter2" not in str(info.value)
    assert config.parse_database_url("postgresql://u:p@db:5432/x", "--d")
    assert config.parse_database_url("host=/tmp port=5432 dbname=x", "--d")


def test_server_endpoint_descriptions():
    assert config.parse_server_endpoint("tcp:8080:interface=127.0.0.1", "--listen")
    for bad in ("nonsense:8080", "tcp:notaport"):
        with pytest.raises(usage.UsageError, match=r"^--listen: "):
            config.parse_server_endpoint(bad, "--listen")


# -- the frontend's options ---------------------------------------------------------------


def test_frontend_defaults():
    options = parse(frontend_tap.Options, [])
    assert options["listen"] == "tcp:8080:interface=127.0.0.1"  # loopback: no key, no network
    assert options["database-url"] is None
    assert options["reconnect-grace"] == 90.0
    assert options["heartbeat-batch"] == 0.2
    assert parse(frontend_tap.Options, ["--heartbeat-batch", "0"])["heartbeat-batch"] == 0.0
    assert parse(frontend_tap.Options, ["--heartbeat-batch", "2s"])["heartbeat-batch"] == 2.0
    assert options["tunnel-liveness"] == 10.0
    assert parse(frontend_tap.Options, ["--tunnel-liveness", "0"])["tunnel-liveness"] == 0.0
    assert options["api-key"] == []
    assert options["single-host"] is False and options["require-approval"] is False
    assert options["instance-id"] is None  # makeService reads or makes <data-dir>/instance-id
    assert options["data-dir"] == config.default_data_dir()


def test_frontend_environment():
    env = {
        "LOCALAI_DATABASE_URL": "postgresql://u@db/x",
        "LOCALAI_DATA_DIR": "/srv/ltw",
        "LOCALAI_API_KEY": "k1,k2",
        "LOCALAI_REGISTRATION_TOKEN": "tok",
        "LOCALAI_INSTANCE_ID": "replica-a",
        "LOCALAI_RECONNECT_GRACE": "2m",
        "LOCALAI_REQUIRE_APPROVAL": "true",
        "LOCALAI_NATS_URL": "nats://ignored:4222",
        "LOCALAI_LISTEN": "tcp:9090",
    }
    options = parse(frontend_tap.Options, [], env)
    assert options["database-url"] == "postgresql://u@db/x"
    assert options["data-dir"] == "/srv/ltw"
    assert options["api-key"] == ["k1", "k2"]
    assert options["registration-token"] == "tok"
    assert options["instance-id"] == "replica-a"
    assert options["reconnect-grace"] == 120.0
    assert options["require-approval"] is True
    assert options["nats-url"] == "nats://ignored:4222"
    assert options["listen"] == "tcp:9090"


def test_frontend_loopback_advertise_address_needs_single_host():
    with pytest.raises(usage.UsageError, match=r"^--advertise-address: .*--single-host"):
        parse(frontend_tap.Options, ["--advertise-address", "127.0.0.1:8080"])
    options = parse(frontend_tap.Options, ["--advertise-address", "127.0.0.1:8080",
                                           "--single-host"])
    assert options["advertise-address"] == ("127.0.0.1", 8080)
    options = parse(frontend_tap.Options, [], {"LOCALAI_ADVERTISE_ADDRESS": "localhost:8080",
                                              "LOCALAI_SINGLE_HOST": "1"})
    assert options["advertise-address"] == ("localhost", 8080)


@pytest.mark.parametrize("args, env, named", [
    (["--listen", "bogus:1"], {}, "--listen"),
    (["--reconnect-grace", "soon"], {}, "--reconnect-grace"),
    ([], {"LOCALAI_RECONNECT_GRACE": "soon"}, "--reconnect-grace (from LOCALAI_RECONNECT_GRACE)"),
    (["--database-url", "mysql://x"], {}, "--database-url"),
    (["--instance-id", "has space"], {}, "--instance-id"),
    (["--instance-id", "x" * 37], {}, "--instance-id"),
    (["--advertise-address", "nohost"], {}, "--advertise-address"),
    (["--registration-token", " "], {}, "--registration-token"),
    # A heartbeat waits for its batch's statement at most 2 s (the stale threshold is 90 s).
    (["--heartbeat-batch", "5m"], {}, "--heartbeat-batch"),
    (["--heartbeat-batch", "-1"], {}, "--heartbeat-batch"),
    # A stamped heartbeat must stay far inside the 90 s stale threshold.
    (["--tunnel-liveness", "1m"], {}, "--tunnel-liveness"),
])
def test_frontend_errors_name_the_option(args, env, named):
    with pytest.raises(usage.UsageError) as info:
        parse(frontend_tap.Options, args, env)
    assert str(info.value).startswith(named + ":")


def test_frontend_help_shows_every_option_with_its_variable():
    text = flat(str(frontend_tap.Options(environ={})))
    for setting in frontend_tap.SETTINGS:
        assert f"--{setting.name}" in text
        assert f"[env: {setting.env}, default: " in text
    assert "[env: LOCALAI_LISTEN, default: tcp:8080:interface=127.0.0.1]" in text
    assert "[env: LOCALAI_RECONNECT_GRACE, default: 90s]" in text
    assert "[env: LOCALAI_DATABASE_URL, default: embedded PostgreSQL]" in text


# -- the worker's options -----------------------------------------------------------------


def test_worker_requires_register_to():
    with pytest.raises(usage.UsageError, match=r"^--register-to is required.*LOCALAI_REGISTER_TO"):
        parse(worker_tap.Options, [])


def test_worker_defaults_and_environment():
    import socket

    options = parse(worker_tap.Options, ["--register-to", "https://f.example"])
    assert options["node-name"] == socket.gethostname()
    assert options["node-type"] == "backend"
    assert options["backend-port-range"] == config.PortRange(30000, 30999)
    assert options["labels"] == {}
    options = parse(worker_tap.Options, [], {
        "LOCALAI_REGISTER_TO": "wss://lb.example",
        "LOCALAI_NODE_NAME": "gpu-7",
        "LOCALAI_NODE_TYPE": "agent",
        "LOCALAI_NODE_LABELS": "gpu=a100,zone=eu",
        "LOCALAI_BACKEND_PORT_RANGE": "20000-20099",
    })
    assert options["register-to"] == "wss://lb.example"
    assert options["node-name"] == "gpu-7"
    assert options["node-type"] == "agent"
    assert options["labels"] == {"gpu": "a100", "zone": "eu"}
    assert options["backend-port-range"] == config.PortRange(20000, 20099)


@pytest.mark.parametrize("args, named", [
    (["--register-to", "tcp://f"], "--register-to"),
    (["--node-type", "gpu"], "--node-type"),
    (["--backend-port-range", "9-1"], "--backend-port-range"),
    (["--label", "nokey"], "--label"),
    (["--label", "a=1", "--label", "a=2"], "--label"),
])
def test_worker_errors_name_the_option(args, named):
    with pytest.raises(usage.UsageError) as info:
        parse(worker_tap.Options, ["--register-to", "http://f"] + args
              if args[0] != "--register-to" else args)
    assert str(info.value).startswith(named + ":")


def test_default_backend_port_range_is_outside_linux_ephemeral_default():
    default = config.parse_port_range(worker_tap.DEFAULT_BACKEND_PORT_RANGE, "--x")
    assert not default.overlaps(32768, 60999)


def test_ephemeral_overlap_reads_the_kernel_range(tmp_path):
    proc = tmp_path / "ip_local_port_range"
    proc.write_text("32768\t60999\n")
    assert worker_tap.ephemeral_port_overlap(config.PortRange(40000, 40999), str(proc)) == \
        (32768, 60999)
    assert worker_tap.ephemeral_port_overlap(config.PortRange(30000, 30999), str(proc)) is None
    assert worker_tap.ephemeral_port_overlap(config.PortRange(1, 2), str(tmp_path / "no")) is None


def test_worker_service_tree_holds_no_secret(tmp_path):
    options = parse(worker_tap.Options, ["--register-to", "http://f", "--registration-token",
                                         "tok-123"])
    tree = worker_tap.makeService(options)
    names = {svc.name for svc in tree}
    assert names == {"configuration-report", "worker"}
    assert "tok-123" not in repr(options.describe())


# -- /healthz and /readyz -----------------------------------------------------------------


class StubDatabaseService:
    def __init__(self, ready, reason="starting the embedded PostgreSQL", answer=None):
        self._ready, self._reason = ready, reason
        self.database = None if answer is None else StubDatabase(answer)

    def readiness(self):
        return self._ready, self._reason


class StubDatabase:
    def __init__(self, answer):
        self.answer = answer

    def runQuery(self, sql):
        return self.answer


def render(resource, request):
    result = resource.render(request)
    if result is not NOT_DONE_YET:
        request.write(result)
        request.finish()
    return request


def body(request):
    return b"".join(request.written)


def test_healthz_is_ok():
    request = render(frontend_tap.LivenessResource(), DummyRequest([b""]))
    assert request.responseCode in (None, 200)
    assert body(request) == b"ok"


def test_readyz_not_ready_says_why():
    resource = frontend_tap.ReadinessResource(StubDatabaseService(False), MemoryReactorClock())
    request = render(resource, DummyRequest([b""]))
    assert request.responseCode == 503
    assert json.loads(body(request)) == {"ready": False,
                                         "reason": "starting the embedded PostgreSQL"}


def test_readyz_ready_when_the_database_answers():
    service = StubDatabaseService(True, "ready", answer=defer.succeed([(1,)]))
    resource = frontend_tap.ReadinessResource(service, MemoryReactorClock())
    request = render(resource, DummyRequest([b""]))
    assert request.finished
    assert request.responseCode in (None, 200)
    assert json.loads(body(request)) == {"ready": True}


def test_readyz_times_out_a_hung_database():
    clock = MemoryReactorClock()
    service = StubDatabaseService(True, "ready", answer=defer.Deferred())
    resource = frontend_tap.ReadinessResource(service, clock, probe_timeout=2.0)
    request = render(resource, DummyRequest([b""]))
    assert not request.finished
    clock.advance(2.0)
    assert request.finished
    assert request.responseCode == 503
    reason = json.loads(body(request))["reason"]
    # A sentence, never the timeout's repr "(2.0, 'Deferred')" (issue 26 §5).
    assert reason.startswith("the database did not answer SELECT 1 within 2 s"), reason
    assert "Deferred" not in reason


def test_readyz_of_a_started_replica_whose_database_is_away_is_not_state_ready():
    """Issue 26 §5: during an outage ``/readyz`` said ``"state": "ready"`` beside ``"ready":
    false``.  A pool that knows the database is away answers at once, in words, with the state
    ``database_unavailable``; a probe that times out says the same state."""
    clock = MemoryReactorClock()
    service = StubDatabaseService(True, "ready", answer=defer.Deferred())
    service.database.outage = "database connection lost: server closed the connection"
    resource = frontend_tap.ReadinessResource(service, clock, state=lambda: "ready")
    answer = json.loads(body(render(resource, DummyRequest([b""]))))
    assert answer == {"ready": False, "state": "database_unavailable",
                      "reason": "the database is unavailable (database connection lost: server "
                                "closed the connection); this replica is reconnecting"}
    service.database.outage = None
    request = render(resource, DummyRequest([b""]))
    clock.advance(2.0)
    answer = json.loads(body(request))
    assert answer["state"] == "database_unavailable" and answer["ready"] is False
    # Not ready for another reason (a startup gate): the startup state, as before.
    gated = frontend_tap.ReadinessResource(StubDatabaseService(False, "joining"), clock,
                                           state=lambda: "joining")
    assert json.loads(body(render(gated, DummyRequest([b""]))))["state"] == "joining"


def test_the_data_directory_lock_refuses_a_second_holder(tmp_path):
    """Issue 26 §5: twistd's own ``--pidfile`` (or ``--pidfile=``) bypassed the pidfile guard;
    the lock in the data directory cannot be bypassed.  flock locks belong to an open file
    description, so a second open of the file here stands for a second process."""
    import fcntl
    import os

    other = os.open(tmp_path / "localai-worker.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(other, b"4242\n")
        with pytest.raises(usage.UsageError) as info:
            config.hold_data_dir_lock(str(tmp_path), "localai-worker")
        assert str(info.value) == (
            f"--data-dir: another localai-worker (pid 4242) is running with data directory "
            f"{tmp_path} (it holds {os.path.realpath(tmp_path / 'localai-worker.lock')}); give "
            "this one its own --data-dir")
    finally:
        os.close(other)  # the holder ends: its lock goes with it
    config.hold_data_dir_lock(str(tmp_path), "localai-worker")
    config.hold_data_dir_lock(str(tmp_path), "localai-worker")  # again in one process: no-op
    assert (tmp_path / "localai-worker.lock").read_text() == f"{os.getpid()}\n"


# -- under twistd: pidfile, usage errors ----------------------------------------------------


def twistd_parse(args, environ=None):
    """Parse ``args`` with twistd's real ``ServerOptions`` (plugins discovered as twistd does),
    the plugin's options reading ``environ`` instead of the process environment."""
    from twisted.scripts._twistd_unix import ServerOptions

    class Server(ServerOptions):
        @property
        def subCommands(self):
            for name, short, parser, doc in super().subCommands:
                yield name, short, (lambda parser=parser: _with_environ(parser(), environ)), doc

    server = Server()
    server.parseOptions(args)
    return server


def _with_environ(options, environ):
    options._environ = environ or {}
    return options


def test_twistd_default_pidfile_moves_into_the_data_directory(tmp_path):
    front = twistd_parse(["-n", "localai-frontend", "--data-dir", str(tmp_path / "f")])
    assert front["pidfile"] == str(tmp_path / "f" / "localai-frontend.pid")
    assert (tmp_path / "f").is_dir()
    worker = twistd_parse(["-n", "localai-worker", "--register-to", "http://f:8080"],
                          {"LOCALAI_DATA_DIR": str(tmp_path / "w")})
    assert worker["pidfile"] == str(tmp_path / "w" / "localai-worker.pid")


def test_twistd_explicit_pidfile_is_kept(tmp_path):
    server = twistd_parse(["-n", "--pidfile=", "localai-frontend", "--data-dir", str(tmp_path)])
    assert server["pidfile"] == ""
    server = twistd_parse(["-n", "--pidfile", str(tmp_path / "x.pid"), "localai-frontend",
                           "--data-dir", str(tmp_path)])
    assert server["pidfile"] == str(tmp_path / "x.pid")


def test_twistd_refuses_a_data_directory_in_use(tmp_path, capsys):
    import os

    (tmp_path / "localai-frontend.pid").write_text(str(os.getpid()))
    with pytest.raises(SystemExit) as info:
        twistd_parse(["-n", "localai-frontend", "--data-dir", str(tmp_path)])
    assert info.value.code == 1
    line = capsys.readouterr().err
    assert line.startswith(f"localai-frontend: --data-dir: another localai-frontend (pid "
                           f"{os.getpid()})")
    assert "its own --data-dir" in line
    (tmp_path / "localai-frontend.pid").write_text("999999999")  # gone: stale, adopted
    assert twistd_parse(["-n", "localai-frontend", "--data-dir", str(tmp_path)])["pidfile"]


def test_twistd_explicit_pidfile_does_not_bypass_the_data_directory_lock(tmp_path, capsys):
    import fcntl
    import os

    holder = os.open(tmp_path / "localai-worker.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for pidfile in ("--pidfile=", f"--pidfile={tmp_path / 'other.pid'}"):
            with pytest.raises(SystemExit) as info:
                twistd_parse(["-n", pidfile, "localai-worker", "--register-to", "http://f",
                              "--data-dir", str(tmp_path)])
            assert info.value.code == 1
            line = capsys.readouterr().err
            assert line.startswith("localai-worker: --data-dir: another localai-worker"), line
            assert "its own --data-dir" in line
    finally:
        os.close(holder)


def test_worker_and_frontend_default_data_directories_differ():
    front = parse(frontend_tap.Options, [])
    worker = parse(worker_tap.Options, ["--register-to", "http://f"])
    assert front["data-dir"] != worker["data-dir"]
    assert worker["data-dir"] == config.default_data_dir("worker")


def test_version_prints_localai_tw_version(capsys):
    from importlib import metadata

    for options_class, program in ((frontend_tap.Options, "localai-frontend"),
                                   (worker_tap.Options, "localai-worker")):
        with pytest.raises(SystemExit) as info:
            parse(options_class, ["--version"])
        assert info.value.code == 0
        assert capsys.readouterr().out == \
            f"{program} (localai-tw) {metadata.version('localai-tw')}\n"


# -- logs an operator reads ------------------------------------------------------------------


def test_log_level_option():
    assert parse(frontend_tap.Options, [])["log-level"] == "info"
    assert parse(worker_tap.Options, ["--register-to", "http://f"],
                 {"LOCALAI_LOG_LEVEL": "WARN"})["log-level"] == "warn"
    with pytest.raises(usage.UsageError, match=r"^--log-level: expected one of debug, info"):
        parse(frontend_tap.Options, ["--log-level", "chatty"])


def test_log_level_filters_twistds_own_observer(tmp_path):
    """Under twistd the root service installs twistd's default observer behind a level
    filter, as the application's ILogObserver (which twistd prefers to its own)."""
    from twisted.application.service import Application
    from twisted.logger import ILogObserver, Logger

    from localai_tw import logs

    server = twistd_parse(["-n", "--pidfile=", "--logfile", str(tmp_path / "t.log"),
                           "localai-frontend", "--data-dir", str(tmp_path), "--log-level",
                           "warn"])
    application = Application("t")
    logs.LevelledMultiService("warn", server).setServiceParent(application)
    observer = application.getComponent(ILogObserver)
    logger = Logger(namespace="probe", observer=observer)
    logger.debug("a debug line")
    logger.info("an info line")
    logger.warn("a warning line")
    logger.error("an error line")
    text = (tmp_path / "t.log").read_text()
    assert "a warning line" in text and "an error line" in text
    assert "info line" not in text and "debug line" not in text


def test_grpc_core_logging_is_off_unless_asked():
    from localai_tw import logs

    environ = {}
    logs.quiet_grpc_core(environ)
    assert environ == {"GRPC_VERBOSITY": "NONE"}
    for asked in ({"GRPC_VERBOSITY": "debug"}, {"GRPC_TRACE": "http"}):
        environ = dict(asked)
        logs.quiet_grpc_core(environ)
        assert environ == asked


def test_access_log_leaves_out_heartbeats_and_probes():
    from localai_tw.web.listener import BoundedSite

    class Request:
        def __init__(self, path, code=200):
            self.path, self.code = path, code

        def getClientAddress(self):
            return IPv4Address("TCP", "127.0.0.1", 40000)

    from twisted.internet.address import IPv4Address

    from localai_tw.frontend.api.workers import is_heartbeat_path

    lines = []
    site = BoundedSite(None, logFormatter=lambda now, request: request.path.decode(),
                       quiet_on_success=is_heartbeat_path)
    site._logFile = type("Sink", (), {"write": lambda self, line: lines.append(line.strip())})()
    for request in (Request(b"/api/node/n1/heartbeat"), Request(b"/healthz"),
                    Request(b"/readyz"), Request(b"/v1/embeddings"),
                    Request(b"/api/node/register"), Request(b"/api/node/n1/heartbeat", 404),
                    Request(b"/readyz", 503)):
        site.log(request)
    assert lines == ["/v1/embeddings", "/api/node/register", "/api/node/n1/heartbeat"]


def test_access_log_option_keeps_errors_only_or_nothing():
    from twisted.internet.address import IPv4Address

    from localai_tw.web.listener import BoundedSite

    class Request:
        def __init__(self, path, code=200):
            self.path, self.code = path, code

        def getClientAddress(self):
            return IPv4Address("TCP", "127.0.0.1", 40000)

    requests = (Request(b"/v1/completions"), Request(b"/v1/completions", 502),
                Request(b"/v1/embeddings", 401), Request(b"/api/node/n1/heartbeat", 503),
                Request(b"/healthz", 500))
    logged = {}
    for choice in ("all", "errors", "off"):
        lines = logged[choice] = []
        site = BoundedSite(None, access_log=choice,
                           logFormatter=lambda now, r: f"{r.path.decode()} {r.code}")
        site._logFile = type("Sink", (), {"write": lambda self, line, lines=lines:
                                          lines.append(line.strip())})()
        for request in requests:
            site.log(request)
    assert logged["all"] == ["/v1/completions 200", "/v1/completions 502",
                             "/v1/embeddings 401", "/api/node/n1/heartbeat 503"]
    assert logged["errors"] == ["/v1/completions 502", "/v1/embeddings 401",
                                "/api/node/n1/heartbeat 503"]
    assert logged["off"] == []
    assert parse(frontend_tap.Options, []).get("access-log") == "all"
    assert parse(frontend_tap.Options, ["--access-log", "errors"]).get("access-log") == "errors"
    with pytest.raises(usage.UsageError):
        parse(frontend_tap.Options, ["--access-log", "some"])


def test_exposure_line_says_what_is_open():
    from twisted.internet.address import IPv4Address

    local = IPv4Address("TCP", "127.0.0.1", 8080)
    everywhere = IPv4Address("TCP", "0.0.0.0", 8080)
    open_line = frontend_tap.exposure_line(local, parse(frontend_tap.Options, []))
    assert "the OpenAI API is open to anyone who can reach 127.0.0.1:8080 (no --api-key)" \
        in open_line
    assert "the admin API is closed" in open_line
    assert "worker registration is open to anyone" in open_line
    keyed = parse(frontend_tap.Options, ["--api-key", "sk-secret-1", "--registration-token",
                                         "tok-secret"])
    line = frontend_tap.exposure_line(everywhere, keyed)
    assert "every interface of this machine, port 8080" in line
    assert "the OpenAI API needs an API key (1 configured)" in line
    assert "worker registration needs the registration token" in line
    assert "secret" not in line
    minted = parse(frontend_tap.Options, ["--local-worker"])
    assert "limited to the local worker" in frontend_tap.exposure_line(local, minted)
    scoped = parse(frontend_tap.Options, ["--api-key", "sk-secret-1", "--admin-api-key",
                                          "sk-secret-admin"])
    line = frontend_tap.exposure_line(local, scoped)
    assert "1 inference, 1 admin configured" in line and "needs an admin key" in line
    assert "secret" not in line


# -- secure by default ------------------------------------------------------------------------


@pytest.mark.parametrize("listen, reach", [
    ("tcp:8080:interface=127.0.0.1", None),
    ("tcp:8080:interface=127.0.0.2", None),
    (r"tcp6:8080:interface=\:\:1", None),
    ("tcp:8080:interface=localhost", None),
    ("unix:/run/ltw.sock", None),
    ("tcp:8080", "every interface"),
    ("tcp:8080:interface=0.0.0.0", "0.0.0.0"),
    ("tcp:8080:interface=192.0.2.7", "192.0.2.7"),
    ("ssl:8443:privateKey=k.pem", "every interface"),
])
def test_listener_reach(listen, reach):
    assert config.listener_reach(listen) == reach


@pytest.mark.parametrize("args, env", [
    (["--listen", "tcp:8080"], {}),
    ([], {"LOCALAI_LISTEN": "tcp:8080:interface=0.0.0.0"}),
])
def test_open_network_listener_needs_a_key_or_the_explicit_flag(args, env):
    with pytest.raises(usage.UsageError) as info:
        parse(frontend_tap.Options, args, env)
    message = str(info.value)
    assert message.startswith("--listen: ")
    assert "--allow-open-api" in message and "LOCALAI_ALLOW_OPEN_API" in message
    assert "--api-key" in message
    locked = args + ["--registration-token", "tok"]
    assert parse(frontend_tap.Options, locked + ["--allow-open-api"], env)["listen"]
    assert parse(frontend_tap.Options, locked, dict(env, LOCALAI_ALLOW_OPEN_API="1"))["listen"]
    assert parse(frontend_tap.Options, locked + ["--api-key", "k"], env)["api-key"] == ["k"]


@pytest.mark.parametrize("args, env", [
    (["--listen", "tcp:8080"], {}),
    ([], {"LOCALAI_LISTEN": "tcp:8080:interface=0.0.0.0"}),
])
def test_open_network_listener_needs_a_registration_token_or_the_explicit_flag(args, env):
    """Issue 21 §6: a reachable listener with open registration lets anyone register a worker
    that then wins cold loads, and with them users' prompts."""
    keyed = args + ["--api-key", "k"]
    with pytest.raises(usage.UsageError) as info:
        parse(frontend_tap.Options, keyed, env)
    message = str(info.value)
    assert message.startswith("--listen: ")
    assert "--registration-token-file" in message
    assert "--allow-open-registration" in message and "LOCALAI_ALLOW_OPEN_REGISTRATION" in message
    assert parse(frontend_tap.Options, keyed + ["--allow-open-registration"], env)["listen"]
    assert parse(frontend_tap.Options, keyed,
                 dict(env, LOCALAI_ALLOW_OPEN_REGISTRATION="1"))["listen"]
    assert parse(frontend_tap.Options, keyed + ["--registration-token", "t"],
                 env)["registration-token"] == "t"
    # Loopback needs neither.
    assert parse(frontend_tap.Options, [], {})["registration-token"] in (None, "")


def test_admin_keys_from_a_file(tmp_path):
    (tmp_path / "admin").write_text("adm-one\n")
    options = parse(frontend_tap.Options, [], {"LOCALAI_ADMIN_API_KEY_FILE":
                                              str(tmp_path / "admin")})
    assert options["admin-api-key"] == ["adm-one"]


def test_secrets_from_files(tmp_path):
    (tmp_path / "token").write_text("tok-from-file\n")
    (tmp_path / "keys").write_text("key-one\n\nkey-two\n")
    options = parse(frontend_tap.Options, ["--registration-token-file", str(tmp_path / "token"),
                                           "--listen", "tcp:8080"],
                    {"LOCALAI_API_KEY_FILE": str(tmp_path / "keys")})
    assert options["registration-token"] == "tok-from-file"
    assert options["api-key"] == ["key-one", "key-two"]
    assert options.sources["api-key"] == "file"
    shown = repr(options.describe())
    assert "tok-from-file" not in shown and "key-one" not in shown
    assert str(tmp_path / "token") in shown
    worker = parse(worker_tap.Options, ["--register-to", "http://f",
                                        "--registration-token-file", str(tmp_path / "token")])
    assert worker["registration-token"] == "tok-from-file"


def test_bad_secret_files_are_usage_errors(tmp_path):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text("s3cret\n")
    for args, expected in (
            (["--registration-token-file", str(tmp_path / "missing")],
             f"--registration-token-file: cannot read {tmp_path / 'missing'}: No such file"),
            (["--api-key-file", str(tmp_path / "empty")],
             f"--api-key-file: {tmp_path / 'empty'} is empty"),
            (["--api-key-file", str(tmp_path)], f"--api-key-file: cannot read {tmp_path}"),
            (["--registration-token", "x", "--registration-token-file", str(tmp_path / "token")],
             "--registration-token and --registration-token-file are both set")):
        with pytest.raises(usage.UsageError) as info:
            parse(frontend_tap.Options, args)
        assert str(info.value).startswith(expected), str(info.value)
        assert "s3cret" not in str(info.value)


def test_worker_warns_when_registering_in_clear_across_a_network():
    assert worker_tap.warn_if_unencrypted("http://192.0.2.10:8080") is True
    assert worker_tap.warn_if_unencrypted("ws://frontends.example") is True
    assert worker_tap.warn_if_unencrypted("https://frontends.example") is False
    assert worker_tap.warn_if_unencrypted("http://127.0.0.1:8080") is False
    assert worker_tap.warn_if_unencrypted("http://localhost:8080") is False


def test_instance_id_is_kept_in_the_data_directory(tmp_path):
    first = frontend_tap.stored_instance_id(str(tmp_path / "d"))
    assert len(first) == 36
    assert (tmp_path / "d" / "instance-id").read_text() == first + "\n"
    assert frontend_tap.stored_instance_id(str(tmp_path / "d")) == first
    assert frontend_tap.stored_instance_id(str(tmp_path / "other")) != first
    (tmp_path / "d" / "instance-id").write_text("not valid!\n")
    with pytest.raises(usage.UsageError, match=r"^--instance-id \(from .*instance-id\): "):
        frontend_tap.stored_instance_id(str(tmp_path / "d"))


def test_tests_never_use_the_real_data_directories():
    """tests/conftest.py points the default data directories at a directory of the session."""
    import os

    home_share = os.path.join(os.path.expanduser("~"), ".local", "share")
    for role in ("", "worker"):
        assert not config.default_data_dir(role).startswith(home_share)
    assert not parse(frontend_tap.Options, [])["data-dir"].startswith(home_share)


def test_server_endpoints_get_a_backlog_sized_for_a_fleet():
    """Twisted's default backlog (50) overflowed when 1000 workers registered at once."""
    assert config.with_fleet_backlog("tcp:8080:interface=127.0.0.1") == \
        f"tcp:8080:interface=127.0.0.1:backlog={config.FLEET_BACKLOG}"
    assert config.with_fleet_backlog("unix:/run/x.sock").endswith(":backlog=1024")
    assert config.with_fleet_backlog("ssl:8443:privateKey=k.pem").endswith(":backlog=1024")
    # The operator's own choice wins; endpoints without a backlog are left alone.
    assert config.with_fleet_backlog("tcp:8080:backlog=10") == "tcp:8080:backlog=10"
    assert config.with_fleet_backlog("systemd:domain=INET:index=0") == \
        "systemd:domain=INET:index=0"


def test_the_frontend_process_runs_full_garbage_collections_rarely(tmp_path):
    """Issue 15 §4: at 4000 workers the frontend's full collections (every ~8 s with Python's
    thresholds, collecting nothing) stalled ``/healthz`` for 1-2.5 s.  ``makeService`` (the
    twistd process) sets rarer ones.  Remove the ``gc.set_threshold`` call: this fails."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        options = parse(frontend_tap.Options, ["--data-dir", str(tmp_path),
                                               "--instance-id", "replica-gc"])
        frontend_tap.makeService(options)
        assert gc.get_threshold() == frontend_tap.GC_THRESHOLDS == (700, 10, 100)
    finally:
        gc.set_threshold(*before)
