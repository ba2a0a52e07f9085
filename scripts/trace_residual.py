"""Per-epoch trace of a compressed run of the digits CNN at issue 14's acceptance settings
(SGD momentum 0.9 with gradfuse's default momentum correction, lr 0.1, batch 32 per rank,
30 epochs, split seed 0): train loss, test accuracy, the size of the residual and of the
velocity, and the largest weight. docs/experiments.md ("2-bit with a scaled threshold")
uses it to show why a seed collapsed.

    mpiexec -n 2 python scripts/trace_residual.py --seed 3 --compress 2bit --option threshold=0.5
"""
import argparse
import ast

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compress", default="2bit")
    ap.add_argument("--option", action="append", default=[], help="compressor option NAME=VALUE (repeatable)")
    ap.add_argument("--epochs", type=int, default=30)
    a = ap.parse_args()
    opts = {}
    for o in a.option:
        k, v = o.split("=", 1)
        opts[k] = ast.literal_eval(v)

    import mxnet as mx
    from mxnet import autograd
    import gradfuse.mxnet as hvd
    from gradfuse.experiments.tasks import get_task

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    task = get_task("digits_cnn", {})
    data = task.load(0, rank, size, None)
    mx.random.seed(a.seed + rank)              # as gradfuse.experiments.worker does
    np.random.seed(a.seed + rank)
    net = task.build_net()
    net.initialize(task.initializer())
    net.hybridize()
    net(mx.nd.zeros(task.input_shape(data)))
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.0},
                                     compress=a.compress, **opts)
    loss_fn = task.loss()
    steps = task.steps_per_epoch(data, size, 32)
    rng = np.random.default_rng(a.seed + 1 + 7919 * rank)
    x, y = data["x"], data["y"]
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    for epoch in range(1, a.epochs + 1):
        tot = 0.0
        for idx in task.batches(rng, data, steps, 32):
            with autograd.record():
                loss = loss_fn(net(mx.nd.array(x[idx])), mx.nd.array(y[idx]))
            loss.backward()
            trainer.step(len(idx))
            tot += float(loss.sum().asscalar())
        sd = trainer.pipeline.state_dict()
        res = np.concatenate([np.ravel(b["residual"]) for b in sd["buckets"].values()] + [np.zeros(1)])
        vel = np.concatenate([np.ravel(b.get("velocity", np.zeros(0))) for b in sd["buckets"].values()]
                             + [np.zeros(1)])
        acc = task.evaluate(net, data)["test_accuracy"]
        wmax = max(float(np.abs(p.data().asnumpy()).max()) for p in params)
        if rank == 0:
            print(f"epoch {epoch:2d} loss {tot / (steps * 32):.4f} test acc {acc:.3f} "
                  f"max|e| {np.abs(res).max():.3g} rms e {np.sqrt(np.mean(res ** 2)):.3g} "
                  f"max|u| {np.abs(vel).max():.3g} max|w| {wmax:.3g}", flush=True)


if __name__ == "__main__":
    main()
