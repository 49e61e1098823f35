"""The state methods' names, one table for every command and study.

A *label* names a method and the options it fixes: every ``make_method`` name under its own
name, LeapQuant at 6 and 4 bits as ``leapquant-b6`` / ``leapquant-b4``, and the two partial
fixes on top of ``int8-w`` (``int8-w+ct``: Compensator Tokens alone, ``int8-w+smooth``:
smoothing alone). ``replay --method``, ``generate``/``score --state``, ``eval``/``recall``/
``demo --states``, ``study errors --methods`` and ``memory --methods`` all take these labels.

Options (``STATE_OPTIONS``) apply where they mean something: ``window`` and ``impl`` to every
windowed method (``leapquant-alloc-*`` and ``leapquant-dual-*`` too), ``bits``, ``rank``,
``compensators`` and ``smoothing`` to LeapQuant alone, ``calibration`` to ``damp`` alone,
``stepquant_calibration`` (the file of ``leapquant calibrate-stepquant``, given to ``make_method`` as
``calibration``) to the ``LIFETIME_METHODS`` alone. An option that contradicts what a label fixes
(``leapquant-b6`` with ``bits=4``) is an error; a method's own name fixes nothing
(``leapquant --bits 4`` is LeapQuant at 4 bits).

``MAX_WINDOW`` bounds the window ``p``. The reference takes any window, but a window's buffer
of ``p`` key and value records (fp16) outgrows the fp32 state it stands in for by ``p = 128``
at 128 x 128 heads, and each step reads every record held; 256 leaves room to study windows past
that point. The Pallas kernels take powers of two from 2 to 32 (``pallas_kernels.support``).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from .methods import LIFETIME_METHODS, METHOD_NAMES, WINDOWED_LIFETIME_METHODS, WINDOWED_METHODS, make_method

MAX_WINDOW = 256

# The lineup of the studies (the default of `study errors`), label -> (make_method name, fixed options).
STUDY_METHODS: dict[str, tuple[str, dict]] = {
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {}),
    "fp8": ("fp8", {}),
    "int8": ("int8", {}),
    "bf16-w": ("bf16-w", {}),
    "int8-w": ("int8-w", {}),
    "int8-w+ct": ("leapquant", dict(bits=8, smoothing=False)),
    "int8-w+smooth": ("leapquant", dict(bits=8, compensators=False)),
    "leapquant": ("leapquant", dict(bits=8)),
    "leapquant-b6": ("leapquant", dict(bits=6)),
    "leapquant-b4": ("leapquant", dict(bits=4)),
}

# Every label: the lineup, then each other method under its own name (the rival formats: block
# floats, adapted KV-cache methods, error feedback, stochastic rounding, damp; the lossless fp32-w).
METHOD_LABELS: dict[str, tuple[str, dict]] = {
    **STUDY_METHODS,
    **{n: (n, {}) for n in METHOD_NAMES if n not in STUDY_METHODS},
}

WINDOW_OPTIONS = ("window", "impl")
LEAPQUANT_OPTIONS = ("bits", "rank", "compensators", "smoothing") + WINDOW_OPTIONS
STATE_OPTIONS = LEAPQUANT_OPTIONS + ("calibration", "stepquant_calibration")


def check_window(window: Optional[int], *, flag: str = "--window") -> None:
    """Raises ``ValueError`` naming ``flag`` for a window outside ``[1, MAX_WINDOW]``."""
    if window is not None and not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"{flag} {window}: a window holds 1 to {MAX_WINDOW} records (MAX_WINDOW; the Pallas "
                         "kernels take powers of two from 2 to 32)")


def applicable_options(label: str) -> tuple[str, ...]:
    """The ``STATE_OPTIONS`` that mean something for ``label``'s method."""
    name = METHOD_LABELS[label][0]
    if name == "damp":
        return ("calibration",)
    if name in LIFETIME_METHODS:
        return ("stepquant_calibration",) + (WINDOW_OPTIONS if name in WINDOWED_LIFETIME_METHODS else ())
    if name not in WINDOWED_METHODS:
        return ()
    return LEAPQUANT_OPTIONS if name == "leapquant" else WINDOW_OPTIONS


