"""Benchmarks: ratios measured side by side in one run (``python -m gradfuse.bench --help``).

``sets`` holds the gradient sets (ResNet-50's shapes, 2000 small tensors) and the timing
loop, ``kernels`` the local kernel benchmarks, ``allreduce`` the multi-rank ones, ``gpu``
the CUDA kernels; ``__main__`` is the command.
"""
