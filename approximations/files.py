"""Atomic file writes: every table, generated module, result and figure goes through here.

The bytes go to a temporary file in the target's folder, are flushed and fsynced, and the temporary file is
moved into place with ``os.replace`` (or hard-linked, when overwriting is not allowed, so that two writers
cannot both claim a new name). A crash, a full disk or a concurrent reader never sees a half-written file.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path


def check_writable(path: str | Path, overwrite: bool = False) -> Path:
    """Fail early (before a long fit) if ``path`` cannot be written: a folder, an existing file without
    ``overwrite``, or a folder that cannot be created or written into (tried for real). Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"output path {path} is a folder; give a file name")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --force (overwrite=True) to replace it")
    try:  # the real test: create the folder and a temporary file in it
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise PermissionError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def write_atomic(path: str | Path, data: str | bytes, overwrite: bool = True) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically; with ``overwrite=False`` an existing file is never
    replaced (FileExistsError), even by a writer racing this one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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


def save_figure(fig, path: str | Path, **kwargs) -> Path:
    """``fig.savefig`` through :func:`write_atomic` (the format follows the file suffix)."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".") or "png", **kwargs)
    return write_atomic(path, buf.getvalue())
