"""Pipelined buckets (``gradfuse.step.overlap``) across ranks: the same bits as the
serial step for every compressor and algorithm, on several buckets; an error in one
bucket's exchange (or compression) reaches the caller on every rank, with nothing of the
step still running, and the pipeline goes on; ``nonfinite="skip"`` and "raise" as before;
the timeline keeps one nesting track per stage and thread."""
import os
import tempfile
import threading
import time

import numpy as np
import pytest

import gradfuse
from gradfuse.step.exchange import AllgatherJob
from gradfuse.step.sparse_allreduce import SparseAllreduceJob
from gradfuse.step.twophase import TwoPhaseJob
from gradfuse.errors import NonFiniteError
from gradfuse.runtime import timeline
from timeline_checks import assert_nested, load_trace, spans, track_names

SIZES = (300, 17, 1000, 1, 640, 129, 2048, 0, 77, 900)
THRESHOLD = 2048          # bytes: several buckets of a few tensors each

CASES = [
    ("none", {}),
    ("fp16", {}),
    ("fp16", {"predivide": True}),
    ("bf16", {}),
    ("1bit", {"algorithm": "allgather", "block_size": 64}),
    ("1bit", {"algorithm": "twophase", "block_size": 32}),
    ("1bit", {"algorithm": "twophase", "error_feedback": False}),
    ("2bit", {"threshold": 0.3}),
    ("2bit", {"algorithm": "twophase", "block_size": 32}),
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.05, "seed": 3}),
    ("randomk", {"ratio": 0.1, "algorithm": "allreduce"}),
    ({"t1": "fp16", "t6": "fp16", "*": "1bit"}, {}),      # 16-bit allreduces on the exchange thread too
]
SERIAL = ("none", "fp16", "bf16")      # no job (none), or 16-bit allreduces alone on one host: serial


def grads_for(rank, step, ints=False):
    rng = np.random.default_rng([rank, step, 16])
    g = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(SIZES)}
    g["h"] = rng.standard_normal(333).astype(np.float16)
    if ints:                  # summed (average=False) in a plain bucket of their own
        g["i"] = np.arange(5, dtype=np.int64) + rank
    return g


def pair(name, opts, **kw):
    a = gradfuse.Pipeline(compress=name, fusion_threshold=THRESHOLD, pipeline_buckets=True, **opts, **kw)
    b = gradfuse.Pipeline(compress=name, fusion_threshold=THRESHOLD, pipeline_buckets=False, **opts, **kw)
    return a, b


def same(x, y):
    return all(np.asarray(x[k]).tobytes() == np.asarray(y[k]).tobytes() for k in x) and set(x) == set(y)


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    if sa["step"] != sb["step"] or set(sa["buckets"]) != set(sb["buckets"]):
        return False
    return all(sa["buckets"][k][f].tobytes() == sb["buckets"][k][f].tobytes()
               for k in sa["buckets"] for f in ("residual", "server_residual"))


def n_buckets(pipe):
    return len(next(iter(pipe._plans.values())).plan.buckets)


def refused_alike(a, b, g):
    """Both pipelines refuse ``g`` with a NonFiniteError, with the same message."""
    errors = []
    for pipe in (a, b):
        with pytest.raises(NonFiniteError, match="NaN/Inf in the step's gradients") as exc:
            pipe.allreduce(g)
        errors.append(str(exc.value))
    assert errors[0] == errors[1]


def both(a, b, g):
    """Each pipeline's result of allreduce(g), or its NonFiniteError's message."""
    outs = []
    for pipe in (a, b):
        try:
            outs.append(pipe.allreduce(g))
        except NonFiniteError as exc:
            outs.append(str(exc))
    return outs


