"""The experiment tasks: models and data, none of which downloads anything.

A task is a class registered in ``TASKS`` (its base, ``Task``, is in ``taskbase``); the
worker asks it for its data shard, its Gluon network, its loss, its batches and its
evaluation. MXNet and scikit-learn are imported inside the methods, so the runner (which
only validates and launches) stays light.

* ``digits_cnn``: the CNN of ``examples/mxnet_gluon_digits.py`` on scikit-learn's digits
  (1797 8x8 images, 10 classes), 20 % held out (359 test images).
* ``mlp``: an MLP on ``sklearn.datasets.make_classification`` (default 100 000 samples,
  256 features, 10 classes, 25 % held out: 25 000 test samples).
* ``resnet``: a CIFAR-style ResNet (depth 6n+2, 16/32/64 channels, BatchNorm) on random
  32x32x3 images with random labels: for throughput and bytes, not accuracy.
* ``counterexample``: Counter-example 1 of Karimireddy et al. 2019 (ICML), a
  least-squares problem on R^2 where sign compression without error feedback cannot
  reach the optimum (docs/experiments.md states it).
* ``transformer_lm``: a byte-level causal Transformer language model on the Python
  standard library's own source files (``transformer_lm``).
"""
import numpy as np

from .taskbase import Task, TaskError
from .transformer_lm import TransformerLM


def digits_cnn():
    """The digits CNN (also examples/mxnet_gluon_digits.py's): Conv(16, 3x3, pad 1, relu),
    MaxPool(2), Conv(32, 3x3, pad 1, relu), MaxPool(2), Dense(64, relu), Dense(10)."""
    from mxnet import gluon
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Flatten(),
            gluon.nn.Dense(64, activation="relu"),
            gluon.nn.Dense(10))
    return net


class DigitsCNN(Task):
    """The CNN of examples/mxnet_gluon_digits.py on scikit-learn's digits.

    Data: ``load_digits()``, pixels / 16, shape (1, 8, 8). Split: a permutation drawn
    from ``numpy.random.default_rng(split_seed)``; its first ``1797 // 5 = 359`` images
    are the test set, the other 1438 the training set. Net: Conv(16, 3x3, pad 1, relu),
    MaxPool 2, Conv(32, 3x3, pad 1, relu), MaxPool 2, Dense(64, relu), Dense(10):
    13 706 parameters in 8 tensors, all under 64 KiB.
    """

    name = "digits_cnn"
    model = "cnn-digits"

    def arrays(self, split_seed):
        from sklearn.datasets import load_digits
        digits = load_digits()
        x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
        y = digits.target.astype(np.float32)
        order = np.random.default_rng(split_seed).permutation(len(x))
        n_test = len(x) // 5
        test, train = order[:n_test], order[n_test:]
        return x[train], y[train], x[test], y[test]

    def build_net(self):
        return digits_cnn()


