"""Write checkpoint files with whatever polyamp is importable, for tests/test_checkpoint_files.py.

Two commands::

    # with the polyamp of the current environment (any commit's checkout, installed -e):
    python tools/write_checkpoint_fixtures.py write --out tests/data/checkpoints [--label SHA]
    # for each commit: a temporary git worktree and venv, then ``write`` there (this file is run
    # from where it is, so it need not exist in the old commit):
    python tools/write_checkpoint_fixtures.py build 9195a22 372f9c9 ... --out tests/data/checkpoints

``write`` trains a few steps (an overflow among them) with ``LossScaler`` (NumPy), the torch
facade and the paddle facade, with and without a StepGuard where that commit has one, and saves
what a user would: ``LossScaler.save`` (.json, .json.gz), ``torch.save`` of the torch facade's
state dict (and of a LossScaler state dict inside a training checkpoint), ``json.dump`` of the
facades' state dicts, ``pickle.dump`` and ``paddle.save`` of the paddle facade's. The values that
commit's own API reports after training go to ``<label>-expected.json``, which the test compares
today's loading against. Only the API every commit since the first has is used, feature-tested.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

#: StepGuard settings used wherever the commit has one; recorded in the sidecar for the loader.
GUARD = {"max_grad_norm": 50.0, "loss_zscore": 6.0, "grad_norm_zscore": 6.0, "window": 4, "min_history": 2}
#: Each variant's steps: 1.0 finite gradients, "inf" an overflow, "big" finite ones over max_grad_norm.
#: plain ends with a growth tracker short of its interval, extras with a backoff tracker, guard with
#: a streak of two skips.
STEPS = {
    "plain": (1.0, 1.0, "inf", 1.0, 1.0, 1.0, 1.0, 1.0, "inf", 1.0, 1.0),
    "extras": (1.0, 1.0, "inf", "inf", 1.0, 1.0, 1.0, 1.0, "inf"),
    "guard": (1.0, 1.0, "inf", 1.0, 1.0, 1.0, 1.0, 1.0, "inf", "big"),
}
VARIANTS = (("plain", False, False), ("extras", True, False), ("guard", False, True))


# -- write (runs inside the checkout's environment) ------------------------------------
def _git(*args: str, cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _has_param(func: Any, name: str) -> bool:
    return name in inspect.signature(func).parameters


def _plain(value: Any) -> Any:
    """A state dict as JSON values (arrays and NumPy scalars as lists and numbers)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # np.ndarray, np.generic, torch.Tensor
        return value.tolist()
    return value


def _update_after(scaler: Any) -> None:
    """update() where step() leaves it to the caller (the first commits' step() ran it itself)."""
    import polyamp

    try:
        scaler.update()
    except polyamp.ScalerStateError:
        pass


def _loss_scaler(what: str, extras: bool, guard: bool) -> tuple[Any, dict[str, Any]]:
    import polyamp

    fields = {"init_scale": 1024.0, "growth_interval": 3}
    if extras:
        fields.update(backoff_interval=2, min_scale=1.0, max_scale=2.0**20)
        if "rule" in {f.name for f in dataclasses.fields(polyamp.LossScaleConfig)}:
            fields.update(rule="deepspeed", consecutive_hysteresis=True)
    kwargs = {"guard": polyamp.StepGuard(**GUARD)} if guard else {}
    scaler = polyamp.LossScaler(polyamp.LossScaleConfig(**fields), "numpy", **kwargs)
    for i, kind in enumerate(STEPS[what]):
        value = {"inf": np.inf, "big": 100.0}.get(kind, 1.0)  # type: ignore[call-overload]
        grads = [np.full(4, value * scaler.get_scale(), np.float32)]  # unscaled: value
        loss = {"loss": 1.0 + 0.01 * i} if guard else {}
        scaler.step(grads, lambda: None, **loss)
        _update_after(scaler)
    host = scaler.host_state()
    expected = {
        "scale": host.scale, "growth_tracker": host.growth_tracker, "backoff_tracker": host.backoff_tracker,
        "steps": scaler.steps, "skipped_steps": scaler.skipped_steps, "config": scaler.config.to_dict(),
    }
    if guard:
        expected.update(guard=scaler.guard_history.to_dict(), guard_config=GUARD)
    return scaler, expected


def _train_torch_like(what: str, scaler: Any, model: Any, optimizer: Any, ones: Any) -> None:
    """The facades' loop: scale(loss).backward(), step(optimizer), update(); ``ones(v)`` an input."""
    for kind in STEPS[what]:
        x = ones({"inf": 1e36, "big": 1000.0}.get(kind, 1.0))  # type: ignore[call-overload]
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.clear_grad() if hasattr(optimizer, "clear_grad") else optimizer.zero_grad()


def _torch_model() -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), lambda v: torch.full((4, 2), v)


