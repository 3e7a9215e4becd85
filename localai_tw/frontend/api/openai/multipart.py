"""``multipart/form-data`` bodies, parsed from a file as they were spooled to disk
(``SpooledCappedBody``): small fields in memory (bounded in number and size), the one file part
streamed to a file of its own, never the whole body in memory.

:func:`parse_form` is blocking (it reads and writes files): call it in a thread.

What this module must never do: keep more than :data:`MAX_FIELD_BYTES` of a field or more than
:data:`MAX_FIELDS` fields, read a header block over :data:`MAX_HEADER_BYTES`, accept a second
file part, use the client's file name as a path, or answer a malformed body with anything but
:class:`MultipartError` naming what is wrong.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

#: Fields (parts that are not the file) one form may carry.
MAX_FIELDS = 64
#: Bytes of one field's value.
MAX_FIELD_BYTES = 64 * 1024
#: Bytes of one part's header block.
MAX_HEADER_BYTES = 8 * 1024
#: Bytes read at a time.
CHUNK = 64 * 1024
#: Bytes of the file kept to recognise its format.
HEAD_BYTES = 64

_BOUNDARY = re.compile(r"^[0-9A-Za-z'()+_,\-./:=? ]{1,70}$")
_PARAM = re.compile(r';\s*([A-Za-z0-9_\-*]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


class MultipartError(ValueError):
    """The body is not the form it claims to be; the message says what is wrong, ``param``
    which field (when one is at fault)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class UploadedFile:
    field: str
    filename: str
    content_type: str
    path: str
    size: int
    head: bytes


@dataclass
class Form:
    fields: dict[str, list[str]] = field(default_factory=dict)
    file: UploadedFile | None = None

    def value(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None

    def values(self, *names: str) -> list[str]:
        return [v for name in names for v in self.fields.get(name, ())]


def _params(header_value: str) -> tuple[str, dict[str, str]]:
    main, _, rest = header_value.partition(";")
    params = {}
    for key, raw in _PARAM.findall(";" + rest):
        raw = raw.strip()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        params[key.lower()] = raw
    return main.strip().lower(), params


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a ``multipart/form-data`` Content-Type, or :class:`MultipartError`."""
    if not content_type:
        raise MultipartError("the request has no Content-Type: send the audio as "
                             "multipart/form-data with a 'file' part")
    kind, params = _params(content_type)
    if kind != "multipart/form-data":
        raise MultipartError(f"Content-Type {kind[:64]!r} is not accepted: send "
                             "multipart/form-data with a 'file' part (curl -F file=@audio.wav "
                             "-F model=...)")
    boundary = params.get("boundary", "")
    if not _BOUNDARY.match(boundary) or boundary.endswith(" "):
        raise MultipartError("the multipart/form-data Content-Type has no valid boundary")
    return boundary.encode("ascii")


def _headers_of(block: bytes) -> dict[str, str]:
    headers = {}
    for line in block.split(b"\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            raise MultipartError("a part header line has no ':'")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("utf-8",
                                                                               "replace")
    return headers


class _Reader:
    def __init__(self, source):
        self.source = source
        self.buffer = b""
        self.eof = False

    def fill(self) -> bool:
        if self.eof:
            return False
        chunk = self.source.read(CHUNK)
        if not chunk:
            self.eof = True
            return False
        self.buffer += chunk
        return True


def parse_form(source, boundary: bytes, directory: str, *, file_field: str = "file") -> Form:
    """Parse the form read from ``source`` (a file positioned at the body's start).  The part
    named ``file_field`` that carries a file name is written to ``directory/upload``; every
    other part is a field.  Blocking."""
    reader = _Reader(source)
    first = b"--" + boundary
    delimiter = b"\r\n--" + boundary
    # The preamble (ignored) ends at the first boundary line.
    while True:
        at = reader.buffer.find(first)
        if at >= 0 and (at == 0 or reader.buffer[at - 2:at] == b"\r\n"):
            reader.buffer = reader.buffer[at + len(first):]
            break
        if len(reader.buffer) > MAX_HEADER_BYTES or not reader.fill():
            raise MultipartError("the body does not start with the boundary its Content-Type "
                                 "names (is it multipart/form-data?)")
    form = Form()
    count = 0
    while True:
        while len(reader.buffer) < 2 and reader.fill():
            pass
        if reader.buffer.startswith(b"--"):
            return form  # the closing boundary; an epilogue is ignored
        if not reader.buffer.startswith(b"\r\n"):
            raise MultipartError("a boundary line is not followed by CRLF")
        reader.buffer = reader.buffer[2:]
        while True:
            end = reader.buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(reader.buffer) > MAX_HEADER_BYTES or not reader.fill():
                raise MultipartError("a part's headers do not end (or are over "
                                     f"{MAX_HEADER_BYTES} bytes)")
        if end > MAX_HEADER_BYTES:
            raise MultipartError(f"a part's headers are over {MAX_HEADER_BYTES} bytes")
        headers = _headers_of(reader.buffer[:end])
        reader.buffer = reader.buffer[end + 4:]
        kind, params = _params(headers.get("content-disposition", ""))
        name = params.get("name")
        if kind != "form-data" or name is None:
            raise MultipartError("a part has no Content-Disposition: form-data; name=...")
        count += 1
        if count > MAX_FIELDS + 1:
            raise MultipartError(f"the form has more than {MAX_FIELDS} fields")
        is_file = name == file_field and "filename" in params
        if "filename" in params and not is_file:
            raise MultipartError(f"the form has a file part named {name[:64]!r}; the audio "
                                 f"goes in the {file_field!r} part", file_field)
        if is_file:
            if form.file is not None:
                raise MultipartError(f"the form has more than one {file_field!r} part")
            path = os.path.join(directory, "upload")
            with open(path, "wb") as out:
                size, head = _copy_part(reader, delimiter, out)
            form.file = UploadedFile(name, params.get("filename", "")[:255],
                                     headers.get("content-type", "")[:128], path, size, head)
        else:
            value = _field_part(reader, delimiter, name)
            form.fields.setdefault(name[:128], []).append(value)


def _part_chunks(reader: _Reader, delimiter: bytes):
    """The part's content in chunks, up to the next delimiter (consumed).  The last
    ``len(delimiter)`` bytes are held back until it is known they are not its start."""
    keep = len(delimiter)
    while True:
        at = reader.buffer.find(delimiter)
        if at >= 0:
            data, reader.buffer = reader.buffer[:at], reader.buffer[at + keep:]
            yield data
            return
        if len(reader.buffer) > keep:
            data, reader.buffer = reader.buffer[:-keep], reader.buffer[-keep:]
            yield data
        if not reader.fill():
            raise MultipartError("the body ended before its closing boundary")


def _copy_part(reader: _Reader, delimiter: bytes, out) -> tuple[int, bytes]:
    size = 0
    head = b""
    for data in _part_chunks(reader, delimiter):
        if len(head) < HEAD_BYTES:
            head += data[:HEAD_BYTES - len(head)]
        out.write(data)
        size += len(data)
    return size, head


def _field_part(reader: _Reader, delimiter: bytes, name: str) -> str:
    chunks = []
    size = 0
    for data in _part_chunks(reader, delimiter):
        size += len(data)
        if size > MAX_FIELD_BYTES:
            raise MultipartError(f"field {name[:64]!r} is over {MAX_FIELD_BYTES} bytes")
        chunks.append(data)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise MultipartError(f"field {name[:64]!r} is not UTF-8") from None
