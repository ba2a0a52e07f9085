"""Horovod 0.28.1's semantics where users can see them, in one process: float16 scaling
against the numpy statement of Horovod's rule, alltoall's error classes, the object
collectives' cloudpickle, the timeline's views, what the KVStore accepts."""
import json

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet.base import MXNetError  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402
from gradfuse import collectives  # noqa: E402
from gradfuse.runtime import timeline  # noqa: E402
from ref_horovod import horovod_allreduce, horovod_scale  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


FACTORS = [0.3141592653589793, 1 / 3, 1e-3, 7.77, 2.0 ** -20]


@pytest.mark.parametrize("factor", FACTORS)
def test_scale_is_horovods_rule_for_every_dtype(factor):
    rng = np.random.default_rng(5)
    for dt in ["float16", "float32", "float64", "int32", "int64"]:
        x = (rng.uniform(-1000, 1000, 257)).astype(dt)
        got = x.copy()
        collectives._scale(got, factor)
        want = horovod_scale(x, factor)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=dt)


def test_float16_is_scaled_in_float32_and_rounded_once():
    """The old rule (the factor rounded to float16, a float16 multiply) gives other bits."""
    x = np.random.default_rng(1).uniform(-100, 100, 4096).astype(np.float16)
    f = 0.3141592653589793
    once = (x.astype(np.float32) * np.float32(f)).astype(np.float16)
    twice = x * np.float16(f)                             # numpy 1.x: float16 loop
    assert not np.array_equal(once, twice)                # the case is not vacuous
    got = x.copy()
    collectives._scale(got, f)
    np.testing.assert_array_equal(got.view(np.uint16), once.view(np.uint16))


@pytest.mark.parametrize("op", ["Sum", "Average"])
@pytest.mark.parametrize("fn", ["allreduce", "reducescatter", "grouped_reducescatter"])
@pytest.mark.parametrize("kind", ["prescale", "postscale"])
def test_fp16_scale_factors_on_one_rank(fn, kind, op):
    """The 6 cases of issue 15 (x Sum/Average) on one rank: Horovod's bits."""
    x = np.random.default_rng(2).uniform(-100, 100, (6, 5)).astype(np.float16)
    f = 0.3141592653589793
    pre, post = (f, 1.0) if kind == "prescale" else (1.0, f)
    kw = dict(op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post, name=f"one.{fn}.{kind}.{op}")
    nd = mx.nd.array(x, dtype="float16")
    if fn == "allreduce":
        got = hvd.allreduce(nd, **kw).asnumpy()
    elif fn == "reducescatter":
        got = hvd.reducescatter(nd, **kw).asnumpy()
    else:
        got = hvd.grouped_reducescatter([nd], **kw)[0].asnumpy()
    want = horovod_allreduce([x], op.lower(), pre, post)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_alltoall_errors_are_both_classes():
    """Horovod: MXNetError or RuntimeError (splits do not fit), MXNetError or ValueError
    (splits not int32). gradfuse's are both, and still ValueError/TypeError."""
    with pytest.raises(RuntimeError) as info:
        hvd.alltoall(mx.nd.ones((2,)), splits=[3], name="a2a.fit")
    assert isinstance(info.value, MXNetError) and isinstance(info.value, ValueError)
    with pytest.raises((MXNetError, ValueError)) as info:        # Horovod's test catches these
        hvd.alltoall(mx.nd.ones((2,)), splits=mx.nd.ones((1,), dtype="float32"), name="a2a.dt")
    assert isinstance(info.value, MXNetError) and isinstance(info.value, TypeError)
    out, splits = hvd.alltoall(mx.nd.ones((2,)), splits=[2], name="a2a.ok")        # still in step
    assert splits.asnumpy().tolist() == [2]


def test_object_collectives_use_cloudpickle():
    """As Horovod's: lambdas and local classes travel (the standard pickle refuses them)."""
    pytest.importorskip("cloudpickle")
    scale = 3

    class Local:
        def __init__(self, v):
            self.v = v
    got = hvd.allgather_object(lambda x: x * scale, name="obj.fn")
    assert got[0](2) == 6
    got = hvd.allgather_object(Local(5), name="obj.cls")
    assert got[0].v == 5
    assert hvd.broadcast_object({"a": 1}, root_rank=0) == {"a": 1}


def test_the_mxnet_extra_installs_cloudpickle():
    import re
    try:
        import tomllib
    except ImportError:                      # Python < 3.11
        import tomli as tomllib
    from pathlib import Path
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extra = meta["project"]["optional-dependencies"]["mxnet"]
    assert any(re.match(r"cloudpickle\b", req) for req in extra), extra


def test_without_cloudpickle_the_error_says_what_to_install(monkeypatch):
    """Where cloudpickle is missing, the standard pickle serializes; what it refuses names
    the missing package (a silent difference from Horovod otherwise)."""
    import pickle
    monkeypatch.setattr(collectives, "_serializer", lambda: pickle)
    with pytest.raises(TypeError, match="cloudpickle.*is not installed"):
        hvd.allgather_object(lambda x: x, name="obj.nocp")
    assert hvd.allgather_object({"k": 2}, name="obj.nocp.after") == [{"k": 2}]


def test_an_object_that_cannot_be_serialized_raises_type_error():
    import threading
    with pytest.raises(TypeError, match="cannot serialize"):
        hvd.allgather_object(threading.Lock(), name="obj.lock")
    assert hvd.allgather_object(1, name="obj.after") == [1]