@pytest.mark.parametrize("name,opts", CASES)
def test_pipelined_steps_are_the_serial_bits(world, monkeypatch, name, opts):
    from gradfuse.step import grouped
    made = []
    plan = grouped.plan

    def spy(jobs, comm):
        made.append(sorted({j.algorithm for j in jobs}))
        return plan(jobs, comm)
    monkeypatch.setattr(grouped, "plan", spy)
    rank = world.Get_rank()
    a, b = pair(name, opts)
    for step in range(4):
        ra, rb = a.allreduce(grads_for(rank, step)), b.allreduce(grads_for(rank, step))
        assert same(ra, rb), (name, opts, step)
        assert same_state(a, b), (name, opts, step)
    assert n_buckets(a) >= 5
    assert a._cfg.overlap.runs == (0 if name in SERIAL else 4)
    # every allgather and sparse-allreduce step in exchange groups (gradfuse.step.grouped)
    grouped_algo = None if name in SERIAL or opts.get("algorithm") == "twophase" else \
        "sparse_allreduce" if opts.get("algorithm") == "allreduce" else "allgather"
    assert made == ([] if grouped_algo is None else [[grouped_algo]] * 4), made
    assert (a._cfg.overlap.runs > 0) == (name not in SERIAL)     # the exchange thread ran
    assert b._cfg.overlap is None
    assert a.stats.as_dict() == b.stats.as_dict()
    # the same on every rank
    got = world.allgather(np.concatenate([np.asarray(ra[k]).view(np.uint8).ravel() for k in sorted(ra)]).tobytes())
    assert len(set(got)) == 1


@pytest.mark.parametrize("name,opts", [("fp16", {}), ("fp16", {"predivide": True}), ("bf16", {}),
                                       ({"t1": "fp16", "t6": "bf16", "*": "none"}, {})])
def test_16bit_steps_between_hosts_are_the_serial_bits(world, monkeypatch, name, opts):
    """Between 2 hosts (here: one host's ranks, with the one-host rule turned off) a step of
    16-bit buckets runs pipelined: each bucket's words cross on the exchange thread while
    the next bucket is cast, and the communication thread adds and decodes them. The bits
    are the serial step's (MPI's user-op allreduce: one float32 add, rounded once); from
    3 ranks such a step stays serial."""
    from gradfuse.step import overlap
    monkeypatch.setattr(overlap, "SERIAL16_ON_ONE_HOST", False)
    rank = world.Get_rank()
    a, b = pair(name, opts)
    for step in range(4):
        ra, rb = a.allreduce(grads_for(rank, step)), b.allreduce(grads_for(rank, step))
        assert same(ra, rb), (name, opts, step)
    assert a._cfg.overlap.runs == (4 if world.Get_size() == 2 else 0)
    assert a.stats.as_dict() == b.stats.as_dict()
    got = world.allgather(np.concatenate([np.asarray(ra[k]).view(np.uint8).ravel() for k in sorted(ra)]).tobytes())
    assert len(set(got)) == 1
    # |x| near float16's top on one rank (the check cannot rule out an overflow, the sum
    # has none): not streamed, bucket 0 already sent, decoded after the verdict, same bits
    near = grads_for(rank, 8)
    if rank == 0:
        near["t0"][3] = np.float32(40000.0)
    ra, rb = a.allreduce(near), b.allreduce(near)
    assert same(ra, rb)
    # an inf on one rank: not streamed (decoded after the verdict), refused alike
    big = grads_for(rank, 9)
    if rank == world.Get_size() - 1:
        big["t6"][11] = np.inf
    refused_alike(a, b, big)
    ra, rb = a.allreduce(grads_for(rank, 10)), b.allreduce(grads_for(rank, 10))     # and they go on
    assert same(ra, rb)


