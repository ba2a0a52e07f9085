"""Settings read from ``GRADFUSE_*`` environment variables (and three of Horovod's).

Only an unset variable means the default. Any other value must parse, or the error
names the variable and what it holds; nothing is silently replaced by a default.

A script written for Horovod keeps its settings: ``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_STALL_CHECK_TIME_SECONDS`` and ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` are read
when the ``GRADFUSE_*`` variable they stand for (``HOROVOD_NAMES``) is unset, by the same
strict rules, and a bad value is refused naming the Horovod variable. With neither set,
gradfuse keeps its own defaults (a 1 MiB fusion threshold, not Horovod's 128 MiB, which
is about 3x slower here; a 600 s stall timeout, not Horovod's "never").
"""
import math
import operator
import os
import re

_INT = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")

DEFAULT_FUSION_THRESHOLD = 1 << 20   # bytes; chosen by measurement, see docs/design.md
MAX_FUSION_THRESHOLD = 1 << 40      # bytes: far beyond any bucket, and an int64 everywhere
DEFAULT_STALL_WARNING_S = 60.0
DEFAULT_STALL_TIMEOUT_S = 600.0      # as PyTorch's NCCL watchdog; 0 turns it off
DEFAULT_PIPELINE_BUCKETS = True      # bit-identical either way; measured, see docs/benchmarks.md


# the GRADFUSE_* variable -> the Horovod 0.28.1 variable read when it is unset
HOROVOD_NAMES = {
    "GRADFUSE_FUSION_THRESHOLD": "HOROVOD_FUSION_THRESHOLD",
    "GRADFUSE_STALL_WARNING_S": "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "GRADFUSE_STALL_TIMEOUT_S": "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
}


# Horovod 0.28.1 tuning variables gradfuse does not read: gradfuse.mxnet's init() warns
# when one is set, so a script moved from Horovod does not lose a setting silently
HOROVOD_UNREAD = ("HOROVOD_CYCLE_TIME",
                  "HOROVOD_CACHE_CAPACITY", "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER",
                  "HOROVOD_AUTOTUNE", "HOROVOD_STALL_CHECK_DISABLE")


def horovod_unread():
    """The variables of ``HOROVOD_UNREAD`` that are set."""
    return [v for v in HOROVOD_UNREAD if _raw(v) is not None]


def _raw(var):
    return os.environ.get(var)


def source(var):
    """The variable a setting comes from: ``var`` when it is set, else its Horovod
    equivalent (``HOROVOD_NAMES``) when that is set, else ``var`` (unset: the default)."""
    other = HOROVOD_NAMES.get(var)
    if _raw(var) is None and other is not None and _raw(other) is not None:
        return other
    return var


def env_int(var, default, minimum=0, maximum=1 << 62):
    """An integer from ``var``, or ``default`` when the variable is unset."""
    raw = _raw(var)
    if raw is None:
        return default
    text = raw.strip()
    # ASCII digits only: int() would also take "1_000" and other scripts' digits
    if not _INT.fullmatch(text):
        raise ValueError(f"{var}={raw!r} is not a whole number "
                         f"(expected an integer in [{minimum}, {maximum}])")
    value = int(text)
    if not minimum <= value <= maximum:
        raise ValueError(f"{var}={raw!r} is out of range: expected an integer in [{minimum}, {maximum}]")
    return value


def env_seconds(var, default, maximum=7 * 24 * 3600.0):
    """A non-negative number of seconds from ``var`` (0 means off), or ``default``."""
    raw = _raw(var)
    if raw is None:
        return default
    text = raw.strip()
    # a plain decimal number: float() would also take "nan", "inf" and "1_0"
    if not _NUMBER.fullmatch(text):
        raise ValueError(f"{var}={raw!r} is not a number of seconds "
                         f"(expected e.g. 30 or 2.5 or 1e3; 0 = off)")
    value = float(text)
    if not math.isfinite(value) or value < 0 or value > maximum:
        raise ValueError(f"{var}={raw!r} is out of range: expected seconds in [0, {maximum:g}], 0 = off")
    return value


def env_bool(var, default):
    """``0`` or ``1`` from ``var`` (surrounding whitespace allowed), or ``default`` when unset."""
    raw = _raw(var)
    if raw is None:
        return default
    text = raw.strip()
    if text not in ("0", "1"):
        raise ValueError(f"{var}={raw!r}: expected 0 or 1")
    return text == "1"


