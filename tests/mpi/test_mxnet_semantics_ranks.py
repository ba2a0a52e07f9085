"""Horovod 0.28.1's semantics where users can see them, across ranks: float16 scaling bits,
alltoall's error classes, failures on one rank only (run under mpiexec)."""
import pickle

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet.base import MXNetError  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402
from gradfuse.errors import RemoteInputError  # noqa: E402
from ref_horovod import horovod_allreduce, horovod_reducescatter  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init(world):
    hvd.init()
    yield


@pytest.fixture(scope="module")
def horovod(world):
    """horovod.mxnet, initialised on the same MPI (mpi4py initialised it: Horovod's
    shutdown leaves it running); skipped where Horovod is not installed."""
    H = pytest.importorskip("horovod.mxnet")
    import os
    saved = os.environ.get("HOROVOD_TIMELINE")
    os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"       # Horovod's start_timeline needs it at init
    try:
        H.init()
    finally:
        if saved is None:
            os.environ.pop("HOROVOD_TIMELINE")
        else:
            os.environ["HOROVOD_TIMELINE"] = saved
    yield H
    H.shutdown()


def _fp16_inputs(world, seed, shape=(7, 9)):
    """Rank inputs: different per rank on 2 ranks (the sum order is then unique); the same
    on every rank on more (MPI's summation order is the library's, any order gives one sum)."""
    def one(r):
        rng = np.random.default_rng([seed, r if world.size <= 2 else 0])
        return rng.uniform(-100, 100, shape).astype(np.float16)
    return [one(r) for r in range(world.size)]


FACTOR = 0.3141592653589793      # not a float16 (nor float32) number: rounding shows


def _case(fn, kind, op, world, xs, factor):
    pre, post = (factor, 1.0) if kind == "prescale" else (1.0, factor)
    hop = hvd.Sum if op == "sum" else hvd.Average
    mine = xs[world.rank]
    name = f"fp16.{fn}.{kind}.{op}"
    if fn == "allreduce":
        got = hvd.allreduce(mx.nd.array(mine, dtype="float16"), op=hop, name=name,
                            prescale_factor=pre, postscale_factor=post).asnumpy()
        want = horovod_allreduce(xs, op, pre, post)
    elif fn == "reducescatter":
        got = hvd.reducescatter(mx.nd.array(mine, dtype="float16"), op=hop, name=name,
                                prescale_factor=pre, postscale_factor=post).asnumpy()
        want = horovod_reducescatter(xs, op, world.rank, pre, post)
    else:
        got = hvd.grouped_reducescatter([mx.nd.array(mine, dtype="float16"),
                                         mx.nd.array(mine[:3] * 2, dtype="float16")], op=hop, name=name,
                                        prescale_factor=pre, postscale_factor=post)[1].asnumpy()
        want = horovod_reducescatter([x[:3] * 2 for x in xs], op, world.rank, pre, post)
    return got, want


CASES = [(fn, kind) for fn in ("allreduce", "reducescatter", "grouped_reducescatter")
         for kind in ("prescale", "postscale")]


@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("fn,kind", CASES)
def test_fp16_scaling_gives_horovods_bits(world, fn, kind, op):
    """Horovod on the CPU scales float16 in float32 and rounds once: the same bits here."""
    xs = _fp16_inputs(world, 3)
    got, want = _case(fn, kind, op, world, xs, FACTOR)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("fn,kind", CASES)