def test_16bit_parts_bound_the_shared_buffers(world, monkeypatch):
    """Between 2 hosts a 16-bit bucket of more than ``AllreduceJob.PART_WORDS`` words (512
    here; one large tensor, or several) moves as parts of at most that many: the step's four
    shared 16-bit buffers (two cast, two receive) hold no more than that, not the largest bucket;
    the bits are the serial step's, also when the step cannot stream (a value near fp16's
    top in part 0 of a cut bucket 0, and in a later part of another) and when it is refused
    (an inf in a later part)."""
    from gradfuse.step.exchange import AllreduceJob
    from gradfuse.step import overlap
    monkeypatch.setattr(overlap, "SERIAL16_ON_ONE_HOST", False)
    monkeypatch.setattr(AllreduceJob, "PART_WORDS", 512)
    rank, p = world.Get_rank(), world.Get_size()
    sizes = (5000, 300, 17, 1200, 2048, 513, 511)

    def grads(step):
        rng = np.random.default_rng([rank, step, 17])
        g = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(sizes)}
        for i, s in enumerate((400, 500, 100)):      # one float16 bucket of 1000, cut inside h1
            g[f"h{i}"] = rng.standard_normal(s).astype(np.float16)
        return g
    a, b = pair("fp16", {})
    for step in range(3):
        ra, rb = a.allreduce(grads(step)), b.allreduce(grads(step))
        assert same(ra, rb), step
    assert a.stats.as_dict() == b.stats.as_dict()
    if p == 2:
        scratch = next(iter(a._plans.values())).wire["scratch"]
        assert sorted(scratch) == ["r16", "r16b", "u16", "u16b"]
        assert max(v.size for v in scratch.values()) <= 512
    for where in ((0, 4000), (4, 1500)):      # not streamed: decoded after the verdict
        g = grads(5)
        if rank == 0:
            g[f"t{where[0]}"][where[1]] = np.float32(40000.0)
        assert same(a.allreduce(g), b.allreduce(g)), where
    g = grads(6)
    if rank == p - 1:
        g["t3"][1100] = np.inf
    refused_alike(a, b, g)
    ra, rb = a.allreduce(grads(7)), b.allreduce(grads(7))
    assert same(ra, rb)
    assert a.stats.as_dict() == b.stats.as_dict()
    assert a._cfg.overlap.runs == (4 + 3 * 2 if p == 2 else 0)     # a step that cannot stream: 2 hand-overs


@pytest.mark.parametrize("name,opts", [("1bit", {"algorithm": "twophase"}), ("topk", {"ratio": 0.1}),
                                       ("fp16", {})])
def test_nonfinite_skip_and_raise_unchanged(world, name, opts):
    rank, size = world.Get_rank(), world.Get_size()
    for policy in ("skip", "raise"):
        a, b = pair(name, opts, nonfinite=policy, average=False)
        for step in range(3):
            g = grads_for(rank, step, ints=True)
            if step == 1 and rank == size - 1:
                g["t6"][11] = np.inf
            outs = both(a, b, g)
            if step == 1 and policy == "raise":
                assert isinstance(outs[0], str) and outs[0] == outs[1]
            else:
                assert same(*outs), (name, policy, step)
            if step == 1 and policy == "skip":
                assert np.isnan(outs[0]["t6"]).all() and np.isnan(outs[0]["h"]).all()
            assert same_state(a, b)
        assert a.stats.as_dict() == b.stats.as_dict()


class Inject:
    """Patch ``cls.<stage>`` to raise on bucket ``bad`` at the ``when``-th call of its
    stage (every rank alike), recording when each call of it ended."""

    def __init__(self, monkeypatch, cls, stage, bad, slow=0.0, method=None):
        self.calls, self.ended, self.armed = [], [], False
        method = method or stage
        orig = getattr(cls, method)
        self.thread = None

        def patched(job):
            self.calls.append(job.bucket.index)
            if self.armed and job.bucket.index == 0 and slow:
                time.sleep(slow)           # the next buckets' compressions run meanwhile
            try:
                if self.armed and job.bucket.index == bad:
                    raise RuntimeError(f"injected {stage} error in bucket {bad}")
                return orig(job)
            finally:
                self.ended.append(time.monotonic())
                self.thread = threading.get_ident()
        monkeypatch.setattr(cls, method, patched)