# --- the timeline: one record set, two views ---------------------------------------------
def _records():
    sink = timeline.start("/dev/null", view="horovod")
    with timeline.stage("negotiate", "allreduce", ["a", "b"]):
        pass
    rec = timeline.recorder()
    t = timeline.clock()
    rec("pack", "allreduce", ["a", "b"], t, t + 1e-6, bucket=0)
    rec("reduce", "allreduce", lambda: ["a", "b"], t + 1e-6, t + 2e-6, bucket=0)    # the old name of exchange
    rec("unpack", "allreduce", ["a", "b"], t + 2e-6, t + 3e-6, bucket=0)
    with timeline.Span("allreduce", "a", 0):          # a binding's call: not in Horovod's view
        pass
    records = list(timeline._state["records"][sink.begin - timeline._state["base"]:])
    timeline.stop(sink)
    return records, {"t0": sink.t0, "wall0": 0.0, "cycles": False, "rank": 0}


def test_horovod_view_names_and_nesting():
    records, state = _records()
    events = timeline.horovod_trace(records, state)
    a = [e.get("name") for e in events if e.get("pid") == 1]
    assert a == ["process_name", "process_sort_index", "NEGOTIATE_ALLREDUCE", None, "ALLREDUCE",
                 "MEMCPY_IN_FUSION_BUFFER", None, "MPI_ALLREDUCE", None, "MEMCPY_OUT_FUSION_BUFFER", None, None]
    assert [e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]] == \
        ["a", "b"]
    json.dumps(events)


def test_gradfuse_view_is_complete_events_one_track_per_stage():
    records, state = _records()
    trace = timeline.gradfuse_trace(records, state)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["allreduce", "pack b0", "exchange b0", "unpack b0", "a"]
    assert all(e["dur"] >= 0 and e["pid"] == 0 for e in spans)
    assert len({e["tid"] for e in spans}) == 5             # negotiate, pack, exchange, unpack, call
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert [tracks[e["tid"]] for e in spans] == ["negotiate", "pack", "exchange", "unpack", "call"]
    assert spans[2]["args"] == {"op": "allreduce", "tensors": ["a", "b"], "count": 2, "bucket": 0}


def test_timeline_is_off_until_started():
    assert not timeline.recording() and timeline.recorder() is None
    with timeline.stage("negotiate", "allreduce", lambda: 1 / 0):     # the names are never built
        pass
    with pytest.raises(ValueError, match="view"):
        timeline.start("/dev/null", view="nope")


def test_start_timeline_on_one_rank_writes_horovods_array(tmp_path):
    path = tmp_path / "tl.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(mx.nd.ones((3,)), name="one.tl")
    hvd.stop_timeline()
    events = json.loads(path.read_text())
    assert isinstance(events, list)
    # a lone small tensor goes through a fusion bucket: copied in, reduced, copied out
    assert [e["name"] for e in events if e["ph"] == "B"] == [
        "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]


def test_stop_timeline_waits_for_queued_collectives_but_not_forever(tmp_path, monkeypatch):
    """stop_timeline first lets the communication thread run what was called before it;
    a thread that does not get there in GRADFUSE_STALL_WARNING_S gives a StallWarning
    naming the job, and the file is still written."""
    import threading
    from gradfuse.runtime import context
    from gradfuse.runtime.control import StallWarning
    ctx = context.default_context()
    gate = threading.Event()
    blocker = ctx.engine.submit(gate.wait, "blocker")
    try:
        assert context.flush(0.05) == ["blocker"]
        monkeypatch.setenv("GRADFUSE_STALL_WARNING_S", "0.05")
        path = tmp_path / "late.json"
        hvd.start_timeline(str(path))
        with pytest.warns(StallWarning, match="blocker still running"):
            hvd.stop_timeline()
        assert json.loads(path.read_text())[0]["name"] == "process_name"
    finally:
        gate.set()
    blocker.wait()
    assert context.flush(5.0) == []


# --- the KVStore takes what MXNet hands it -----------------------------------------------
def test_kvstore_broadcast_and_pushpull_take_lists():
    kv = hvd.KVStore()
    nd, o = mx.nd.ones((3,)) * 4, mx.nd.zeros((3,))
    kv.broadcast("200", [nd], out=o)
    np.testing.assert_array_equal(o.asnumpy(), np.full(3, 4))
    vals = [mx.nd.ones((2,), ctx=mx.cpu(0)), mx.nd.ones((2,), ctx=mx.cpu(1)) * 2]
    kv.pushpull("g", vals)
    for v in vals:
        np.testing.assert_array_equal(v.asnumpy(), np.full(2, 3))
    with pytest.raises(ValueError, match="3 keys, 2 values"):
        kv.pushpull(["a", "b", "c"], vals)


def test_kvstore_is_capable_answers_module_and_trainer():
    kv = hvd.KVStore()
    assert not kv.is_capable("optimizer")            # asked directly (and by gluon.Trainer)
    _, update = mx.model._create_kvstore(kv, 1, {})  # Module's question
    assert update is True
    assert hvd.KVStore(update_on_kvstore=False).is_capable("optimizer") is False
    assert hvd.KVStore(update_on_kvstore=True).is_capable("optimizer") is True
    with pytest.raises(ValueError, match="update_on_kvstore"):
        hvd.KVStore(update_on_kvstore="yes")
    with pytest.raises(NotImplementedError, match="no optimizer"):
        kv.save_optimizer_states("/dev/null")
