"""The small Gluon MLP the momentum-correction tests train (one process and multi-rank)."""
import mxnet as mx
import numpy as np
from mxnet import gluon

IN, HID, OUT, B = 8, 16, 3, 6


def mlp(seed=0):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HID, activation="tanh", in_units=IN), gluon.nn.Dense(OUT, in_units=HID))
    mx.random.seed(seed)
    net.initialize(mx.init.Xavier())
    return net


def flat(net):
    """Every parameter's values, in name order, as one flat array."""
    return np.concatenate([p.data().asnumpy().ravel() for _, p in sorted(net.collect_params().items())])
