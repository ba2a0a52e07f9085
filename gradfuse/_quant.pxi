# Kernels: 1-bit and 2-bit quantization with error feedback. Included by _core.pyx.
