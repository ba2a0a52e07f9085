"""Compressor state on disk: the atomic writer, the .npz format, and one validation for every state.

**Writing.** ``atomic_write(path, write)`` is the only way gradfuse writes state: ``write(f)``
fills a file object opened on a temporary name in ``path``'s folder; the file is flushed and
fsynced, renamed over ``path`` (``os.replace``: readers see the old file or the new one,
never part of one) and the folder is fsynced, so a crash during a save keeps the previous
checkpoint. The Pipeline's ``save_state`` and the MXNet trainer's side file use it.

**Format.** ``save_npz`` writes a ``state_dict()`` as numpy .npz: the arrays plus a JSON
``meta`` entry, no pickle (``load_npz`` reads it with ``allow_pickle=False``). ``pack`` /
``unpack`` do the same for several state dicts in one file (the MXNet trainer's pipelines).
A file that is not such a state (missing, empty, text, truncated, an unrelated .npz, another
format) raises ``GradfuseError`` naming the file and what is wrong with it.

**Validation.** ``check_state(sd, where)`` checks a whole state dict before any of it is
used: its format, its step counter (an int >= 0), and every array against ``ARRAYS``, the one
table of the arrays a compressor keeps (the residuals and velocity of error feedback and
DGC's momentum correction, the Adam correction's ``adam.*``, PowerSGD's ``q`` and
``residual``): 1-D, the dtype given there, finite, within its range (counters >= 0, masks 0
or 1), and of a consistent size (the residual has ``n`` elements, ``adam.m``, ``adam.mask``
and ``adam.r`` as many as ``adam.v``, the counters one). An array this table does not know is
refused too, so a new compressor's state must be added here to be saved.

**World size.** ``ARRAYS`` also says which arrays are the same on every rank (``shared``:
the Adam moments, counters and mask, which every rank updates from the averaged gradient or
the mean of the ranks' moments, and PowerSGD's Q, which is averaged over the ranks) and which
are this rank's own (residuals, velocities). ``for_world_size`` keeps the former and zeroes
the latter, for a state restored on another number of ranks.
"""
import json
import os
import secrets
import struct
import zipfile
import zlib

import numpy as np

from ..errors import GradfuseError

FORMAT = "gradfuse-state-1"


class Kind:
    """One named array's rules: dtype, range (``"finite"``, ``"nonneg"`` finite and >= 0,
    ``"flag"`` 0 or 1), ``shared`` (the same on every rank), and its size (``size``: fixed;
    ``like``: that of another array of the bucket)."""

    __slots__ = ("dtype", "range", "shared", "size", "like")

    def __init__(self, dtype, range, shared, size=None, like=None):
        self.dtype, self.range, self.shared, self.size, self.like = np.dtype(dtype), range, shared, size, like


#: Every array a compressor keeps, by name: a bucket's parts (``residual``, ``server_residual``,
#: ``velocity``) and the named arrays of ``BucketState.arrays`` (PowerSGD's own residual shares
#: the name and the rules of the bucket's). The one place that decides what a load checks and
#: what survives a change of the world size.
ARRAYS = {
    "residual": Kind(np.float32, "finite", shared=False),
    "server_residual": Kind(np.float32, "finite", shared=False),
    "velocity": Kind(np.float32, "finite", shared=False),
    "adam.m": Kind(np.float32, "finite", shared=True, like="adam.v"),
    "adam.v": Kind(np.float32, "nonneg", shared=True),
    "adam.r": Kind(np.float32, "nonneg", shared=True, like="adam.v"),
    "adam.mask": Kind(np.uint8, "flag", shared=True, like="adam.v"),
    "adam.step": Kind(np.int64, "nonneg", shared=True, size=1),
    "adam.freeze": Kind(np.int64, "nonneg", shared=True, size=1),
    "q": Kind(np.float32, "finite", shared=True),
}
_PARTS = ("residual", "server_residual", "velocity")