class MLP(Task):
    """An MLP on a synthetic ``make_classification`` problem.

    Data: ``make_classification(n_samples, n_features, n_informative, n_redundant,
    n_classes=10, n_clusters_per_class=2, class_sep, flip_y=0.01,
    random_state=split_seed)``; the last ``test_fraction`` of a ``split_seed``
    permutation is the test set; features standardised with the training set's mean and
    standard deviation. Net: ``depth`` x [Dense(hidden), BatchNorm, relu], then Dense(10)
    (``batchnorm=False``: Dense(hidden, relu) layers). Without BatchNorm the fp32 net itself
    does not survive SGD at lr 0.1 and momentum 0.9 here: on 100 000 samples its test
    accuracy fell from 0.85 after one epoch to 0.12 after ten; with it, 0.95 to 0.96.
    """

    name = "mlp"
    model = "mlp-synthetic"
    cacheable = True
    OPTIONS = {"n_samples": 100000, "n_features": 256, "n_informative": 32, "n_redundant": 32,
               "class_sep": 2.0, "test_fraction": 0.25, "hidden": 256, "depth": 2, "batchnorm": True}

    def validate(self):
        o = self.options
        if o["n_informative"] + o["n_redundant"] > o["n_features"]:
            raise TaskError(f"task 'mlp': n_informative + n_redundant = "
                            f"{o['n_informative'] + o['n_redundant']} exceeds n_features = {o['n_features']}")
        if not 0 < o["test_fraction"] < 1:
            raise TaskError(f"task 'mlp': option 'test_fraction' must be in (0, 1), got {o['test_fraction']!r}")
        if 10 * 2 > 2 ** o["n_informative"]:
            raise TaskError(f"task 'mlp': n_informative = {o['n_informative']} is too small for 10 classes "
                            f"x 2 clusters")

    def arrays(self, split_seed):
        from sklearn.datasets import make_classification
        o = self.options
        x, y = make_classification(n_samples=o["n_samples"], n_features=o["n_features"],
                                   n_informative=o["n_informative"], n_redundant=o["n_redundant"],
                                   n_classes=10, n_clusters_per_class=2, class_sep=float(o["class_sep"]),
                                   flip_y=0.01, random_state=split_seed)
        order = np.random.default_rng(split_seed).permutation(len(x))
        n_test = int(round(len(x) * o["test_fraction"]))
        test, train = order[:n_test], order[n_test:]
        mean = x[train].mean(axis=0)
        std = x[train].std(axis=0) + 1e-8
        x = ((x - mean) / std).astype(np.float32)
        y = y.astype(np.float32)
        return x[train], y[train], x[test], y[test]

    def build_net(self):
        from mxnet import gluon
        net = gluon.nn.HybridSequential()
        for _ in range(self.options["depth"]):
            if self.options["batchnorm"]:
                net.add(gluon.nn.Dense(self.options["hidden"]), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"))
            else:
                net.add(gluon.nn.Dense(self.options["hidden"], activation="relu"))
        net.add(gluon.nn.Dense(10))
        return net


class _BasicBlock:
    """Factory for a CIFAR ResNet basic block (two 3x3 convs, BN, identity or 1x1 shortcut)."""

    @staticmethod
    def make(channels, stride, downsample):
        from mxnet import gluon

        class Block(gluon.HybridBlock):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.body = gluon.nn.HybridSequential()
                self.body.add(gluon.nn.Conv2D(channels, 3, stride, 1, use_bias=False),
                              gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
                              gluon.nn.Conv2D(channels, 3, 1, 1, use_bias=False), gluon.nn.BatchNorm())
                self.down = None
                if downsample:
                    self.down = gluon.nn.HybridSequential()
                    self.down.add(gluon.nn.Conv2D(channels, 1, stride, use_bias=False), gluon.nn.BatchNorm())

            def hybrid_forward(self, F, x):
                res = self.body(x)
                sc = self.down(x) if self.down is not None else x
                return F.Activation(res + sc, act_type="relu")

        return Block()


class ResNet(Task):
    """A CIFAR-style ResNet on random 32x32x3 data, for throughput.

    Data: ``n_train`` training and ``n_test`` test images drawn from N(0, 1) and labels
    uniform in 0..9, from ``default_rng(split_seed)``; nothing to learn, so the
    accuracy stays at chance. Net: ResNet-(6n+2) as in He et al. 2016 section 4.2:
    Conv(16) + BN + relu, three stages of ``n`` basic blocks (16, 32, 64 channels,
    stride 2 between stages, 1x1 projection shortcuts), global average pooling,
    Dense(10). ``n = 3`` is ResNet-20 (0.27 M parameters), GRACE's CIFAR-10 model.
    """

    name = "resnet"
    model = "resnet-random32"
    kind = "throughput"
    OPTIONS = {"n": 3, "n_train": 1024, "n_test": 256}

    def arrays(self, split_seed):
        rng = np.random.default_rng(split_seed)
        o = self.options
        x = rng.standard_normal((o["n_train"] + o["n_test"], 3, 32, 32)).astype(np.float32)
        y = rng.integers(0, 10, len(x)).astype(np.float32)
        return x[:o["n_train"]], y[:o["n_train"]], x[o["n_train"]:], y[o["n_train"]:]

    def build_net(self):
        from mxnet import gluon
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(16, 3, 1, 1, use_bias=False), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"))
        in_ch = 16
        for stage, ch in enumerate((16, 32, 64)):
            for b in range(self.options["n"]):
                stride = 2 if stage > 0 and b == 0 else 1
                net.add(_BasicBlock.make(ch, stride, downsample=(stride != 1 or in_ch != ch)))
                in_ch = ch
        net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Flatten(), gluon.nn.Dense(10))
        return net


