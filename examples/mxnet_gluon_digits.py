"""Train a small Gluon CNN on scikit-learn's digits with gradfuse, data-parallel.

    mpiexec -n 2 python examples/mxnet_gluon_digits.py --compress none
    mpiexec -n 2 python examples/mxnet_gluon_digits.py --compress 1bit     # any registered compressor
    mpiexec -n 2 python examples/mxnet_gluon_digits.py --compress hvd-fp16 # Horovod's Compression.fp16
    mpiexec -n 2 python examples/mxnet_gluon_digits.py --optimizer adamw --lr 1e-3 --compress 1bit

The data ships with scikit-learn (1797 8x8 images, 10 classes): nothing is downloaded.
Each rank trains on its own shard; gradients are averaged by
``gradfuse.mxnet.DistributedTrainer``; rank 0 prints progress, the final test accuracy
and the bytes handed to the reduction.
"""
import argparse
import sys
import time

import numpy as np


def parse(argv=None):
    import gradfuse
    names = gradfuse.compressors.available() + ["hvd-fp16"]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compress", default="none",
                   help=f"gradfuse compressor ({', '.join(names)}); hvd-fp16 is Horovod's "
                        f"Compression.fp16 cast")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],
                   help="sgd (with --momentum), MXNet's adam, or adamw (torch.optim.AdamW's rule); "
                        "the lossy compressors take Adam through the Adam correction, on by default "
                        "(docs/mxnet.md)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.1 for sgd, 1e-3 for Adam)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (the lossy compressors take it through DGC's momentum "
                        "correction, on by default: docs/mxnet.md)")
    p.add_argument("--wd", type=float, default=None,
                   help="weight decay (default: the optimizer's own: 0, adamw 0.01)")
    p.add_argument("--correction", default="on", choices=["on", "off"],
                   help="the optimizer correction (DGC's momentum correction for sgd, the Adam "
                        "correction for adam/adamw): on = the default rule, off = turned off")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="the compressor's warmup_steps (with Adam: the freeze point; default: the adaptive rule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap", action="store_true",
                   help="reduce bucket by bucket as backward writes them (see docs/mxnet.md)")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 if the final test accuracy is below this")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 1e-3
    if args.compress not in names:
        p.error(f"--compress {args.compress!r} is not available here; choose from: {', '.join(names)}")
    return args


def main(argv=None):
    args = parse(argv)
    import mxnet as mx
    from mxnet import autograd, gluon
    from sklearn.datasets import load_digits

    import gradfuse.mxnet as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.float32)
    order = np.random.default_rng(args.seed).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    shard = train[rank::size]                     # each rank its own part of the data

    # the net of gradfuse-experiments' digits_cnn task, so docs/experiments.md's tables are
    # about this example: two 3x3 convolutions (16, 32) with max-pooling, Dense(64), Dense(10)
    from gradfuse.experiments.tasks import digits_cnn
    net = digits_cnn()
    mx.random.seed(args.seed + rank)              # different on purpose: the broadcast fixes it
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((1, 1, 8, 8)))                # finish deferred initialisation
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)

    kw = {"overlap": args.overlap, "fusion_threshold": 16384 if args.overlap else None}
    if args.compress == "hvd-fp16":
        kw["compression"] = hvd.Compression.fp16
    else:
        kw["compress"] = args.compress
    if args.correction == "off":
        kw["momentum_correction"] = False
    if args.warmup_steps is not None:
        kw["warmup_steps"] = args.warmup_steps
    opt_params = {"learning_rate": args.lr}
    if args.optimizer == "sgd":
        opt_params["momentum"] = args.momentum
    if args.wd is not None:
        opt_params["wd"] = args.wd
    trainer = hvd.DistributedTrainer(net.collect_params(), args.optimizer, opt_params, **kw)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(args.seed + 1)
    steps_per_epoch = len(train) // size // args.batch_size
    if rank == 0:
        print(f"gradfuse.mxnet: {size} ranks, {len(train)} training / {n_test} test images, "
              f"batch {args.batch_size} per rank, {steps_per_epoch} steps per epoch, "
              f"compress={args.compress}, optimizer={args.optimizer}", flush=True)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = rng.permutation(shard)             # same seed everywhere: same step count
        total, correct, seen = 0.0, 0, 0
        for s in range(steps_per_epoch):
            idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
            xb, yb = mx.nd.array(x[idx]), mx.nd.array(y[idx])
            with autograd.record():
                out = net(xb)
                loss = loss_fn(out, yb)
            loss.backward()
            trainer.step(args.batch_size)
            total += float(loss.sum().asscalar())
            correct += int((out.argmax(axis=1) == yb).sum().asscalar())
            seen += len(idx)
        stats = hvd.allreduce(mx.nd.array([total, correct, seen], dtype="float64"),
                              op=hvd.Sum, name=f"epoch{epoch}")
        total, correct, seen = stats.asnumpy()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {total / seen:.4f}, "
                  f"train accuracy {correct / seen:.3f}, {time.perf_counter() - t0:.1f} s", flush=True)

    pred = net(mx.nd.array(x[test])).argmax(axis=1).asnumpy()
    acc = float((pred == y[test]).mean())
    accs = hvd.allgather_object(acc)
    stats = trainer.stats
    if rank == 0:
        assert len(set(accs)) == 1, f"ranks disagree on the test accuracy: {accs}"
        print(f"final test accuracy: {acc:.4f}")
        # compressed payloads as sent; uncompressed allreduces as 2 (p-1)/p of the buffer
        sent = stats.bytes_sent
        print(f"bytes communicated by rank 0: {sent} sent (estimate) for {stats.bytes_reduced} gradient bytes "
              f"reduced in {stats.steps} steps ({sent / max(stats.steps, 1):.0f} sent per step, "
              f"{stats.bytes_reduced / max(sent, 1):.1f}x compression)")
        if trainer._adam_correction is not None:
            frozen = [int(b["arrays"]["adam.freeze"][0]) for p in trainer._reducer.pipelines
                      for b in p.state_dict()["buckets"].values() if "arrays" in b]
            at = max(frozen, default=0)
            print(f"Adam correction: v frozen after step {at} of {stats.steps} "
                  f"({at / max(stats.steps, 1):.1%} of the steps exact)" if at else
                  f"Adam correction: v never froze in {stats.steps} steps (every step exact)")
    hvd.shutdown()
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
