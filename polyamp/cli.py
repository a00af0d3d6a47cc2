"""The ``polyamp`` command: ``info``, ``demo``, ``inspect`` and ``advise``. A reader that leaves early
(``polyamp demo | head -1``) costs nothing: the rest of the output is dropped, the command runs on.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from . import __version__
from ._registry import ENV_VAR, available_backends

DESCRIPTION = ("Dynamic loss scaling over NumPy, CuPy and PyTorch arrays. 'polyamp info' lists the "
               "backends and the POLYAMP_BACKEND in effect; 'polyamp demo' trains one MLP in float32 "
               "and in float16 without and with loss scaling, and plots the result; 'polyamp inspect "
               "PATH' shows what a checkpoint holds; 'polyamp advise FILE' what saved gradients lose in "
               "float16, bfloat16 or float8.")

STDOUT_CLOSED = ("polyamp: error: standard output is closed (started with '>&-'), and every polyamp "
                 "command prints its result there. Fix: redirect it instead of closing it "
                 "(>/dev/null to discard it, or >FILE).")


def _env_line(infos: list) -> str:
    """What POLYAMP_BACKEND says and whether scalers can use it."""
    env = os.environ.get(ENV_VAR, "").strip()
    if not env:
        return f"{ENV_VAR}: (unset: backend chosen from the arrays, numpy by default)"
    info = {i.name: i for i in infos}.get(env)
    if info is None:
        state = "unknown backend: scalers built without backend= will raise"
    elif not info.available:
        state = f"unavailable ({info.reason}): scalers built without backend= will raise"
    else:
        state = "in effect for scalers built without backend="
    return f"{ENV_VAR}: {env} ({state})"


def _info(args: argparse.Namespace) -> int:
    print(f"polyamp {__version__}")
    infos = available_backends()
    print(_env_line(infos))
    rows = [("backend", "available", "version", "reason")]
    rows += [(i.name, "yes" if i.available else "no", i.version or "-", i.reason or "") for i in infos]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
    print(_numpy_kernel_line())
    return 0


def _numpy_kernel_line() -> str:
    """Which NumPy unscale-and-check kernel runs here, and why (imports numba to find out)."""
    from ._errors import install_hint
    from .backends import _numpy_kernels as kernels

    try:
        requested = kernels._requested()
    except ValueError as exc:  # a POLYAMP_NUMPY_KERNEL that names no kernel
        return f"numpy kernel: {exc}"
    if requested != "compiled":
        return f"numpy kernel: {requested} ({kernels.ENV_VAR}={requested}; the compiled one not asked for)"
    if kernels.compiled_available():
        import numba

        return f"numpy kernel: compiled (numba {numba.__version__}), the fastest on CPU"
    return (f"numpy kernel: blocked, not the compiled one ({kernels.compiled_error}). "
            f"Fix: {install_hint('compiled')}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; subcommands register themselves here."""
    parser = argparse.ArgumentParser(prog="polyamp", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"polyamp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "info", help="list backends, their availability and versions",
        description="Print polyamp's version, the POLYAMP_BACKEND in effect, every backend found with "
        "whether it can run here (and why not), its library's version, and which NumPy kernel runs: "
        "the numba-compiled one (the 'compiled' extra) or the blocked NumPy loop, and why.",
    ).set_defaults(func=_info)
    demo = sub.add_parser(
        "demo", help="train an MLP in float32, float16 without and with loss scaling; plot it",
        description="Train one MLP three ways (float32, float16 without loss scaling, float16 + "
        "polyamp) where float16 gradients underflow; print a table and write a plot.",
    )
    from .demo import command

    command.add_arguments(demo)
    demo.set_defaults(func=command.main)
    inspect = sub.add_parser(
        "inspect", help="show a checkpoint's format, scale, trackers, counters and config",
        description="Read a checkpoint (LossScaler.save(), .gz too; a torch- or paddle-facade "
        "state_dict() saved as JSON; a torch.save file, read with torch.load(weights_only=True), "
        "torch's restricted unpickler) and print every scaler state it holds; a field the format "
        "does not hold shows as 'not saved in this format'. Nothing in the file is executed. Exits 2 "
        "with a one-line error for anything else.",
    )
    inspect.add_argument("path", metavar="PATH", help="the checkpoint file")
    inspect.add_argument("--json", action="store_true", help="print the same as JSON")
    inspect.set_defaults(func=_inspect)
    _add_advise(sub)
    return parser


def _add_advise(sub: Any) -> None:
    """The ``advise`` subcommand's parser."""
    advise = sub.add_parser(
        "advise", help="what saved gradients lose in float16, bfloat16 or float8, and which scale keeps them",
        description="Read unscaled gradients saved as a dict name -> array (np.savez, or torch.save, read "
        "with torch.load(weights_only=True)) and print, per gradient and target format, how many values "
        "underflow, turn subnormal or overflow at the given loss scale, and advice. Nothing in the file is "
        "executed. Exits 2 with a one-line error for anything else.",
    )
    advise.add_argument("path", metavar="FILE", help="the gradients file")
    advise.add_argument("--scale", default="1", help="the loss scale of 'loss' targets (default 1: none)")
    advise.add_argument("--targets", nargs="+", metavar="DTYPE[:SCALE]",
                        help="formats to judge, SCALE 'loss' (default), 'amax' or a number "
                        "(default: float16:loss bfloat16:1)")
    advise.add_argument("--json", action="store_true", help="print the report as JSON")
    advise.set_defaults(func=_advise)


def _inspect(args: argparse.Namespace) -> int:
    from . import _inspect as inspect
    from ._errors import StateDictError

    try:
        found = inspect.describe_all(args.path)
    except StateDictError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"polyamp inspect: error: {message}", file=sys.stderr)
        return 2
    if args.json:  # one object for a JSON checkpoint (as before), a list for a torch.save file
        print(inspect.as_json(found[0] if "where" not in found[0] else found))
    else:
        print("\n\n".join(inspect.format_text(info) for info in found))
    return 0


def _advise(args: argparse.Namespace) -> int:
    import json

    from . import _advise as advise
    from ._errors import ConfigError, StateDictError

    try:
        targets = None if args.targets is None else advise.parse_targets(args.targets)
        found = advise.report(args.path, advise.parse_scale(args.scale), targets)
    except (ConfigError, StateDictError) as exc:
        print(f"polyamp advise: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(json.dumps({"file": os.fspath(args.path), **found.to_dict()}, indent=2) if args.json else found)
    return 0


class _ReaderMayLeave:
    """``sys.stdout`` while a command runs: once the reader has gone, writes are dropped and stdout
    points at devnull so no later flush raises (Python docs, "Note on SIGPIPE")."""

    def __init__(self, stream: TextIO) -> None:
        self._stream, self.reader_left = stream, False

    def write(self, text: str) -> int:
        if not self.reader_left:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.reader_left:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.reader_left = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m polyamp``."""
    stdout = sys.stdout
    if stdout is None:  # started with stdout closed (``>&-``): every command prints, so none can run
        print(STDOUT_CLOSED, file=sys.stderr or sys.__stderr__)
        return 2
    args = build_parser().parse_args(argv)
    sys.stdout = _ReaderMayLeave(stdout)  # type: ignore[assignment]
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader that left shows here at the latest
    finally:
        sys.stdout = stdout
    return status


if __name__ == "__main__":
    sys.exit(main())
