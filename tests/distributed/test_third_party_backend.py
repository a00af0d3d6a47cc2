"""A third-party backend, found exactly as an installed plugin is, runs the whole scaler.

``tests/third_party/polyamp_boxed`` is a backend for ``Boxed``, an array type of the test's own
(NumPy values in a box that is not an array: no ``__array__``, no DLPack, no array API). A
dist-info with an ``entry_points.txt`` under the ``polyamp`` group is written into a temporary
folder on ``PYTHONPATH``, and fresh processes find it there: ``LossScaler`` steps (skip on inf,
backoff, growth), ``explain_overflow`` on its arrays, and a 2-rank gloo agreement, with no
polyamp file edited for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "third_party"
ENTRY_POINTS = "[polyamp]\nboxed = polyamp_boxed.backend\n"


@pytest.fixture
def boxed_installed(tmp_path, monkeypatch) -> Path:
    """A dist-info for ``polyamp-boxed`` on PYTHONPATH: child processes see the entry point."""
    dist_info = tmp_path / "polyamp_boxed-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: polyamp-boxed\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    paths = [str(tmp_path), str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.delenv("POLYAMP_BACKEND", raising=False)
    return tmp_path


def local_checks() -> dict:
    """Run in a fresh process: discovery, steps, the scale rule and the overflow report."""
    import math
    from importlib.metadata import entry_points

    import numpy as np
    from polyamp_boxed import Boxed, box

    import polyamp

    found = [ep.value for ep in entry_points(group="polyamp") if ep.name == "boxed"]
    assert found == ["polyamp_boxed.backend"], found

    config = polyamp.LossScaleConfig(init_scale=2.0**4, growth_interval=2)
    scaler = polyamp.LossScaler(config, diagnose=True)
    loss = scaler.scale(box(3.0))
    assert isinstance(loss, Boxed) and float(loss) == 48.0
    assert scaler.backend.name == "boxed"  # chosen for its arrays, as any installed backend

    applied, scales = [], []
    for bad in (False, True, False, False, False):
        grads = [box([32.0, np.inf if bad else 16.0]), box([[8.0]])]
        first = grads[0]
        result = scaler.step(grads, lambda: applied.append(float(first.data[0])))  # noqa: B023
        scaler.update()
        scales.append(scaler.get_scale())
        assert bool(result) is not bad
        if bad:
            report = scaler.last_overflow
            assert [t.name for t in report.tensors] == ["grads[0]"] and report.tensors[0].posinf == 1
    # skip on inf; backoff 16 -> 8 after it; growth after 2 finite steps: 8 -> 16
    assert applied == [2.0, 4.0, 4.0, 2.0]
    assert scales == [16.0, 8.0, 8.0, 16.0, 16.0]
    assert all(isinstance(a, Boxed) for a in scaler.state)

    grads = {"w": box([1.0, np.nan, -np.inf, -3.0]), "b": box([0.5]), "h": box([np.inf], np.float16)}
    report = polyamp.explain_overflow(grads, loss=box([math.inf]), scale=8.0)
    assert report.loss_finite is False and report.found
    w, h = report.tensors
    assert (w.name, w.nan, w.posinf, w.neginf, w.max_abs_finite) == ("w", 1, 0, 1, 3.0)
    assert (h.name, h.posinf, h.dtype, h.max_abs_finite) == ("h", 1, "float16", 0.0)
    assert not polyamp.explain_overflow([box([1.0]), box([2.0])], loss=box(1.0))
    modules = sorted(m for m in ("torch", "paddle", "cupy", "array_api_strict") if m in sys.modules)
    # listed beside the built-ins (whose backend_info imports their libraries: so asked last)
    assert [i.available for i in polyamp.available_backends() if i.name == "boxed"] == [True]
    return {"scales": scales, "modules": modules}


def test_a_third_party_backend_runs_the_scaler_and_the_report(boxed_installed) -> None:
    code = f"import runpy; print(runpy.run_path({__file__!r}, run_name='boxed')['local_checks']())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "'modules': []" in done.stdout  # neither the scaler nor the report looked at another library


def agreeing_ranks(rank: int, size: int) -> dict:
    """Rank 1 overflows at step 1: both ranks skip it, through one agreement each step."""
    import numpy as np
    from polyamp_boxed import Boxed, box

    import polyamp

    scaler = polyamp.LossScaler(polyamp.LossScaleConfig(init_scale=2.0**4, growth_interval=2),
                                reducer="torch")
    applied, flags = [], []
    for step in range(4):
        bad = step == 1 and rank == 1
        grads = [box([16.0 * (rank + 1), np.inf if bad else 1.0])]
        found = scaler.unscale_(grads)
        agreed = scaler.agree_()
        assert isinstance(agreed.found_inf, Boxed)
        flags.append(float(agreed.found_inf))
        if scaler.step(grads, lambda: None):
            applied.append(step)
        scaler.update()
        assert isinstance(found, Boxed)
    return {"applied": applied, "flags": flags, "scale": scaler.get_scale(),
            "collectives": scaler.reducer.collectives, "backend": scaler.backend.name}


def test_a_third_party_backend_agrees_across_two_gloo_ranks(boxed_installed, run_gloo) -> None:
    results = run_gloo(agreeing_ranks, 2).results()
    for result in results:
        assert result["backend"] == "boxed"
        assert result["applied"] == [0, 2, 3]  # step 1 skipped on both ranks: rank 1 overflowed
        assert result["flags"][1] >= 1 and result["flags"][0] == result["flags"][2] == 0
        assert result["collectives"] == 4  # one agreement per step
    assert results[0]["scale"] == results[1]["scale"] == 16.0  # 16 -> 8 (skip) -> 16 (2 finite)
