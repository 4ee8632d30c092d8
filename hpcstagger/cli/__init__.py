"""The ``hpcstagger`` command line. One module per subcommand group registers its parser.

Only this entry point configures logging. Errors from :mod:`hpcstagger.errors` become one line on
stderr and exit status 1; usage errors exit 2 with one line. Under MPI with more than one rank, an
error raised on this rank alone, or an unexpected exception, aborts the whole job (MPI_Abort)
rather than leaving the other ranks waiting.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from typing import Any, NoReturn
from collections.abc import Callable, Sequence

from hpcstagger._io import say_line
from hpcstagger._version import __version__
from hpcstagger.cli._args import settle_spec
from hpcstagger.errors import CollectiveError, HpcstaggerError

__all__ = ["build_parser", "main"]

# Subcommands in --help order; each is the module hpcstagger.cli.cmd_<name>, with register(subparsers).
SUBCOMMANDS: list[str] = ["demo", "info", "cache", "clean", "ckpt", "calibrate", "plan", "profile", "launch", "sweep",
                          "history", "slurm"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and exit 2, and that takes options only
    as spelled in full: ``--cold`` is not read as ``--cold-cache`` (no abbreviations, so a
    destructive flag never acts on a prefix). Its subparsers are Parsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> Parser:
    """The full argument parser with every subcommand registered."""
    parser = Parser(
        prog="hpcstagger",
        description="Co-located deep-learning training on HPC nodes: staggered starts, a shared "
                    "/dev/shm sample cache, and asynchronous checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"hpcstagger {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.cmd_{name}").register(sub)
    return parser


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _world_size_if_mpi() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return 1
    try:
        return mpi.COMM_WORLD.Get_size() if mpi.Is_initialized() and not mpi.Is_finalized() else 1
    except Exception:  # best effort while already failing
        return 1


# Seconds between a rank's last words and MPI_Abort: the launcher's proxies forward each rank's output,
# and the abort kills them, so a line written just before it can be lost (both ranks' error files of
# a two-rank abort came back empty once, on a loaded 2-core VM). A failing run can spare it.
ABORT_GRACE = 0.2


def _abort_world(code: int) -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    sys.stdout.flush()
    sys.stderr.flush()
    if mpi is not None:
        time.sleep(ABORT_GRACE)
        mpi.COMM_WORLD.Abort(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    settle_spec(args)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    _configure_logging(args.verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except HpcstaggerError as exc:
        say_line(f"hpcstagger {args.command}: error: {exc}")
        # A CollectiveError was raised on every rank, so all of them exit together; anything else
        # was raised on this rank alone and would strand the others.
        if _world_size_if_mpi() > 1 and not isinstance(exc, CollectiveError):
            _abort_world(1)
        return 1
    except KeyboardInterrupt:
        say_line(f"hpcstagger {args.command}: interrupted")
        return 130
    except BrokenPipeError:
        return 141
    except Exception:
        if _world_size_if_mpi() > 1:
            import traceback

            traceback.print_exc()
            say_line(f"hpcstagger {args.command}: unexpected error; aborting every rank")
            _abort_world(1)
        raise