def _torch_facade(what: str, extras: bool, guard: bool) -> tuple[Any, dict[str, Any]]:
    from polyamp.compat.torch import GradScaler

    import polyamp

    kwargs: dict[str, Any] = {"init_scale": 1024.0, "growth_interval": 3}
    if extras:
        kwargs.update(backoff_interval=2, min_scale=1.0, max_scale=2.0**20)
    if guard:
        kwargs["guard"] = polyamp.StepGuard(**GUARD)
    scaler = GradScaler("cpu", **kwargs)
    _train_torch_like(what, scaler, *_torch_model())
    state = _plain(scaler.state_dict())
    expected = {
        "scale": scaler.get_scale(), "growth_tracker": scaler._get_growth_tracker(),
        "growth_factor": scaler.get_growth_factor(), "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(), "state_dict": state,
    }
    if guard:
        expected.update(guard=state["guard"], guard_config=GUARD)
    return scaler, expected


def _paddle_facade(what: str, extras: bool, guard: bool) -> tuple[Any, dict[str, Any]]:
    """Real paddle (its backend came before the facade's first commit)."""
    import paddle
    from polyamp.compat.paddle import GradScaler

    import polyamp

    kwargs: dict[str, Any] = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 3}
    if extras:
        kwargs.update(decr_every_n_nan_or_inf=2, min_scale=1.0, max_scale=2.0**20)
    if guard:
        kwargs["guard"] = polyamp.StepGuard(**GUARD)
    scaler = GradScaler(**kwargs)
    paddle.set_device("cpu")
    paddle.seed(0)
    model = paddle.nn.Linear(2, 1)
    optimizer = paddle.optimizer.SGD(learning_rate=1e-3, parameters=model.parameters())
    _train_torch_like(what, scaler, model, optimizer, lambda v: paddle.full((4, 2), v, "float32"))
    state = _plain(scaler.state_dict())
    host = scaler.engine.host_state()
    expected = {
        "scale": host.scale, "growth_tracker": host.growth_tracker, "backoff_tracker": host.backoff_tracker,
        "incr_ratio": scaler.get_incr_ratio(), "decr_ratio": scaler.get_decr_ratio(),
        "incr_every_n_steps": scaler.get_incr_every_n_steps(),
        "decr_every_n_nan_or_inf": scaler.get_decr_every_n_nan_or_inf(),
        "use_dynamic_loss_scaling": scaler.is_use_dynamic_loss_scaling(), "state_dict": state,
    }
    if guard:
        expected.update(guard=state["guard"], guard_config=GUARD)
    return scaler, expected


def write(out: str, label: str) -> dict[str, Any]:
    """Write this polyamp's checkpoint files into ``out`` as ``<label>-<what>.<ext>``; the sidecar."""
    import polyamp

    os.makedirs(out, exist_ok=True)
    files: dict[str, Any] = {}

    def path(name: str) -> str:
        return os.path.join(out, f"{label}-{name}")

    has_guard = hasattr(polyamp, "StepGuard")
    for what, extras, guard in VARIANTS:
        if guard and not has_guard:
            continue
        scaler, expected = _loss_scaler(what, extras, guard)
        names = [f"ls-{what}.json"] + ([f"ls-{what}.json.gz"] if what == "plain" else [])
        for name in names:
            scaler.save(path(name))
            files[f"{label}-{name}"] = {"kind": "LossScaler.save", **expected}
        if what == "plain":
            import torch

            torch.save({"epoch": 3, "scaler": scaler.state_dict()}, path("ls-in-torch.pt"))
            files[f"{label}-ls-in-torch.pt"] = {"kind": "LossScaler.state_dict in torch.save",
                                                "where": 'checkpoint["scaler"]', **expected}

    import polyamp.compat.torch as torch_facade

    facade_guard = _has_param(torch_facade.GradScaler.__init__, "guard")
    for what, extras, guard in VARIANTS:
        if guard and not facade_guard:
            continue
        import torch

        scaler, expected = _torch_facade(what, extras, guard)
        torch.save(scaler.state_dict(), path(f"torch-{what}.pt"))
        files[f"{label}-torch-{what}.pt"] = {"kind": "torch GradScaler.state_dict in torch.save", **expected}
        if what == "plain":
            with open(path("torch-plain.json"), "w") as f:
                json.dump(scaler.state_dict(), f)
            files[f"{label}-torch-plain.json"] = {"kind": "torch GradScaler.state_dict in json.dump",
                                                  **expected}

    try:
        import polyamp.compat.paddle as paddle_facade
    except ImportError:
        paddle_facade = None
    if paddle_facade is not None:
        paddle_guard = _has_param(paddle_facade.GradScaler.__init__, "guard")
        for what, extras, guard in VARIANTS:
            if guard and not paddle_guard:
                continue
            scaler, expected = _paddle_facade(what, extras, guard)
            with open(path(f"paddle-{what}.pkl"), "wb") as f:
                pickle.dump(scaler.state_dict(), f)
            files[f"{label}-paddle-{what}.pkl"] = {"kind": "paddle GradScaler.state_dict in pickle.dump",
                                                   **expected}
            if what == "plain":
                import paddle

                paddle.save(scaler.state_dict(), path("paddle-plain.pdparams"))
                files[f"{label}-paddle-plain.pdparams"] = {
                    "kind": "paddle GradScaler.state_dict in paddle.save", **expected}
                with open(path("paddle-plain.json"), "w") as f:  # scale as a one-number list
                    json.dump(_plain(scaler.state_dict()), f)
                files[f"{label}-paddle-plain.json"] = {"kind": "paddle GradScaler.state_dict in json.dump",
                                                       **expected}

    here = os.path.dirname(os.path.abspath(polyamp.__file__))
    meta = {
        "commit": _git("rev-parse", "HEAD", cwd=here),
        "subject": _git("log", "-1", "--format=%s", cwd=here)[:200],
        "date": _git("log", "-1", "--format=%cs", cwd=here),
        "python": sys.version.split()[0], "numpy": np.__version__,
        "torch": __import__("torch").__version__,
        "paddle": __import__("paddle").__version__ if paddle_facade is not None else None,
        "steps": {k: list(v) for k, v in STEPS.items()}, "guard": GUARD,
    }
    sidecar = {"meta": meta, "files": files}
    with open(path("expected.json"), "w") as f:
        json.dump(sidecar, f, indent=1, sort_keys=True)
    return sidecar


