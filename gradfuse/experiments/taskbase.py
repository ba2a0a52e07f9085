"""The base of the experiment tasks: options, data (cached), batches, evaluation.

A task (``gradfuse.experiments.tasks`` registers them) tells the worker its data shard,
its Gluon network, its loss, its batches and its evaluation. MXNet is imported inside
the methods, so the runner (which only validates and launches) stays light.
"""
import hashlib
import json
import math
import os

import numpy as np


class TaskError(ValueError):
    """A task name or task option is invalid."""


class Task:
    """Base of the tasks: options, data, network, loss, batches, evaluation.

    Args:
        **options: the task's own options (see ``OPTIONS``); unknown ones raise
            ``TaskError`` naming them.
    """

    name = "abstract"
    model = "abstract"              # GRACE's 'model' column
    kind = "classification"         # "objective": no accuracy, an objective value;
                                    # "throughput": random labels, only speed and bytes count;
                                    # "language_model": the objective is a validation loss
    num_classes = 10
    cacheable = False               # True: cached_arrays keeps the generated data on disk
    gap_metric = "accuracy"         # the tidy column the summary's paired gap compares
    OPTIONS = {}

    def __init__(self, **options):
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise TaskError(f"task {self.name!r}: unknown option(s) {', '.join(unknown)}; "
                            f"valid options: {', '.join(sorted(self.OPTIONS)) or '(none)'}")
        self.options = {k: options.get(k, v) for k, v in self.OPTIONS.items()}
        for k, default in self.OPTIONS.items():
            v = self.options[k]
            if isinstance(default, bool):
                ok = isinstance(v, bool)
            elif isinstance(default, int):
                ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
            elif isinstance(default, float):
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            else:
                ok = isinstance(v, type(default))
            if not ok:
                raise TaskError(f"task {self.name!r}: option {k!r} must be a positive "
                                f"{type(default).__name__}, got {v!r}")
        self.validate()

    def validate(self):
        """Check option combinations; raise ``TaskError`` naming the option."""

    # --- data ------------------------------------------------------------------------
    def arrays(self, split_seed):
        """Return ``(x_train, y_train, x_test, y_test)`` as numpy arrays (float32)."""
        raise NotImplementedError

    def data_options(self):
        """The options the data depends on (the cache key): all of them unless a task says less."""
        return self.options

    def cache_extra(self):
        """What else the data depends on, outside the options (part of the cache key), or None."""
        return None

    def cache_path(self, split_seed, cache_dir):
        """The .npz file ``cached_arrays`` keeps the data of ``split_seed`` in."""
        parts = [self.name, self.data_options(), split_seed]
        extra = self.cache_extra()
        if extra is not None:
            parts.append(extra)
        key = hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()
        return os.path.join(cache_dir, f"{self.name}-{key[:16]}.npz")

    def cached_arrays(self, split_seed, cache_dir=None):
        """``arrays(split_seed)``, kept in ``cache_dir`` as .npz for tasks slow to generate.

        The file name hashes the task, its data options, ``cache_extra()`` and the split
        seed; a missing or unreadable file is regenerated (written atomically, so ranks
        racing to write the same file both leave a whole one).
        """
        if not (cache_dir and self.cacheable):
            return self.arrays(split_seed)
        path = self.cache_path(split_seed, cache_dir)
        try:
            with np.load(path) as z:
                return z["x"], z["y"], z["x_test"], z["y_test"]
        except (OSError, KeyError, ValueError):
            pass
        x, y, xt, yt = self.arrays(split_seed)
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path[:-4]}.tmp{os.getpid()}.npz"
        np.savez(tmp, x=x, y=y, x_test=xt, y_test=yt)
        os.replace(tmp, path)
        return x, y, xt, yt

    def load(self, split_seed, rank, size, cache_dir=None):
        """This rank's training shard and the whole test set.

        Returns:
            dict with ``x``, ``y`` (the whole training set), ``shard`` (this rank's
            training indices: ``rank::size``), ``x_test``, ``y_test``.
        """
        x, y, xt, yt = self.cached_arrays(split_seed, cache_dir)
        return {"x": x, "y": y, "shard": np.arange(len(x))[rank::size], "x_test": xt, "y_test": yt}

    def data_info(self, split_seed):
        """What the run's result records about the data beyond the options (a dict, maybe empty)."""
        return {}

    def steps_per_epoch(self, data, size, batch_size):
        """Steps per epoch, the same on every rank (the smallest shard decides)."""
        return (len(data["x"]) // size) // batch_size

    def batches(self, rng, data, steps, batch_size):
        """Yield index arrays: a fresh permutation of this rank's shard each epoch."""
        perm = rng.permutation(data["shard"])
        for s in range(steps):
            yield perm[s * batch_size:(s + 1) * batch_size]

    def batch(self, data, idx):
        """The NDArrays ``(inputs, labels)`` of the training samples ``idx``."""
        import mxnet as mx
        return mx.nd.array(data["x"][idx]), mx.nd.array(data["y"][idx])

    # --- model -----------------------------------------------------------------------
    def build_net(self):
        raise NotImplementedError

    def initializer(self):
        import mxnet as mx
        return mx.init.Xavier()

    def input_shape(self, data):
        return (1,) + data["x"].shape[1:]

    def loss(self):
        from mxnet import gluon
        return gluon.loss.SoftmaxCrossEntropyLoss()

    def evaluate(self, net, data):
        """Test metrics: ``{"test_accuracy": ..., "objective": ...}`` (floats, maybe nan)."""
        import mxnet as mx
        correct = 0
        xt, yt = data["x_test"], data["y_test"]
        for i in range(0, len(xt), 4096):
            out = net(mx.nd.array(xt[i:i + 4096])).asnumpy()
            ok = np.isfinite(out).all(axis=1) & (out.argmax(axis=1) == yt[i:i + 4096])
            correct += int(ok.sum())
        return {"test_accuracy": correct / len(xt), "objective": float("nan")}

    def diverged_metrics(self):
        """The metrics a diverged run is recorded with from its divergence on (chance).

        A diverged model's predictions mean nothing: the test accuracy is chance
        (1 / classes; nan for a task without classes). The measured values are kept
        beside them with the suffix ``_measured``.
        """
        return {"test_accuracy": 1.0 / self.num_classes if self.num_classes else float("nan")}

    def progress_text(self, metrics):
        """The metric the progress bar shows after an epoch: ``'acc 0.9123'``."""
        acc = metrics.get("test_accuracy", float("nan"))
        if acc == acc:
            return f"acc {acc:.4g}"
        return f"f {metrics.get('objective', float('nan')):.4g}"
