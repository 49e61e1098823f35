"""What every ``leapquant`` command shares: the parser, argument types, the state-method options,
progress bars, output paths and the one-line error handling.

Each package registers its own commands on an ``argparse`` subparsers object
(``leapquant_jax.cli.add_subcommands``, ``models.cli.add_subcommands``); ``leapquant_cli``
gathers them. A handler takes the parsed namespace and returns an exit code. Bad input
(``BAD_INPUT``) becomes one line ``leapquant: error: ...`` on stderr and exit code 2, checked
before anything is written; every command that reports numbers takes ``--json`` and then prints
one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from matplotlib.backend_bases import FigureCanvasBase
from tqdm.auto import tqdm

from .method_names import MAX_WINDOW, METHOD_LABELS, STATE_OPTIONS, STUDY_METHODS, method_for_label
from .impls import REQUESTS

PROG = "leapquant"

# Exceptions that mean bad input: the API refuses out-of-range arguments and tensors with a
# ValueError naming them, and files that cannot be read raise OSError. Anything else (a
# TypeError, a KeyError, an error inside JAX) is a bug and keeps its traceback.
BAD_INPUT = (ValueError, OSError, FloatingPointError)


class UsageError(ValueError):
    """Bad command-line input found by the parser (an unknown option, a value out of range)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (``None``, a flag's
    ``False``) or the help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text.lower():
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """The CLI's parser: help shows defaults, and a usage error is raised as ``UsageError``
    (``run_parser`` prints it as one line and returns 2) instead of printing the usage and
    exiting. Sub-command parsers inherit both."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ----------------------------------------------------------------------------- argument types


def int_at_least(low: int):
    """An ``argparse`` type: an integer ``>= low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def int_in(low: int, high: int, *, why: str = ""):
    """An ``argparse`` type: an integer in ``[low, high]``; ``why`` says where the bound comes from."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}" + (f" ({why})" if why else ""))
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False):
    """An ``argparse`` type: a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and value <= high):
            if math.isfinite(high):
                span = f"in {'(' if low_open else '['}{low}, {high}]"
            else:
                span = f"{'>' if low_open else '>='} {low}"
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


# The window p of every command (`method_names.MAX_WINDOW` says why the bound).
window_size = int_in(1, MAX_WINDOW, why=f"a window holds at most MAX_WINDOW = {MAX_WINDOW} records; the Pallas "
                                        "kernels take powers of two from 2 to 32")


# ----------------------------------------------------------------------------- state methods


def add_method_options(parser: argparse.ArgumentParser, *, flag: Optional[str] = "--method",
                       default: Optional[str] = None) -> None:
    """The state-method option and the LeapQuant options, for every command that picks one state
    method (``replay --method``, ``generate``/``score --state``). The method label
    (``method_names.METHOD_LABELS``) is stored as ``args.method`` whatever ``flag`` is;
    ``default=None`` makes it required. ``flag=None`` adds the LeapQuant options alone (the
    commands that take a list, ``add_states_option``)."""
    if flag is not None:
        parser.add_argument(flag, dest="method", metavar="METHOD", choices=list(METHOD_LABELS),
                            required=default is None, default=default, help="state method: %(choices)s")
        parser.set_defaults(method_flag=flag)
    parser.add_argument("--bits", type=int, choices=(8, 6, 4), help="residual bits (leapquant; default 8)")
    parser.add_argument("--window", type=window_size,
                        help=f"records per window p, at most {MAX_WINDOW} (windowed methods; default 16)")
    parser.add_argument("--rank", type=int_at_least(0),
                        help="Compensator Tokens r, at most min(dk, dv) (leapquant; default 4 at 8 bits, 6 at 6/4)")
    parser.add_argument("--no-compensators", dest="compensators", action="store_false", default=None,
                        help="no Compensator Tokens (leapquant)")
    parser.add_argument("--no-smoothing", dest="smoothing", action="store_false", default=None,
                        help="no residual smoothing (leapquant)")
    parser.add_argument("--impl", choices=[str(r) for r in REQUESTS],
                        help="implementation of the windowed methods' step and flush (default auto: the Pallas kernels "
                             "on a GPU, the reference elsewhere; pallas: a kernel or an error; or one by name)")
    parser.add_argument("--damp-calibration", dest="calibration", metavar="FILE",
                        help="method damp's calibration file (made by `leapquant calibrate-damp`)")
    parser.add_argument("--stepquant-calibration", dest="stepquant_calibration", metavar="FILE",
                        help="the calibration file of methods stepquant-6/-4 and leapquant-alloc-6/-4 (made by "
                             "`leapquant calibrate-stepquant`)")


