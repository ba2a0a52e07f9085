"""Shared pieces of the hypothesis fuzz tests (kernels, one-process and multi-rank Pipeline).

Every fuzz test is deterministic: ``derandomize=True`` draws the same cases on every run
and on every rank (so the ranks of tests/mpi/test_fuzz_mpi.py draw the same names and
shapes and their collectives match), ``database=None`` keeps no state between runs, and
``max_examples`` is fixed. ``COUNTS`` records how many cases each test ran.
"""
import collections

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

COUNTS = collections.Counter()


def fuzz_settings(max_examples):
    return settings(derandomize=True, max_examples=max_examples, deadline=None, database=None,
                    print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


EDGE_SIZES = [0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 255, 256,
              257, 511, 512, 513, 1023, 1024, 1025]


def sizes(max_n=2500):
    return st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, max_n))


KINDS = ["normal", "tiny", "huge", "bits", "special", "zeros", "ints", "halfrange"]
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, -65504, 65520, 1e5, 6e-8, -6e-8,
                    1e-40, -1e-40, 1.4e-45, 3.4e38, -3.4e38, 1.0, -1.0, 0.5], dtype=np.float32)


def values(kind, n, seed, dtype=np.float32):
    """``n`` values of ``dtype`` of one kind, from a seed (hypothesis draws kind and seed)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if kind == "bits":                   # every float32 bit pattern: NaNs, infs, subnormals
        if dtype.kind == "f":
            raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
            return raw.view(dtype).copy()
        kind = "ints"
    if kind == "special":
        return rng.choice(SPECIAL, n).astype(dtype) if dtype.kind == "f" else \
            rng.choice(np.array([0, 1, -1, np.iinfo(dtype).max, np.iinfo(dtype).min], dtype), n)
    if kind == "zeros":
        return np.zeros(n, dtype) if dtype.kind != "f" else \
            np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(dtype)
    if kind == "ints" or dtype.kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    scale = {"normal": 1.0, "tiny": 1e-30, "huge": 1e30, "halfrange": 3e4}[kind]
    with np.errstate(over="ignore"):
        return (rng.standard_normal(n) * scale).astype(dtype)


def seeds():
    return st.integers(0, 2 ** 32 - 1)


# ------------------------------------------------------------------ Pipeline cases
# A case is plain metadata drawn by hypothesis (identical on every rank); ``build_case``
# turns it into arrays whose values depend on the rank too.

GOOD_DTYPES = ["float16", "float32", "float64", "int32", "int64"]
BAD_DTYPES = ["uint8", "bool", "complex64", "int16", ">f4", "uint64"]
TENSOR_KINDS = ["ok"] * 6 + ["noncontig", "readonly", "baddtype", "pylist", "none", "scalar0d"]
STRUCTS = ["list"] * 3 + ["tuple", "dict", "dict"] + ["bare_array", "set", "none", "nested"]
NAME_MODES = ["none"] * 4 + ["unique", "duplicate", "wrong_length", "bad_type", "ints"]
OUT_MODES = ["none"] * 3 + ["inplace", "inplace", "fresh", "wrong_shape", "readonly_out"]
THRESHOLDS = [None] * 3 + [0, 1, 64, 1000, 1 << 20, 4294967296, -1, 1.5, True, "64"]
AVERAGES = [True, True, False, False, np.bool_(True), 1, "yes", None]
COMPRESS = [None, None, "none", "bogus"]


@st.composite
def pipeline_cases(draw, max_tensors=10, bad=True):
    """One Pipeline call: structure, tensors, names, options and out=.

    ``bad=False`` draws only valid cases.
    """
    # at most one area of the call is allowed to be wrong, so valid and invalid cases mix
    fault = draw(st.sampled_from([None, None, None, "tensor", "struct", "names", "out",
                                  "options", "rank"])) if bad else None
    pick = (lambda area, xs, good: draw(st.sampled_from(xs if fault == area else good)))
    n = draw(st.integers(0, max_tensors))
    tensors = []
    for _ in range(n):
        kind = pick("tensor", TENSOR_KINDS, ["ok", "ok", "ok", "noncontig", "readonly", "scalar0d"])
        dtype = draw(st.sampled_from(BAD_DTYPES if kind == "baddtype" else GOOD_DTYPES))
        shape = tuple(draw(st.lists(st.one_of(st.integers(0, 4), st.sampled_from([1, 7, 33, 300])),
                                    max_size=3)))
        tensors.append({"kind": kind, "dtype": dtype, "shape": shape})
    case = {
        "tensors": tensors,
        "struct": pick("struct", STRUCTS, ["list", "tuple", "dict"]),
        "names": pick("names", NAME_MODES, ["none", "unique", "ints"]),
        "out": pick("out", OUT_MODES, ["none", "inplace", "fresh"]),
        "fusion_threshold": pick("options", THRESHOLDS, [None, 0, 1, 64, 1000, 1 << 20]),
        "direct_threshold": pick("options", [None, None, 0, 16, 100000, -5], [None, None, 0, 16, 100000]),
        "average": pick("options", AVERAGES, [True, False]),
        "compress": pick("options", COMPRESS, [None, "none"]),
        "seed": draw(st.integers(0, 2 ** 31)),
        "kind": draw(st.sampled_from(KINDS)),
        "bad_rank": draw(st.integers(0, 2)) if fault == "rank" else -1,   # < 0: none
        "bad_rank_fault": draw(st.sampled_from(["dtype", "shape", "name", "count"])),
        "async_ops": draw(st.integers(1, 3)),
    }
    if fault != "options" and any(t["dtype"].startswith("int") for t in tensors):
        case["average"] = False             # average=True needs float tensors
    return case


def _make(t, seed, rank, kind):
    dt = np.dtype(t["dtype"])
    shape = t["shape"]
    size = int(np.prod(shape)) if shape else 1
    if dt.kind in "fiu" and dt.kind != "u":
        flat = values(kind if dt.kind == "f" else "ints", size, (seed * 1000003 + rank) & 0xFFFFFFFF,
                      dt.newbyteorder("="))
        flat = flat.astype(dt)
    elif dt.kind == "u":
        flat = np.arange(size).astype(dt)
    elif dt.kind == "b":
        flat = (np.arange(size) % 2).astype(dt)
    else:
        flat = np.arange(size).astype(dt)
    a = flat.reshape(shape)
    if t["kind"] == "noncontig":
        big = np.zeros(shape + (2,), dt)
        big[..., 0] = a
        return big[..., 0]
    if t["kind"] == "readonly":
        a.setflags(write=False)
    if t["kind"] == "pylist":
        return a.tolist()
    if t["kind"] == "none":
        return None
    if t["kind"] == "scalar0d":
        return np.array(flat[0] if size else 0, dt)
    return a


def build_case(case, rank, world_size=1):
    """The (grads, out, names) of ``case`` on ``rank``, and whether the case is valid.

    Validity is computed from the rules in gradfuse/pipeline.py's docstrings and
    config.py, independently of the code under test.
    """
    seed, kind = case["seed"], case["kind"]
    tensors = [dict(t) for t in case["tensors"]]
    names = [f"t{i}" for i in range(len(tensors))]
    br = case["bad_rank"]
    fault = None
    if 0 <= br < world_size and world_size > 1 and tensors:
        fault = case["bad_rank_fault"]
        if rank == br:
            if fault == "dtype":
                tensors[0] = dict(tensors[0], kind="baddtype", dtype="int16")
            elif fault == "shape":
                tensors[0] = dict(tensors[0], kind="ok", shape=tuple(tensors[0]["shape"]) + (2,))
            elif fault == "name":
                names[0] = "renamed"
            elif fault == "count":
                tensors = tensors[1:]
                names = names[1:]
    arrays = [_make(t, seed + 7919 * i, rank, kind) for i, t in enumerate(tensors)]
    valid = True
    struct = case["struct"]
    if struct == "dict":
        grads = dict(zip(names, arrays))
    elif struct == "tuple":
        grads = tuple(arrays)
    elif struct == "list":
        grads = list(arrays)
    else:
        valid = False
        grads = {"bare_array": np.zeros(3, np.float32), "set": {1, 2},
                 "none": None, "nested": [arrays]}[struct]
    call_names = None
    if struct in ("list", "tuple"):
        mode = "unique" if fault == "name" else case["names"]
        if mode == "unique":
            call_names = list(names)
        elif mode == "ints":
            call_names = list(range(len(arrays)))
        elif mode == "duplicate":
            call_names = ["same"] * len(arrays)
            valid &= len(arrays) < 2
        elif mode == "wrong_length":
            call_names = list(names) + ["extra"]
            valid = False
        elif mode == "bad_type":
            call_names = [1.5] * len(arrays)
            valid &= len(arrays) == 0
    out_mode = case["out"] if struct in ("list", "tuple", "dict") else "none"
    out = None
    good_dtype = all(np.dtype(t["dtype"]) in [np.dtype(d) for d in GOOD_DTYPES]
                     for t in tensors if t["kind"] not in ("none",))
    for t, a in zip(tensors, arrays):
        if t["kind"] in ("baddtype", "none", "pylist") or not good_dtype:
            valid = False
        # in place needs writable C-contiguous arrays (numpy's flag: size <= 1 is contiguous)
        if out_mode == "inplace" and isinstance(a, np.ndarray) and \
                (not a.flags.c_contiguous or not a.flags.writeable):
            valid = False
    avg = case["average"]
    if not isinstance(avg, (bool, np.bool_)):
        valid = False
    elif avg and any(np.dtype(t["dtype"]).kind != "f" for t in tensors):
        valid = False
    for opt in ("fusion_threshold", "direct_threshold"):
        v = case[opt]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            valid = False
    if case["compress"] == "bogus":
        valid = False
    if valid and out_mode == "inplace":
        out = grads
    elif out_mode == "fresh" and valid:
        outs = [np.empty(np.shape(a), np.asarray(a).dtype) for a in arrays]
        out = dict(zip(names, outs)) if struct == "dict" else type(grads)(outs)
    elif out_mode in ("wrong_shape", "readonly_out") and struct in ("list", "tuple", "dict"):
        outs = [np.empty(np.shape(a) + ((2,) if out_mode == "wrong_shape" else ()),
                         np.asarray(a).dtype if a is not None else np.float32) for a in arrays]
        if out_mode == "readonly_out":
            for o in outs:
                o.setflags(write=False)
        if arrays:
            valid = False
            out = dict(zip(names, outs)) if struct == "dict" else type(grads)(outs)
    elif out_mode == "inplace":
        out = grads
    if fault is not None:
        valid = False
    return grads, out, call_names, valid, fault


def pipeline_kwargs(case):
    kw = {"average": case["average"]}
    for k in ("fusion_threshold", "direct_threshold", "compress"):
        if case[k] is not None:
            kw[k] = case[k]
    return kw
