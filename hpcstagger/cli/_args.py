"""The job spec argument shared by every subcommand that reads one: ``SPEC`` as the first
positional argument, or the older ``--spec SPEC`` option; never both.

argparse cannot say "one of a positional and an option", so :func:`add_spec` registers both and
:func:`settle_spec`, called by :func:`hpcstagger.cli.main` right after parsing, merges them into
``args.spec`` or ends with a one-line usage error (exit 2) from the subcommand's own parser.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["SPEC_HELP", "add_spec", "settle_spec"]

SPEC_HELP = "the job spec (TOML: [run], [[job]], ...)"


def add_spec(p: argparse.ArgumentParser, help: str = SPEC_HELP, *, required: bool = True,
             then: str | None = None) -> None:
    """Give parser ``p`` the spec as positional ``SPEC`` and as ``--spec SPEC``. ``required``: one of
    them must be given. ``then``: the name of an optional positional that follows SPEC; with
    ``--spec``, a single positional is that one."""
    p.add_argument("spec", nargs="?", metavar="SPEC", help=help)
    p.add_argument("--spec", dest="spec_option", metavar="SPEC", default=None,
                   help="the same as SPEC, as an option" + (f"; then a single positional argument is {then.upper()}"
                                                            if then else ""))
    p.set_defaults(spec_parser=(p, required, then))


def settle_spec(args: argparse.Namespace) -> None:
    """Merge ``--spec`` into ``args.spec``; a usage error (exit 2) when both are given, or neither
    where the subcommand needs a spec. Does nothing for a subcommand without a spec."""
    settings: Any = getattr(args, "spec_parser", None)
    if settings is None:
        return
    parser, required, then = settings
    option = args.spec_option
    del args.spec_parser, args.spec_option
    if option is not None:
        if args.spec is not None and then is not None and getattr(args, then) is None:
            setattr(args, then, args.spec)  # 'status --spec SPEC RUN_DIR': the positional is RUN_DIR
            args.spec = None
        if args.spec is not None:
            parser.error(f"the spec is given twice ({args.spec!r} and --spec {option!r}): give SPEC or --spec SPEC")
        args.spec = option
    if args.spec is None and required:
        parser.error("the following arguments are required: SPEC (the job spec, TOML)")