@pytest.mark.parametrize("name,opts,cls", [
    ("1bit", {"algorithm": "allgather"}, AllgatherJob),
    ("1bit", {"algorithm": "twophase"}, TwoPhaseJob),
    ("randomk", {"ratio": 0.1, "algorithm": "allreduce"}, SparseAllreduceJob),
])
@pytest.mark.parametrize("stage", ["exchange", "compress"])
def test_an_error_in_one_bucket_reaches_every_rank(world, monkeypatch, name, opts, cls, stage):
    from gradfuse.step import grouped
    monkeypatch.setattr(grouped, "LAST_GROUP", 40)      # groups of a few buckets: the error's
    monkeypatch.setattr(grouped, "MAX_GROUP", 90)       # group has others after it
    rank = world.Get_rank()
    a, b = pair(name, opts)
    a.allreduce(grads_for(rank, 0))
    b.allreduce(grads_for(rank, 0))
    # allgather and sparse-allreduce buckets go in exchange groups (gradfuse.step.grouped),
    # whose collectives are the group's: the bucket's own part of its exchange is
    # received() (the allgather's bookkeeping) or serve() (the sum of this rank's chunks
    # between the alltoall and the allgather)
    method = {AllgatherJob: "received", SparseAllreduceJob: "serve"}.get(cls, stage) if stage == "exchange" \
        else stage
    inj = Inject(monkeypatch, cls, stage, bad=2, slow=0.2 if stage == "exchange" else 0.0, method=method)
    inj.armed = True
    before = a.state_dict()["step"]
    with pytest.raises(RuntimeError, match=f"injected {stage} error in bucket 2"):
        a.allreduce(grads_for(rank, 1))
    returned = time.monotonic()
    n_ex = len(inj.calls)
    assert inj.calls[:3] == [0, 1, 2], inj.calls
    if stage == "exchange":
        # the buckets after the failed one were dropped, not exchanged, and nothing of
        # the step ran after the error reached the caller
        assert n_ex == 3, inj.calls
    assert max(inj.ended) <= returned
    time.sleep(0.05)
    assert len(inj.calls) == n_ex                      # nothing ran later either
    assert a.state_dict()["step"] == before            # the step did not happen
    inj.armed = False
    # the pipeline goes on: the next steps pair up on every rank and match a serial
    # pipeline started from the same state (a failed step may have compressed buckets
    # ahead of the failing one, and the compression updates residuals)
    b.load_state_dict(a.state_dict())
    for step in (2, 3):
        ra, rb = a.allreduce(grads_for(rank, step)), b.allreduce(grads_for(rank, step))
        assert same(ra, rb), (name, stage, step)
    got = world.allgather(ra["t0"].tobytes())
    assert len(set(got)) == 1


@pytest.mark.parametrize("algorithm", ["twophase", "allgather"])
def test_timeline_tracks_nest_with_the_exchange_thread(world, algorithm):
    """Two-phase buckets exchange on the exchange thread, a track of its own; a step of
    allgathers alone posts them from the communication thread, whose exchange track holds
    every bucket's (the bookkeeping once its allgather completed)."""
    me, p = world.Get_rank(), world.Get_size()
    where = world.bcast(tempfile.mkdtemp(prefix="gradfuse_pipe_tl_") if me == 0 else None, root=0)
    path = timeline.rank_path(os.path.join(where, "tl.json"), me, p)
    pipe = gradfuse.Pipeline(compress="1bit", fusion_threshold=THRESHOLD, pipeline_buckets=True, average=False,
                             algorithm=algorithm)
    sink = timeline.start(path, rank=me)
    for step in range(2):
        pipe.allreduce(grads_for(me, step, ints=True))
    timeline.stop(sink)
    trace = load_trace(path)
    assert_nested(trace)
    names = track_names(trace)
    by_stage = {}
    for e in spans(trace):
        by_stage.setdefault(names[(e["pid"], e["tid"])], set()).add(e["args"].get("bucket"))
    buckets = set(range(n_buckets(pipe)))
    # compressed buckets: compress on the communication thread, exchange on the exchange
    # thread (two-phase); the int64 bucket's exchange (a plain allreduce) on the
    # communication thread, a track of its own ("exchange (2)"); posted allgathers: one track
    assert by_stage["compress"] | by_stage["unpack"] == buckets
    exchange = set().union(*(v for k, v in by_stage.items() if k.startswith("exchange")))
    assert exchange == buckets
    assert len([k for k in by_stage if k.startswith("exchange")]) == (2 if algorithm == "twophase" else 1)
    assert len(by_stage["unpack"]) == 1 and len(by_stage["compress"]) == len(buckets) - 1


