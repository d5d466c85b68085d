"""Writing a user's file atomically: a temporary file in the same folder, fsynced, renamed over the target.

The target holds either its old content or the whole new one, never a partial file (a full disk, a
kill). The temporary name carries the writer's pid (``.<name>.<pid>.<random>.tmp``), so that the next
write to the same target can tell a dead writer's leftovers from a running one's and remove them.
"""

from __future__ import annotations

import os
import secrets

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


def write_atomically(path: str | os.PathLike[str], data: bytes, what: str = "file") -> None:
    """``path`` gets ``data`` whole or keeps what it had; a failure is one MinferError naming it
    ("cannot write the trace page out.html: No space left on device")."""
    shown = os.fspath(path)
    target = os.path.realpath(shown)  # through a symlink: the user's link keeps working
    remove_stale_temps(target)
    tmp = temp_path(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        except FileNotFoundError:
            pass
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise MinferError(f"cannot write the {what} {shown}: {e.strerror or e}") from None
        raise
