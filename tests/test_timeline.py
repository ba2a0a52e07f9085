"""gradfuse's one timeline on one rank: GRADFUSE_TIMELINE's Chrome trace for every pipeline
path (uncompressed, fp16/bf16, the compressors' allgather and two-phase), its tracks and
nesting, the Horovod view of a compressed step, the env variables, streaming, merging,
and that nothing is built while no timeline records. Multi-rank: tests/mpi/test_timeline.py."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gradfuse
from gradfuse.step import plain as _plain, compressed as _step
from gradfuse.runtime import timeline
from timeline_checks import assert_nested, load_trace, spans, stage_counts, track_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    g = {f"w{i}": rng.standard_normal(700 + 50 * i).astype(np.float32) for i in range(6)}
    g["big"] = rng.standard_normal(5000).astype(np.float32)      # over the threshold: reduced where it lies
    return g


def _record(path, pipe, grads, steps=STEPS):
    sink = timeline.start(path, rank=0)
    try:
        for _ in range(steps):
            pipe.allreduce(grads)      # out of place: on one rank, in place reduces nothing
    finally:
        timeline.stop(sink)
    return load_trace(path)


@pytest.fixture(scope="module", autouse=True)
def _init():
    gradfuse.init()


@pytest.mark.parametrize("compress,options,stages", [
    ("none", {}, ("pack", "exchange", "unpack")),
    ("fp16", {}, ("compress", "exchange", "decompress")),
    ("bf16", {}, ("compress", "exchange", "decompress")),
    ("1bit", {"algorithm": "allgather"}, ("compress", "exchange", "decompress")),
    ("1bit", {"algorithm": "twophase"}, ("compress", "exchange", "decompress")),
    ("2bit", {}, ("compress", "exchange", "decompress")),
    ("topk", {}, ("compress", "exchange", "decompress")),
    ("randomk", {}, ("compress", "exchange", "decompress")),
])
def test_every_stage_of_every_bucket_is_on_its_own_track(tmp_path, compress, options, stages):
    """Valid Chrome trace, one track per stage, spans nested per track, one negotiation per
    step and every data stage once per bucket and step."""
    pipe = gradfuse.Pipeline(compress=compress, fusion_threshold=8192, **options)
    trace = _record(tmp_path / "tl.json", pipe, _grads())
    assert_nested(trace)
    names = track_names(trace)
    feedback = compress not in ("none", "fp16", "bf16")        # residuals: the step's verdict
    assert sorted(set(names.values())) == sorted({"negotiate", *stages} | ({"exchange"} if compress == "none" else set())
                                                 | ({"verdict"} if feedback else set()))
    counts = stage_counts(trace)
    assert counts[("negotiate", None)] == STEPS
    verdict = sorted((e for e in spans(trace) if e["cat"] == "verdict"), key=lambda e: e["ts"])
    # once a step: the pass over the inputs, then the allreduce that agrees on its bound
    assert [e["args"]["part"] for e in verdict] == ["max |x|", "agree"] * (STEPS if feedback else 0)
    for a, b in zip(verdict[::2], verdict[1::2]):
        assert a["name"] == b["name"] == "verdict" and a["ts"] + a["dur"] <= b["ts"] + 0.002
        assert a["args"]["op"] == "allreduce"
    plan = next(iter(pipe._plans.values())).plan
    packed = [b.index for b in plan.buckets if not b.direct]
    assert len(packed) >= 3
    for b in (packed if compress == "none" else [b.index for b in plan.buckets]):
        for s in stages:
            assert counts[(s, b)] == STEPS, (s, b, counts)
    for e in spans(trace):
        if names[(e["pid"], e["tid"])] in stages and compress != "none":
            assert e["args"]["algorithm"] == (options.get("algorithm") or e["args"]["algorithm"])
            assert e["name"] == f"{names[(e['pid'], e['tid'])]} b{e['args']['bucket']}"
            assert e["args"]["count"] >= 1 and e["args"]["tensors"][0] in pipe_names()


def pipe_names():
    return set(_grads())


def test_direct_tensor_reduced_where_it_lies_has_exchange_and_divide(tmp_path):
    pipe = gradfuse.Pipeline(fusion_threshold=8192)
    trace = _record(tmp_path / "tl.json", pipe, _grads())
    plan = next(iter(pipe._plans.values())).plan
    (direct,) = [b.index for b in plan.buckets if b.direct]
    counts = stage_counts(trace)
    assert counts[("exchange", direct)] == STEPS and counts[("pack", direct)] == 0
    big = [e for e in spans(trace) if e["args"].get("bucket") == direct]
    assert {e["args"]["tensors"][0] for e in big} == {"big"}


def test_horovod_view_of_a_compressed_step_has_compress_and_decompress(tmp_path):
    pipe = gradfuse.Pipeline(compress="1bit", fusion_threshold=8192)
    sink = timeline.start(tmp_path / "hvd.json", view="horovod")
    pipe.allreduce_(_grads())
    timeline.stop(sink)
    events = json.loads((tmp_path / "hvd.json").read_text())
    pid = next(e["pid"] for e in events if e.get("name") == "process_name" and e["args"].get("name") == "w0")
    assert [e["name"] for e in events if e.get("pid") == pid and e["ph"] == "B"] == [
        "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "COMPRESS", "MPI_ALLREDUCE", "DECOMPRESS"]


def test_two_sinks_share_one_record_set(tmp_path):
    """GRADFUSE_TIMELINE's sink and a Horovod window at once: each writes what it saw."""
    pipe = gradfuse.Pipeline(compress="fp16", fusion_threshold=8192)
    whole = timeline.start(tmp_path / "whole.json")
    pipe.allreduce_(_grads())
    window = timeline.start(tmp_path / "window.json", view="horovod")
    pipe.allreduce_(_grads())
    timeline.stop(window)
    pipe.allreduce_(_grads())
    timeline.stop(whole)
    assert stage_counts(load_trace(tmp_path / "whole.json"))[("negotiate", None)] == 3
    events = json.loads((tmp_path / "window.json").read_text())
    assert sum(e.get("name") == "NEGOTIATE_ALLREDUCE" for e in events) == len(_grads())   # one step, per tensor
    assert not timeline.recording() and timeline._state["records"] == []