def test_serial_below_thread_multiple(world, monkeypatch):
    from gradfuse.step import overlap
    monkeypatch.setattr(overlap, "_thread_multiple", [False])      # as under MPI_THREAD_SERIALIZED
    rank = world.Get_rank()
    a, b = pair("1bit", {})
    for step in range(2):
        assert same(a.allreduce(grads_for(rank, step)), b.allreduce(grads_for(rank, step)))
    assert a._cfg.overlap.runs == 0


@pytest.mark.parametrize("name,opts,caps", [
    ("randomk", {"ratio": 0.05, "seed": 3}, (40, 90)),
    ("randomk", {"ratio": 0.1, "algorithm": "allreduce", "sparsity_warmup": 3}, (40, 90)),    # layouts change
    ({"t2": {"name": "randomk", "algorithm": "allreduce"}, "t5": "1bit", "t8": "fp16",
      "*": {"name": "randomk", "ratio": 0.2}}, {}, (400, 900)),     # both algorithms, other jobs after
    ("randomk", {"ratio": 0.05, "error_feedback": False}, (40, 90)),
])
def test_randomk_exchange_groups_are_the_serial_bits(world, monkeypatch, name, opts, caps):
    """random-k's buckets exchange in groups on the communication thread
    (gradfuse.step.grouped); with groups of a few buckets each (the caps made small
    here), the results, residuals and counters are the serial step's (one collective per
    bucket), on every rank, and a non-finite step is refused or skipped alike."""
    from gradfuse.step import grouped
    monkeypatch.setattr(grouped, "LAST_GROUP", caps[0])
    monkeypatch.setattr(grouped, "MAX_GROUP", caps[1])
    made = []
    plan = grouped.plan

    def spy(jobs, comm):
        groups = plan(jobs, comm)
        made.append([[j.bucket.index for j in g.jobs] for g in groups])
        return groups
    monkeypatch.setattr(grouped, "plan", spy)
    rank, size = world.Get_rank(), world.Get_size()
    for policy in ("raise", "skip"):
        a, b = pair(name, opts, nonfinite=policy)
        for step in range(5):
            g = grads_for(rank, step)
            if step == 3 and rank == size - 1:
                g["t6"][11] = np.nan
            outs = both(a, b, g)
            if step == 3 and policy == "raise":
                assert isinstance(outs[0], str) and outs[0] == outs[1], outs
                assert f"rank(s) {size - 1}" in outs[0]
            else:
                assert same(*outs), (name, opts, policy, step)
            assert same_state(a, b), (name, opts, policy, step)
            got = world.allgather(a.state_dict()["step"])
            assert len(set(got)) == 1
        assert a.stats.as_dict() == b.stats.as_dict()
        assert a._cfg.overlap.runs >= 4
    # groups of several buckets, several groups, every randomk bucket in exactly one
    assert made and all(len(m) >= 3 for m in made), made
    assert any(len(grp) >= 2 for m in made for grp in m), made
    for m in made:
        flat = [i for grp in m for i in grp]
        assert len(flat) == len(set(flat))


