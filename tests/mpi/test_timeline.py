"""GRADFUSE_TIMELINE on every rank: each rank's file is a valid trace with its rank as pid,
every stage of every bucket on its own track, and ``merge`` puts the ranks on one clock."""
import os
import tempfile

import numpy as np
import pytest

import gradfuse
from gradfuse.runtime import timeline
from timeline_checks import assert_nested, load_trace, spans, stage_counts

STEPS = 2


@pytest.mark.parametrize("compress,options,stages", [
    ("none", {}, ("pack", "exchange", "unpack")),
    ("fp16", {}, ("compress", "exchange", "decompress")),
    ("1bit", {"algorithm": "allgather"}, ("compress", "exchange", "decompress")),
    ("1bit", {"algorithm": "twophase"}, ("compress", "exchange", "decompress")),
])
def test_every_rank_writes_every_stage_of_every_bucket(world, compress, options, stages):
    me, p = world.Get_rank(), world.Get_size()
    where = world.bcast(tempfile.mkdtemp(prefix="gradfuse_tl_") if me == 0 else None, root=0)
    path = timeline.rank_path(os.path.join(where, "tl.json"), me, p)
    pipe = gradfuse.Pipeline(compress=compress, fusion_threshold=8192, **options)
    rng = np.random.default_rng(me)
    grads = {f"w{i}": rng.standard_normal(700 + 50 * i).astype(np.float32) for i in range(6)}
    sink = timeline.start(path, rank=me)
    for _ in range(STEPS):
        pipe.allreduce_(grads)
    timeline.stop(sink)
    world.Barrier()
    if me == 0:
        paths = [timeline.rank_path(os.path.join(where, "tl.json"), r, p) for r in range(p)]
        merged = os.path.join(where, "merged.json")
        timeline.merge(paths, merged)
        trace = load_trace(merged)
        assert_nested(trace)
        buckets = [b.index for b in next(iter(pipe._plans.values())).plan.buckets]
        assert len(buckets) >= 3
        assert {e["pid"] for e in spans(trace)} == set(range(p))
        for r in range(p):
            counts = stage_counts(trace, pid=r)
            assert counts[("negotiate", None)] == STEPS
            for b in buckets:
                for s in stages:
                    assert counts[(s, b)] == STEPS, (r, s, b, counts)
        if "algorithm" in options:
            assert {e["args"].get("algorithm") for e in spans(trace) if e["cat"] == "exchange"} == \
                {options["algorithm"]}
        for f in paths + [merged]:
            os.unlink(f)
        os.rmdir(where)
    world.Barrier()
