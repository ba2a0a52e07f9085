"""One run under mpiexec: train a task with ``gradfuse.mxnet.DistributedTrainer``.

    mpiexec -n N python -m gradfuse.experiments.worker SPEC.json RESULT.json

SPEC.json is a ``RunSpec`` as a dict. Every rank trains; rank 0 prints one progress line
per epoch (``@@gradfuse-experiments {json}`` on stdout) and writes RESULT.json at the end:
``{"status": "ok" | "diverged" | "refused", "epochs": [...], ...}``. Recorded per epoch:
the mean train loss over all ranks' samples, the test accuracy (or the objective), the
bytes this rank sent and the gradient bytes it reduced (``trainer.stats``, i.e. the
compressor's payloads as its collective sends them), the step count, the training and
wall time, and the throughput (samples per second over all ranks).

The optimizer is the spec's (``sgd``, ``adam`` or ``adamw``, with ``RunSpec.optimizer_params``),
the same for every method, the fp32 baseline included.

Divergence is a result, not a failure: a non-finite train loss, or a
``NonFiniteError`` from a compressed step (raised on every rank alike), marks the run
``diverged`` at that epoch; that epoch and every later one are recorded with loss nan
and the task's chance metrics (``Task.diverged_metrics``: the test accuracy at 1 / classes,
the LM's validation loss at ln 256), the values measured on the last weights kept with
the suffix ``_measured``. Any other exception is a failure: the traceback goes to
stderr and the exit status is 1, and the runner reports it.
"""
import inspect
import json
import math
import os
import sys
import time

import numpy as np

PROGRESS = "@@gradfuse-experiments "
CACHE_ENV = "GRADFUSE_EXPERIMENTS_CACHE"      # where generated data sets are kept (set by the runner)