def test_fp16_scaling_against_horovod(world, horovod, fn, kind, op):
    """The same calls through Horovod 0.28.1 itself give the same bits."""
    xs = _fp16_inputs(world, 4)
    got, want = _case(fn, kind, op, world, xs, FACTOR)
    H = horovod
    pre, post = (FACTOR, 1.0) if kind == "prescale" else (1.0, FACTOR)
    hop = H.Sum if op == "sum" else H.Average
    mine = xs[world.rank]
    name = f"hvd.fp16.{fn}.{kind}.{op}"
    if fn == "allreduce":
        ref = H.allreduce(mx.nd.array(mine, dtype="float16"), op=hop, name=name,
                          prescale_factor=pre, postscale_factor=post).asnumpy()
    elif fn == "reducescatter":
        ref = H.reducescatter(mx.nd.array(mine, dtype="float16"), op=hop, name=name,
                              prescale_factor=pre, postscale_factor=post).asnumpy()
    else:
        ref = H.grouped_reducescatter([mx.nd.array(mine, dtype="float16"),
                                       mx.nd.array(mine[:3] * 2, dtype="float16")], op=hop, name=name,
                                      prescale_factor=pre, postscale_factor=post)[1].asnumpy()
    np.testing.assert_array_equal(ref.view(np.uint16), want.view(np.uint16))    # the reference is Horovod's
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def _after(world, tag):
    """The next collective still matches: a Sum of known values on every rank."""
    out = hvd.allreduce(mx.nd.ones((3,)) * (world.rank + 1), op=hvd.Sum, name=f"after.{tag}")
    np.testing.assert_array_equal(out.asnumpy(), np.full(3, world.size * (world.size + 1) / 2))


def _all_raise(fn, world, bad_rank=None):
    """fn raises on every rank; returns this rank's exception."""
    with pytest.raises(Exception) as info:
        fn()
    exc = info.value
    flags = world.allgather(True)
    assert all(flags)
    if bad_rank is not None and world.rank != bad_rank:
        assert isinstance(exc, RemoteInputError) and isinstance(exc, MXNetError), repr(exc)
        assert f"rank {bad_rank}" in str(exc), str(exc)
    return exc


def test_alltoall_error_classes_match_horovods(world):
    """Horovod raises MXNetError or RuntimeError (splits that do not fit, a first dimension
    that does not divide), MXNetError or ValueError (splits not int32): both, on every rank."""
    n = world.size
    exc = _all_raise(lambda: hvd.alltoall(mx.nd.ones((n + 1,)), splits=[1] * n + [1], name="a2a.fit"), world)
    assert isinstance(exc, MXNetError) and isinstance(exc, RuntimeError) and isinstance(exc, ValueError)
    assert "splits" in str(exc)
    exc = _all_raise(lambda: hvd.alltoall(mx.nd.ones((max(n - 1, 0) + 2 * n,)), splits=mx.nd.array(
        [3] * n, dtype="int32"), name="a2a.sum"), world)
    assert isinstance(exc, MXNetError) and isinstance(exc, RuntimeError) and "sum to" in str(exc)
    if n > 1:
        exc = _all_raise(lambda: hvd.alltoall(mx.nd.ones((n + 1,)), name="a2a.div"), world)
        assert isinstance(exc, MXNetError) and isinstance(exc, RuntimeError) and "divide" in str(exc)
    exc = _all_raise(lambda: hvd.alltoall(mx.nd.ones((n,)), splits=mx.nd.ones((n,), dtype="float32"),
                                          name="a2a.dtype"), world)
    assert isinstance(exc, MXNetError) and isinstance(exc, (ValueError, TypeError)) and "splits" in str(exc)
    _after(world, "a2a")


def test_alltoall_bad_splits_on_one_rank(world):
    if world.size == 1:
        pytest.skip("needs two ranks")
    bad = world.size - 1
    n = world.size
    splits = [2] * n if world.rank == bad else [1] * n
    exc = _all_raise(lambda: hvd.alltoall(mx.nd.ones((n, 2)), splits=splits, name="a2a.one"), world, bad)
    assert isinstance(exc, MXNetError) and isinstance(exc, RuntimeError)
    if world.rank == bad:
        assert isinstance(exc, ValueError) and "sum to" in str(exc)
    _after(world, "a2a.one")


class _Unpicklable:
    def __reduce__(self):
        raise pickle.PicklingError("this object refuses to be pickled")


