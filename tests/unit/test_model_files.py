"""Model files checked on the frontend before a load (``frontend/inference/modelfiles.py``) and the
config keys that name them (``download_files``, a URL ``parameters.model``; ``models.py``),
and the URL rules of ``frontend/inference/downloads.py``: issue 11 §4 and §5."""

from __future__ import annotations

import hashlib
import os
import re

import pytest

from localai_tw.frontend.inference import modelfiles
from localai_tw.frontend.inference.downloads import resolve_url, shown_url
from localai_tw.frontend.inference.interfaces import ModelFileMismatch
from localai_tw.frontend.inference.modelfiles import DigestCache, plan_blocking
from localai_tw.localai.model_config import ModelConfigError, parse_model_config


def parse(**data):
    data.setdefault("name", "m")
    data.setdefault("backend", "echo")
    return parse_model_config(data, "m.yaml")


def write(root, rel: str, data: bytes = b"x") -> str:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


# -- config keys --------------------------------------------------------------------------------


def test_download_files_are_read_as_localai_writes_them():
    config = parse(parameters={"model": "w.gguf"}, download_files=[
        {"filename": "w.gguf", "uri": "https://example.org/w.gguf", "sha256": "AB" * 32},
        {"filename": "sub/tok.json", "uri": "huggingface://o/r/tok.json"}])
    assert [(d.filename, d.uri, d.sha256, d.where) for d in config.downloads] == [
        ("w.gguf", "https://example.org/w.gguf", "ab" * 32, "download_files[0]"),
        ("sub/tok.json", "huggingface://o/r/tok.json", None, "download_files[1]")]
    assert not any("download_files" in w for w in config.warnings)  # acted on now


def test_a_url_model_becomes_its_file_name_and_a_download():
    config = parse(parameters={"model": "https://h.example/x/tiny.Q4.gguf?token=s3cret"})
    assert config.model == "tiny.Q4.gguf"
    [d] = config.downloads
    assert (d.filename, d.sha256, d.where) == ("tiny.Q4.gguf", None, "parameters.model")
    nameless = parse(parameters={"model": "https://h.example/"})
    assert nameless.model == hashlib.md5(b"https://h.example/").hexdigest()


@pytest.mark.parametrize("data, where, text", [
    ({"parameters": {"model": "ollama://llama3"}}, "parameters.model", "ollama:// URLs"),
    ({"download_files": [{"filename": "a", "uri": "oci://x/y"}]}, "download_files[0].uri",
     "oci:// URLs"),
    ({"download_files": [{"filename": "a", "uri": "ftp://x/y"}]}, "download_files[0].uri",
     "ftp:// URLs"),
    ({"download_files": [{"filename": "../a", "uri": "https://x/a"}]},
     "download_files[0].filename", "leaves the models directory"),
    ({"download_files": [{"filename": "/etc/a", "uri": "https://x/a"}]},
     "download_files[0].filename", "relative"),
    ({"download_files": [{"filename": "a", "uri": "https://x/a", "sha256": "12"}]},
     "download_files[0].sha256", "64 hex"),
    ({"download_files": [{"filename": "a", "uri": "https://x/a", "size": 3}]},
     "download_files[0].size", "unknown field"),
    ({"download_files": [{"filename": "a", "uri": "https://x/a"},
                         {"filename": "a", "uri": "https://x/b"}]}, "download_files",
     "same filename"),
    ({"download_files": "https://x/a"}, "download_files", "must be a list"),
])
def test_bad_download_keys_refuse_the_file_naming_the_key(data, where, text):
    with pytest.raises(ModelConfigError) as caught:
        parse(**data)
    assert caught.value.field == where and text in caught.value.problem