def method_for_label(label: str, options: Optional[Mapping] = None, *, flag: str = "--state",
                     only_applicable: bool = False):
    """The state method of ``label`` with ``options`` (``STATE_OPTIONS``; ``None`` values keep
    the defaults). With ``only_applicable`` an option the method does not take is left out (a
    list of methods shares its options); without, ``make_method`` refuses it. Raises
    ``ValueError`` naming ``flag`` for an unknown label, an option that contradicts the label or
    a window beyond ``MAX_WINDOW``."""
    if label not in METHOD_LABELS:
        raise ValueError(f"{flag}: unknown method {label!r}; known: {', '.join(METHOD_LABELS)}")
    options = {k: v for k, v in (options or {}).items() if v is not None}
    unknown = set(options) - set(STATE_OPTIONS)
    if unknown:
        raise ValueError(f"unknown state option(s) {sorted(unknown)}; known: {list(STATE_OPTIONS)}")
    check_window(options.get("window"))
    name, fixed = METHOD_LABELS[label]
    if name == "damp" and "calibration" not in options:
        raise ValueError("method damp needs its calibration file: --damp-calibration FILE "
                         "(made by `leapquant calibrate-damp`)")
    if name in LIFETIME_METHODS and "stepquant_calibration" not in options:
        raise ValueError(f"method {name} needs its calibration file: --stepquant-calibration FILE "
                         "(made by `leapquant calibrate-stepquant`)")
    if not only_applicable and name not in LIFETIME_METHODS and "stepquant_calibration" in options:
        raise ValueError(f"--stepquant-calibration is the calibration of methods {', '.join(LIFETIME_METHODS)}, "
                         f"not of {name}")
    if not only_applicable and name in LIFETIME_METHODS and "calibration" in options:
        raise ValueError(f"--damp-calibration is the calibration of method damp; {name} takes "
                         "--stepquant-calibration")
    applies = applicable_options(label)
    opts = dict(fixed)
    for key, value in options.items():
        if only_applicable and key not in applies:
            continue
        if key == "stepquant_calibration":   # make_method's calibration of the lifetime methods
            opts["calibration"] = value
            continue
        # A label other than its method's own name fixes its options (leapquant-b6: bits=6); the
        # method's own name takes any (leapquant --bits 4).
        if key in fixed and fixed[key] != value and label != name:
            raise ValueError(f"{flag} {label} fixes {key}={fixed[key]!r}, which contradicts "
                             f"--{key.replace('_', '-')} {value!r}")
        opts[key] = value
    return make_method(name, **opts)


def methods_for_labels(labels: Sequence[str], options: Optional[Mapping] = None, *, flag: str = "--states") -> dict:
    """``{label: method}`` for a list of labels sharing ``options`` (each method takes those that
    apply to it), fp32 first (added when missing: it is the reference). Raises ``ValueError``
    naming ``flag`` for an empty, unknown or repeated label, and for a damp calibration given
    without ``damp`` in the list."""
    labels = [str(x).strip() for x in labels]
    if not labels or any(not x for x in labels):
        raise ValueError(f"{flag} must be a comma-separated list of methods, got {','.join(labels)!r}")
    for label in labels:
        if label not in METHOD_LABELS:
            raise ValueError(f"{flag}: unknown method {label!r}; known: {', '.join(METHOD_LABELS)}")
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"{flag} names {repeated[0]!r} more than once")
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if "damp" in labels and "calibration" not in options:
        raise ValueError(f"{flag} damp needs its calibration file: --damp-calibration FILE "
                         "(made by `leapquant calibrate-damp`)")
    if "calibration" in options and "damp" not in labels:
        raise ValueError(f"--damp-calibration is the calibration of method damp, which {flag} does not name")
    lifetime = [x for x in labels if METHOD_LABELS[x][0] in LIFETIME_METHODS]
    if lifetime and "stepquant_calibration" not in options:
        raise ValueError(f"{flag} {lifetime[0]} needs its calibration file: --stepquant-calibration FILE "
                         "(made by `leapquant calibrate-stepquant`)")
    if "stepquant_calibration" in options and not lifetime:
        raise ValueError(f"--stepquant-calibration is the calibration of methods {', '.join(LIFETIME_METHODS)}, "
                         f"which {flag} does not name")
    return {label: method_for_label(label, options, flag=flag, only_applicable=True)
            for label in ["fp32"] + [x for x in labels if x != "fp32"]}


__all__ = ["LEAPQUANT_OPTIONS", "MAX_WINDOW", "METHOD_LABELS", "STATE_OPTIONS", "STUDY_METHODS", "WINDOW_OPTIONS",
           "applicable_options", "check_window", "method_for_label", "methods_for_labels"]
