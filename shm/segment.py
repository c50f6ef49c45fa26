"""Named POSIX shared-memory segments: the memory the engine and the CPU LoRA workers share.

The owner creates a segment and unlinks it when it closes; other processes attach by name and only
unmap. Names are `/lorad-{instance}-{purpose}` where `instance` starts with the creating pid, so that
`sweep_stale()` at start-up can unlink what a killed daemon left in /dev/shm.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import weakref

import numpy as np
import posix_ipc
import torch

log = logging.getLogger(__name__)

PREFIX = "/lorad-"
SHM_DIR = "/dev/shm"
ALIGNMENT = 64  # one cache line: regions never share a line, and every dtype is aligned

# `/lorad-{pid}x{token}n{pid namespace}-{purpose}`: the pid is the leading digits of the instance, and its
# pid namespace (the inode of /proc/self/ns/pid) tells whether this process can see the creator at all.
_NAME = re.compile(r"^/lorad-(\d+)x[0-9a-f]+(?:n(\d+))?-[A-Za-z0-9_.-]+$")
_PURPOSE = re.compile(r"^[A-Za-z0-9_.-]+$")


def new_instance() -> str:
    """A daemon instance id: the creating pid, a random token (pids are reused, tokens are not) and the pid
    namespace the pid belongs to."""
    return f"{os.getpid()}x{secrets.token_hex(4)}n{pid_namespace()}"


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(instance: str, purpose: str) -> str:
    if not _PURPOSE.match(purpose):
        raise ValueError(f"segment purpose must be letters, digits, '_', '.', '-': {purpose!r}")
    name = f"{PREFIX}{instance}-{purpose}"
    if not _NAME.match(name):
        raise ValueError(f"instance must be '{{pid}}x{{hex}}' (see new_instance()): {instance!r}")
    return name


def creator_pid(name: str) -> int | None:
    """The pid encoded in a lorad segment name, None for names that are not lorad's."""
    match = _NAME.match(name if name.startswith("/") else "/" + name)
    return int(match.group(1)) if match else None


def creator_namespace(name: str) -> int | None:
    """The pid namespace encoded in a lorad segment name (None: not said, as in names before it was)."""
    match = _NAME.match(name if name.startswith("/") else "/" + name)
    return int(match.group(2)) if match and match.group(2) else None


def align(offset: int, alignment: int = ALIGNMENT) -> int:
    return (offset + alignment - 1) // alignment * alignment


class Segment:
    """A mapped POSIX shared-memory segment.

    `Segment.create(name, size)` (owner: unlinks on close) or `Segment.attach(name)` (no unlink).
    `array()` and `tensor()` are views over the mapping, not copies: what one process writes there the
    others see. Close only after dropping the views; an exported buffer cannot be unmapped, and then
    the mapping is left to the garbage collector (the name is unlinked all the same).
    """

    def __init__(self, name: str, size: int, owner: bool):
        self.name = name
        self.owner = owner
        flags = posix_ipc.O_CREX if owner else 0
        memory = posix_ipc.SharedMemory(name, flags, mode=0o600, size=size if owner else 0)
        try:
            self.size = memory.size
            self.buffer = mmap.mmap(memory.fd, self.size)
        except BaseException:
            if owner:
                memory.unlink()
            raise
        finally:
            memory.close_fd()
        # Last line of defence: an owner that is garbage collected or exits without close() still
        # unlinks, but only in the creating process (a forked child must not remove its parent's name).
        self._finalizer = weakref.finalize(self, _unlink_if_creator, name, os.getpid()) if owner else None

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        if size <= 0:
            raise ValueError(f"segment size must be positive, not {size}")
        return cls(name, size, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        return cls(name, 0, owner=False)

    def array(self, offset: int, shape, dtype) -> np.ndarray:
        """A numpy view of `shape` `dtype` elements at byte `offset` (C order)."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64))
        if offset % dtype.alignment or offset < 0 or offset + count * dtype.itemsize > self.size:
            raise ValueError(f"{shape} {dtype} at offset {offset} does not fit {self.name} ({self.size} bytes)")
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

    def tensor(self, offset: int, shape, dtype=np.float32) -> torch.Tensor:
        """A torch view (CPU, shares the memory) of the same region as `array()`."""
        return torch.from_numpy(self.array(offset, shape, dtype))

    def close(self) -> None:
        if self.buffer is None:
            return
        try:
            self.buffer.close()
        except BufferError:
            log.debug("segment=%s views still alive; unmapped when they are collected", self.name)
        self.buffer = None
        if self.owner:
            self._finalizer()  # unlinks once

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size}, owner={self.owner})"


def _unlink_if_creator(name: str, creator: int) -> None:
    if os.getpid() != creator:
        return
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'.
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def lorad_segments(prefix: str = PREFIX) -> list[str]:
    """Names (with the leading '/') of the lorad segments in /dev/shm that start with `prefix`."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted("/" + entry for entry in entries if ("/" + entry).startswith(prefix))


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink the segments whose creating process is gone; returns their names.

    A segment of a live process, or a name that is not lorad's, is left alone; so is one another user owns
    (not ours to judge or remove: logged) and one created in another pid namespace (its creator's pid means
    nothing here). Pid reuse can only make a stale segment survive a sweep, never remove a live one.
    """
    removed = []
    here, uid = pid_namespace(), os.geteuid()
    for name in lorad_segments(prefix):
        pid = creator_pid(name)
        if pid is None:
            continue
        try:
            owner = os.stat(SHM_DIR + name).st_uid
        except OSError:
            continue  # gone meanwhile
        if owner != uid:
            log.info("left a lorad segment of another user alone segment=%s owner_uid=%d", name, owner)
            continue
        namespace = creator_namespace(name)
        if namespace is not None and namespace != here or pid_alive(pid):
            continue
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            continue  # another sweeper got there first
        except posix_ipc.PermissionsError as error:
            log.info("could not remove a stale segment=%s: %s", name, error)
            continue
        log.info("swept stale segment=%s creator_pid=%d", name, pid)
        removed.append(name)
    return removed