def test_urls_resolve_as_localai_and_are_shown_without_secrets(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert resolve_url("huggingface://TheBloke/M-GGUF/m.Q2_K.gguf") == \
        "https://huggingface.co/TheBloke/M-GGUF/resolve/main/m.Q2_K.gguf"
    assert resolve_url("hf://o/r/dir/f.bin@dev") == "https://huggingface.co/o/r/resolve/dev/dir/f.bin"
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example/")
    assert resolve_url("hf://o/r/f") == "https://mirror.example/o/r/resolve/main/f"
    assert resolve_url("github:org/repo/a/b.yaml@v1") == \
        "https://raw.githubusercontent.com/org/repo/v1/a/b.yaml"
    assert resolve_url("https://x/y") == "https://x/y"
    assert shown_url("https://user:pw@h.example:8443/p/f.gguf?token=t#x") == \
        "https://h.example:8443/p/f.gguf"


# -- the staging plan ---------------------------------------------------------------------------


def test_a_folder_is_walked_with_its_layout_and_without_what_is_not_the_model(tmp_path):
    models = str(tmp_path)
    write(models, "mini/config.json", b"{}")
    write(models, "mini/1_Pooling/config.json", b"{1}")
    write(models, "mini/.git/HEAD", b"ref")
    write(models, "mini/.cache/huggingface/x", b"c")
    write(models, "mini/w.bin.partial", b"half")
    write(models, "mini/config.json.sha256", b"sidecar")
    plan = plan_blocking(parse(parameters={"model": "mini"}), models, DigestCache())
    [entry] = plan.entries
    assert plan.primary is entry and entry.folder and entry.key == "models/m/mini"
    assert [i.rel for i in entry.items] == ["config.json", "1_Pooling/config.json"]
    assert entry.items[1].key == "models/m/mini/1_Pooling/config.json"
    assert entry.items[0].sha256 == hashlib.sha256(b"{}").hexdigest()
    # a .sha256 file with no file beside it is the model's, and the worker refuses such keys
    write(models, "mini/lone.sha256", b"a file of its own")
    with pytest.raises(ModelFileMismatch, match="mini/lone.sha256 cannot be staged"):
        plan_blocking(parse(parameters={"model": "mini"}), models, DigestCache())


def test_a_model_not_in_the_models_dir_is_left_to_the_worker(tmp_path):
    for model in ("/abs/on/the/worker", "org/hub-id", "../up"):
        assert plan_blocking(parse(parameters={"model": model}), str(tmp_path),
                             DigestCache()).entries == ()


def test_a_listed_file_stays_primary_and_its_digest_is_checked(tmp_path):
    models = str(tmp_path)
    write(models, "w.bin", b"weights")
    good = hashlib.sha256(b"weights").hexdigest()
    plan = plan_blocking(parse(parameters={"model": "w.bin"},
                               files=[{"path": "w.bin", "sha256": good}]), models, DigestCache())
    assert [e.key for e in plan.entries] == ["models/m/w.bin"] and plan.primary.folder is False
    with pytest.raises(ModelFileMismatch, match=f"has sha256 {good}, the config says 00"):
        plan_blocking(parse(files=[{"path": "w.bin", "sha256": "00" * 32}]), models,
                      DigestCache())


@pytest.mark.parametrize("setup, text", [
    (lambda root, out: None, "mini (named by files) does not exist in the models directory"),
    (lambda root, out: os.makedirs(os.path.join(root, "mini")), "folder mini holds no files"),
    (lambda root, out: (write(root, "mini/a", b"1"),
                        os.symlink(out, os.path.join(root, "mini", "linked"))),
     "mini/linked is a symbolic link to a directory"),
    (lambda root, out: (write(root, "mini/a", b"1"), write(out, "secret", b"s"),
                        os.symlink(os.path.join(out, "secret"), os.path.join(root, "mini", "s"))),
     "mini/s is a symbolic link out of the folder mini"),
    (lambda root, out: write(root, "mini/" + "n" * 210, b"1"),
     "cannot be staged under the worker key"),
])
def test_bad_folders_are_refused_naming_the_file(tmp_path, setup, text):
    root, out = str(tmp_path / "models"), str(tmp_path / "outside")
    os.makedirs(root)
    os.makedirs(out)
    setup(root, out)
    files = [{"path": "mini"}] if not os.path.exists(os.path.join(root, "mini")) else []
    with pytest.raises(ModelFileMismatch, match=re.escape(text)):
        plan_blocking(parse(parameters={"model": "mini"}, files=files), root, DigestCache())


def test_a_folder_is_bounded_in_files_and_bytes(tmp_path, monkeypatch):
    models = str(tmp_path)
    for i in range(4):
        write(models, f"mini/f{i}", b"12345")
    monkeypatch.setattr(modelfiles, "MAX_FOLDER_FILES", 3)
    with pytest.raises(ModelFileMismatch, match="more than 3 files"):
        plan_blocking(parse(parameters={"model": "mini"}), models, DigestCache())
    monkeypatch.setattr(modelfiles, "MAX_FOLDER_FILES", 100)
    monkeypatch.setattr(modelfiles, "MAX_FOLDER_BYTES", 12)
    with pytest.raises(ModelFileMismatch, match="more than 12 bytes"):
        plan_blocking(parse(parameters={"model": "mini"}), models, DigestCache())


def test_a_sha256_on_a_folder_is_refused(tmp_path):
    write(str(tmp_path), "mini/a", b"1")
    with pytest.raises(ModelFileMismatch, match="is a folder, and sha256 applies to a file"):
        plan_blocking(parse(files=[{"path": "mini", "sha256": "0" * 64}]), str(tmp_path),
                      DigestCache())


def test_digests_are_cached_until_the_file_changes(tmp_path, monkeypatch):
    path = write(str(tmp_path), "w.bin", b"one")
    reads = []
    real = modelfiles.sha256_of_file
    monkeypatch.setattr(modelfiles, "sha256_of_file", lambda p: reads.append(p) or real(p))
    cache = DigestCache()
    assert cache.digest(path) == cache.digest(path) == (3, hashlib.sha256(b"one").hexdigest())
    assert len(reads) == 1
    write(str(tmp_path), "w.bin", b"two!")
    assert cache.digest(path) == (4, hashlib.sha256(b"two!").hexdigest())
    assert len(reads) == 2


def test_download_progress_is_logged_at_most_every_interval_and_described(tmp_path):
    from twisted.internet import task
    from twisted.logger import globalLogPublisher

    from localai_tw.frontend.inference.downloads import Download, ModelDownloads
    from localai_tw.localai.model_config import ModelDownload

    clock = task.Clock()
    downloads = ModelDownloads(str(tmp_path), clock, agent=object(), log_interval=5.0)
    item = ModelDownload("w.gguf", "https://user:pw@h.example/w.gguf?sig=1", None,
                         "download_files[0]")
    download = Download("m", item, str(tmp_path / "w.gguf"), item.uri, clock.seconds())
    download.total = 10 * 1024**2
    downloads._active[download.target] = download
    lines = []
    observer = lines.append
    globalLogPublisher.addObserver(observer)
    try:
        for _ in range(20):  # 20 chunks of 256 KiB, one every 0.5 s: 10 s
            clock.advance(0.5)
            download.received += 256 * 1024
            downloads._note(download)
    finally:
        globalLogPublisher.removeObserver(observer)
    progress = [e for e in lines if "bytes/s" in (e.get("log_format") or "")]
    assert len(progress) == 2  # at 5 s and at 10 s
    assert progress[-1]["received"] == 5 * 1024**2 and progress[-1]["rate"] == 524288
    [shown] = downloads.in_progress()
    assert shown["url"] == "https://h.example/w.gguf"  # no credentials, no query
    assert (shown["received"], shown["total"], shown["bytes_per_second"]) == (
        5 * 1024**2, 10 * 1024**2, 524288)
    assert downloads.describe("m") == "downloading w.gguf 5.0 MiB/10.0 MiB at 0.5 MiB/s"
    assert downloads.describe("other") is None


def test_downloaded_companions_are_staged_beside_the_model_file(tmp_path):
    models = str(tmp_path)
    write(models, "llava/model.gguf", b"m")
    write(models, "llava/mmproj.gguf", b"p")
    write(models, "tok/tokenizer.json", b"t")
    config = parse(parameters={"model": "llava/model.gguf"}, download_files=[
        {"filename": "llava/model.gguf", "uri": "https://x/m"},
        {"filename": "llava/mmproj.gguf", "uri": "https://x/p",
         "sha256": hashlib.sha256(b"p").hexdigest()},
        {"filename": "tok/tokenizer.json", "uri": "https://x/t"}],
        files=[{"path": "tok"}])
    plan = plan_blocking(config, models, DigestCache())
    assert [(e.path, e.key) for e in plan.entries] == [
        ("tok", "models/m/tok"), ("llava/model.gguf", "models/m/model.gguf"),
        ("llava/mmproj.gguf", "models/m/mmproj.gguf")]
    assert plan.primary.path == "llava/model.gguf"
