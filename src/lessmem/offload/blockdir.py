"""``BlockDir``: the files behind a :class:`~lessmem.offload.DiskTier`, safe to share.

A store directory ``<path>`` holds::

    <path>/blocks/<key>.blk        one checksummed block per file (the only files named .blk)
    <path>/blocks/+tmp.<c>.<rand>  a block being written by client <c> (``+`` is never in a key)
    <path>/lock                    flock()ed by every change; holds the bytes all blocks use
    <path>/clients/<c>             flock()ed by live client <c>; lists its private sessions

**Security.** Every file is created ``O_CREAT|O_EXCL|O_NOFOLLOW`` (or ``O_NOFOLLOW``) with
mode 0600, and ``blocks/`` and ``clients/`` with mode 0700, so no other user can read a
block, plant a symlink or a forged block where this store writes, or race a temp name
(temp names are random and opened exclusively). Opening a store *refuses* (ValueError)
a ``<path>`` that another user could tamper with: it must be owned by the current user
and not writable by group/others — or, like ``/tmp`` itself, be owned by root with the
sticky bit (others may then create names beside ours but not move ours). Its ``blocks/``
and ``clients/`` must be ours (looser modes that we own are tightened to 0700). Refusing
is safer than warning: a forged block would be fed to the model silently.

**Several processes.** Every change to the directory (a block renamed into place,
evicted, deleted or moved aside as corrupt) happens under an exclusive ``flock`` of
``lock``, which also stores the bytes held by all blocks, so capacity holds across
processes and is checked inside the lock. A process killed inside that section leaves
a "dirty" mark; the next holder recounts from the directory (as every open does).
Readers take no lock: files are only ever replaced by rename, so a read sees a whole
block or none; a block another process evicted reads as a miss.

**Orphans.** Keys ``s<16 hex>-…`` are *session-private* (the tiered cache's keys for
blocks nobody else can ask for). A client lists each session it writes in its
``clients/<c>`` file (before the first block is visible) and holds that file's flock
while it lives; a session no live client lists is dead and its blocks — and the temp
files of dead clients — are deleted when a store opens, rescans, or evicts (checked at
most once a second).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import threading
import time
import weakref
from contextlib import contextmanager

TEMP_PREFIX = "+tmp."
SESSION_KEY = re.compile(r"s([0-9a-f]{16})-")
_RECORD = 32  # bytes of the usage record at the start of ``lock``
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"disk tier path {path!r} is not safe to use: {why}; use a directory "
                      "you own that only you can write (e.g. mkdir -m 700 DIR)")


def _check_top(path: str) -> None:
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"disk tier path {path!r} is not a usable directory: not a directory")
    writable = st.st_mode & 0o022
    sticky = st.st_mode & stat.S_ISVTX
    if st.st_uid == os.geteuid():
        if writable and not sticky:
            raise _refuse(path, f"it is writable by group/others (mode {stat.S_IMODE(st.st_mode):o}) "
                                "without the sticky bit")
    elif not (st.st_uid == 0 and sticky):
        raise _refuse(path, f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")


def _private_dir(path: str) -> None:
    """Create ``path`` 0700, or check that an existing one is ours (tightening it to 0700)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory (a symlink or a file is in its place)")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


