# Kernels: fp16/bf16 casts, 16-bit sums, fused pack+cast. Included by _core.pyx.
