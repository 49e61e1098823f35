"""Decoding over several devices and processes from the command line: ``--mesh`` and the options
that join one program running as N processes (one per host) to one global mesh.

* ``add_mesh_options(parser)``: ``--mesh DATA MODEL`` (``models.sharding``: sequences over
  ``data``, heads, channels and experts over ``model``) and ``--coordinator HOST:PORT
  --num-processes N --process-id I``, given together or not at all.
* ``start(args, prog=)``: with ``--coordinator``, ``jax.distributed.initialize`` before anything
  touches a device (on the CPU with gloo collectives, so the processes' devices exchange data).
  Every process then sees every device (``jax.devices()``) and runs the same program on its own
  (``jax.local_devices()``). A process whose peers do not all join within ``--join-timeout``
  seconds ends with one line on stderr (exit code 2). Output that native libraries print on the
  standard output (the collectives' connection notices) goes to stderr, so that ``--json``
  output stays one object.
* ``mesh_from_args(args, config, batch=)``: the checked mesh (``models.sharding.check_mesh``,
  ``make_mesh``) or ``None``; a bad one is refused in one line naming ``--mesh`` and the count.
* ``is_primary()``: whether this process prints and writes the outputs (process 0; every
  process computes them, ``models.sharding.to_host``).

Each process passes the same arguments and loads the same checkpoint; a mesh over several
processes takes every device of every process, ``--mesh DATA MODEL`` with ``DATA x MODEL`` the
total, processes in order along the devices (with one host's GPUs along ``model``, tensor
parallelism stays inside a host and data parallelism spans hosts). A process that dies after
joining leaves the others waiting in a collective until JAX's heartbeat ends them.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any, Optional

import jax

from leapquant_jax.cli_support import PROG, int_at_least
from models.sharding import check_mesh, make_mesh

# Seconds a process waits for the others to join (the coordinator included) before giving up.
JOIN_TIMEOUT_S = 120
# Seconds past --join-timeout that JAX's own deadline (an abort) waits behind ours (one line, exit 2).
RUNTIME_MARGIN_S = 30


def add_mesh_options(parser: argparse.ArgumentParser) -> None:
    """``--mesh`` and the multi-process options (module docstring) on ``parser``."""
    parser.add_argument("--mesh", nargs=2, type=int_at_least(1), metavar=("DATA", "MODEL"), default=None,
                        help="decode over a DATA x MODEL device mesh: sequences over DATA, heads over MODEL")
    parser.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                        help="run as one of --num-processes processes (one per host) joined by jax.distributed; "
                             "HOST:PORT is process 0's address, the same for every process")
    parser.add_argument("--num-processes", type=int_at_least(1), default=None, help="processes in all (--coordinator)")
    parser.add_argument("--process-id", type=int_at_least(0), default=None,
                        help="this process's index, 0 .. N-1 (--coordinator); process 0 prints and writes")
    parser.add_argument("--join-timeout", type=int_at_least(1), default=JOIN_TIMEOUT_S,
                        help=f"seconds to wait for every process to join (default {JOIN_TIMEOUT_S})")


def check_distributed_args(args: Any) -> None:
    """Raises ``ValueError`` naming the option when the multi-process options are incomplete or
    inconsistent (module docstring)."""
    given = {f: getattr(args, a, None) for f, a in (("--coordinator", "coordinator"),
                                                     ("--num-processes", "num_processes"),
                                                     ("--process-id", "process_id"))}
    if all(v is None for v in given.values()):
        return
    missing = [f for f, v in given.items() if v is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} must be given with "
                         f"{' and '.join(f for f in given if f not in missing)}")
    host, sep, port = args.coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--coordinator must be HOST:PORT with a port in [1, 65535], got {args.coordinator!r}")
    if args.process_id >= args.num_processes:
        raise ValueError(f"--process-id {args.process_id} must be below --num-processes {args.num_processes}")
    if args.mesh is None:
        raise ValueError("--coordinator needs --mesh DATA MODEL: the processes decode over one mesh")


def start(args: Any, *, prog: str = PROG) -> None:
    """Joins the processes (``jax.distributed.initialize``) when ``--coordinator`` is given and
    this process has not joined yet; call it before anything touches a device. Bad options raise
    ``ValueError`` naming the option (``check_distributed_args``); peers that do not join within
    ``--join-timeout`` seconds end the process with ``<prog>: error: ...`` and exit code 2."""
    check_distributed_args(args)
    if getattr(args, "coordinator", None) is None or jax.distributed.is_initialized():
        return
    # The CPU backend exchanges data between processes only with a collectives library.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = f"process {args.process_id} of {args.num_processes}"
    print(f"{where}: joining {args.coordinator} (at most {args.join_timeout} s)", file=sys.stderr, flush=True)

    def give_up():  # JAX's runtime would abort with a C++ stack trace: say it in one line first
        print(f"{prog}: error: --coordinator {args.coordinator}: {where}: the {args.num_processes} processes did "
              f"not all join within {args.join_timeout} s (--join-timeout); start one per host, --process-id 0 .. "
              f"{args.num_processes - 1}, with the same --coordinator", file=sys.stderr, flush=True)
        os._exit(2)

    watchdog = threading.Timer(args.join_timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   initialization_timeout=args.join_timeout + RUNTIME_MARGIN_S)
    except RuntimeError as err:  # JAX already started in this process (a device was touched)
        raise ValueError(f"--coordinator {args.coordinator}: {str(err).splitlines()[0]}") from None
    finally:
        watchdog.cancel()
    _native_stdout_to_stderr()


def _native_stdout_to_stderr() -> None:
    # File descriptor 1 becomes a copy of stderr (what native code writes there: gloo's notices);
    # Python's sys.stdout keeps writing to the original standard output.
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(kept, "w", buffering=1)


def mesh_from_args(args: Any, config: Any, *, batch: Optional[int] = None):
    """The ``--mesh`` of ``args`` for ``config`` (and ``batch`` sequences, when given), or ``None``
    without ``--mesh``. Raises ``ValueError`` naming ``--mesh`` and what does not divide."""
    if getattr(args, "mesh", None) is None:
        return None
    data, model = args.mesh
    try:
        check_mesh(config, data, model, batch=batch)
        return make_mesh(data, model)
    except ValueError as err:
        raise ValueError(f"--mesh {data} {model}: {err}") from None


def is_primary() -> bool:
    """Whether this process prints and writes the outputs: process 0 (the only one, without
    ``--coordinator``)."""
    return jax.process_index() == 0


__all__ = ["JOIN_TIMEOUT_S", "RUNTIME_MARGIN_S", "add_mesh_options", "check_distributed_args", "is_primary",
           "mesh_from_args", "start"]
