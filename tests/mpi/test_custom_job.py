"""A compressor whose exchange job runs two dependent collectives plugs into the step with
no special case: ``register_job`` adds the job class, the compressor names its algorithm,
and the step runs the job's three stages (serially, and with pipelined buckets).

The job here: every rank agrees on a scale (a max-allreduce of max |x|), quantizes its
values to integers of that scale (which needs the first collective's result), and the
integers are summed by a second allreduce. The reference computes the same in numpy for
all ranks at once.
"""
import functools

import numpy as np
import pytest

import gradfuse
from gradfuse.compressors import register_compressor
from gradfuse.compressors.base import Compressor
from gradfuse.step.exchange import BucketJob
from gradfuse.step.jobs import JOBS, register_job

LEVELS = 127.0


class ScaledSumJob(BucketJob):
    """Two dependent allreduces: the scale, then the quantized values in it."""

    algorithm = "test-scaled-sum"

    def compress(self):
        self.x = np.array(self.bk.gather_f32(self.src, self.n), np.float32)

    def exchange(self):
        m = np.array([float(np.abs(self.x).max()) if self.n else 0.0])
        top = np.empty_like(m)
        self.comm.allreduce_op(m, top, "max")                 # collective 1: the shared scale
        scale = np.float32(top[0] / LEVELS) if top[0] > 0 else np.float32(1.0)
        q = np.rint(self.x / scale).astype(np.float32)        # depends on collective 1
        self.comm.allreduce_inplace(q)                        # collective 2: the sum
        self.total = q * scale

    def decode(self):
        self.bk.scatter_f32(np.divide(self.total, np.float32(self.divisor), dtype=np.float32), self.dst)


class ScaledSum(Compressor):
    """A test compressor exchanged by ``ScaledSumJob`` (its plain methods are never called)."""

    name = "test-scaled-sum"
    collective = "test-scaled-sum"

    def payload_layout(self, n):
        return [(np.dtype(np.float32), n)]

    def compress(self, c, payloads, ctx):
        raise AssertionError("the job exchanges this compressor's buckets itself")

    def decompress(self, payloads, n, ctx):
        raise AssertionError("the job exchanges this compressor's buckets itself")


if ScaledSumJob.algorithm not in JOBS:
    register_job(ScaledSumJob)
    register_compressor(ScaledSum.name, ScaledSum)


def reference(all_grads, p):
    """The job's result for every rank's gradients (a list over ranks of name -> array)."""
    names = list(all_grads[0])
    flat = [np.concatenate([g[k].ravel() for k in names]) for g in all_grads]
    top = max(float(np.abs(f).max()) for f in flat)
    scale = np.float32(top / LEVELS) if top > 0 else np.float32(1.0)
    total = functools.reduce(np.add, [np.rint(f / scale).astype(np.float32) for f in flat]) * scale
    total = np.divide(total, np.float32(p), dtype=np.float32)
    out, at = {}, 0
    for k in names:
        n = all_grads[0][k].size
        out[k] = total[at:at + n].reshape(all_grads[0][k].shape)
        at += n
    return out


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("self_comm", [False, True])
def test_a_job_of_two_dependent_collectives_runs_through_the_step(world, pipelined, self_comm):
    from mpi4py import MPI
    comm = MPI.COMM_SELF if self_comm else world
    p, rank = comm.Get_size(), comm.Get_rank()
    pipe = gradfuse.Pipeline(compress="test-scaled-sum", comm=comm, fusion_threshold=1 << 30,
                             pipeline_buckets=pipelined)

    def grads(r, step):
        rng = np.random.default_rng([r, step, 5])
        return {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}

    for step in range(3):
        got = pipe.allreduce(grads(rank, step))
        want = reference([grads(r, step) for r in range(p)], p)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (k, step)
    assert pipe.stats.steps == 3 and pipe.state.step == 3