def test_randomk_exchange_groups_timeline(world, monkeypatch):
    """On the grouped path every random-k bucket still has one compress, one exchange (its
    group's span) and one decompress span per step, on tracks where spans nest."""
    from gradfuse.step import grouped
    monkeypatch.setattr(grouped, "LAST_GROUP", 40)
    monkeypatch.setattr(grouped, "MAX_GROUP", 90)
    me, p = world.Get_rank(), world.Get_size()
    where = world.bcast(tempfile.mkdtemp(prefix="gradfuse_groups_tl_") if me == 0 else None, root=0)
    path = timeline.rank_path(os.path.join(where, "tl.json"), me, p)
    pipe = gradfuse.Pipeline(compress="randomk", ratio=0.05, fusion_threshold=THRESHOLD, pipeline_buckets=True)
    sink = timeline.start(path, rank=me)
    for step in range(2):
        pipe.allreduce(grads_for(me, step))
    timeline.stop(sink)
    trace = load_trace(path)
    assert_nested(trace)
    names = track_names(trace)
    per = {}
    for e in spans(trace):
        stage = names[(e["pid"], e["tid"])].split(" ")[0]
        if stage in ("compress", "exchange", "decompress"):
            per.setdefault(stage, []).append(e["args"]["bucket"])
    groups = [e["args"]["group"] for e in spans(trace) if names[(e["pid"], e["tid"])].startswith("exchange")
              and "group" in e["args"]]
    assert groups and max(groups) >= 2
    jobs = sorted(set(per["compress"]))
    for stage in ("compress", "exchange", "decompress"):
        assert sorted(per[stage]) == sorted(jobs * 2), (stage, per[stage])
    os.unlink(path)
    world.Barrier()
    if me == 0:
        os.rmdir(where)


SETTLED = [
    ("1bit", {"algorithm": "allgather", "block_size": 64}),
    ("2bit", {"block_size": 32}),
    ("2bit", {"threshold": 0.3}),
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.05, "seed": 3}),
    ("randomk", {"ratio": 0.1, "algorithm": "allreduce"}),
]


@pytest.mark.parametrize("name,opts", SETTLED)
def test_settled_steps_decode_as_their_groups_arrive(world, monkeypatch, name, opts):
    """A pipelined step whose inputs are finite and whose bound rules out an overflow
    (``verdict.settled``) decodes each bucket once its exchange group has arrived, while later
    groups are still in flight; the early groups are compressed before the verdict into
    pinned (double-buffered) residuals. The same bits and residuals as the serial step, in
    place and not, and every bucket decoded once a step."""
    from gradfuse.step import grouped, run as step_mod
    monkeypatch.setattr(grouped, "LAST_GROUP", 40)
    monkeypatch.setattr(grouped, "MAX_GROUP", 90)
    log = []
    ended, decode = grouped._Posted._ended, step_mod.decode

    def spy_ended(self, group):
        was = group.state
        ended(self, group)
        if was == "allgather":
            log.append(("arrived", tuple(j.bucket.index for j in group.jobs)))

    def spy_decode(job):
        log.append(("decode", job.bucket.index))
        return decode(job)
    monkeypatch.setattr(grouped._Posted, "_ended", spy_ended)
    monkeypatch.setattr(step_mod, "decode", spy_decode)
    rank = world.Get_rank()
    a, b = pair(name, opts)
    for step in range(4):
        log.clear()
        ga, gb = grads_for(rank, step), grads_for(rank, step)
        if step % 2:
            a.allreduce_(ga)
            seen = list(log)
            b.allreduce_(gb)
        else:
            ga = a.allreduce(ga)
            seen = list(log)
            gb = b.allreduce(gb)
        assert same(ga, gb), (name, opts, step)
        assert same_state(a, b), (name, opts, step)
        events = seen
        arrived = [e for e in events if e[0] == "arrived"]
        last = max(i for i, e in enumerate(events) if e[0] == "arrived")
        decoded = [e[1] for e in events if e[0] == "decode"]
        if step:              # step 0 learns the residual bounds (zero residuals: also settled)
            assert len(arrived) >= 3, events
            assert any(e[0] == "decode" for e in events[:last]), events   # before the last group arrived
        assert sorted(decoded) == sorted(i for e in arrived for i in e[1]), events
    states = list(a.state.buckets.values())
    pinned = [st for st in states if st.pinned]
    assert pinned and len(pinned) < len(states)          # early groups: some buckets, never all
    assert all(st.nxt is not st.cur for st in pinned) and all(st.nxt is st.cur for st in states if not st.pinned)
    assert a.stats.as_dict() == b.stats.as_dict()