def _one_rank_failures(world):
    """(tag, call) pairs whose call fails on the last rank only."""
    bad = world.rank == world.size - 1
    n = world.size
    return [
        ("dtype", lambda: hvd.allreduce(mx.nd.ones((2,), dtype="uint8" if bad else "float32"), name="o.dtype")),
        ("not-an-ndarray", lambda: hvd.grouped_allreduce([mx.nd.ones((2,)), [1.0, 2.0] if bad else mx.nd.ones((2,))],
                                                         name="o.list")),
        ("prescale-type", lambda: hvd.allreduce(mx.nd.ones((2,)), prescale_factor="x" if bad else 1.0, name="o.pre")),
        ("adasum", lambda: hvd.allreduce(mx.nd.ones((2,)), op=hvd.Adasum if bad else hvd.Sum, name="o.adasum")),
        ("root", lambda: hvd.broadcast(mx.nd.ones((2,)), root_rank=n if bad else 0, name="o.root")),
        ("reducescatter-op", lambda: hvd.reducescatter(mx.nd.ones((n, 2)), op=hvd.Max if bad else hvd.Sum,
                                                       name="o.rs")),
        ("allgather-sparse", lambda: hvd.allgather(mx.nd.ones((1, 2)).tostype("row_sparse") if bad
                                                   else mx.nd.ones((1, 2)), name="o.ag")),
        ("alltoall-splits-length", lambda: hvd.alltoall(mx.nd.ones((n,)), splits=[1] * (n + 1 if bad else n),
                                                        name="o.a2a")),
        ("alltoall-splits-dtype", lambda: hvd.alltoall(mx.nd.ones((n,)), splits=[1.5] * n if bad else [1] * n,
                                                       name="o.a2a.dt")),
        ("async-dtype", lambda: hvd.allreduce_async_(mx.nd.ones((2,), dtype="uint8" if bad else "float32"),
                                                     name="o.async").wait()),
        ("allgather_object", lambda: hvd.allgather_object(_Unpicklable() if bad else 1, name="o.ago")),
        ("broadcast_object", lambda: hvd.broadcast_object(_Unpicklable() if bad else 1, root_rank=n - 1,
                                                          name="o.bo")),
    ]


def _settled(result):
    """Wait for a collective's outputs. The collectives return at once (they are handed to
    MXNet's engine, as Horovod's): on the ranks whose own check passed, the error of
    another rank's check reaches the user at ``wait_to_read()``, as with Horovod."""
    for x in (result if isinstance(result, (list, tuple)) else [result]):
        if isinstance(x, mx.nd.NDArray):
            x.wait_to_read()
    return result


