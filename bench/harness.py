"""What every benchmark shares: the JAX timing loop and the run's record (environment, commit,
log file). Needs no GPU package; ``environment`` records torch, triton and fla-core where present."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import jax


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def time_loop(step, carry, min_seconds=0.25, repeats=5):
    """Median µs per call of ``carry = step(carry)`` (host clock around ``calls`` back-to-back
    calls, after two warm-up calls)."""
    for _ in range(2):
        carry = step(carry)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    carry = step(carry)
    jax.block_until_ready(carry)
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(3, int(min_seconds / once))
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            carry = step(carry)
        jax.block_until_ready(carry)
        per.append((time.perf_counter() - t0) / calls)
    del carry
    return statistics.median(per) * 1e6


def time_jax(fn, state, toks, steps, **kw):
    """Median µs per token-step of ``state, o = fn(state, toks)`` (``steps`` token-steps per call)."""
    return time_loop(lambda c: fn(c[0], toks), (state, None), **kw) / steps


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None


def environment(commit, module="bench.kernels"):
    """The run's record: date, Python, JAX, devices, ``commit``, the command line of ``module``,
    and the torch, triton, GPU and fla-core versions where installed."""
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), jax=jax.__version__,
                devices=[str(d) for d in jax.devices()], commit=commit,
                command=" ".join([os.path.basename(sys.executable), "-m", module] + sys.argv[1:]))
    try:
        import torch
        import triton
        info.update(torch=torch.__version__, triton=triton.__version__,
                    gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    except Exception as err:
        info["torch"] = f"unavailable ({err!r})"
    try:
        from importlib.metadata import version
        info["fla"] = version("fla-core")
    except Exception:
        info["fla"] = None
    return info


def results_log(out: str, prefix: str):
    """``(base, say)``: ``out/<prefix>-<UTC time>`` (the folder made) and a ``say(*x)`` that prints
    its arguments and appends them to ``base.log``, flushed at once (a run cut short keeps them)."""
    os.makedirs(out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = os.path.join(out, f"{prefix}-{stamp}")
    log = open(base + ".log", "w")

    def say(*x):
        line = " ".join(str(y) for y in x)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    return base, say
