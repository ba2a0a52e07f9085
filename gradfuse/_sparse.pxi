# Kernels: top-k and random-k sparsification. Included by _core.pyx.
