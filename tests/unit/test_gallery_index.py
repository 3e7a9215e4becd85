"""The gallery's index reading (``frontend/gallery/installs.py``): ``--galleries`` values, LocalAI's
entry format (the snapshot in ``tests/fixtures/localai-gallery``), bounds, and the order in
which a replica keeps job snapshots it hears."""

from __future__ import annotations

import glob
import os

import pytest
import pytest_twisted
import yaml
from twisted.internet import reactor

from localai_tw.frontend.gallery.installs import GalleryJobs, read_url

from localai_tw.frontend.gallery.index import (

    Gallery,

    GalleryError,

    merge,

    parse_entry,

    parse_galleries,

    parse_index,

)

from .pendingbus import PendingBus

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "localai-gallery")
G = Gallery("test", "file:///index.yaml")


def test_galleries_option_takes_name_url_a_bare_url_and_localai_json():
    assert parse_galleries(["local=file:///srv/index.yaml"]) == (
        Gallery("local", "file:///srv/index.yaml"),)
    assert parse_galleries(["https://example.org/g/models.yaml"]) == (
        Gallery("models", "https://example.org/g/models.yaml"),)
    assert parse_galleries(['[{"name":"localai","url":"github:mudler/LocalAI/gallery/'
                            'index.yaml@master"}]']) == (
        Gallery("localai", "github:mudler/LocalAI/gallery/index.yaml@master"),)


@pytest.mark.parametrize("value, says", [
    ("ftp://x/index.yaml", "is not a file://"),
    ("[not json", "not JSON"),
    ('[{"name": "x"}]', "JSON must be"),
    ("../up=file:///x.yaml", "plain name"),
])
def test_bad_galleries_option_values_are_named(value, says):
    with pytest.raises(GalleryError, match=says):
        parse_galleries([value])


def test_two_galleries_with_one_name_are_refused():
    with pytest.raises(GalleryError, match="same name"):
        parse_galleries(["a=file:///x.yaml", "a=file:///y.yaml"])


def test_every_named_entry_of_localai_gallery_snapshot_is_read():
    named = unnamed = 0
    for path in sorted(glob.glob(os.path.join(FIXTURES, "*.yaml"))):
        with open(path, "rb") as f:
            raw = yaml.safe_load(f)
        if raw.get("name"):
            entry = parse_entry(raw, G)
            assert entry.id == f"test@{raw['name']}"
            assert isinstance(entry.config_file, str) and entry.config_file
            named += 1
        else:  # the config files entries name by url (piper.yaml ...): no name of their own
            with pytest.raises(GalleryError):
                parse_entry(raw, G)
            unnamed += 1
    assert (named, unnamed) == (74, 7)


def test_an_index_entry_in_localai_format_with_files_and_overrides():
    entries, skipped = parse_index([
        {"name": "m", "url": "github:mudler/LocalAI/gallery/virtual.yaml@master",
         "description": "d", "license": "apache-2.0", "tags": ["llm", 3],
         "overrides": {"backend": "llama-cpp", "parameters": {"model": "m.gguf"}},
         "files": [{"filename": "m.gguf", "sha256": "AB" * 32,
                    "uri": "huggingface://org/repo/m.gguf"}]},
        {"name": "../escape"}, {"name": ".hidden"}, {"description": "no name"}, "text",
        {"name": "bad-files", "files": [{"filename": "/etc/passwd", "uri": "file:///x"}]},
        {"name": "bad-digest", "files": [{"filename": "a", "uri": "file:///x",
                                          "sha256": "nope"}]},
    ], G)
    assert [e.name for e in entries] == ["m"] and skipped == 6
    [m] = entries
    assert m.tags == ("llm",) and m.files[0].sha256 == "ab" * 32
    meta = m.metadata(installed=False)
    assert meta["gallery"] == {"name": "test", "url": "file:///index.yaml"}
    assert meta["files"] == [{"filename": "m.gguf", "uri": "huggingface://org/repo/m.gguf",
                              "sha256": "ab" * 32}]
    with pytest.raises(GalleryError, match="must be a YAML or JSON list"):
        parse_index({"not": "a list"}, G)


def test_a_bad_file_names_the_entry_and_the_field():
    with pytest.raises(GalleryError, match=r"entry x: files\[0\].filename: must be relative"):
        parse_entry({"name": "x", "files": [{"filename": "/abs", "uri": "file:///y"}]}, G)


