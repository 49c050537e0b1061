"""The file behind the ``OffloadingConnector``'s ``"path"`` tier: opened safely, its space
reserved before the first byte is written.

A memory-mapped file that is only *sized* (``ftruncate``, or ``torch.from_file``) is
sparse: its blocks are allocated when first written, through the mapping. When the
filesystem is full at that moment the kernel has no way to report an error to a memory
store, and it sends SIGBUS: the process dies with every request in flight, no message.
So ``open_store_file``:

- opens with ``O_NOFOLLOW`` (a symbolic link at the path is refused: it could point the
  store, and the prompts' KV written into it, at any file) and refuses anything but a
  regular file with one link (a hard link is another name for someone's file);
- creates the file with mode 0600; an existing file must be this user's and is set to
  0600 (``fchmod``) before anything is written: the KV of every prompt goes there, and
  the old content is overwritten anyway, so the file is reused, not refused;
- takes an exclusive ``flock`` (held while the engine runs): a second engine given the
  same path is refused instead of writing into the first one's slots;
- reserves every block with ``os.posix_fallocate``: a filesystem too small for the store
  fails here, at start, with an error that says what to change (``num_cpu_blocks``,
  ``dtype`` or ``path``), never later with SIGBUS.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass


def _mb(nbytes: int | float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


@dataclass
class StoreFile:
    """An open, locked, fully reserved store file and its shared mapping."""

    path: str
    nbytes: int
    fd: int
    mapping: mmap.mmap

    def close(self) -> None:
        """Release the file and its lock. The mapping holds a duplicate of the descriptor
        (and so the lock) until it is closed: here if no tensor uses it any more, else
        when the last tensor on it goes."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.mapping.close()
        except BufferError:   # tensors still view it
            pass

    def __del__(self) -> None:   # the engine was collected: another may take the path
        self.close()


def open_store_file(path: str, nbytes: int, *, what: str = "kv_connector_extra_config path") -> StoreFile:
    """Open (or create, mode 0600) ``path``, reserve ``nbytes`` in it and map it shared.

    Raises ``ValueError`` saying what to change when the path is a link, not a regular
    file, someone else's, in use by another engine, or on a filesystem without the room."""
    if nbytes < 1:
        raise ValueError(f"{what}={path!r}: the store would be {nbytes} bytes: give num_cpu_blocks of at least 1")
    base = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    created = False
    try:
        try:
            fd = os.open(path, base | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, base)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(f"{what}={path!r} is a symbolic link: refused (it could point the KV store at any "
                             "file); give the path of a regular file, or of one to create") from None
        raise ValueError(f"{what}={path!r} cannot be opened ({error.strerror}): give a path in a folder this "
                         "user can write") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what}={path!r} is not a regular file: give the path of a file (created if missing)")
        if info.st_nlink != 1:
            raise ValueError(f"{what}={path!r} has {info.st_nlink} hard links (another name for the same file): "
                             "give a path of its own")
        if info.st_uid != os.geteuid():
            raise ValueError(f"{what}={path!r} belongs to user id {info.st_uid}, not this user ({os.geteuid()}): "
                             "give a path of a file of your own, or of one to create")
        os.fchmod(fd, 0o600)   # the prompts' KV goes here: this user only, even for a reused file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{what}={path!r} is in use by another engine (in this process too, until the "
                             "old one is shut down and collected): give each engine a path of its own") from None
        if info.st_size != nbytes:
            os.ftruncate(fd, nbytes)
        _reserve(fd, path, nbytes, what)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        if created:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    return StoreFile(path, nbytes, fd, mapping)


def _reserve(fd: int, path: str, nbytes: int, what: str) -> None:
    """Allocate every block of the file now (no sparse file: no SIGBUS later)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as error:
        code = error.errno
        strerror = error.strerror
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        try:
            fs = os.statvfs(path)
            room = f"{_mb(fs.f_bavail * fs.f_frsize)} free of {_mb(fs.f_blocks * fs.f_frsize)}"
        except OSError:
            room = "less free"
        raise ValueError(
            f"{what}={path!r}: the KV store needs {_mb(nbytes)} and its filesystem has {room} ({strerror}): "
            "give a smaller num_cpu_blocks (or \"dtype\": \"float16\" to halve a float32 store), or a path "
            "on a filesystem with room") from None
    # A filesystem that cannot reserve (posix_fallocate unsupported): check the room at
    # least; a later shortage could still end in SIGBUS, so say so.
    fs = os.statvfs(path)
    free = fs.f_bavail * fs.f_frsize
    if free < nbytes:
        raise ValueError(f"{what}={path!r}: the KV store needs {_mb(nbytes)} and its filesystem has "
                         f"{_mb(free)} free: give a smaller num_cpu_blocks, or a path on a filesystem with room")
    import logging
    logging.getLogger(__name__).warning(
        "%s=%r: its filesystem cannot reserve space (%s); %s free now for a %s store: if it fills up, "
        "writing the store kills the engine (SIGBUS). Prefer a local filesystem", what, path, strerror,
        _mb(free), _mb(nbytes))