def atomic_write(path, write):
    """Write ``path`` through ``write(f)`` (``f`` a binary file object) so that it is either
    the old file or the whole new one, also after a crash (module docstring). A link is
    followed (the file it names is replaced); a device or pipe is written in place."""
    path = os.path.realpath(os.fspath(path))      # a link keeps pointing at the new file
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "wb") as f:               # a device or a pipe (/dev/null): written in place
            write(f)
        return
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:           # named by the file asked for, not by the temporary one
        raise type(e)(e.errno, f"gradfuse: cannot write {path!r} (a temporary file in {folder!r} first): "
                               f"{e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- the .npz format

def pack(sd, prefix=""):
    """``(meta, arrays)`` of a ``state_dict()``: its JSON-able part (the buckets by key, each
    naming its arrays) and its arrays, named ``prefix`` + ``r<i>``, ``s<i>``, ``v<i>``,
    ``a<i>/<name>``."""
    arrays = {}
    meta = {k: v for k, v in sd.items() if k != "buckets"}
    meta["buckets"] = {}
    for i, (key, b) in enumerate(sd["buckets"].items()):
        arrays[f"{prefix}r{i}"] = b["residual"]
        arrays[f"{prefix}s{i}"] = b["server_residual"]
        m = {"n": b["n"], "algorithm": b["algorithm"], "i": i}
        if b.get("velocity") is not None:
            arrays[f"{prefix}v{i}"] = b["velocity"]
            m["velocity_scale"] = float(b.get("velocity_scale", 1.0))
        if b.get("arrays"):
            m["arrays"] = sorted(b["arrays"])
            for name, a in b["arrays"].items():
                arrays[f"{prefix}a{i}/{name}"] = a
        meta["buckets"][key] = m
    return meta, arrays


def unpack(meta, z, where, prefix=""):
    """The ``state_dict()`` that ``pack`` made ``meta`` of, its arrays read from the open
    .npz ``z`` (a GradfuseError naming ``where`` when one is missing)."""
    def read(name):
        if prefix + name not in z.files:
            raise GradfuseError(f"gradfuse: {where}: array {prefix + name!r} is missing (the file is incomplete)")
        return z[prefix + name]
    if not isinstance(meta, dict) or not isinstance(meta.get("buckets"), dict):
        raise GradfuseError(f"gradfuse: {where}: its metadata has no bucket table")
    buckets = {}
    for key, b in meta["buckets"].items():
        i = b["i"]
        buckets[key] = {"n": b["n"], "algorithm": b["algorithm"], "residual": read(f"r{i}"),
                        "server_residual": read(f"s{i}")}
        if f"{prefix}v{i}" in z.files:
            buckets[key]["velocity"] = z[f"{prefix}v{i}"]
            buckets[key]["velocity_scale"] = float(b.get("velocity_scale", 1.0))
        if b.get("arrays"):
            buckets[key]["arrays"] = {name: read(f"a{i}/{name}") for name in b["arrays"]}
    return dict(meta, buckets=buckets)


def write_npz(path, meta, arrays):
    """Write ``meta`` (JSON) and ``arrays`` to ``path`` as .npz, atomically (no pickle)."""
    blob = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    atomic_write(path, lambda f: np.savez(f, meta=blob, **arrays))


def save_npz(sd, path):
    """Write a ``state_dict()`` to ``path``: numpy .npz, arrays plus JSON metadata, no pickle,
    atomically."""
    meta, arrays = pack(sd)
    write_npz(path, meta, arrays)


#: what reading a damaged .npz raises (numpy, zipfile, zlib, json): each becomes a GradfuseError naming the file
READ_ERRORS = (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError, TypeError, zlib.error, struct.error,
        UnicodeDecodeError)


def read_npz(path, what, known=()):
    """Open ``path`` (a ``what``: "state file", ...): returns ``(meta, z, where)``, ``z`` the
    open .npz (the caller closes it), ``where`` the file as the messages name it. Every way a file can fail to be one of gradfuse's
    raises GradfuseError naming the file; ``known``: ``(bytes, message)`` pairs of earlier
    formats refused by name (a file starting with those bytes)."""
    where = f"{what} {os.fspath(path)!r}"
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise GradfuseError(f"gradfuse: {where} does not exist") from None
    except OSError as e:
        raise GradfuseError(f"gradfuse: {where} cannot be read: {e}") from None
    if not head:
        raise GradfuseError(f"gradfuse: {where} is empty (a save that never finished, or not a state file)")
    for marker, message in known:
        if marker in head and not head.startswith(b"PK"):
            raise GradfuseError(f"gradfuse: {where} {message}")
    if not head.startswith(b"PK"):
        raise GradfuseError(f"gradfuse: {where} is not a gradfuse state file (not a .npz archive: it starts with "
                            f"{head[:16]!r})")
    try:
        z = np.load(path, allow_pickle=False)
    except READ_ERRORS as e:
        raise GradfuseError(f"gradfuse: {where} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if not hasattr(z, "files") or "meta" not in z.files:
        names = sorted(z.files) if hasattr(z, "files") else []
        if hasattr(z, "close"):
            z.close()
        raise GradfuseError(f"gradfuse: {where} is a .npz without gradfuse's metadata (arrays "
                            f"{names[:8]}{' ...' if len(names) > 8 else ''}): not a gradfuse state file")
    try:
        meta = json.loads(z["meta"].tobytes().decode())
    except READ_ERRORS as e:
        z.close()
        raise GradfuseError(f"gradfuse: {where}: its metadata cannot be read ({type(e).__name__}: {e}); the file "
                            f"is truncated or corrupt") from None
    if not isinstance(meta, dict):
        z.close()
        raise GradfuseError(f"gradfuse: {where}: its metadata is a {type(meta).__name__}, not a table")
    return meta, z, where


def load_npz(path):
    """The ``state_dict()`` that ``save_npz`` wrote to ``path`` (files without velocities or
    named arrays too); a GradfuseError naming the file and the problem for anything else."""
    meta, z, where = read_npz(path, "state file")
    with z:
        if meta.get("format") != FORMAT:
            raise GradfuseError(f"gradfuse: {where} has format {meta.get('format')!r}; this gradfuse reads "
                                f"{FORMAT!r}")
        try:
            return unpack(meta, z, where)
        except GradfuseError:
            raise
        except READ_ERRORS as e:
            raise GradfuseError(f"gradfuse: {where} is truncated or corrupt ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- validation

def _check_array(where, name, a, kind):
    if not isinstance(a, np.ndarray):
        raise GradfuseError(f"gradfuse: {where}: {name} is a {type(a).__name__}, not an array")
    if a.dtype != kind.dtype:
        raise GradfuseError(f"gradfuse: {where}: {name} has dtype {a.dtype}, expected {kind.dtype}")
    if a.ndim != 1:
        raise GradfuseError(f"gradfuse: {where}: {name} has shape {a.shape}, expected a 1-D array")
    if kind.size is not None and a.size != kind.size:
        raise GradfuseError(f"gradfuse: {where}: {name} has {a.size} elements, expected {kind.size}")
    if not a.size:
        return
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        bad = int(np.flatnonzero(~np.isfinite(a))[0])
        raise GradfuseError(f"gradfuse: {where}: {name} holds {a[bad]} at element {bad} "
                            f"({int((~np.isfinite(a)).sum())} non-finite values); a state must be finite")
    if kind.range == "nonneg" and (a < 0).any():
        bad = int(np.flatnonzero(a < 0)[0])
        raise GradfuseError(f"gradfuse: {where}: {name} holds {a[bad]} at element {bad}; it must be >= 0")
    if kind.range == "flag" and (a > 1).any():
        bad = int(np.flatnonzero(a > 1)[0])
        raise GradfuseError(f"gradfuse: {where}: {name} holds {a[bad]} at element {bad}; a mask is 0 or 1")


def _count(where, name, v, positive=False):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0 or (positive and v == 0):
        raise GradfuseError(f"gradfuse: {where}: {name} is {v!r}; it must be an integer >= {int(positive)}")


def _check_meta(where, value, path="meta"):
    if isinstance(value, dict):
        for k, v in value.items():
            _check_meta(where, v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_meta(where, v, f"{path}[{i}]")
    elif isinstance(value, (float, np.floating)) and not np.isfinite(value):
        raise GradfuseError(f"gradfuse: {where}: {path} is {value}; a state must be finite")
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value < 0:
        raise GradfuseError(f"gradfuse: {where}: {path} is {value}; counters must be >= 0")


def check_state(sd, where="the state_dict"):
    """Raise GradfuseError naming ``where`` and the first problem unless ``sd`` is a valid
    ``state_dict()`` (module docstring: format, step counter, every array)."""
    if not isinstance(sd, dict):
        raise GradfuseError(f"gradfuse: {where} is a {type(sd).__name__}, not a gradfuse state dict")
    if sd.get("format") != FORMAT:
        raise GradfuseError(f"gradfuse: {where} has format {sd.get('format')!r}; this gradfuse reads {FORMAT!r}")
    for field in ("compressor", "world_size", "step", "buckets"):
        if field not in sd:
            raise GradfuseError(f"gradfuse: {where} has no {field!r} entry")
    _count(where, "step", sd["step"])
    _count(where, "world_size", sd["world_size"], positive=True)
    if not isinstance(sd["buckets"], dict):
        raise GradfuseError(f"gradfuse: {where}: 'buckets' is a {type(sd['buckets']).__name__}, not a table")
    _check_meta(where, sd.get("meta") or {})
    for key, b in sd["buckets"].items():
        if not isinstance(key, str) or "/" not in key or not key.rsplit("/", 1)[1].isdigit():
            raise GradfuseError(f"gradfuse: {where}: bucket key {key!r} is not '<digest>/<index>'")
        at = f"bucket {key}"
        for part in ("n", "residual", "server_residual"):
            if part not in b:
                raise GradfuseError(f"gradfuse: {where}: {at} has no {part!r}")
        _count(where, f"{at} n", b["n"])
        for part in _PARTS:
            if b.get(part) is not None:
                _check_array(where, f"{at} {part}", b[part], ARRAYS[part])
        if b["residual"].size != b["n"]:
            raise GradfuseError(f"gradfuse: {where}: {at} residual has {b['residual'].size} elements, its n "
                                f"says {b['n']}")
        scale = b.get("velocity_scale", 1.0)
        if not isinstance(scale, (int, float, np.floating)) or not np.isfinite(scale) or scale <= 0:
            raise GradfuseError(f"gradfuse: {where}: {at} velocity_scale is {scale!r}; it must be finite and > 0")
        named = b.get("arrays") or {}
        for name, a in named.items():
            kind = ARRAYS.get(name)
            if kind is None or name in _PARTS[1:]:
                raise GradfuseError(f"gradfuse: {where}: {at} holds an array {name!r} this gradfuse does not know "
                                    f"(known: {', '.join(sorted(ARRAYS))})")
            _check_array(where, f"{at} {name}", a, kind)
            if kind.like is not None and kind.like in named and a.size != named[kind.like].size:
                raise GradfuseError(f"gradfuse: {where}: {at} {name} has {a.size} elements and {kind.like} "
                                    f"{named[kind.like].size}; they must match")


def for_world_size(entry):
    """A bucket entry for another world size: the shared arrays as they are, this rank's own
    ones dropped (they start from zero: empty residuals, no velocity); returns ``(entry,
    names of what was zeroed)``."""
    zeroed = [p for p in _PARTS if entry.get(p) is not None and entry[p].size]
    out = {"n": 0, "algorithm": entry.get("algorithm", "allgather"),
           "residual": np.zeros(0, np.float32), "server_residual": np.zeros(0, np.float32)}
    kept = {}
    for name, a in (entry.get("arrays") or {}).items():
        if ARRAYS[name].shared:
            kept[name] = a
        else:
            zeroed.append(name)
    if kept:
        out["arrays"] = kept
    return out, zeroed


def differences(saved, live):
    """``key: saved -> live`` for every entry where the two (JSON-able) tables differ."""
    norm = lambda d: json.loads(json.dumps(d, sort_keys=True, default=str))     # noqa: E731
    saved, live = norm(saved), norm(live)
    if not isinstance(saved, dict) or not isinstance(live, dict):
        return [] if saved == live else [f"{saved!r} -> {live!r}"]
    show = lambda d, k: repr(d[k]) if k in d else "unset"      # noqa: E731
    return [f"{k}: saved {show(saved, k)}, here {show(live, k)}"
            for k in sorted(set(saved) | set(live)) if saved.get(k, show) != live.get(k, show)]
