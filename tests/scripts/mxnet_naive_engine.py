"""gradfuse.mxnet under MXNET_ENGINE_TYPE=NaiveEngine (run by tests/test_mxnet_naive_engine.py
under mpiexec -n 2): NaiveEngine runs every pushed operation to completion inside the push
and drops the errors of completion callbacks, so the hand-off completes the collective
before the call returns and raises its error from the call itself, on every rank."""
import os
import sys
import time

import numpy as np

assert os.environ.get("MXNET_ENGINE_TYPE") == "NaiveEngine"
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import gradfuse.mxnet as hvd  # noqa: E402
from gradfuse.mxnet.errors import CollectiveMismatchError  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
tri = n * (n + 1) / 2

# results are there when the call returns; a late rank makes the call wait
if r == n - 1:
    time.sleep(0.5)
t0 = time.perf_counter()
out = hvd.allreduce(mx.nd.ones((4,)) * (r + 1), op=hvd.Sum, name="naive.ar")
t_call = time.perf_counter() - t0
assert r == n - 1 or t_call > 0.25, f"rank {r}: NaiveEngine's call returned after {t_call:.3f} s"
np.testing.assert_array_equal(out.asnumpy(), np.full(4, tri))
g = [mx.nd.ones((3,)) * (r + 1), mx.nd.ones((2, 2)) * (r + 1)]
hvd.grouped_allreduce_(g, op=hvd.Sum, name="naive.g")
np.testing.assert_array_equal(g[1].asnumpy(), np.full((2, 2), tri))
np.testing.assert_array_equal(hvd.allreduce(mx.nd.ones((2,)), prescale_factor=0.5, op=hvd.Sum,
                                            name="naive.pre").asnumpy(), np.full(2, 0.5 * n))
np.testing.assert_array_equal(hvd.broadcast(mx.nd.ones((2,)) * (r + 1), 0, name="naive.b").asnumpy(), np.ones(2))
np.testing.assert_array_equal(hvd.allgather(mx.nd.ones((1,)) * r, name="naive.ag").asnumpy(), np.arange(n))

# an error found in the negotiation: raised by the call, on every rank
try:
    hvd.allreduce(mx.nd.ones((3 + r,)), name="naive.mismatch")
except CollectiveMismatchError as exc:
    assert "naive.mismatch" in str(exc), str(exc)
else:
    sys.exit(f"rank {r}: no error from the mismatched call")
mx.nd.waitall()          # nothing left for MXNet to rethrow
np.testing.assert_array_equal(hvd.allreduce(mx.nd.ones((3,)) * (r + 1), op=hvd.Sum, name="naive.after").asnumpy(),
                              np.full(3, tri))

# the trainer's path
net = gluon.nn.Dense(2, in_units=3, prefix="naive_dense_")
net.initialize(mx.init.Constant(0.5))
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
with autograd.record():
    loss = net(mx.nd.ones((2, 3)) * (r + 1)).sum()
loss.backward()
trainer.step(2)
w = net.weight.data().asnumpy()
ws = hvd.allgather(mx.nd.array(w[None]), name="naive.w").asnumpy()
assert all(np.array_equal(ws[0], x) for x in ws), ws
import gradfuse  # noqa: E402
print(f"rank {r}: NaiveEngine OK, gradfuse from {os.path.dirname(os.path.dirname(gradfuse.__file__))}", flush=True)