def test_streamed_in_chunks_and_records_dropped_once_written(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "FLUSH_RECORDS", 5)
    pipe = gradfuse.Pipeline(compress="1bit", fusion_threshold=8192)
    sink = timeline.start(tmp_path / "tl.json")
    for _ in range(4):
        pipe.allreduce_(_grads())
        assert len(timeline._state["records"]) < 5 + 20       # written and dropped as it goes
    assert os.path.getsize(tmp_path / "tl.json") > 1000       # already on disk before stop
    timeline.stop(sink)
    trace = load_trace(tmp_path / "tl.json")
    assert_nested(trace)
    assert stage_counts(trace)[("negotiate", None)] == 4


def test_nothing_is_built_or_kept_while_off(monkeypatch):
    """No per-tensor cost when off: bucket names are never built, no record is kept."""
    assert not timeline.recording() and timeline.recorder() is None

    def boom(*a):
        raise AssertionError("bucket names built while no timeline records")
    monkeypatch.setattr(_step, "bucket_names", boom)
    monkeypatch.setattr(_plain, "bucket_names", boom)
    for compress in ("none", "1bit", "fp16"):
        gradfuse.Pipeline(compress=compress, fusion_threshold=8192).allreduce_(_grads())
    assert timeline._state["records"] == []


def test_rank_paths_and_merge(tmp_path):
    assert timeline.rank_path("/x/tl.json", 0, 1) == "/x/tl.json"
    assert timeline.rank_path("/x/tl.json", 3, 4) == "/x/tl.rank3.json"
    assert timeline.rank_path("/x/tl-{rank}.json", 2, 4) == "/x/tl-2.json"
    pipe = gradfuse.Pipeline(fusion_threshold=8192)
    a, b = _record(tmp_path / "a.json", pipe, _grads(), 1), _record(tmp_path / "b.json", pipe, _grads(), 1)
    timeline.merge([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "m.json")
    m = load_trace(tmp_path / "m.json")
    assert len(spans(m)) == len(spans(a)) + len(spans(b))
    # b started later: its spans come after a's on the merged clock
    assert min(e["ts"] for e in spans(m)[len(spans(a)):]) > max(e["ts"] for e in spans(m)[:len(spans(a))])


def _run(code, **env):
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_gradfuse_timeline_env_writes_the_file_at_exit(tmp_path):
    path = tmp_path / "env.json"
    r = _run("import numpy as np, gradfuse\n"
             "p = gradfuse.Pipeline(compress='1bit', fusion_threshold=4096)\n"
             "p.allreduce_({f't{i}': np.ones(900, np.float32) for i in range(4)})\n",
             GRADFUSE_TIMELINE=str(path))
    assert r.returncode == 0, r.stderr
    trace = load_trace(path)
    assert_nested(trace)
    assert {n for n in track_names(trace).values()} == {"negotiate", "verdict", "compress", "exchange", "decompress"}


def test_bad_gradfuse_timeline_fails_init_naming_it(monkeypatch, tmp_path):
    from gradfuse import config
    monkeypatch.setenv("GRADFUSE_TIMELINE", " ")
    with pytest.raises(ValueError, match="GRADFUSE_TIMELINE=' ': expected a file path"):
        config.validate()
    r = _run("import gradfuse; gradfuse.init()", GRADFUSE_TIMELINE=str(tmp_path / "no" / "such" / "tl.json"))
    assert r.returncode != 0 and "GRADFUSE_TIMELINE=" in r.stderr and "rank 0 cannot write" in r.stderr, r.stderr


def test_horovod_timeline_env_starts_rank_0s_horovod_view_at_init(tmp_path):
    pytest.importorskip("mxnet")
    path = tmp_path / "hvd.json"
    code = ("import warnings, mxnet as mx, gradfuse.mxnet as hvd\n"
            "warnings.simplefilter('error', UserWarning)\n"
            "hvd.init(); hvd.allreduce(mx.nd.ones((3,)), name='env.one').wait_to_read()\n")
    r = _run(code, HOROVOD_TIMELINE=str(path), HOROVOD_TIMELINE_MARK_CYCLES="1")
    assert r.returncode == 0, r.stderr              # no "does not read" warning any more
    events = json.loads(path.read_text())
    assert [e["name"] for e in events if e["ph"] in ("B", "i")] == [
        "CYCLE_START", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE",
        "MEMCPY_OUT_FUSION_BUFFER"]
    r = _run(code + "hvd.start_timeline(%r); hvd.shutdown()\n" % str(tmp_path / "dyn.json"),
             HOROVOD_TIMELINE="DYNAMIC")       # Horovod's "no file yet": start_timeline writes one
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "dyn.json").read_text())[0]["name"] == "process_name"