@pytest.mark.parametrize("index", range(12))
def test_a_failure_on_one_rank_raises_everywhere_and_the_next_call_matches(world, index):
    """A check that fails on one rank only: that rank raises its error, every other rank
    raises too (naming it), and none is left paired with the next call."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    tag, call = _one_rank_failures(world)[index]
    bad = world.size - 1
    exc = _all_raise(lambda: _settled(call()), world, bad)
    assert isinstance(exc, (ValueError, TypeError, NotImplementedError, RuntimeError, pickle.PicklingError)), tag
    _after(world, tag)


# --- start_timeline: Horovod's view of gradfuse's one timeline, from rank 0 ------------
HOROVOD_PHASES = {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE", "NEGOTIATE_BROADCAST", "BROADCAST",
                  "MPI_BCAST", "NEGOTIATE_ALLGATHER", "ALLGATHER", "MPI_ALLGATHER", "NEGOTIATE_ALLTOALL",
                  "ALLTOALL", "MPI_ALLTOALL", "NEGOTIATE_REDUCESCATTER", "REDUCESCATTER", "MPI_REDUCESCATTER",
                  "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER", "COMPRESS", "DECOMPRESS"}


TOP_LEVEL = {"ALLREDUCE", "BROADCAST", "ALLGATHER", "ALLTOALL", "REDUCESCATTER"}


def test_start_timeline_writes_horovods_phases_from_rank_0(world):
    import json
    import os
    import tempfile
    from mxnet import autograd, gluon
    path = os.path.join(tempfile.gettempdir(), f"gradfuse_hvd_tl_{world.rank}_{os.getpid()}.json")
    n = world.size
    net = gluon.nn.Dense(3, in_units=4, prefix="tl_dense_")      # leaves Gluon's name counters alone
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    hvd.start_timeline(path, mark_cycles=True)
    hvd.grouped_allreduce([mx.nd.ones((4,)), mx.nd.ones((2, 3))], op=hvd.Sum, name="tl.g")
    hvd.broadcast(mx.nd.ones((3,)), 0, name="tl.b")
    hvd.allgather(mx.nd.ones((2,)), name="tl.ag")
    hvd.alltoall(mx.nd.ones((2 * n,)), name="tl.a2a")
    hvd.reducescatter(mx.nd.ones((2 * n,)), name="tl.rs")
    with autograd.record():
        loss = net(mx.nd.ones((2, 4))).sum()
    loss.backward()
    trainer.step(2)                                     # the Pipeline's step: negotiate, bucket reduce
    mx.nd.waitall()
    hvd.stop_timeline()
    if world.rank != 0:
        assert not os.path.exists(path)                 # Horovod: rank 0 alone writes it
        return
    with open(path) as f:
        events = json.load(f)                           # Horovod's (and Chrome's) JSON array format
    os.unlink(path)
    assert isinstance(events, list) and events[0].get("name") == "process_name"
    tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
    for t in ["tl.g.0", "tl.g.1", "tl.b", "tl.ag", "tl.a2a", "tl.rs"]:
        assert t in tracks.values(), tracks
    named = [e["name"] for e in events if e["ph"] == "B"]
    assert set(named) <= HOROVOD_PHASES, set(named) - HOROVOD_PHASES
    for phase in ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE", "MPI_BCAST", "MPI_ALLGATHER",
                  "MPI_ALLTOALL", "MPI_REDUCESCATTER", "NEGOTIATE_REDUCESCATTER"]:
        assert phase in named, phase
    # B/E pairs nest per tensor, times never go back
    stacks, last = {}, {}
    for e in events:
        if e["ph"] in "BE":
            st = stacks.setdefault(e["pid"], [])
            assert e["ts"] >= last.get(e["pid"], 0.0)
            last[e["pid"]] = e["ts"]
            if e["ph"] == "B":
                # an activity runs inside its collective's top-level span, as in Horovod
                assert (not e["name"].startswith(("MPI_", "MEMCPY_", "COMPRESS", "DECOMPRESS"))
                        or (st and st[-1] in TOP_LEVEL)), (e, st)
                st.append(e["name"])
            else:
                assert st, e
                st.pop()
    assert all(not st for st in stacks.values())
    # per tensor: NEGOTIATE_<OP>, then <OP> holding MPI_<OP>, as in Horovod
    # (the fusion-buffer copies appear where gradfuse/step/run.py records its pack/unpack stages)
    g0 = [e.get("name") for e in events if e.get("pid") == next(p for p, t in tracks.items() if t == "tl.g.0")]
    assert g0 in (["process_name", "process_sort_index", "NEGOTIATE_ALLREDUCE", None, "ALLREDUCE",
                   "MPI_ALLREDUCE", None, None],
                  ["process_name", "process_sort_index", "NEGOTIATE_ALLREDUCE", None, "ALLREDUCE",
                   "MEMCPY_IN_FUSION_BUFFER", None, "MPI_ALLREDUCE", None, "MEMCPY_OUT_FUSION_BUFFER", None, None]), g0
    # the trainer's gradients (the Pipeline's fused step): negotiated, reduced in a bucket
    grad_tracks = [p for p, t in tracks.items() if not t.startswith("tl.")]
    assert grad_tracks and all(
        any(e.get("pid") == p and e.get("name") == "MPI_ALLREDUCE" for e in events) for p in grad_tracks)
    cycles = [e for e in events if e["ph"] == "i"]
    assert cycles and all(e["name"] == "CYCLE_START" for e in cycles)


def _load_trace(path):
    """A trace file as Horovod leaves it: a JSON array, possibly still open (it streams)."""
    import json
    text = open(path).read().strip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


def _phases(events, strip=""):
    """{track name: [B names]} of a Horovod-format trace (``strip``: a track-name prefix)."""
    tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
    out = {}
    for e in events:
        if e.get("ph") == "B" and e.get("pid") in tracks:
            out.setdefault(tracks[e["pid"]].split(strip, 1)[-1] if strip else tracks[e["pid"]], []).append(e["name"])
    return out


# phases only Horovod's runtime has (its fusion-buffer set-up, output allocation, GPU waits)
HOROVOD_ONLY = {"INIT_FUSION_BUFFER", "ALLOCATE_OUTPUT", "WAIT_FOR_DATA", "WAIT_FOR_OTHER_TENSOR_DATA", "QUEUE",
                "SCHEDULE", "MEMCPY_IN_HOST_BUFFER", "MEMCPY_OUT_HOST_BUFFER"}


def test_start_timeline_phases_match_horovods_own_file(world, horovod):
    """The same collectives through Horovod 0.28.1's start_timeline and through gradfuse's:
    per tensor, the same phases in the same order (Horovod-only phases left out); rank 0
    alone writes, in both."""
    import os
    import tempfile
    import time
    H, n = horovod, world.size
    files = {}
    for lib, prefix in ((H, "hvd"), (hvd, "gf")):
        path = os.path.join(tempfile.gettempdir(), f"gradfuse_cmp_tl_{prefix}_{world.rank}_{os.getpid()}.json")
        lib.start_timeline(path)
        if lib is H:
            # Horovod turns its timeline on at a later cycle of its background thread: on 3
            # ranks the first tensor's negotiation could begin before, and its
            # NEGOTIATE_ALLREDUCE be missing from Horovod's file. One untimed collective first.
            H.allreduce(mx.nd.ones((1,)), name="cmp.warm")
            mx.nd.waitall()
            time.sleep(0.3)
        lib.allreduce(mx.nd.ones((4,)), name="cmp.ar")
        lib.broadcast(mx.nd.ones((3,)), 0, name="cmp.b")
        lib.allgather(mx.nd.ones((2,)), name="cmp.ag")
        lib.alltoall(mx.nd.ones((2 * n,)), name="cmp.a2a")
        lib.reducescatter(mx.nd.ones((2 * n,)), name="cmp.rs")
        mx.nd.waitall()
        if lib is H:
            time.sleep(0.3)                 # Horovod records on its background thread's cycles
        lib.stop_timeline()
        if lib is H:
            time.sleep(0.3)
        files[prefix] = path
    if world.rank != 0:
        for path in files.values():
            assert not os.path.exists(path)
        return
    theirs = _phases(_load_trace(files["hvd"]), strip=".")        # horovod_allreduce.cmp.ar -> cmp.ar
    ours = _phases(_load_trace(files["gf"]))
    for path in files.values():
        os.unlink(path)
    names = ["cmp.ar", "cmp.b", "cmp.ag", "cmp.a2a", "cmp.rs"]
    assert set(names) <= set(theirs), theirs
    # the fusion-buffer copies are left out on both sides: a lone small tensor is reduced in
    # place by Horovod, while gradfuse's fused path copies it through a bucket (and records
    # that once gradfuse/step/run.py records pack/unpack); their nesting is checked above
    copies = {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"}
    for t in names:
        assert [p for p in theirs[t] if p not in HOROVOD_ONLY | copies] == \
            [p for p in ours[t] if p not in copies], (t, theirs[t], ours[t])
