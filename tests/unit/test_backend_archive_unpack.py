"""A backend archive is unpacked by the worker only inside the backend's own directory
(``worker/backend_install.py``): absolute names, ``..``, links leading out, special files and
oversized archives are refused, and nothing of a refused archive is left behind."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from localai_tw.worker.backend_install import InstallError, unpack

RUN_SH = b"#!/bin/sh\nexec true\n"


def archive(path, members, *, top: str = "") -> str:
    """``members``: (name, kind, data-or-linkname)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(top + name)
            if kind == "file":
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            elif kind == "sym":
                info.type = tarfile.SYMTYPE
                info.linkname = data
                tar.addfile(info)
            elif kind == "hard":
                info.type = tarfile.LNKTYPE
                info.linkname = data
                tar.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                tar.addfile(info)
    return str(path)


def left_behind(parent) -> list[str]:
    return sorted(os.listdir(parent))


def test_a_backend_archive_unpacks_with_run_sh_made_executable(tmp_path):
    parent = tmp_path / "backends"
    parent.mkdir()
    path = archive(tmp_path / "b.tar.gz", [("run.sh", "file", RUN_SH),
                                           ("lib", "dir", None),
                                           ("lib/x.py", "file", b"x = 1\n"),
                                           ("lib/current", "sym", "x.py"),
                                           ("lib/again", "hard", "lib/x.py")])
    root, files, size = unpack(path, str(parent), "b")
    assert os.access(os.path.join(root, "run.sh"), os.X_OK)
    assert open(os.path.join(root, "lib", "current")).read() == "x = 1\n"
    assert files == 2 and size == len(RUN_SH) + 6


def test_one_top_level_directory_is_taken_as_the_backend(tmp_path):
    parent = tmp_path / "backends"
    parent.mkdir()
    path = archive(tmp_path / "b.tar.gz", [("", "dir", None), ("run.sh", "file", RUN_SH)],
                   top="my-echo/")
    root, _, _ = unpack(path, str(parent), "b")
    assert os.path.basename(root) == "my-echo"
    assert os.path.isfile(os.path.join(root, "run.sh"))


@pytest.mark.parametrize("members, why", [
    ([("/etc/evil", "file", b"x")], "absolute path"),
    ([("a/../../evil", "file", b"x")], "'..' component"),
    ([("out", "sym", "/etc/passwd")], "absolute path"),
    ([("out", "sym", "../../evil")], "refused"),
    ([("d", "dir", None), ("d/up", "sym", ".."), ("d/up/up2", "sym", "..")], "refused"),
    ([("deep", "dir", None), ("deep/er", "dir", None), ("deep/er/s", "sym", "../.."),
      ("deep/er/s/t", "sym", "..")], "refused"),
    ([("link", "hard", "/etc/passwd")], "refused"),
    ([("pipe", "fifo", None)], "special file"),
    ([("lib.py", "file", b"x")], "no run.sh"),
])
def test_an_archive_that_would_leave_its_directory_is_refused_and_nothing_stays(
        tmp_path, members, why):
    parent = tmp_path / "backends"
    parent.mkdir()
    path = archive(tmp_path / "b.tar.gz", [("run.sh", "file", RUN_SH)] * (why != "no run.sh")
                   + members)
    with pytest.raises(InstallError) as raised:
        unpack(path, str(parent), "b")
    assert why in str(raised.value)
    assert left_behind(parent) == []
    assert not os.path.exists(tmp_path / "evil")


def test_size_and_entry_bounds_are_kept(tmp_path):
    parent = tmp_path / "backends"
    parent.mkdir()
    path = archive(tmp_path / "b.tar.gz", [("run.sh", "file", RUN_SH),
                                           ("big", "file", b"0" * 4096)])
    with pytest.raises(InstallError, match="more than 1000 bytes"):
        unpack(path, str(parent), "b", max_bytes=1000)
    with pytest.raises(InstallError, match="more than 1 entries"):
        unpack(path, str(parent), "b", max_members=1)
    assert left_behind(parent) == []


def test_not_an_archive_is_a_clear_error(tmp_path):
    parent = tmp_path / "backends"
    parent.mkdir()
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"<html>not found</html>")
    with pytest.raises(InstallError, match="not a tar archive"):
        unpack(str(junk), str(parent), "b")
    assert left_behind(parent) == []
