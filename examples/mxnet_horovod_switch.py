"""A Horovod-style MXNet training script that runs unchanged on gradfuse.

The only gradfuse-specific line is the import: put back ``import horovod.mxnet as hvd``
and the script runs on Horovod (tests/test_mxnet_examples.py runs it both ways and
compares the results).

    mpiexec -n 2 python examples/mxnet_horovod_switch.py
    mpiexec -n 2 python examples/mxnet_horovod_switch.py --fp16
"""
import argparse

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import gradfuse.mxnet as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--fp16", action="store_true", help="Compression.fp16 for the allreduce")
args = parser.parse_args()

# Horovod: initialize and pin nothing (CPU); every rank gets its own data.
hvd.init()
ctx = mx.cpu(hvd.local_rank())
config = hvd.broadcast_object({"seed": 42, "hidden": 32} if hvd.rank() == 0 else None, root_rank=0,
                              name="config")   # Horovod matches by name: same on every rank

rng = np.random.default_rng(config["seed"])
true_w = rng.standard_normal((10, 3))
x_all = rng.standard_normal((64 * hvd.size() * 4, 10)).astype(np.float32)
y_all = (x_all @ true_w).argmax(axis=1).astype(np.float32)
x_mine, y_mine = x_all[hvd.rank()::hvd.size()], y_all[hvd.rank()::hvd.size()]

net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(config["hidden"], activation="relu", in_units=10),
        gluon.nn.Dense(3, in_units=config["hidden"]))
mx.random.seed(hvd.rank())                       # different inits: the broadcast fixes it
net.initialize(mx.init.Xavier(), ctx=ctx)
net.hybridize()

# Horovod: broadcast the initial parameters from rank 0, then average gradients.
params = net.collect_params()
hvd.broadcast_parameters(params, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
opt = mx.optimizer.create("sgd", learning_rate=args.lr * hvd.size(), momentum=0.9)
trainer = hvd.DistributedTrainer(params, opt, compression=compression)

loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
metric = mx.metric.Accuracy()
for epoch in range(args.epochs):
    metric.reset()
    for i in range(0, len(x_mine), args.batch_size):
        data = mx.nd.array(x_mine[i:i + args.batch_size], ctx=ctx)
        label = mx.nd.array(y_mine[i:i + args.batch_size], ctx=ctx)
        with autograd.record():
            out = net(data)
            loss = loss_fn(out, label)
        loss.backward()
        trainer.step(args.batch_size)
        metric.update([label], [out])
    name, acc = metric.get()
    # Horovod: average the metric over the ranks
    acc = hvd.allreduce(mx.nd.array([acc]), name=f"acc{epoch}").asscalar()
    if hvd.rank() == 0:
        print(f"epoch {epoch}: average train accuracy {acc:.4f}", flush=True)

# every rank holds the same parameters: compare their checksums
sums = hvd.allgather(mx.nd.array([sum(float(p.data().sum().asscalar()) for p in params.values())],
                                 dtype="float64"), name="checksum").asnumpy()
if hvd.rank() == 0:
    print(f"parameter checksum on every rank: {' '.join(f'{s:.6f}' for s in sums)}")
    assert np.all(sums == sums[0]), "ranks diverged"
    print(f"size={hvd.size()} ok")
