"""The shared-memory segment the ranks of one host reduce through.

Rank 0 creates it in /dev/shm, mode 0600, under a name no other process can guess (128 random
bits, sent to the other ranks over the process group), and unlinks it as soon as every rank has
mapped it: from then on it is only memory the ranks' mappings hold, which the kernel frees when
the last of them exits, however it exits. The name carries rank 0's pid, so that the one window
that could leave an entry behind (rank 0 killed between creating and unlinking it) is closed by
the next run, which removes this user's segments whose creator is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets

SHM_DIR = "/dev/shm"
PREFIX = "pocketllm-shm-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]{32}")


class Segment:
    """A mapped segment: `base` is the address of its first byte in this process."""

    def __init__(self, path: str, mm: mmap.mmap):
        self.path, self.mm = path, mm
        # The exported buffer keeps the mapping alive (and mm from being closed) while in use.
        self._anchor = ctypes.c_char.from_buffer(mm)
        self.base = ctypes.addressof(self._anchor)

    def close(self) -> None:
        self._anchor = None
        self.base = 0
        try:
            self.mm.close()
        except BufferError:
            pass


def _owned_by_me(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid()


def remove_stale(root: str = SHM_DIR) -> None:
    """Unlink this user's segments whose creating rank 0 has exited."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        m = _NAME.fullmatch(entry.name)
        if m is None:
            continue
        try:
            if not _owned_by_me(entry.stat(follow_symlinks=False)):
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(entry.path)
            except OSError:
                pass
        except OSError:
            # Another user's process has the pid (this user's creator is gone too, but the
            # entry is harmless to leave to the next look), or the entry vanished.
            continue


def create(size: int, root: str = SHM_DIR) -> Segment:
    """A new zeroed segment of `size` bytes, mapped, only this user may open."""
    remove_stale(root)
    path = os.path.join(root, f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        # Reserved now: a full /dev/shm fails here, not with SIGBUS on a later first touch.
        os.posix_fallocate(fd, 0, size)
        return Segment(path, mmap.mmap(fd, size))
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def attach(path: str, size: int, root: str = SHM_DIR) -> Segment:
    """Map the segment rank 0 created, after checking it is one: named as create() names them, this
    user's, private and of the expected size."""
    if os.path.dirname(path) != root or _NAME.fullmatch(os.path.basename(path)) is None:
        raise OSError(f"{path} is not a pocketllm segment name")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not _owned_by_me(st) or st.st_mode & 0o077 or st.st_size != size:
            raise OSError(f"{path} is not this run's segment (owner, mode or size differ)")
        return Segment(path, mmap.mmap(fd, size))
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
