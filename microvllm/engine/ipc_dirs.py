"""The folders of the IPC sockets between a front end and its engine core processes.

One private folder per front-end process (``mkdtemp``: mode 0700, so no other user can
connect to its sockets), named ``microvllm-dp-<pid>-<random>``; removed at shutdown, or,
after a ``kill -9`` (when nothing of the dead process can run), by the next front end
that finds that pid dead and none of the folder's sockets bound.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile

logger = logging.getLogger(__name__)

SOCKET_DIR_PREFIX = "microvllm-dp-"   # + the front end's pid + "-" + random


def new_socket_dir() -> str:
    """A fresh private folder for this process's sockets (stale ones removed first)."""
    remove_stale_socket_dirs()
    return tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True


def _bound_unix_paths() -> set[str]:
    """The paths of the unix sockets bound in this network namespace (``/proc/net/unix``)."""
    try:
        with open("/proc/net/unix") as table:
            return {fields[7] for fields in (line.split() for line in table.readlines()[1:]) if len(fields) >= 8}
    except OSError:
        return set()


def remove_stale_socket_dirs(root: str | None = None) -> list[str]:
    """Remove the socket folders of data-parallel servers that died without cleaning up
    (``kill -9``): ``microvllm-dp-<pid>-*`` folders of this user in the temp folder whose
    pid is dead and none of whose sockets is still bound. Returns the removed paths."""
    root = root or tempfile.gettempdir()
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    bound = None
    removed = []
    for name in entries:
        if not name.startswith(SOCKET_DIR_PREFIX):
            continue
        pid_text = name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue   # a folder of an older version (no pid), or a live server's
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        bound = _bound_unix_paths() if bound is None else bound
        if any(os.path.join(path, socket) in bound for socket in ("input", "output")):
            continue   # its pid is of another pid namespace, and it still serves
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d socket folder(s) left by data-parallel servers that were killed: %s",
                    len(removed), ", ".join(removed))
    return removed