def _write_json(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
    os.replace(tmp, path)


def _trainer_kwargs(spec, correction):
    kw = {"compress": None if spec.compress == "none" else spec.compress}
    if spec.compress != "none":
        kw.update(spec.options)
    kw.update(correction)
    return kw


def train(spec, emit):
    """Train ``spec`` on this rank; return the result dict (meaningful on rank 0)."""
    import mxnet as mx
    from mxnet import autograd

    import gradfuse.mxnet as hvd

    from .. import _version
    from ..errors import NonFiniteError
    from .grid import correction_options, correction_refused
    from .tasks import get_task

    rank, size = hvd.rank(), hvd.size()
    if size != spec.workers:
        raise RuntimeError(f"run {spec.id} wants {spec.workers} ranks, mpiexec started {size}")
    params = inspect.signature(hvd.DistributedTrainer).parameters
    correction = correction_options(spec, params)   # raises UnsupportedError before any work
    task = get_task(spec.task, spec.task_options)
    data = task.load(spec.split_seed, rank, size, os.environ.get(CACHE_ENV))
    mx.random.seed(spec.seed + rank)            # different on purpose: the broadcast fixes it
    np.random.seed(spec.seed + rank)
    net = task.build_net()
    net.initialize(task.initializer())
    net.hybridize()
    net(mx.nd.zeros(task.input_shape(data)))    # finish deferred initialisation
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    n_params = int(sum(np.prod(p.shape) for p in net.collect_params().values() if p.grad_req != "null"))
    try:
        trainer = hvd.DistributedTrainer(net.collect_params(), spec.optimizer, spec.optimizer_params(),
                                         **_trainer_kwargs(spec, correction))
    except (TypeError, ValueError) as exc:
        if correction.get("momentum_correction") is True:     # the library says it cannot: refused, not failed
            raise correction_refused(spec, exc) from None
        raise
    loss_fn = task.loss()
    steps = task.steps_per_epoch(data, size, spec.batch_size)
    if spec.max_steps_per_epoch:
        steps = min(steps, spec.max_steps_per_epoch)
    if steps < 1:
        raise RuntimeError(f"run {spec.id}: fewer samples per rank than one batch of {spec.batch_size}")
    rng = np.random.default_rng(spec.seed + 1 + 7919 * rank)   # data order: own stream per rank
    chance = task.diverged_metrics()
    diverged_at, steps_done, wall0 = None, 0, time.perf_counter()
    m0 = task.evaluate(net, data)               # epoch 0: the broadcast initial weights
    epochs = [dict({"epoch": 0, "steps": 0, "train_loss": float("nan"), "bytes_sent": 0, "bytes_reduced": 0,
                    "train_s": 0.0, "wall_s": 0.0, "throughput": float("nan"), "diverged": False}, **m0)]
    if rank == 0:
        emit({"epoch": 0, "epochs": spec.epochs, "steps": 0, "train_loss": float("nan"),
              "test_accuracy": m0["test_accuracy"], "objective": m0["objective"], "diverged": False,
              "progress": task.progress_text(m0)})
    for epoch in range(1, spec.epochs + 1):
        if diverged_at is not None:             # nothing more to train: the divergence stands
            epochs.append(dict(epochs[-1], epoch=epoch))
            continue
        t0 = time.perf_counter()
        total = mx.nd.zeros((1,), dtype="float64")
        seen, nonfinite = 0, False
        for idx in task.batches(rng, data, steps, spec.batch_size):
            xb, yb = task.batch(data, idx)
            with autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            try:
                trainer.step(len(idx))
            except NonFiniteError:
                nonfinite = True                # raised on every rank for the same step
                break
            total += loss.sum().astype("float64")
            seen += len(idx)
            steps_done += 1
        try:
            mx.nd.waitall()
        except NonFiniteError:                  # the step's error, when MXNet's engine carried it here
            nonfinite = True                    # (gradfuse.mxnet hands collectives to the engine)
        train_s = time.perf_counter() - t0
        sums = hvd.allreduce(mx.nd.array([float(total.asscalar()), seen, float(nonfinite)], dtype="float64"),
                             op=hvd.Sum, name=f"epoch{epoch}").asnumpy()
        train_loss = float(sums[0] / max(sums[1], 1))
        metrics = task.evaluate(net, data)
        st = trainer.stats
        row = {"epoch": epoch, "steps": steps_done, "train_loss": train_loss,
               "test_accuracy": metrics["test_accuracy"], "objective": metrics["objective"],
               "bytes_sent": int(st.bytes_sent), "bytes_reduced": int(st.bytes_reduced),
               "train_s": train_s, "wall_s": time.perf_counter() - wall0,
               "throughput": float(sums[1]) / train_s if train_s > 0 else float("nan"), "diverged": False}
        row.update({k: v for k, v in metrics.items() if k not in row})     # the task's own (x, bits_per_byte)
        if sums[2] or not math.isfinite(train_loss):
            diverged_at = epoch
            row.update({f"{k}_measured": row.get(k, float("nan")) for k in chance})
            row.update(chance, train_loss=float("nan"), diverged=True, nonfinite_step=bool(sums[2]))
        epochs.append(row)
        if rank == 0:
            emit({"epoch": epoch, "epochs": spec.epochs, "steps": steps_done, "train_loss": row["train_loss"],
                  "test_accuracy": row["test_accuracy"], "objective": row["objective"],
                  "diverged": row["diverged"], "progress": task.progress_text(row)})
    return {"status": "diverged" if diverged_at else "ok", "diverged_at": diverged_at, "epochs": epochs,
            "steps_per_epoch": steps, "n_params": n_params,
            "compressor": trainer.pipeline.get_config() if trainer.pipeline is not None else None,
            "trainer_kwargs": _trainer_kwargs(spec, correction), "optimizer_params": spec.optimizer_params(),
            "data": task.data_info(spec.split_seed),
            "gradfuse_version": _version.__version__, "mxnet_version": mx.__version__,
            "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MXNET_CPU_WORKER_NTHREADS")}}


def main(argv=None):
    """Run the spec in ``argv[0]`` and write the result to ``argv[1]`` (rank 0)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m gradfuse.experiments.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    from .grid import RunSpec, UnsupportedError
    with open(argv[0]) as f:
        spec = RunSpec.from_dict(json.load(f))
    import gradfuse.mxnet as hvd
    hvd.init()

    def emit(obj):
        print(PROGRESS + json.dumps(obj), flush=True)

    try:
        result = train(spec, emit)
    except UnsupportedError as exc:
        result = {"status": "refused", "error": str(exc)}
    if hvd.rank() == 0:
        result["spec"] = spec.to_dict()
        _write_json(argv[1], result)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