@pytest.mark.mpi
def test_gradfuse_timeline_env_on_two_ranks_writes_one_file_per_rank(tmp_path):
    """Under mpiexec: rank r writes tl.rank<r>.json, pid r; merged, both ranks' buckets."""
    from conftest import mpiexec_path
    from helpers import run_limited
    code = ("import numpy as np, gradfuse\n"
            "p = gradfuse.Pipeline(compress='1bit', fusion_threshold=4096)\n"
            "p.allreduce_({f't{i}': np.ones(900, np.float32) for i in range(4)})\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GRADFUSE_TIMELINE=str(tmp_path / "tl.json"))
    rc, out, timed_out = run_limited([mpiexec_path(), "-n", "2", sys.executable, "-c", code], timeout=120, env=env)
    assert rc == 0 and not timed_out, out
    paths = [tmp_path / f"tl.rank{r}.json" for r in range(2)]
    timeline.merge(paths, tmp_path / "all.json")
    trace = load_trace(tmp_path / "all.json")
    assert_nested(trace)
    for r in range(2):
        assert load_trace(paths[r])["otherData"]["rank"] == r
        counts = stage_counts(trace, pid=r)
        assert counts[("negotiate", None)] == 1
        assert [counts[("decompress", b)] for b in range(4)] == [1, 1, 1, 1]
