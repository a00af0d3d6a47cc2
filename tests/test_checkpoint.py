"""Checkpoint files: paths and file objects, gzip, atomic writes, symlinks, modes, stale temps, bad files."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler, StateDictError, _atomic_file, checkpoint
from polyamp import _errors as polyamp_errors


@pytest.fixture
def scaler():
    s = LossScaler(LossScaleConfig(init_scale=64.0, growth_interval=3))
    s.scale(np.ones(2, np.float32))
    s.update(found_inf=False)
    return s


def _fresh():
    return LossScaler(LossScaleConfig(init_scale=2.0))


# -- file objects and names -----------------------------------------------------------------
def test_save_and_load_through_binary_file_objects(scaler):
    buffer = io.BytesIO()
    scaler.save(buffer)
    assert json.loads(buffer.getvalue())["scale"] == 64.0  # plain JSON: no path to say .gz
    buffer.seek(0)
    other = _fresh()
    other.load(buffer)
    assert other.state_dict() == scaler.state_dict()


def test_load_reads_gzip_from_a_file_object_by_content(scaler, tmp_path):
    scaler.save(tmp_path / "ckpt.gz")
    other = _fresh()
    with open(tmp_path / "ckpt.gz", "rb") as fh:
        other.load(fh)
    assert other.state_dict() == scaler.state_dict()


def test_text_files_and_other_objects_are_refused(scaler, tmp_path):
    with open(tmp_path / "t.json", "w") as fh, pytest.raises(TypeError, match="'wb'"):
        scaler.save(fh)
    (tmp_path / "t.json").write_text("{}")
    with open(tmp_path / "t.json") as fh, pytest.raises(TypeError, match="'rb'"):
        _fresh().load(fh)
    with pytest.raises(TypeError, match="path or a binary file"):
        scaler.save(42)


@pytest.mark.parametrize("name", ["ckpt.GZ", "ckpt.json.Gz", "ckpt.json.gz"])
def test_gz_suffix_in_any_case_compresses(scaler, tmp_path, name):
    scaler.save(tmp_path / name)
    assert (tmp_path / name).read_bytes()[:2] == b"\x1f\x8b"
    other = _fresh()
    other.load(tmp_path / name)
    assert other.state_dict() == scaler.state_dict()


# -- bad files: StateDictError naming the file, scaler unchanged ----------------------------
def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _bad_files(good: bytes):
    return {
        "truncated.gz": _gz(good)[:-10],
        "header-only.gz": _gz(good)[:12],
        "magic-only.gz": b"\x1f\x8b",
        "not-deflate.gz": b"\x1f\x8b\x08\x00" + b"\x00" * 6 + b"this is not deflate data",
        "bad-crc.gz": _gz(good)[:-8] + b"\x00\x00\x00\x00" + _gz(good)[-4:],
        "deep.json": b"[" * 200_000 + b"]" * 200_000,
        "deep.json.gz": _gz(b"[" * 200_000 + b"]" * 200_000),
        "huge-scale.json": good.replace(b'"scale": 64.0', b'"scale": 1' + b"0" * 400),
        "big-scale.json": good.replace(b'"scale": 64.0', b'"scale": 1e300'),
        "nan-scale.json": good.replace(b'"scale": 64.0', b'"scale": NaN'),
        "huge-factor.json": good.replace(b'"growth_factor": 2.0', b'"growth_factor": 1' + b"0" * 400),
        "not-utf8.json": b"\xff\xfe\xfa",
        "bomb.gz": _gz(b" " * (checkpoint.MAX_BYTES + 1)),
        "big.json": b" " * (checkpoint.MAX_BYTES + 1),
    }


def test_bad_checkpoint_files_raise_state_dict_errors_naming_the_file(scaler, tmp_path):
    good = json.dumps(scaler.state_dict(), sort_keys=True).encode()
    assert b'"scale": 64.0' in good and b'"growth_factor": 2.0' in good
    target = _fresh()
    target.scale(np.float32(1.0))
    before = target.state_dict()
    for name, data in _bad_files(good).items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(StateDictError) as info:
            target.load(path)
        assert name in str(info.value), name
        assert target.state_dict() == before, name
        with open(path, "rb") as fh, pytest.raises(StateDictError, match=re.escape(name)):
            target.load(fh)


def test_a_gzip_bomb_is_decompressed_only_up_to_the_cap(tmp_path):
    path = tmp_path / "bomb.gz"
    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as fh:
        for _ in range(128):
            fh.write(b" " * 2**20)  # 128 MiB of spaces in ~128 KiB
    tracemalloc.start()
    try:
        with pytest.raises(StateDictError, match=r"bomb\.gz' decompresses to more than .*16 MiB"):
            _fresh().load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * checkpoint.MAX_BYTES  # the cap and its copies, not 128 MiB


def test_state_dict_errors_from_a_file_name_it_and_the_key(scaler, tmp_path):
    sd = scaler.state_dict()
    sd["growth_tracker"] = 3  # == growth_interval
    path = tmp_path / "ckpt.json"
    path.write_text(json.dumps(sd))
    with pytest.raises(StateDictError, match=r"ckpt\.json.*growth_tracker"):
        _fresh().load(path)


# -- atomic writes --------------------------------------------------------------------------
def test_save_writes_through_a_symlink_to_its_target(scaler, tmp_path):
    real = tmp_path / "real" / "ckpt.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "ckpt.json"
    link.symlink_to(real)
    scaler.save(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["scale"] == 64.0
    assert sorted(os.listdir(real.parent)) == ["ckpt.json"] and sorted(os.listdir(tmp_path)) == [
        "ckpt.json", "real"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_new_files_get_the_umask_mode_and_existing_ones_keep_theirs(scaler, tmp_path):
    old = os.umask(0o027)
    try:
        scaler.save(tmp_path / "new.json")
        assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o640
        assert _atomic_file._umask() == 0o027 and os.umask(0o027) == 0o027  # read without change
        os.chmod(tmp_path / "new.json", 0o604)
        scaler.save(tmp_path / "new.json")
        assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o604
    finally:
        os.umask(old)


@pytest.mark.skipif(os.name != "posix", reason="POSIX umask")
def test_the_umask_is_read_without_proc_too(monkeypatch):
    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/self/status")

    monkeypatch.setattr(_atomic_file, "open", no_proc, raising=False)  # shadows the builtin there
    old = os.umask(0o077)
    try:
        assert _atomic_file._umask() == 0o077 and os.umask(0o077) == 0o077  # read, then restored
    finally:
        os.umask(old)


def test_the_folder_is_fsynced_after_the_rename(scaler, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    scaler.save(tmp_path / "ckpt.json")
    assert events == ["fsync file", "rename", "fsync folder"]


def test_write_errors_name_the_users_path_not_the_temp_file(scaler, tmp_path):
    path = tmp_path / "missing" / "ckpt.json"
    with pytest.raises(FileNotFoundError) as info:
        scaler.save(path)
    assert str(path) in str(info.value) and ".polyamp" not in str(info.value)
    assert info.value.filename == str(path)


def _temps(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


@pytest.mark.skipif(os.name != "posix", reason="kills a writer with SIGKILL")
def test_a_killed_writes_temp_file_is_removed_by_the_next_save(scaler, tmp_path):
    path = tmp_path / "ckpt.json"
    code = (
        "import os, signal, sys, polyamp\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "polyamp.LossScaler().save(sys.argv[1])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert len(_temps(tmp_path)) == 1 and not path.exists()  # what a killed save leaves
    scaler.save(path)
    assert _temps(tmp_path) == [] and json.loads(path.read_text())["scale"] == 64.0


@pytest.mark.skipif(os.name != "posix", reason="looks processes up by pid")
def test_only_stale_temps_of_this_target_are_removed(scaler, tmp_path):
    prefix = _atomic_file._temp_prefix("ckpt.json")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        in_flight = tmp_path / f"{prefix}{live.pid}-abcd1234.tmp"  # another live writer's temp
        ours = tmp_path / f"{prefix}{os.getpid()}-abcd1234.tmp"  # this process, e.g. another thread
        old = tmp_path / f"{prefix}{live.pid}-old12345.tmp"  # live pid, but untouched for an hour
        other_host = tmp_path / f".ckpt.json.polyamp-00000000-{live.pid + 1}-abcd1234.tmp"
        other_target = tmp_path / f"{_atomic_file._temp_prefix('other.json')}999999999-abcd1234.tmp"
        for p in (in_flight, ours, old, other_host, other_target):
            p.write_text("partial")
        hour_ago = time.time() - 3600
        os.utime(old, (hour_ago, hour_ago))
        scaler.save(tmp_path / "ckpt.json")
        assert _temps(tmp_path) == sorted(p.name for p in (in_flight, ours, other_host, other_target))
    finally:
        live.kill()
        live.wait()


def test_the_figures_in_the_docs_are_the_code_s():
    doc = (Path(__file__).parents[1] / "docs" / "checkpoints.md").read_text()
    assert checkpoint.MAX_BYTES == 16 * 2**20 and "at most 16 MiB" in doc
    assert _atomic_file.STALE_SECONDS == 600 and "older than 10 minutes" in doc
    assert checkpoint.TRACKER_LIMIT == 2**31 and "below 2**31" in doc


# -- issue 15: writers that take fewer bytes, FIFOs, ambiguous or inconsistent state dicts ------
class _Trickle(io.RawIOBase):
    """A raw file whose write() takes at most ``chunk`` bytes per call, as a pipe or socket may."""

    def __init__(self, chunk: int) -> None:
        self.data, self.chunk = bytearray(), chunk

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        taken = bytes(b)[: self.chunk]
        self.data += taken
        return len(taken)


def test_save_completes_a_write_that_takes_fewer_bytes(scaler):
    f = _Trickle(7)
    scaler.save(f)  # the whole checkpoint, 7 bytes a call: it used to stop after the first 7
    fresh = _fresh()
    fresh.load(io.BytesIO(bytes(f.data)))
    assert fresh.state_dict() == scaler.state_dict()


def test_save_raises_when_write_takes_nothing(scaler):
    f = _Trickle(0)
    with pytest.raises(OSError, match=r"could not write checkpoint <_Trickle object>: its write\(\) took 0"):
        scaler.save(f)


def test_load_refuses_a_fifo_without_opening_it(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: in a subprocess, so a regression times out."""
    fifo = tmp_path / "ckpt.fifo"
    os.mkfifo(fifo)
    code = (
        "import polyamp, sys\n"
        "try:\n    polyamp.LossScaler().load(sys.argv[1])\n"
        "except polyamp.StateDictError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "is a FIFO (named pipe), not a regular file" in out.stdout and str(fifo) in out.stdout


def test_load_refuses_a_folder_by_name(tmp_path):
    with pytest.raises(StateDictError, match=r"which is a folder, not a regular file"):
        _fresh().load(tmp_path)


@pytest.mark.parametrize(
    "change, key",
    [({"version": True}, "'version'"), ({"steps": 3, "skipped_steps": 4}, "'skipped_steps'")],
)
def test_inconsistent_state_dicts_are_refused_naming_the_key(scaler, change, key):
    fresh = _fresh()
    with pytest.raises(StateDictError, match=re.escape(f"state_dict[{key}]")):
        fresh.load_state_dict({**scaler.state_dict(), **change})
    assert fresh.get_scale() == 2.0 and fresh.steps == 0


def test_a_repeated_json_key_is_refused(scaler, tmp_path):
    path = tmp_path / "dup.json"
    text = json.dumps(scaler.state_dict())
    path.write_text(text[:-1] + ', "scale": 2.0}')  # json.loads would keep the second silently
    fresh = _fresh()
    with pytest.raises(StateDictError, match=r"key 'scale' appears twice"):
        fresh.load(path)
    nested = text.replace('"dynamic": true', '"dynamic": true, "dynamic": false')
    assert nested != text
    path.write_text(nested)
    with pytest.raises(StateDictError, match=r"key 'dynamic' appears twice"):
        fresh.load(path)
    assert fresh.get_scale() == 2.0


def test_state_dict_and_save_are_refused_between_step_and_update(tmp_path):
    """Decision: like copies, a checkpoint waits for update(): the step is counted before its scale."""
    s = LossScaler(LossScaleConfig(init_scale=8.0))
    s.step([np.array([np.inf], np.float32)], lambda: None)
    for call in (s.state_dict, lambda: s.save(tmp_path / "c.json")):
        message = r"between step\(\) and update\(\).*Fix: call update"
        with pytest.raises(polyamp_errors.ScalerStateError, match=message):
            call()
    assert not (tmp_path / "c.json").exists()
    s.update()
    s.save(tmp_path / "c.json")
    fresh = _fresh()
    fresh.load(tmp_path / "c.json")
    assert fresh.get_scale() == 4.0 and fresh.steps == 1 and fresh.skipped_steps == 1


_FULL_DISK = r"""
import errno, os, sys
import polyamp
folder = sys.argv[1]
target = os.path.join(folder, "ckpt.json")
polyamp.LossScaler(polyamp.LossScaleConfig(init_scale=64.0)).save(target)
before = open(target, "rb").read()
with open(os.path.join(folder, "fill"), "wb", buffering=0) as fh:  # fill the 64 KiB file system
    try:
        while True:
            fh.write(b"x" * 512)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
try:
    polyamp.LossScaler(polyamp.LossScaleConfig(init_scale=2.0)).save(target)
except OSError as exc:
    assert exc.errno == errno.ENOSPC, exc
    assert open(target, "rb").read() == before
    assert [n for n in os.listdir(folder) if n.endswith(".tmp")] == []
    print(exc)
"""


def test_a_full_disk_says_so_and_keeps_the_old_checkpoint(tmp_path):
    """A real full file system: a 64 KiB tmpfs in a user + mount namespace (skipped where there is none)."""
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    mount = tmp_path / "mnt"
    mount.mkdir()
    shell = f'mount -t tmpfs -o size=64k tmpfs "{mount}" && exec "{sys.executable}" "{script}" "{mount}"'
    try:
        out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
                             capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here to make a small file system")
    no_namespace = "unshare" in out.stderr or "mount" in out.stderr
    if out.returncode != 0 and no_namespace and "Traceback" not in out.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    assert "No space left on device" in out.stdout and "the disk (or quota) is full" in out.stdout
    assert "nothing was replaced" in out.stdout and "folder exists" not in out.stdout
