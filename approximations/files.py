"""Atomic file writes: every table, generated module, result and figure goes through here.

The bytes go to a temporary file in the target's folder, are flushed and fsynced, and the temporary file is
moved into place with ``os.replace`` (or hard-linked, when overwriting is not allowed, so that two writers
cannot both claim a new name). A crash, a full disk or a concurrent reader never sees a half-written file; the
temporary file of a process killed mid-write is removed by the next write of the same target.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from glob import escape as glob_escape
from pathlib import Path

__all__ = ["check_writable", "SAFE_NAME", "safe_stem", "save_figure", "write_atomic"]


#: Characters of the target's name kept in a temporary file's name (a 255-byte name must still leave room).
_TEMP_NAME_CHARS = 100


def _target(path: Path) -> Path:
    """The file a write to ``path`` lands in: a symbolic link to a file is followed (the link stays); a dangling
    link, a folder or anything but a regular file (a device, a pipe) is refused."""
    if path.is_symlink():
        if not path.exists():
            raise ValueError(f"output path {path} is a dangling symbolic link (to {os.readlink(path)})")
        path = path.resolve()
    if path.is_dir():
        raise ValueError(f"output path {path} is a folder; give a file name")
    if path.exists() and not path.is_file():
        raise ValueError(f"output path {path} exists and is not a regular file (a device, pipe or socket); "
                         "refusing to replace it")
    return path


def check_writable(path: str | Path, overwrite: bool = False) -> Path:
    """Fail early (before a long fit) if ``path`` cannot be written: a folder, a dangling link, something that is
    not a regular file, an existing file without ``overwrite``, or a folder that cannot be created or written
    into (tried for real). Returns the path."""
    path = Path(path)
    target = _target(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --force (overwrite=True) to replace it")
    try:  # the real test: create the folder and a temporary file in it
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix(target), suffix=".probe")
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise PermissionError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def _temp_prefix(target: Path) -> str:
    """``.<name>.<pid>.``: short enough for any legal name, and it says which process owns the file."""
    return f".{target.name[:_TEMP_NAME_CHARS]}.{os.getpid()}."


def _remove_orphans(target: Path) -> None:
    """Delete temporary files of ``target`` left by a process that no longer runs (killed mid-write)."""
    for tmp in target.parent.glob(f".{glob_escape(target.name[:_TEMP_NAME_CHARS])}.*.tmp"):
        parts = tmp.name[len(target.name[:_TEMP_NAME_CHARS]) + 2:].split(".")
        if not parts or not parts[0].isdigit() or int(parts[0]) == os.getpid():
            continue
        try:
            os.kill(int(parts[0]), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (PermissionError, OverflowError):
            continue


def write_atomic(path: str | Path, data: str | bytes, overwrite: bool = True) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically; with ``overwrite=False`` an existing file is never
    replaced (FileExistsError), even by a writer racing this one."""
    path = _target(Path(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else _default_mode())  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if path exists: no clobbering, even under a race
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(path.parent)
    return path


def _default_mode() -> int:
    """0666 less the process umask: the mode ``open(path, "w")`` would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Characters of names that end up in file names, module names and generated code (table forms, activation labels).
_NAME_CHARACTERS = r"A-Za-z0-9_.+\-"
#: Such a name, whole.
SAFE_NAME = re.compile(rf"[{_NAME_CHARACTERS}]{{1,64}}")


def safe_stem(label: str, limit: int = 80) -> str:
    """A file-name stem for a label that may be a whole expression (``x*sigmoid(x)/1``): characters outside
    ``[A-Za-z0-9_.+-]`` become ``_``; a changed or shortened label gets 8 hex digits of its sha256, so two labels
    never share a file."""
    stem = re.sub(rf"[^{_NAME_CHARACTERS}]", "_", label).lstrip(".")[:limit]
    return stem if stem == label else f"{stem}-{hashlib.sha256(label.encode()).hexdigest()[:8]}"


def save_figure(fig, path: str | Path, **kwargs) -> Path:
    """``fig.savefig`` through :func:`write_atomic` (the format follows the file suffix)."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".") or "png", **kwargs)
    return write_atomic(path, buf.getvalue())