@pytest.mark.parametrize("name,opts", SETTLED[:1] + SETTLED[3:5])
def test_a_refused_settled_candidate_writes_nothing(world, monkeypatch, name, opts):
    """NaN on one rank in a pipelined in-place step of a compressor that could settle: the
    early groups were already compressed and posted, yet nothing is decoded: every rank
    raises, every tensor is unchanged, and the residuals are those before the step."""
    from gradfuse.step import grouped
    monkeypatch.setattr(grouped, "LAST_GROUP", 40)
    monkeypatch.setattr(grouped, "MAX_GROUP", 90)
    rank, size = world.Get_rank(), world.Get_size()
    pipe = gradfuse.Pipeline(compress=name, fusion_threshold=THRESHOLD, pipeline_buckets=True, **opts)
    for step in range(2):
        pipe.allreduce_(grads_for(rank, step))
    before = pipe.state_dict()
    g = grads_for(rank, 2)
    if rank == size - 1:
        g["t8"][5] = np.nan
    kept = {k: np.array(v, copy=True) for k, v in g.items()}
    with pytest.raises(NonFiniteError, match="no result was written and the residuals are unchanged"):
        pipe.allreduce_(g)
    for k in g:
        assert np.asarray(g[k]).tobytes() == kept[k].tobytes(), k
    after = pipe.state_dict()
    assert all(after["buckets"][k]["residual"].tobytes() == v["residual"].tobytes()
               for k, v in before["buckets"].items())
    out = pipe.allreduce(grads_for(rank, 3))                 # and it goes on
    assert all(np.isfinite(v).all() for v in out.values())


@pytest.mark.parametrize("name,opts", SETTLED + [("1bit", {"algorithm": "twophase"})])
def test_residual_bounds_hold(world, name, opts):
    """Each residual's bound (``BucketState.bound``, grown by ``Compressor.settle``) is at
    least its largest |e| after every step; a restored state's bound is its exact largest
    |e|; a residual without a bound (two-phase, server residual) says inf."""
    rank = world.Get_rank()
    pipe = gradfuse.Pipeline(compress=name, fusion_threshold=THRESHOLD, **opts)
    for step in range(6):
        g = grads_for(rank, step)
        g["t2"] *= 10.0 ** (step - 2)                         # magnitudes that move
        pipe.allreduce_(g)
        for st in pipe.state.buckets.values():
            if st.server_cur.size:
                assert st.bound == float("inf")
            elif st.cur.size:
                assert np.abs(st.cur).max() <= st.bound < float("inf"), (name, step)
    sd = pipe.state_dict()
    fresh = gradfuse.Pipeline(compress=name, fusion_threshold=THRESHOLD, **opts)
    fresh.load_state_dict(sd)
    fresh.allreduce_(grads_for(rank, 6))          # claims the restored residuals
    for st in fresh.state.buckets.values():       # a restored bound, grown by a step, still holds
        if st.cur.size and not st.server_cur.size:
            assert np.abs(st.cur).max() <= st.bound < float("inf"), (name, "restored")
    again = gradfuse.Pipeline(compress=name, fusion_threshold=THRESHOLD, **opts)
    again.load_state_dict(sd)
    from gradfuse.compressors.state import BucketState
    for key, saved in again.state.pending.items():
        st = BucketState(saved["n"], saved["server_residual"].size, None,
                         next(iter(pipe._plans.values())).bk, single=True)
        st.upload(saved)
        assert st.bound == (float(np.abs(saved["residual"]).max()) if saved["residual"].size else 0.0)
