"""Files in directories other processes can write (the file_sd directory, ``rlwatch up``'s
directory, the state directory): read only regular files, of bounded size, never through a symbolic
link and never blocking (a FIFO, ``/dev/zero``); write a whole new file and rename it over the name,
so that a symbolic link already there is replaced, never written through."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

#: Largest file read from such a directory, bytes (a file_sd entry or pids.json is well under 4 KB).
MAX_READ_BYTES = 1 << 20


def read_bytes(path: str | os.PathLike, limit: int = MAX_READ_BYTES) -> bytes:
    """The bytes of regular file ``path``. Raises OSError for a symbolic link, a FIFO, a device, a
    directory, or a file over ``limit`` bytes; never blocks on what it opens."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{os.fspath(path)}: not a regular file")
        if info.st_size > limit:
            raise OSError(f"{os.fspath(path)}: {info.st_size} bytes, more than {limit}")
        chunks, size = [], 0
        while chunk := os.read(fd, min(65536, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OSError(f"{os.fspath(path)}: more than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, limit: int = MAX_READ_BYTES) -> str:
    """:func:`read_bytes` decoded as UTF-8 (ValueError when it is not)."""
    return read_bytes(path, limit).decode("utf-8")


def write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to a new file (created with O_EXCL, so never through an existing link) in
    ``path``'s directory, then rename it to ``path``: a symbolic link or file already named ``path``
    is replaced, never written through, and readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_append(path: str | os.PathLike) -> int:
    """A descriptor appending to log file ``path`` (created 0600 if missing), never through a
    symbolic link (OSError when ``path`` is one)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                   | getattr(os, "O_CLOEXEC", 0), 0o600)