def add_states_option(parser: argparse.ArgumentParser, default: str) -> None:
    """``--states`` (comma-separated method labels, default ``default``) and the LeapQuant
    options: the state options of ``eval``, ``recall`` and ``demo``."""
    parser.add_argument("--states", default=default,
                        help=f"comma-separated methods ({', '.join(STUDY_METHODS)}, or any other of `leapquant "
                             "memory --methods all`); fp32, the reference, is always run")
    add_method_options(parser, flag=None)


def state_options(args: argparse.Namespace) -> dict:
    """The state options (``method_names.STATE_OPTIONS``) of parsed ``add_method_options`` flags."""
    return {k: getattr(args, k) for k in STATE_OPTIONS}


def method_from_args(args: argparse.Namespace):
    """The state method of parsed ``add_method_options`` flags (one method)."""
    return method_for_label(args.method, state_options(args), flag=getattr(args, "method_flag", "--method"))


def method_label(args: argparse.Namespace) -> dict:
    """The method options given on the command line (for ``--json`` reports)."""
    return {k: getattr(args, k) for k in ("method",) + STATE_OPTIONS if getattr(args, k) is not None}


# ----------------------------------------------------------------------------- output


def progress(iterable, *, desc: str, enabled: bool, total: Optional[int] = None):
    """A progress bar on stderr (none when not ``enabled``, as under ``--json``)."""
    return tqdm(iterable, desc=desc, total=total, disable=not enabled, file=sys.stderr, leave=False)


def emit(args: argparse.Namespace, payload: dict, human: str) -> None:
    """Prints ``payload`` as one JSON object under ``--json``, else ``human``."""
    print(json.dumps(payload) if args.json else human)


def warn(message: str) -> None:
    """One line ``leapquant: warning: ...`` on stderr; the command goes on."""
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def add_plot_options(parser: argparse.ArgumentParser, plot: str) -> None:
    """``--out-dir``, ``--plot`` (default ``plot``) and ``--json`` of the commands that draw."""
    parser.add_argument("--out-dir", default="out", help="folder for the plot, created if missing (default: %(default)s)")
    parser.add_argument("--plot", default=plot, help="plot file name inside --out-dir, '' to skip (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def plot_path(args: argparse.Namespace) -> Optional[str]:
    """Where a command writes its plot: ``--plot`` inside ``--out-dir`` (created if missing; an
    absolute ``--plot`` is used as is), or ``None`` for ``--plot ''``. Checked before the run (a
    bad folder should not cost one); ``make_folder_for`` creates the folder when writing."""
    if not args.plot:
        return None
    ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
    supported = FigureCanvasBase.get_supported_filetypes()
    if ext not in supported:
        raise ValueError(f"--plot {args.plot!r}: the file name must end in one of .{', .'.join(sorted(supported))}")
    path = os.path.join(args.out_dir, args.plot)
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise ValueError(f"--out-dir {args.out_dir!r}: {existing!r} is not a writable folder")
    return path


def make_folder_for(path: str) -> None:
    """Creates the folder of ``path`` (an ``--out-dir`` plot)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out-dir: cannot create the folder {folder!r} ({err.strerror})") from None


def check_output(path, flag: str, *, folder: bool) -> None:
    """Refuses an output ``path`` of the wrong kind (a file where ``flag`` wants a folder, or a
    folder where it wants a file). Called before the work, so a bad path costs nothing and
    nothing is written; ``None`` passes."""
    if path is None:
        return
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise FileExistsError(f"{flag} {path} exists and is not a folder")
    if not folder and path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder; give a file name")


# ----------------------------------------------------------------------------- running


def one_line(err: BaseException) -> str:
    """An error message on one line: a multi-line report is joined with ``; ``."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    head, rest = lines[0], lines[1:]
    if not rest:
        return head
    return head + (" " if head.endswith(":") else "; ") + "; ".join(rest)


def run_parser(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> int:
    """Parses ``argv`` and runs the chosen command. Bad input (``BAD_INPUT``) gives one line
    ``leapquant: error: ...`` on stderr and exit code 2; ``--help`` exits 0 as usual."""
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except BAD_INPUT as err:
        print(f"{PROG}: error: {one_line(err)}", file=sys.stderr)
        return 2


__all__ = ["ArgumentParser", "BAD_INPUT", "HelpFormatter", "PROG", "UsageError", "add_method_options",
           "add_plot_options", "add_states_option", "check_output", "emit", "float_in", "int_at_least", "int_in",
           "make_folder_for", "method_from_args", "method_label", "one_line", "plot_path", "progress", "run_parser",
           "state_options", "warn", "window_size"]
