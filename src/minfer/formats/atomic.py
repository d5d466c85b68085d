"""Writing a user's file atomically: a temporary file in the same folder, fsynced, renamed over the target.

The target holds either its old content or the whole new one, never a partial file (a full disk, a
kill). The temporary name carries the writer's pid (``.<name>.<pid>.<random>.tmp``), so that the next
write to the same target can tell a dead writer's leftovers from a running one's and remove them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from minfer.errors import MinferError


def temp_path(target: str) -> str:
    directory = os.path.dirname(target) or "."
    return os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def remove_stale_temps(target: str) -> list[str]:
    """Delete the temporary files earlier writes to ``target`` left when they were killed (their process
    is gone). Returns the paths removed."""
    directory = os.path.dirname(target) or "."
    prefix = f".{os.path.basename(target)}."
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_text = name[len(prefix):-len(".tmp")].split(".")[0]
        if not pid_text.isdigit() or process_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:
            pass
    return removed


def process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OSError:
        return False
    return True


@contextmanager
def atomic_writer(path: str | os.PathLike[str], failure: str) -> Iterator[BinaryIO]:
    """A binary file (readable and seekable too) whose content replaces ``path``'s when the block ends
    without an error; on any error ``path`` keeps what it had and the temporary file is removed. An
    ``OSError`` becomes one :class:`MinferError`, ``"<failure>: <reason>"``. Through a symlink, what it
    points to is replaced (the user's link keeps working); a replaced file keeps its mode."""
    target = os.path.realpath(os.fspath(path))
    remove_stale_temps(target)
    tmp = ""
    try:
        tmp = _create_temp(target, failure)
        with open(tmp, "r+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        except FileNotFoundError:
            pass
        os.replace(tmp, target)
    except BaseException as e:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise MinferError(f"{failure}: {e.strerror or e}") from None
        raise
    _fsync_dir(os.path.dirname(target) or ".")


def write_atomically(path: str | os.PathLike[str], data: bytes, what: str = "file") -> None:
    """``path`` gets ``data`` whole or keeps what it had; a failure is one MinferError naming it
    ("cannot write the trace page out.html: No space left on device")."""
    with atomic_writer(path, f"cannot write the {what} {os.fspath(path)}") as f:
        view, fd = memoryview(data), f.fileno()
        while view:  # straight to the descriptor: nothing else is written through f
            view = view[os.write(fd, view):]


def _create_temp(target: str, failure: str) -> str:
    # In the target's folder, so that os.replace is a rename within one filesystem (atomic). Mode 0o666
    # minus the umask, like a plain open(); the mode of a file being replaced is copied over afterwards.
    for _ in range(100):
        tmp = temp_path(target)
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise MinferError(f"{failure}: no free temporary name in {os.path.dirname(target) or '.'}")


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable; not every platform can open a folder (Windows), which is fine.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