def test_overrides_merge_deeply_and_replace_the_rest():
    base = {"backend": "a", "parameters": {"model": "x", "temperature": 0.1}, "options": [1]}
    assert merge(base, {"parameters": {"model": "y"}, "options": [2]}) == {
        "backend": "a", "parameters": {"model": "y", "temperature": 0.1}, "options": [2]}
    assert base["parameters"]["model"] == "x"  # not changed in place


@pytest_twisted.ensureDeferred
async def test_an_index_larger_than_the_bound_is_refused(tmp_path):
    index = tmp_path / "index.yaml"
    index.write_bytes(b"x" * 101)
    with pytest.raises(GalleryError, match="larger than 100 bytes"):
        await read_url(f"file://{index}", 100, reactor)
    assert await read_url(f"file://{index}", 101, reactor) == b"x" * 101
    with pytest.raises(GalleryError, match="cannot be read"):
        await read_url(f"file://{tmp_path}/absent.yaml", 100, reactor)


def test_a_late_older_snapshot_does_not_replace_a_newer_one():
    jobs = GalleryJobs(None, PendingBus(), "r1", "/nowhere", None, (), reactor)
    jobs._heard("gallery.j1", {"id": "j1", "replica": "r1", "seq": 5, "state": "downloading"})
    jobs._heard("gallery.j1", {"id": "j1", "replica": "r1", "seq": 4, "state": "queued"})
    assert jobs.snapshots["j1"]["state"] == "downloading"
    jobs._heard("gallery.j1", {"id": "j1", "replica": "r1", "seq": 6, "state": "done"})
    assert jobs.snapshots["j1"]["state"] == "done"
    jobs._heard("gallery.j2", {"id": "other", "seq": 1})  # a subject and id that disagree
    assert "j2" not in jobs.snapshots and "other" not in jobs.snapshots


def test_progress_snapshots_without_the_description_keep_the_one_heard():
    jobs = GalleryJobs(None, PendingBus(), "r1", "/nowhere", None, (), reactor)
    jobs._heard("gallery.j1", {"id": "j1", "replica": "r1", "seq": 1, "state": "queued",
                               "description": "long text"})
    jobs._heard("gallery.j1", {"id": "j1", "replica": "r1", "seq": 2, "state": "downloading"})
    assert jobs.snapshots["j1"]["description"] == "long text"
    assert jobs.snapshots["j1"]["state"] == "downloading"


@pytest_twisted.ensureDeferred
async def test_a_replica_queues_a_bounded_number_of_jobs(monkeypatch):
    from localai_tw.frontend.gallery import installs as gallery

    monkeypatch.setattr(gallery, "MAX_QUEUED", 2)
    bus = PendingBus()
    jobs = GalleryJobs(None, bus, "r1", "/nowhere", None, (), reactor)
    jobs._running = True  # (a job runs: nothing is started here)
    first = await jobs.delete("a")
    second = await jobs.delete("b")
    with pytest.raises(gallery.GalleryBusy, match="2 gallery jobs are queued"):
        await jobs.delete("c")
    assert jobs.snapshots[first]["state"] == "queued" and len(jobs.snapshots) == 2
    # each queued job is broadcast to the other replicas; the refused one is not
    assert [(subject, s["state"]) for subject, s in bus.published] == [
        (f"gallery.{first}", "queued"), (f"gallery.{second}", "queued")]


def test_a_replica_stopped_before_its_gallery_subscription_lands_logs_no_failure():
    """Found by CI: a frontend stopped right after it was ready logged a critical traceback
    ("gallery: cannot subscribe to the bus", BusStopped).  A stop while the subscription is on
    its way is normal: one info line, and a subscription landing after the stop is undone.
    (Log the failure unconditionally in _not_subscribed: this fails.)"""
    from twisted.internet import task
    from twisted.logger import LogLevel, globalLogPublisher

    from localai_tw.bus.pgbus import BusStopped
    from localai_tw.frontend.gallery.installs import GalleryJobs

    from .pendingbus import PendingBus as Bus
    from .pendingbus import Subscription

    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        for outcome in ("fails", "lands"):
            bus = Bus()
            gallery = GalleryJobs(None, bus, "replica-a", "/nonexistent", None, [], task.Clock())
            gallery.startService()
            gallery.stopService()
            if outcome == "fails":
                bus.pending[0].errback(BusStopped("the bus was stopped"))
            else:
                late = Subscription()
                bus.pending[0].callback(late)
                assert late.unsubscribed
    finally:
        globalLogPublisher.removeObserver(events.append)
    ours = [e for e in events if "gallery" in str(e.get("log_namespace", ""))]
    assert not [e for e in ours if e["log_level"] >= LogLevel.error], ours
