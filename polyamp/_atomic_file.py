"""Atomic file replacement: temp file beside the real target, fsync, rename, folder fsync.

Symlinks are written through; the mode is what ``open(path, "w")`` would give; errors name the
caller's path; temps that killed writes left are removed (only the same target's, writer gone).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import threading
import time
import zlib

#: A temp file of ours older than this (seconds) is from a killed write and is removed.
STALE_SECONDS = 600
_umask_lock = threading.Lock()


def atomic_write(path: str, payload: bytes) -> None:
    """Temp file beside the real target, fsync, rename over it, fsync the folder; errors name ``path``."""
    target = os.path.realpath(path)  # through symlinks: the link stays, its target is replaced
    folder, base = os.path.split(target)
    try:
        mode = _file_mode(target)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(base) + f"{os.getpid()}-", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise _named(exc, path) from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            _chmod(fh.fileno(), tmp, mode)
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _named(exc, path) from exc
        raise
    _fsync_folder(folder)
    _remove_stale_temps(folder, base)


def _named(exc: OSError, path: str) -> OSError:
    """The same kind of OSError, naming the user's checkpoint path instead of our temp file."""
    why = exc.strerror or str(exc)
    if exc.errno is None:
        return type(exc)(f"cannot write checkpoint {path!r}: {why}")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("the disk (or quota) is full; nothing was replaced (a previous checkpoint there is "
               "intact). Fix: free space, then save again")
    else:
        fix = "check that the folder exists and is writable"
    return OSError(exc.errno, f"cannot write checkpoint ({why}); {fix}", path)


def _file_mode(target: str) -> int:
    """What ``open(target, 'w')`` would give: an existing file's mode, else 0o666 & ~umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else set-and-restore."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _umask_lock:  # other threads creating files in this instant may see umask 0o022
        old = os.umask(0o022)
        os.umask(old)
    return old


def _chmod(fd: int, path: str, mode: int) -> None:
    if hasattr(os, "fchmod"):
        os.fchmod(fd, mode)
    else:  # Windows: only the read-only bit means anything
        os.chmod(path, mode)


def _fsync_folder(folder: str) -> None:
    """Make the rename durable; skipped where the OS cannot open or fsync a folder (Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _host_tag() -> str:
    import socket

    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _temp_prefix(base: str) -> str:
    """``.<target name>.polyamp-<host tag>-``: our temps for one target, then ``<pid>-<random>.tmp``."""
    return f".{base[:96]}.polyamp-{_host_tag()}-"


def _remove_stale_temps(folder: str, base: str) -> None:
    """Remove temps of killed writes to this target: this host's with a dead pid, or any > 10 min old."""
    pattern = re.compile(re.escape(f".{base[:96]}.polyamp-") + r"([0-9a-f]{8})-(\d+)-\w+\.tmp\Z")
    host, now = _host_tag(), time.time()
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            match = pattern.match(entry.name)
            if match is None:
                continue
            with contextlib.suppress(OSError):
                dead = match[1] == host and _pid_dead(int(match[2]))
                if dead or now - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                    os.unlink(entry.path)


def _pid_dead(pid: int) -> bool:
    """Whether no process ``pid`` runs on this machine (POSIX only; elsewhere never claimed)."""
    if os.name != "posix" or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
