"""``polyamp demo``: check every setting, run the three trainings, print the table, write the plot
(with ``--distributed`` on rank 0; every rank trains on its shard of the batch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from polyamp._errors import PolyampError

from . import backends, world
from .report import INSTALL_HINT, plot_path, progress_factory, write_plot
from .run import DemoSettings, format_table, preflight, run_demo, summary

DEFAULTS = DemoSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line flags (defaults are the full demo); help text is plain."""
    parser.add_argument("--backend", default=None, metavar="NAME",
                        help=f"array library to train with: {', '.join(backends.NAMES)} "
                             "(default: POLYAMP_BACKEND when set, else numpy)")
    parser.add_argument("--dtype", default=DEFAULTS.dtype, choices=("float16", "bfloat16"),
                        help="low-precision compute dtype compared with float32 (default: float16)")
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps,
                        help="training steps per run (default: %(default)s)")
    parser.add_argument("--output", default="polyamp-demo.png", metavar="PATH",
                        help="where to write the plot; its suffix picks the format (.png, .pdf, .svg, "
                             "...; none means .png) (default: polyamp-demo.png)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed,
                        help="data and weight seed (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=DEFAULTS.batch,
                        help="samples computed per step (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=DEFAULTS.global_batch,
                        help="samples the loss is averaged over (default: 2**24, which makes "
                             "per-sample float16 gradients underflow); use --batch's value for none")
    parser.add_argument("--distributed", default=None, choices=world.CHOICES,
                        help="train data parallel, the batch split over the ranks of `mpirun -n N polyamp "
                             "demo --distributed mpi` (as root, in containers or CI: `mpirun "
                             "--allow-run-as-root -n N ...`, or set OMPI_ALLOW_RUN_AS_ROOT=1 and "
                             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1) or of `torchrun --nproc-per-node N -m "
                             "polyamp demo --distributed torch`; rank 0 prints (default: one process)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")


def _title(settings: DemoSettings, ranks: world.World) -> str:
    split = f", split over {ranks.size} ranks ({ranks.engine})" if ranks.size > 1 else ""
    return (f"polyamp demo: MLP 2-{settings.hidden}-{settings.hidden}-3 on 3-arm spirals, Adam, "
            f"{settings.backend}\nloss = mean over a global batch of {settings.global_batch:,} samples "
            f"({settings.batch:,} computed per step{split})")


def _checked(args: argparse.Namespace) -> tuple[DemoSettings, Path | None, world.World]:
    """The settings, the plot's path and the ranks, every one checked before any training."""
    settings = DemoSettings(
        backend=backends.chosen(args.backend), dtype=args.dtype, steps=args.steps, seed=args.seed,
        batch=args.batch, global_batch=args.global_batch,
    )
    output = None if args.no_plot else plot_path(args.output)
    preflight(settings)
    ranks = world.join(getattr(args, "distributed", None))
    ranks.share(settings.batch, "--batch")  # every rank checks alike, so every rank stops alike
    return settings, output, ranks


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; 2 (before any training) for a setting that cannot run."""
    try:
        settings, output, ranks = _checked(args)
    except PolyampError as exc:  # a backend, a setting, or the ranks' engine
        print(f"polyamp demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, settings, output, ranks)
    finally:
        ranks.close()


def _run(args: argparse.Namespace, settings: DemoSettings, output: Path | None, ranks: world.World) -> int:
    if not ranks.prints:  # the other ranks train in step with rank 0, silently
        run_demo(settings, None, ranks)
        return 0
    print(_title(settings, ranks).replace("\n", "; "), flush=True)
    results = run_demo(settings, progress_factory(not args.no_progress), ranks)
    print()
    print(format_table(results))
    print(summary(results))
    if output is not None:
        try:
            write_plot(results, output, _title(settings, ranks))
        except ImportError:
            print(f"no plot written: matplotlib is not installed ({INSTALL_HINT})")
        else:
            print(f"plot written to {output}")
    return 0
