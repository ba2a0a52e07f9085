"""The end of an MXNet job on gradfuse.mxnet: what is still pending when the script ends.

    mpiexec -n N python tests/scripts/end_of_job.py MODE [MARKER]

MODE: pending      every rank ends its script with an allreduce still pending in MXNet's
                   engine (its input comes from slow MXNet operations): it must complete
                   before the job ends, with the right sum
      module       Module.fit with DistributedOptimizer (as Horovod's ResNet-50 example in
                   its Module mode): the last batch's update is pending when fit returns;
                   every rank must end with the same parameters
      late         after the exit protocol, rank 0 alone starts an allreduce (an atexit hook
                   registered before init): refused at once, never waited for
      peer_waits   rank 0 ends its script with one more allreduce pending than the others:
                   it must fail within seconds, naming the rank that has finished

An atexit hook registered before ``hvd.init()`` runs after gradfuse's exit protocol and
before MXNet's shutdown: it reads the results there.
MARKER: any other argument is ignored; tests pass one to find leftover processes.
"""
import atexit
import sys
import time

import mxnet as mx
import numpy as np

import gradfuse.mxnet as hvd
import gradfuse.runtime.context

MODE = sys.argv[1]
state = {}


def after_exit_protocol():
    if MODE == "pending":
        # what the communication thread still held when the exit protocol ended (read
        # without waiting for it: asnumpy() below would make it run now)
        late = gradfuse.runtime.context.flush(timeout=0.2)
        print(f"end_of_job: rank {hvd.rank()} still pending after the exit protocol: {late}", flush=True)
        print(f"end_of_job: rank {hvd.rank()} sum {state['x'].asnumpy().ravel()[:3].tolist()}", flush=True)
    elif MODE == "module":
        args, auxs = state["mod"].get_params()
        total = sum(float(np.abs(v.asnumpy()).astype(np.float64).sum()) for v in args.values())
        print(f"end_of_job: rank {hvd.rank()} params {total!r}", flush=True)
    elif MODE == "late" and hvd.rank() == 0:
        t0 = time.monotonic()
        try:
            hvd.allreduce(mx.nd.ones((4,)), name="late").wait_to_read()
            print("end_of_job: the late allreduce returned", flush=True)
        except Exception as exc:      # noqa: BLE001 - what the user would see
            print(f"end_of_job: late allreduce refused after {time.monotonic() - t0:.1f} s: "
                  f"{type(exc).__name__}: {exc}", flush=True)


atexit.register(after_exit_protocol)
hvd.init()
rank, size = hvd.rank(), hvd.size()

if MODE in ("pending", "peer_waits", "late"):
    x = mx.nd.ones((1000, 1000)) * (rank + 1)
    for _ in range(8):           # slow producers (seconds): the allreduce waits for them
        x = mx.nd.dot(x, mx.nd.ones((1000, 1000))) / 1000.0
    hvd.allreduce_(x, op=hvd.Sum, name="last")
    if MODE == "peer_waits" and rank == 0:
        hvd.allreduce_(x, op=hvd.Sum, name="one-more")     # the others never issue it
    state["x"] = x
    print(f"end_of_job: rank {rank} ends its script at monotonic {time.monotonic():.3f}", flush=True)
elif MODE == "module":
    data = mx.sym.var("data")
    net = mx.sym.FullyConnected(mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=64), act_type="relu"),
                                num_hidden=10)
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(net, name="softmax"), context=mx.cpu())
    rng = np.random.default_rng(rank)
    it = mx.io.NDArrayIter(rng.standard_normal((64, 100)).astype(np.float32), rng.integers(0, 10, 64).astype(np.float32),
                           batch_size=8, label_name="softmax_label")
    mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label)
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    args, auxs = mod.get_params()
    hvd.broadcast_parameters(args, root_rank=0)
    mod.set_params(args, auxs)
    opt = hvd.DistributedOptimizer(mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9,
                                                       rescale_grad=1.0 / 8))
    mod.fit(it, num_epoch=2, kvstore=None, optimizer=opt)
    state["mod"] = mod
    print(f"end_of_job: rank {rank} ends its script", flush=True)
else:
    raise SystemExit(f"unknown mode {MODE!r}")
