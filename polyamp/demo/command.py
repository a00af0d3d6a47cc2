"""``polyamp demo``: check every setting, run the three trainings, print the table, write the plot."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from polyamp._errors import BackendError, ConfigError

from . import backends
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
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps, help="training steps per run")
    parser.add_argument("--output", default="polyamp-demo.png", metavar="PATH",
                        help="where to write the plot; its suffix picks the format (.png, .pdf, .svg, "
                             "...; none means .png) (default: polyamp-demo.png)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, help="data and weight seed")
    parser.add_argument("--batch", type=int, default=DEFAULTS.batch, help="samples computed per step")
    parser.add_argument("--global-batch", type=int, default=DEFAULTS.global_batch,
                        help="samples the loss is averaged over (default: 2**24, which makes "
                             "per-sample float16 gradients underflow); use --batch's value for none")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")


def _title(settings: DemoSettings) -> str:
    return (f"polyamp demo: MLP 2-{settings.hidden}-{settings.hidden}-3 on 3-arm spirals, Adam, "
            f"{settings.backend}\nloss = mean over a global batch of {settings.global_batch:,} samples "
            f"({settings.batch:,} computed per step)")


def _checked(args: argparse.Namespace) -> tuple[DemoSettings, Path | None]:
    """The settings and the plot's path, every one checked before any training."""
    settings = DemoSettings(
        backend=backends.chosen(args.backend), dtype=args.dtype, steps=args.steps, seed=args.seed,
        batch=args.batch, global_batch=args.global_batch,
    )
    preflight(settings)
    return settings, None if args.no_plot else plot_path(args.output)


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; 2 (before any training) for a setting that cannot run."""
    try:
        settings, output = _checked(args)
    except (BackendError, ConfigError) as exc:
        print(f"polyamp demo: error: {exc}", file=sys.stderr)
        return 2
    print(_title(settings).replace("\n", "; "), flush=True)
    results = run_demo(settings, progress_factory(not args.no_progress))
    print()
    print(format_table(results))
    print(summary(results))
    if output is not None:
        try:
            write_plot(results, output, _title(settings))
        except ImportError:
            print(f"no plot written: matplotlib is not installed ({INSTALL_HINT})")
        else:
            print(f"plot written to {output}")
    return 0
