"""Reading the files a user names: regular files only, refused before any byte is read.

A FIFO would block the reader forever (no writer), and a device such as ``/dev/zero``
or ``/dev/urandom`` never ends, so a checkpoint, a corpus, a shard, a config or a
tokenizer given as one of those would hang or fill the memory. :func:`read_regular`
opens without blocking (``O_NONBLOCK``: a FIFO opens at once), checks with ``fstat``
on that very descriptor (a symlink's target counts, and nothing can be swapped in
between), refuses anything that is not a regular file and a size over the caller's
limit, and only then reads.
"""
from __future__ import annotations

import os
import stat

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def read_regular(path, what: str, *, max_bytes: int | None = None,
                 limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (its first ``max_bytes`` when given).

    ``what`` names the file for the message (e.g. "checkpoint", "--data"). ``limit``:
    a file larger than this many bytes is refused (``max_bytes`` reads a prefix
    instead). Raises ValueError for anything that is not a regular file, OSError (as
    ``open`` does) for a missing or unreadable one."""
    fname = os.fspath(path)
    fd = os.open(fname, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
            raise ValueError(f"{fname}: {what} must be a regular file, this is {kind}")
        if limit is not None and st.st_size > limit:
            raise ValueError(f"{fname}: {what} is {st.st_size:,} bytes, more than the "
                             f"{limit:,} allowed")
        with os.fdopen(fd, "rb") as f:
            fd = -1                          # the file object closes it now
            return f.read() if max_bytes is None else f.read(max_bytes)
    finally:
        if fd >= 0:
            os.close(fd)