def fusion_threshold(value=None, name="fusion_threshold"):
    """The fusion threshold in bytes: the argument, else GRADFUSE_FUSION_THRESHOLD, else
    HOROVOD_FUSION_THRESHOLD, else the default. ``name``: the option the argument came as
    (in the error)."""
    if value is None:
        return env_int(source("GRADFUSE_FUSION_THRESHOLD"), DEFAULT_FUSION_THRESHOLD,
                       minimum=0, maximum=MAX_FUSION_THRESHOLD)
    try:
        as_int = operator.index(value)
    except TypeError:
        as_int = None
    if isinstance(value, bool) or as_int is None or not 0 <= as_int <= MAX_FUSION_THRESHOLD:
        raise ValueError(f"{name} must be an int of bytes in [0, 2**40], got {value!r}")
    return int(as_int)


def pipeline_buckets(value=None):
    """Whether compressed buckets are pipelined (``gradfuse.step.overlap``): the argument
    (True or False), else GRADFUSE_PIPELINE_BUCKETS (0 or 1), else the default."""
    if value is None:
        return env_bool("GRADFUSE_PIPELINE_BUCKETS", DEFAULT_PIPELINE_BUCKETS)
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"pipeline_buckets must be True, False or None, got {value!r}")
    return bool(value)


def cma():
    """Whether the ranks of one host may sum through each other's memory (cross-memory
    attach, ``gradfuse.comm.cma``): GRADFUSE_CMA (0 or 1), default 1. It is used only
    where every rank of the communicator is on one host and the OS allows it."""
    return env_bool("GRADFUSE_CMA", True)


def mxnet_direct():
    """Whether gradfuse.mxnet's engine callback may compute a known array's data pointer
    from its storage's address (where MXNet's layout was checked at import,
    ``gradfuse.mxnet.fence``): GRADFUSE_MXNET_DIRECT (0 or 1), default 1; 0 reads every
    pointer through ``MXNDArrayGetData``."""
    return env_bool("GRADFUSE_MXNET_DIRECT", True)


def stall_warning_s():
    """Seconds before a waiting collective warns: GRADFUSE_STALL_WARNING_S, else
    HOROVOD_STALL_CHECK_TIME_SECONDS, else 60."""
    return env_seconds(source("GRADFUSE_STALL_WARNING_S"), DEFAULT_STALL_WARNING_S)


def stall_timeout_s():
    """Seconds before a stalled collective aborts the job (0 = never):
    GRADFUSE_STALL_TIMEOUT_S, else HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, else 600."""
    return env_seconds(source("GRADFUSE_STALL_TIMEOUT_S"), DEFAULT_STALL_TIMEOUT_S)


def exit_timeout_s():
    """How long a rank that exits waits for the others before aborting the job
    (GRADFUSE_EXIT_TIMEOUT_S, default GRADFUSE_STALL_TIMEOUT_S; 0 = no limit)."""
    return env_seconds("GRADFUSE_EXIT_TIMEOUT_S", stall_timeout_s())


def _path(var):
    """A file path from ``var`` (None when unset; an empty or blank value is refused)."""
    raw = _raw(var)
    if raw is None:
        return None
    if not raw.strip():
        raise ValueError(f"{var}={raw!r}: expected a file path (unset it to turn the timeline off)")
    return raw


def timeline_path():
    """GRADFUSE_TIMELINE: where every rank writes gradfuse's timeline (a Chrome trace;
    rank r of p > 1 writes ``<stem>.rank<r><ext>``), or None (unset: no timeline)."""
    return _path("GRADFUSE_TIMELINE")


def horovod_timeline():
    """``(path or None, mark_cycles)`` from HOROVOD_TIMELINE and HOROVOD_TIMELINE_MARK_CYCLES,
    as Horovod 0.28.1 reads them at ``init``: a path starts rank 0's Horovod-view timeline
    at once; ``DYNAMIC`` (or unset) starts none (``start_timeline`` works either way)."""
    path = _path("HOROVOD_TIMELINE")
    return (None if path == "DYNAMIC" else path), env_bool("HOROVOD_TIMELINE_MARK_CYCLES", False)


def validate():
    """Read every run-time GRADFUSE_* variable once, so a bad value fails ``init()``
    with a message naming it instead of failing later inside a collective.
    (GRADFUSE_FORCE_SCALAR is checked when ``gradfuse._core`` is imported.)"""
    fusion_threshold()
    stall_warning_s()
    stall_timeout_s()
    exit_timeout_s()
    env_bool("GRADFUSE_HOOKS", True)
    pipeline_buckets()
    cma()
    timeline_path()
    horovod_timeline()
