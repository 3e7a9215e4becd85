"""Model files by content: one copy on disk per digest, however many models name it.

Every model's files are staged under their own keys (``models/<model>/<file>``), so five
configs naming one GGUF used to leave five copies on a worker and cross the tunnel five
times; a frontend's downloads of one file under two names were two downloads.  The store
keeps one more hard link to each staged or downloaded file under
``<models>/.blobs/sha256/<digest>`` (the worker's staging, ``worker/staging.py``, and the
frontend's downloads, ``frontend/inference/downloads.py``):

- :meth:`ContentStore.remember`: after an upload is verified, its file gets that link (or, when
  the store already holds the digest as another file, the upload is replaced by a link to it);
- :meth:`ContentStore.link_into`: before an upload, ``POST /v1/files-link/<key>`` asks for the
  digest; a hit links the stored file under the key and nothing is transferred;
- :meth:`ContentStore.sweep`: a stored file no key links any more (its link count is 1) is
  removed, so replacing a model's file frees the old one.

A hard link shares the inode: model files are only read (backends open them read-only); a
file changed in place would change for every name.  Where links cannot be made (another file
system under a key, a file system without them) the store says so once and the upload keeps
its own copy, as before.

What this module must never do: link a file whose size differs from what the caller expects,
leave a half-made name (links are made under a temporary name and renamed), or run on the
reactor (every method blocks: call it in a thread).
"""

from __future__ import annotations

import errno
import os
import re
import tempfile

from twisted.logger import Logger

log = Logger()

#: The store's directory under the models root (a key may not name it: staging.py).
STORE_DIR = ".blobs"
_HEX_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: ``os.link`` errors that mean "this file system (or this pair of places) has no hard links".
_NO_LINKS = (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EOPNOTSUPP)


class ContentStore:
    """The content store of one root directory (the worker's models directory)."""

    def __init__(self, root: str):
        self.root = root
        self.directory = os.path.join(root, STORE_DIR, "sha256")
        self._unsupported_said = False

    def path_of(self, digest: str) -> str:
        if not _HEX_SHA256.match(digest):
            raise ValueError("not a sha256 hex digest")
        return os.path.join(self.directory, digest)

    def _no_links(self, e: OSError) -> bool:
        if e.errno not in _NO_LINKS:
            return False
        if not self._unsupported_said:
            self._unsupported_said = True
            log.warn("staged files are kept one copy per model: hard links cannot be made "
                     "under {root} ({e})", root=self.root, e=e.strerror)
        return True

    def remember(self, path: str, digest: str) -> str:
        """Keep ``path`` (a verified file of ``digest``) in the store.  Returns ``stored`` (the
        store links to it now), ``shared`` (``path`` was replaced by a link to the copy the
        store held: one copy on disk), ``same`` (already one file) or ``unsupported``."""
        stored = self.path_of(digest)
        try:
            os.makedirs(self.directory, exist_ok=True)
            try:
                held = os.stat(stored)
            except FileNotFoundError:
                _link_atomically(path, stored)
                return "stored"
            mine = os.stat(path)
            if (held.st_dev, held.st_ino) == (mine.st_dev, mine.st_ino):
                return "same"
            if held.st_size != mine.st_size:  # changed in place since: keep the new one
                _link_atomically(path, stored)
                return "stored"
            _link_atomically(stored, path)
            return "shared"
        except OSError as e:
            if self._no_links(e):
                return "unsupported"
            raise

    def link_into(self, digest: str, size: int | None, target: str) -> bool:
        """Make ``target`` a name of the stored file of ``digest`` when the store holds one
        (of ``size`` bytes, when given); False when it does not (or links cannot be made
        there)."""
        try:
            held = os.stat(self.path_of(digest))
        except FileNotFoundError:
            return False
        if size is not None and held.st_size != size:
            return False
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            _link_atomically(self.path_of(digest), target)
        except OSError as e:
            if self._no_links(e):
                return False
            raise
        return True

    def sweep(self) -> tuple[int, int]:
        """Remove stored files no other name links to: (files, bytes) freed."""
        freed = size = 0
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return 0, 0
        for entry in entries:
            if not _HEX_SHA256.match(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_nlink == 1:
                    os.unlink(entry.path)
                    freed += 1
                    size += st.st_size
            except FileNotFoundError:
                continue
        return freed, size

    def usage(self) -> tuple[int, int]:
        """(files, bytes) the store holds: each one copy on disk, whatever links it."""
        files = size = 0
        try:
            for entry in os.scandir(self.directory):
                if _HEX_SHA256.match(entry.name):
                    files += 1
                    size += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
        return files, size


def _link_atomically(source: str, name: str) -> None:
    """``name`` becomes another name of ``source``'s file, replacing what ``name`` was, never
    missing in between."""
    directory = os.path.dirname(name)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(name)[:64],
                                     suffix=".link")
    os.close(fd)
    os.unlink(temporary)
    try:
        os.link(source, temporary)
        os.replace(temporary, name)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
