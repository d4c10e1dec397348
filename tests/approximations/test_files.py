"""Atomic files (approximations/files.py) and table saving: nothing written in the wrong place, nothing lost."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from _helpers import table_json as _table
from approxbp.approximations import table_schema as TS
from approxbp.approximations import tables as table_files
from approxbp.approximations.files import check_writable, safe_stem, write_atomic


def test_a_device_node_is_never_replaced(tmp_path):
    dev = tmp_path / "null"
    os.symlink("/dev/null", dev)
    with pytest.raises(ValueError, match="not a regular file"):
        check_writable(dev, overwrite=True)
    with pytest.raises(ValueError, match="not a regular file"):
        write_atomic(dev, "x")
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_a_dangling_symlink_is_refused_before_any_work(tmp_path):
    link = tmp_path / "out.json"
    os.symlink(tmp_path / "missing" / "target.json", link)
    with pytest.raises(ValueError, match="dangling symbolic link"):
        check_writable(link)


def test_a_symlink_to_a_file_is_written_through(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    os.symlink(target, link)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_legal_long_name_can_be_written(tmp_path):
    name = "t" * 245 + ".json"  # legal (≤ 255 bytes), but a temporary name built from it was not
    check_writable(tmp_path / name)
    write_atomic(tmp_path / name, "{}")
    assert (tmp_path / name).read_text() == "{}"


def test_a_write_killed_mid_way_leaves_no_temporary_file_behind(tmp_path):
    """kill -9 during the write leaves the temporary file; the next write of the same target removes it."""
    target = tmp_path / "big.bin"
    code = textwrap.dedent(f"""
        import os, signal
        from approxbp.approximations import files
        real = os.fsync
        def die(fd):
            os.kill(os.getpid(), signal.SIGKILL)
        os.fsync = die
        files.write_atomic({str(target)!r}, b"x" * 1_000_000)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".big.bin.*.tmp")) and not target.exists()
    write_atomic(target, b"ok")
    assert target.read_bytes() == b"ok" and not list(tmp_path.glob(".big.bin.*"))


def test_force_replaces_an_invalid_table_with_the_same_definition(tmp_path):
    path = tmp_path / "t.json"
    good = table_files.load("relu_sum/gelu-k2-primitive")
    bad = dict(good.to_json())
    bad["provenance"] = {"method": 5}  # the definition leaves provenance out: same definition, invalid file
    assert table_files.definition_sha256(bad) == table_files.definition_sha256(good)
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError):
        table_files.load(path)
    table_files.save(good, path)
    assert table_files.load(path).knots == good.knots


def test_deeply_nested_json_is_one_clear_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(TS.TableError, match="nested too deeply"):
        table_files.load(path)


def test_file_stems_of_expressions_stay_in_their_folder():
    assert safe_stem("gelu") == "gelu"
    s = safe_stem("x*sigmoid(x)/1")
    assert "/" not in s and s != safe_stem("x*sigmoid(x)*1") and s.startswith("x_sigmoid_x__1-")


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----



def test_crash_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "t.json"
    table_files.save(_table("relu_sum/gelu-k2-primitive"), p)
    before = p.read_bytes()

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    t = _table("relu_sum/gelu-k3-primitive")
    with pytest.raises(OSError, match="No space"):
        table_files.save(t, p)
    assert p.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind


def test_no_clobber_write_refuses_an_existing_file(tmp_path):
    p = write_atomic(tmp_path / "a.txt", "first", overwrite=False)
    with pytest.raises(FileExistsError):
        write_atomic(p, "second", overwrite=False)
    assert p.read_text() == "first"
    with pytest.raises(FileExistsError, match="--force"):
        table_files.save(_table("relu_sum/gelu-k2-primitive"), p, overwrite=False)


def test_atomic_writes_keep_ordinary_permissions(tmp_path):
    new = write_atomic(tmp_path / "new.txt", "x")
    mask = os.umask(0)
    os.umask(mask)
    assert new.stat().st_mode & 0o777 == 0o666 & ~mask  # as open(..., "w") would make it, not mkstemp's 0600
    os.chmod(new, 0o640)
    write_atomic(new, "y")
    assert new.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