# -- build (runs from today's checkout) --------------------------------------------------
def build(commits: list[str], out: str, repo: str) -> None:
    """For each commit: a worktree and a venv (system site-packages) that imports polyamp from it,
    then ``write`` there; both removed after. No pip install: the first commits' pyproject lists
    packages they lack, so the venv gets a ``.pth`` line and a dist-info with the commit's entry
    points (the backend registry reads them), and ``polyamp/backends``, ``polyamp/compat`` are
    links in the throwaway worktree (setuptools' package-dir mapping, by hand)."""
    out = os.path.abspath(out)
    for commit in commits:
        sha = _git("rev-parse", "--short=7", commit, cwd=repo)
        tree = os.path.join(tempfile.gettempdir(), f"ck-{sha}")
        venv = os.path.join(tempfile.gettempdir(), f"ck-venv-{sha}")
        subprocess.run(["git", "worktree", "add", "--detach", tree, sha], cwd=repo, check=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
            py = os.path.join(venv, "bin", "python")
            _install_tree(py, tree)
            env = dict(os.environ, PYTHONPATH="", PYTHONNOUSERSITE="1")
            # run from an empty folder, so that no other checkout's polyamp shadows this one
            with tempfile.TemporaryDirectory() as cwd:
                subprocess.run([py, os.path.abspath(__file__), "write", "--out", out, "--label", sha,
                                "--expect-root", tree], check=True, cwd=cwd, env=env)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=repo, check=False)
            shutil.rmtree(venv, ignore_errors=True)


def _install_tree(py: str, tree: str) -> None:
    """Make the venv of ``py`` import polyamp from ``tree`` (see :func:`build`)."""
    import tomllib

    with open(os.path.join(tree, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    for name, folder in project["tool"]["setuptools"].get("package-dir", {}).items():
        link = os.path.join(tree, *name.split("."))
        if name != "polyamp" and not os.path.exists(link):
            os.symlink(os.path.join(tree, folder), link)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "polyamp_checkout.pth"), "w") as f:
        f.write(tree + "\n")
    info = os.path.join(site, f"polyamp-{project['project']['version']}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: polyamp\nVersion: {project['project']['version']}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        for group, points in project["project"].get("entry-points", {}).items():
            f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the files with the polyamp importable here")
    w.add_argument("--out", required=True)
    w.add_argument("--label", help="file prefix (default: the short commit of the imported polyamp)")
    w.add_argument("--expect-root", help="refuse to write unless polyamp is imported from this folder")
    b = sub.add_parser("build", help="write the files of each commit, from a temporary worktree and venv")
    b.add_argument("commits", nargs="+")
    b.add_argument("--out", required=True)
    b.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.commits, args.out, args.repo)
        return 0
    import polyamp

    here = os.path.dirname(os.path.abspath(polyamp.__file__))
    if args.expect_root and not here.startswith(os.path.realpath(args.expect_root)):
        raise SystemExit(f"polyamp is imported from {here}, not from {args.expect_root}")
    label = args.label or _git("rev-parse", "--short=7", "HEAD", cwd=here)
    sidecar = write(args.out, label)
    print(f"{label}: wrote {len(sidecar['files'])} files with polyamp from {here}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
