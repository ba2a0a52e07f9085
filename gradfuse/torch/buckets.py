"""One DDP ``GradBucket`` as gradfuse reads and writes it: host or CUDA, any float dtype.

DDP hands the hook one flat buffer per bucket. ``read`` cuts it into one view per
gradient along ``bucket.gradients()`` (so every tensor keeps its own 1-bit scale and its
own top-k / random-k selection), without a copy:

- **CPU** float32 / float16 / float64: numpy views of the buffer (``Tensor.numpy``).
- **CUDA**: cupy views through DLPack (``cupy.from_dlpack``; ``gradfuse.torch.device.BRIDGE``),
  so the step runs gradfuse's GPU path: the CUDA kernels of ``cuda/`` (``gradfuse.gpu``)
  on the Pipeline's ``CudaBackend``, ordered after torch's current stream on the
  bucket's device (the producer of the gradients), exchanged by ``torch.distributed`` on
  that device (``gradfuse.torch.device``). The future is CUDA-aware.
- **bfloat16** (either place): numpy has no bfloat16 and gradfuse's kernels reduce
  float32, so the bucket's words (viewed as uint16) are widened exactly into a float32
  staging buffer by gradfuse's ``cast_from16`` kernel (bf16 -> float32 is exact), the
  step reduces the staging buffer (any compressor; ``bf16`` sends the bucket's own
  words), and ``cast_to16`` rounds the result once, to nearest even, back into the
  bucket. Uncompressed (after the hook's 1/p scaling in bf16, DDP's), the bf16 values are
  summed in float32 and rounded once, where DDP's own allreduce rounds to bf16 at every
  add of its ring.
"""
import numpy as np
import torch

from . import device as _device

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}
_BF16 = 2           # the cast kernels' format code of bfloat16
SUPPORTED = "float32, float16, bfloat16 and float64"


class BucketIO:
    """What one hook call reads and writes: the views, their names and layout, where the
    step runs, and what happens after it (the bf16 rounding, the device's stream)."""

    __slots__ = ("buf", "views", "names", "layout", "on_gpu", "stream", "device", "_words", "_f32")

    def __init__(self, buf, views, names, layout, on_gpu, stream=None, device=None, words=None, f32=None):
        self.buf, self.views, self.names, self.layout = buf, views, names, layout
        self.on_gpu, self.stream, self.device = on_gpu, stream, device
        self._words, self._f32 = words, f32

    def _context(self):
        """The device and stream the caller's side runs on (the bucket's producer)."""
        if not self.on_gpu:
            return _Null()
        return _Both(_device.cupy().cuda.Device(self.device), self.stream)

    def submit(self, pipe, views=None, names=None):
        """Start ``pipe``'s step on the views (in place; or on ``views`` named ``names``, on
        this bucket's device and stream); its ``Handle``."""
        views = self.views if views is None else views
        with self._context():
            return pipe.allreduce_async(views, out=views, names=self.names if names is None else list(names))

    def finish(self):
        """After the step: a bf16 bucket's float32 result rounded once into its words, and
        on a GPU everything of this call complete before the future is set."""
        with self._context():
            if self._f32 is not None:
                _kernels(self.on_gpu).cast_to16(_BF16, self._f32, self._words)
            if self.on_gpu:
                self.stream.synchronize()

    def future(self):
        """The future DDP waits for (CUDA-aware for a GPU bucket)."""
        return _device.BRIDGE.future(self.buf) if self.on_gpu else torch.futures.Future()


def bare(name):
    """A tensor's name without its ``bucket<i>.`` prefix."""
    return name.split(".", 1)[1]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Both:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def __enter__(self):
        self.a.__enter__()
        self.b.__enter__()
        return self

    def __exit__(self, *exc):
        self.b.__exit__(*exc)
        return self.a.__exit__(*exc)


def _kernels(on_gpu):
    if on_gpu:
        from .. import gpu
        return gpu
    from .. import _core
    return _core


def read(bucket, param_names):
    """The ``BucketIO`` of DDP's ``bucket``.

    Args:
        bucket: DDP's ``dist.GradBucket``.
        param_names: ``{id(parameter): name}`` (may be empty: tensors are then ``<j>``).

    Returns:
        A ``BucketIO``: views named ``bucket<i>.<name>``, the layout (names, shapes, dtype).

    Raises:
        TypeError: the bucket holds a dtype gradfuse does not reduce.
        ValueError: its gradients do not tile its buffer.
    """
    buf = bucket.buffer()
    idx = bucket.index()
    bridge = _device.BRIDGE
    on_gpu = bridge.is_device(buf)
    bf16 = buf.dtype == torch.bfloat16
    if buf.dtype not in _NUMPY and not bf16:
        raise TypeError(f"gradfuse.torch: bucket {idx} holds {buf.dtype} gradients; gradfuse reduces "
                        f"{SUPPORTED} tensors")
    stream = dev = words = f32 = None
    if on_gpu:
        cp = _device.cupy()
        dev = bridge.device_index(buf)
        stream = bridge.cupy_stream(buf)
        with cp.cuda.Device(dev), stream:
            if bf16:
                words = bridge.to_cupy(buf.view(torch.int16)).view(np.uint16)
                f32 = cp.empty(words.size, np.float32)
                _kernels(True).cast_from16(_BF16, words, f32)
                flat = f32
            else:
                flat = bridge.to_cupy(buf)
    elif bf16:
        words = buf.detach().view(torch.int16).numpy().view(np.uint16)
        f32 = np.empty(words.size, np.float32)
        _kernels(False).cast_from16(_BF16, words, f32)
        flat = f32
    else:
        flat = buf.detach().numpy()
    flat = flat.reshape(-1)
    grads = bucket.gradients()
    params = bucket.parameters()
    names, views, shapes, off = [], [], [], 0
    for j, g in enumerate(grads):
        n = g.numel()
        name = param_names.get(id(params[j])) if j < len(params) else None
        names.append(f"bucket{idx}.{name if name is not None else j}")
        views.append(flat[off:off + n].reshape(tuple(g.shape)))
        shapes.append(tuple(g.shape))
        off += n
    if off != flat.size:
        raise ValueError(f"gradfuse.torch: bucket {idx}: its gradients hold {off} elements, its buffer "
                         f"{flat.size}; the tensor boundaries cannot be read")
    dtype = "bfloat16" if bf16 else str(np.dtype(_NUMPY[buf.dtype]))
    return BucketIO(buf, views, names, (tuple(names), tuple(shapes), dtype), on_gpu, stream, dev, words, f32)