class Counterexample(Task):
    """Counter-example 1 of Karimireddy et al. 2019: sign compression cannot converge.

    Problem: minimise ``f(x) = <a1, x>^2 + <a2, x>^2`` over x in R^2 with
    ``a1 = [1, -1] + eps [1, 1]`` and ``a2 = -[1, -1] + eps [1, 1]``, eps in (0, 1).
    A stochastic gradient is the gradient of one term, ``2 <a_i, x> a_i``, with i
    drawn uniformly from {1, 2}; each worker draws its own i every step. The optimum
    is x* = 0, f* = 0. Start: x0 = [1, 1], f(x0) = 8 eps^2.

    Why sign compression fails: both a_i have the sign pattern +-[1, -1], so every
    stochastic gradient, and every (scaled) sign of one, is a multiple of [1, -1]; an
    average of such vectors is one too. Without error feedback the iterates stay on the
    line x0 + t [1, -1], where ``x1 + x2 = 2`` and ``f(x) = 2 (x1 - x2)^2 + 2 eps^2
    (x1 + x2)^2 >= 8 eps^2 = f(x0)``: no step size ever gets below f(x0). With error
    feedback the residual carries the [1, 1] component until it is sent.

    The model is a Gluon ``Dense(1, use_bias=False, in_units=2)`` whose weight is x,
    initialised to ones; a sample is a row a_i; the loss is ``out^2``.
    """

    name = "counterexample"
    model = "karimireddy-ce1"
    kind = "objective"
    num_classes = 0
    OPTIONS = {"eps": 0.5, "steps_per_epoch": 25}

    def validate(self):
        if not 0 < self.options["eps"] < 1:
            raise TaskError(f"task 'counterexample': option 'eps' must be in (0, 1), got {self.options['eps']!r}")

    def vectors(self):
        eps = float(self.options["eps"])
        return np.array([[1 + eps, -1 + eps], [-1 + eps, 1 + eps]], np.float32)

    def arrays(self, split_seed):
        a = self.vectors()
        zeros = np.zeros(2, np.float32)
        return a, zeros, a, zeros

    def load(self, split_seed, rank, size, cache_dir=None):
        d = super().load(split_seed, rank, size, cache_dir)
        d["shard"] = np.arange(2)            # every worker samples from both terms
        return d

    def steps_per_epoch(self, data, size, batch_size):
        return self.options["steps_per_epoch"]

    def batches(self, rng, data, steps, batch_size):
        for _ in range(steps):
            yield rng.integers(0, 2, batch_size)

    def build_net(self):
        from mxnet import gluon
        return gluon.nn.Dense(1, use_bias=False, in_units=2)

    def initializer(self):
        import mxnet as mx
        return mx.init.One()

    def loss(self):
        from mxnet import gluon

        class Square(gluon.loss.Loss):
            def __init__(self, **kw):
                super().__init__(weight=None, batch_axis=0, **kw)

            def hybrid_forward(self, F, pred, label):
                return F.sum(F.square(pred), axis=1)

        return Square()

    def evaluate(self, net, data):
        x = net.weight.data().asnumpy().reshape(-1).astype(np.float64)
        a = self.vectors().astype(np.float64)
        f = float(((a @ x) ** 2).sum())
        return {"test_accuracy": float("nan"), "objective": f, "x": x.tolist()}

    def f0(self):
        """f(x0) = 8 eps^2, the floor sign compression without error feedback cannot pass."""
        return 8.0 * float(self.options["eps"]) ** 2


TASKS = {cls.name: cls for cls in (DigitsCNN, MLP, ResNet, Counterexample, TransformerLM)}


__all__ = ["TASKS", "Counterexample", "DigitsCNN", "MLP", "ResNet", "Task", "TaskError", "TransformerLM",
           "digits_cnn", "get_task"]


def get_task(name, options=None):
    """Instantiate the task registered as ``name`` with ``options``.

    Raises:
        TaskError: unknown name (the message lists the valid ones) or a bad option.
    """
    cls = TASKS.get(name)
    if cls is None:
        raise TaskError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return cls(**(options or {}))
