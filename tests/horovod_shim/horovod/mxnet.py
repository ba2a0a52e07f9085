"""``horovod.mxnet`` is ``gradfuse.mxnet`` (the same module object)."""
import sys

import gradfuse.mxnet

sys.modules[__name__] = gradfuse.mxnet
