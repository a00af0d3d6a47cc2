"""Issue 33, item 6: ``polyamp advise FILE`` reads gradients saved with np.savez or torch.save (never
running code from the file), prints the table and the advice (or JSON), and answers a bad file with
one clear line and exit status 2."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import polyamp
from polyamp.cli import main
from polyamp.precision import PrecisionMeter


def _grads() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(9)
    return {"fc1.weight": (rng.standard_normal((64, 32)) * 1e-7).astype(np.float32),
            "fc2.weight": (rng.standard_normal((10, 64)) * 1e-2).astype(np.float32),
            "fc2.bias": np.zeros(10, np.float16)}


def _want(grads: dict[str, np.ndarray], scale: float, targets=None) -> dict:
    meter = PrecisionMeter() if targets is None else PrecisionMeter(targets=targets)
    counts, extremes = meter.count(polyamp.get_backend("numpy"), list(grads.values()), scale)
    return meter.report(None, scale, list(grads), counts, extremes).to_dict()


def advise(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["advise", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_an_npz_file_gives_the_table_and_the_advice(tmp_path, capsys):
    path = tmp_path / "grads.npz"
    np.savez(path, **_grads())
    status, out, err = advise(capsys, path)
    assert status == 0 and err == ""
    assert out.startswith("precision report, loss scale 1: 3 gradients, 2,698 values")
    assert "fc1.weight" in out and "init_scale=2**" in out
    assert "bfloat16 at scale 1 loses 0.0 % here: loss scaling is not needed for bfloat16" in out


def test_json_holds_the_reports_counts(tmp_path, capsys):
    path = tmp_path / "grads.npz"
    np.savez_compressed(path, **_grads())
    status, out, _ = advise(capsys, path, "--scale", "2**10", "--targets", "float16", "float8_e4m3fn:amax",
                            "bfloat16:0.5", "--json")
    data = json.loads(out)
    targets = [("float16", "loss"), ("float8_e4m3fn", "amax"), ("bfloat16", 0.5)]
    assert status == 0 and data == {"file": str(path), **_want(_grads(), 1024.0, targets)}


def test_a_torch_save_file_is_read_with_the_restricted_unpickler(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    grads = _grads()
    path = tmp_path / "grads.pt"
    saved = {k: torch.from_numpy(v) for k, v in grads.items()}
    saved["fc2.weight"] = saved["fc2.weight"].bfloat16()
    saved["frozen.weight"] = None  # a parameter without a gradient
    torch.save(saved, path)
    status, out, _ = advise(capsys, path, "--json")
    grads["fc2.weight"] = saved["fc2.weight"].float().numpy()  # bfloat16 read exactly as float32
    assert status == 0 and json.loads(out) == {"file": str(path), **_want(grads, 1.0)}


class Payload:
    """What a malicious file holds: unpickling it would create a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def one_line(status: int, out: str, err: str) -> str:
    assert status == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("polyamp advise: error: ")
    return line


def test_code_in_a_file_never_runs(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "ran"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"w": Payload(str(marker))}, f)
    assert "weights_only=True" in one_line(*advise(capsys, tmp_path / "evil.pt"))
    torch.save({"w": Payload(str(marker))}, tmp_path / "evil_zip.pt")
    one_line(*advise(capsys, tmp_path / "evil_zip.pt"))
    np.savez(tmp_path / "objects.npz", w=np.array([Payload(str(marker))], dtype=object))
    assert "np.savez file" in one_line(*advise(capsys, tmp_path / "objects.npz"))
    assert not marker.exists()


def _hostile(tmp_path):
    """name -> (path, what the one line says)."""
    torch = pytest.importorskip("torch")
    (tmp_path / "text").write_text("hello")
    (tmp_path / "empty").write_bytes(b"")
    np.savez(tmp_path / "ints.npz", w=np.arange(3))
    np.savez(tmp_path / "none.npz")
    good = tmp_path / "good.npz"
    np.savez(good, **_grads())
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[:300])
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("readme.txt", "no arrays")
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    torch.save({1: torch.ones(2)}, tmp_path / "intkey.pt")
    torch.save({"w": torch.ones(2, dtype=torch.int64)}, tmp_path / "intgrad.pt")
    torch.save({"w": "text"}, tmp_path / "text.pt")
    os.mkfifo(tmp_path / "fifo")
    return {
        "text": (tmp_path / "text", "neither an np.savez file nor a torch.save file"),
        "empty": (tmp_path / "empty", "neither an np.savez file nor a torch.save file"),
        "ints": (tmp_path / "ints.npz", "not a floating gradient"),
        "none": (tmp_path / "none.npz", "neither an np.savez file"),  # an empty zip: no .npy member
        "cut": (tmp_path / "cut.npz", "could not be read"),
        "other": (tmp_path / "other.zip", "could not be read with torch.load"),
        "list": (tmp_path / "list.pt", "holds a list, not a dict"),
        "intkey": (tmp_path / "intkey.pt", "that is not a str"),
        "intgrad": (tmp_path / "intgrad.pt", "of dtype int64, not a floating gradient"),
        "textgrad": (tmp_path / "text.pt", "is a str"),
        "fifo": (tmp_path / "fifo", "not a regular file"),
        "dir": (tmp_path, "is a directory"),
        "missing": (tmp_path / "missing.npz", "cannot read"),
    }


def test_hostile_files_get_one_clear_line_and_status_2(tmp_path, capsys):
    for name, (path, says) in _hostile(tmp_path).items():
        line = one_line(*advise(capsys, path))
        assert says in line, (name, line)


@pytest.mark.parametrize("args, says", [
    (["--scale", "0"], "--scale must be a finite number > 0"), (["--scale", "nan"], "got --scale 'nan'"),
    (["--scale", "2**2000"], "--scale '2**2000'"), (["--targets", "float32"], "targets[0]'s dtype"),
    (["--targets", "float16:big"], "dtype[:scale]"), (["--targets", "float16:-1"], "targets[0]'s scale"),
])
def test_bad_options_get_one_clear_line_and_status_2(tmp_path, capsys, args, says):
    path = tmp_path / "grads.npz"
    np.savez(path, **_grads())
    assert says in one_line(*advise(capsys, path, *args))


def test_the_command_runs_as_a_module(tmp_path):
    path = tmp_path / "grads.npz"
    np.savez(path, **_grads())
    out = subprocess.run([sys.executable, "-m", "polyamp", "advise", str(path), "--scale", "65536"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "loss scale 2**16" in out.stdout and "advice:" in out.stdout