class BlockDir:
    """Paths, the cross-process lock and byte count, temp files and session bookkeeping."""

    def __init__(self, path):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"disk tier path {path!r}; allowed: a directory path (str or Path)")
        self.root = os.path.abspath(os.fspath(path))
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            _check_top(self.root)
        except OSError as e:
            raise ValueError(f"disk tier path {str(path)!r} is not a usable directory: {e}") from e
        self.blocks = os.path.join(self.root, "blocks")
        self.clients = os.path.join(self.root, "clients")
        _private_dir(self.blocks)
        _private_dir(self.clients)
        self._fd = self._open_private(os.path.join(self.root, "lock"))
        self._tlock = threading.Lock()  # flock does not exclude threads sharing one fd
        self.used = 0  # valid inside ``locked()``
        self.client = secrets.token_hex(8)
        self.sessions: set[str] = set()
        self._last_check = 0.0
        self._pid = os.getpid()
        self._fds = [self._fd]  # closed when the store is closed or garbage-collected
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        with self.locked():
            self._cfd = self._open_private(os.path.join(self.clients, self.client), excl=True)
            self._fds.append(self._cfd)
            fcntl.flock(self._cfd, fcntl.LOCK_EX)

    @staticmethod
    def _open_private(path: str, excl: bool = False) -> int:
        flags = os.O_RDWR | os.O_CREAT | _OPEN | (os.O_EXCL if excl else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise _refuse(path, f"cannot open it for writing as a regular file, not a symlink ({e})") from e
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise _refuse(path, f"it is not a regular file owned by this user (uid {st.st_uid})")
        return fd

    def file(self, key: str) -> str:
        return os.path.join(self.blocks, key + ".blk")

    # -- the lock and the byte count ----------------------------------------------------
    @contextmanager
    def locked(self):
        """Exclusive across threads and processes; ``self.used`` is the shared byte count."""
        with self._tlock:
            fcntl.flock(self._lock_fd(), fcntl.LOCK_EX)
            try:
                rec = os.pread(self._fd, _RECORD, 0).split()
                if len(rec) == 2 and rec[1] == b"0" and rec[0].isdigit():
                    self.used = int(rec[0])
                else:  # first use, or a holder died inside this section: recount
                    self.used = sum(size for _, _, size in self._listing()[0])
                self._record(1)
                yield self
            finally:
                self._record(0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _lock_fd(self) -> int:
        """The lock file's descriptor; a forked child opens its own (a flock is shared by
        every process holding the same open file, so the inherited one excludes nothing)."""
        if os.getpid() != self._pid:
            self._fd = self._open_private(os.path.join(self.root, "lock"))
            self._fds.append(self._fd)
            self._pid = os.getpid()
        return self._fd

    def _record(self, dirty: int) -> None:
        os.pwrite(self._fd, f"{max(self.used, 0)} {dirty}".ljust(_RECORD - 1).encode() + b"\n", 0)

    def usage(self) -> int:
        """Bytes all blocks in the directory use (as last recorded; counted when closed)."""
        if not self._finalizer.alive:
            return sum(size for _, _, size in self._listing()[0])
        with self._tlock:
            fcntl.flock(self._lock_fd(), fcntl.LOCK_SH)
            try:
                rec = os.pread(self._fd, _RECORD, 0).split()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return int(rec[0]) if rec and rec[0].isdigit() else 0

    # -- changes (call inside ``locked()``) --------------------------------------------------
    def size(self, key: str) -> int | None:
        try:
            return os.lstat(self.file(key)).st_size
        except FileNotFoundError:
            return None

    def remove(self, key: str, ino: int | None = None, aside: bool = False) -> int | None:
        """Delete (or, ``aside``, rename to ``.corrupt``) the block file; its size, or None if
        it was not there (or, given ``ino``, was replaced since it was read)."""
        path = self.file(key)
        try:
            st = os.lstat(path)
            if ino is not None and st.st_ino != ino:
                return None
            if aside:
                os.replace(path, path + ".corrupt")
            else:
                os.unlink(path)
        except FileNotFoundError:
            return None
        self.used -= st.st_size
        return st.st_size

    def commit(self, tmp: str, key: str, nbytes: int) -> None:
        """Rename a finished ``nbytes`` temp file over the block's name (it becomes visible)."""
        old = self.size(key) or 0
        m = SESSION_KEY.match(key)
        if m and m.group(1) not in self.sessions:  # listed before its first block is visible
            self.sessions.add(m.group(1))
            os.write(self._cfd, (m.group(1) + "\n").encode())
        os.replace(tmp, self.file(key))
        self.used += nbytes - old

    # -- temp files ------------------------------------------------------------------------
    def temp(self) -> tuple[int, str]:
        """A new temp file (fd, path): random name, exclusive create, no links followed."""
        while True:
            path = os.path.join(self.blocks, f"{TEMP_PREFIX}{self.client}.{secrets.token_hex(8)}")
            try:
                return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o600), path
            except FileExistsError:
                continue

    def fsync_dir(self) -> None:
        fd = os.open(self.blocks, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- listing and reclaiming -----------------------------------------------------------
    def _listing(self) -> tuple[list[tuple[int, str, int]], list[str]]:
        """(mtime, key, size) of every block, oldest first, and the temp/legacy-temp names."""
        blocks, temps = [], []
        with os.scandir(self.blocks) as it:
            for e in it:
                name = e.name
                if name.endswith(".blk"):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    blocks.append((st.st_mtime_ns, name[:-4], st.st_size))
                elif name.startswith(TEMP_PREFIX) or name.startswith(".tmp."):
                    temps.append(name)
        blocks.sort()
        return blocks, temps

    def _live_clients(self) -> tuple[set[str], set[str], list[str]]:
        """(live client ids, sessions they list, dead client ids — their files now removed)."""
        live, sessions, dead = {self.client}, set(self.sessions), []
        for name in os.listdir(self.clients):
            if name == self.client:
                continue
            path = os.path.join(self.clients, name)
            try:
                fd = os.open(path, os.O_RDWR | _OPEN)
            except OSError:
                continue
            try:
                if _try_lock(fd):  # nobody holds it: that client is gone
                    os.unlink(path)
                    dead.append(name)
                else:
                    live.add(name)
                    sessions.update(os.pread(fd, 1 << 20, 0).decode(errors="replace").split())
            finally:
                os.close(fd)
        return live, sessions, dead

    def reclaim_due(self) -> bool:
        """True (at most once a second) when a peer has died since the last look."""
        now = time.monotonic()
        if now - self._last_check < 1.0:
            return False
        self._last_check = now
        for name in os.listdir(self.clients):
            if name == self.client:
                continue
            try:
                fd = os.open(os.path.join(self.clients, name), os.O_RDWR | _OPEN)
            except OSError:
                continue
            try:
                if _try_lock(fd):
                    return True
            finally:
                os.close(fd)
        return False

    def scan(self) -> tuple[list[tuple[int, str, int]], list[str]]:
        """Inside ``locked()``: delete dead sessions' blocks and dead writers' temp files,
        recount ``used``; returns the remaining blocks (oldest first) and the removed keys."""
        live, sessions, _ = self._live_clients()
        blocks, temps = self._listing()
        for name in temps:
            if name.startswith(TEMP_PREFIX):
                if name[len(TEMP_PREFIX):].split(".")[0] not in live:
                    _unlink(os.path.join(self.blocks, name))
            elif not _legacy_writer_alive(name):
                _unlink(os.path.join(self.blocks, name))
        keep, gone = [], []
        for entry in blocks:
            m = SESSION_KEY.match(entry[1])
            if m and m.group(1) not in sessions:
                _unlink(self.file(entry[1]))
                gone.append(entry[1])
            else:
                keep.append(entry)
        self.used = sum(size for _, _, size in keep)
        return keep, gone

    def close(self) -> None:
        """Leave the store: our client file goes (a later scan reclaims our sessions)."""
        if not self._finalizer.alive:
            return
        with self.locked():
            _unlink(os.path.join(self.clients, self.client))
        self._finalizer()  # closes both files, releasing the client lock


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _legacy_writer_alive(name: str) -> bool:
    """Temp files of older versions (``.tmp.<pid>.<n>``): kept while that pid lives."""
    pid = name.split(".")[2] if name.count(".") >= 2 else ""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
