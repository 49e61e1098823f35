"""The ``leapquant`` command line: every package's commands under one parser.

``leapquant_jax.cli`` registers ``replay``, ``study`` and ``memory``; ``models.cli`` registers
``convert``, ``generate``, ``score``, ``eval``, ``recall``, ``train-data``, ``train``, ``demo``,
``calibrate-damp`` and ``calibrate-stepquant``. The shared parser, argument types and error handling are
``leapquant_jax.cli_support``'s. Run as ``leapquant ...`` or ``python -m leapquant_cli ...``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import leapquant_jax.cli
import models.cli
from leapquant_jax.cli_support import PROG, ArgumentParser, run_parser

# The packages whose `add_subcommands(subparsers)` register their commands, in --help order.
PACKAGES = (leapquant_jax.cli, models.cli)

DESCRIPTION = ("LeapQuant in JAX: recurrent states of linear-attention models (Gated DeltaNet, Kimi Delta "
               "Attention) stored in 8, 6 or 4 bits. Replay traces and run the studies (replay, study, memory); "
               "convert, run and evaluate models (convert, generate, score, eval, recall, calibrate-damp, "
               "calibrate-stepquant, demo); "
               "train small ones (train-data, train). Each command has its own --help.")


def build_parser() -> ArgumentParser:
    """The ``leapquant`` argument parser with every package's commands."""
    parser = ArgumentParser(prog=PROG, description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for package in PACKAGES:
        package.add_subcommands(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``leapquant`` console command: runs one command, returns its exit code
    (2 with one line on stderr for bad input)."""
    return run_parser(build_parser(), argv)


__all__ = ["DESCRIPTION", "PACKAGES", "build_parser", "main"]
