"""The demo's output: progress (tqdm when installed, plain lines otherwise) and the plot
(matplotlib, from the optional ``demo`` extra), whose path is checked before any training."""

from __future__ import annotations

import itertools
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from polyamp._errors import ConfigError, install_hint

from .run import RunResult

INSTALL_HINT = install_hint("demo")


Tick = Callable[[float], None]


def progress_factory(enabled: bool = True, stream: TextIO | None = None) -> Callable[[str, int], Tick]:
    """A factory of per-run progress callbacks, ``factory(label, steps)(loss)`` once per step: a
    tqdm bar, else about ten plain lines per run."""
    stream = stream or sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    def start(label: str, steps: int) -> Callable[[float], None]:
        if not enabled:
            return lambda loss: None
        if tqdm is not None:
            bar = tqdm(total=steps, desc=f"{label:<26}", file=stream, leave=True, mininterval=0.5)

            def tick(loss: float) -> None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
                if bar.n == bar.total:
                    bar.close()

            return tick
        counter = itertools.count(1)

        def tick_plain(loss: float) -> None:
            step = next(counter)
            if step == steps or step % max(1, steps // 10) == 0:
                print(f"{label}: step {step}/{steps}, loss {loss:.4f}", file=stream, flush=True)

        return tick_plain

    return start


def _plot_formats() -> list[str] | None:
    """The file suffixes matplotlib can write (without the dot); None without matplotlib."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    return sorted(FigureCanvasBase.get_supported_filetypes())


def plot_path(path: str, option: str = "--output") -> Path:
    """The absolute path the plot will be written to (no suffix: ``.png``), checked before any
    training: a format matplotlib writes, in a writable folder; ConfigError naming ``option``."""
    if not path.strip():  # abspath('') is the current folder, which is not what was meant
        raise ConfigError(f"{option} {path!r} is empty. Fix: give a file name, e.g. {option} "
                          "polyamp-demo.png (or --no-plot for no plot)")
    target = Path(os.path.abspath(os.path.expanduser(path)))
    _check_name_length(target, path, option)
    _check_not_a_device(target, path, option)
    if target.is_dir():
        raise ConfigError(f"{option} {path!r} is a folder. Fix: give a file name, e.g. {target / 'demo.png'}")
    suffix = target.suffix[1:].lower()
    formats = _plot_formats()
    if not suffix:
        target = target.with_name(target.name + ".png")
    elif formats is not None and suffix not in formats:
        raise ConfigError(
            f"{option} {path!r}: matplotlib cannot write .{suffix} files. Fix: end the path in "
            f"one of {', '.join('.' + f for f in formats)} (e.g. .png)"
        )
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(f"{option} {path!r}: the folder {folder} does not exist. Fix: create it "
                          "first, or pick a path in an existing folder")
    _check_name_length(target, path, option)
    if target.is_dir():  # "plot" was given and "plot.png" is a folder
        raise ConfigError(f"{option} {path!r}: {target} is a folder. Fix: give another file name")
    _check_not_a_device(target, path, option)
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{option} {path!r}: {target} is not writable here. Fix: pick a path in a "
                          "folder you can write to")
    _probe_folder(folder, target, path, option)
    return target


def _check_name_length(target: Path, path: str, option: str) -> None:
    """The file name and the whole path within the file system's limits."""
    folder = target.parent
    name_max = _pathconf(folder, "PC_NAME_MAX", 255)
    path_max = _pathconf(folder, "PC_PATH_MAX", 4096)
    name_bytes = len(os.fsencode(target.name))
    if name_bytes > name_max:
        raise ConfigError(f"{option} {path!r}: the file name {target.name[:40]!r}... is {name_bytes} bytes, "
                          f"over this file system's limit of {name_max}. Fix: give a shorter file name")
    if len(os.fsencode(str(target))) >= path_max:
        raise ConfigError(f"{option} {path!r}: the path is over this file system's limit of {path_max} "
                          "bytes. Fix: give a shorter path")


def _pathconf(folder: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError, AttributeError):  # no such folder, or a platform without pathconf
        return default


def _check_not_a_device(target: Path, path: str, option: str) -> None:
    """An existing target must be a regular file: the plot never goes to a device, pipe or socket."""
    try:
        mode = target.stat().st_mode
    except OSError:
        return  # not there (or unreadable): the checks that follow say what is wrong
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ConfigError(f"{option} {path!r}: {target} is a device, pipe or socket, not a file. Fix: "
                          "give a file name in a folder, e.g. polyamp-demo.png (or --no-plot for no plot)")


def _probe_folder(folder: Path, target: Path, path: str, option: str) -> None:
    """Create (and remove) a temporary file beside the target: the folder really takes files."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".polyamp-demo-", suffix=target.suffix):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {path!r}: {target} is not writable here ({exc.strerror or exc}). "
                          "Fix: pick a path in a folder you can write to") from None


def write_plot(results: list[RunResult], path: str | Path, title: str) -> None:
    """Plot loss (log scale) and loss scale over the steps for every run; write it to ``path``
    (ImportError with the install command without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"the demo plot needs matplotlib: {INSTALL_HINT}") from exc
    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                            gridspec_kw={"height_ratios": [3, 2]})
    _plot_losses(ax_loss, results, title)
    _plot_scales(ax_scale, [r for r in results if r.loss_scaling])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_COLORS = {"float32": "black", False: "tab:red", True: "tab:blue"}


def _plot_losses(ax: Any, results: list[RunResult], title: str) -> None:
    """Training loss of every run; float32 dashed and on top, so an identical curve shows."""
    for r in sorted(results, key=lambda r: r.dtype == "float32"):
        reference = r.dtype == "float32"
        label = (f"{r.label}: final loss {r.final_loss:.3g}, test accuracy {100 * r.accuracy:.1f}%, "
                 f"{100 * r.zero_grad_fraction:.0f}% of gradients 0 at step 1")
        ax.plot(range(1, len(r.losses) + 1), r.losses, "--" if reference else "-",
                lw=1.4 if reference else 2.4, label=label,
                color=_COLORS["float32"] if reference else _COLORS[r.loss_scaling])
    ax.set_yscale("log")
    ax.set_ylabel("training loss (log scale)")
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    rank = {r.label: i for i, r in enumerate(results)}  # legend in the order of the runs
    order = sorted(range(len(labels)), key=lambda i: rank[labels[i].split(":")[0]])
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="center right",
              fontsize=8.5, framealpha=0.95)


def _plot_scales(ax: Any, scaled: list[RunResult]) -> None:
    """The loss scale of the scaled runs, with their skipped steps marked."""
    for r in scaled:
        steps = range(1, len(r.scales) + 1)
        ax.step(steps, r.scales, where="post", color=_COLORS[True], lw=1.5, label=f"{r.label}: loss scale")
        skipped = [s for s, flag in zip(steps, r.skipped) if flag]
        if skipped:
            ax.plot(skipped, [r.scales[s - 1] for s in skipped], "x", color="tab:orange", ms=8, mew=2,
                    label=f"skipped steps (inf/nan gradients): {len(skipped)}")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale (log2)")
    ax.set_xlabel("step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=9)
