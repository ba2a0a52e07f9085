"""GPU kernels of gradfuse: the CUDA twins of ``gradfuse._core``, loaded through cupy.

The kernels live in ``cuda/*.cu`` (package data ``gradfuse.cuda``), one file per family:
``pack.cu``, ``cast.cu``, ``onebit.cu``, ``twobit.cu``, ``sparse.cu``, ``momentum.cu``, ``adam.cu``,
``powersgd.cu``. Each file is
compiled at run time by NVRTC (the one cupy loads) with exactly ``OPTIONS`` (no FMA
contraction, IEEE division, no flush to zero) for the device's architecture, kept in
cupy's kernel cache directory, and loaded with ``cupy.RawModule(path=...)`` once per
device; ``compile_all()`` then checks on the device that subnormals survive.

Contract (same as the CPU kernels, see docs/compressors.md and docs/gpu.md): the same
arguments give the same bits as ``gradfuse._core``; Python validates and allocates, the
kernels loop. Arrays are cupy arrays on the current device (C-contiguous, exact dtypes).
Tables (pointers, offsets, counts) may be numpy or cupy int64 arrays: numpy tables are
validated like the CPU ones and uploaded; cupy tables are used as they are (the caller
validated them once, e.g. when the plan was made) and cost one small device read for the
launch geometry.

Functions that return a count (non-finite blocks, overflow/underflow) synchronise to
read it, unless ``count_out`` (a cupy uint64 array of 1, or 2 for casts) is given: the
kernel then adds into it (it is zeroed first) and the function returns it without
waiting, so the count can stay on the device (e.g. as a wire header).

Importing this module does not import cupy; ``available()`` says whether the GPU path
can run at all.

The package, one concern per module (each imports only modules before it in this list):
``loader`` (kernel sources, NVRTC, the compiled-module caches, ``cupy()``), ``launch``
(argument checks, tables, launch geometry: what every wrapper shares), one module of
wrappers per kernel file (``packing`` for ``pack.cu``, ``cast``, ``onebit``, ``twobit``,
``sparse``, ``momentum``, ``adam``, ``powersgd``), and ``verify`` (``compile_all``, ``check_subnormals``). This module only
re-exports their public names: ``gradfuse.gpu`` is the kernel module of the GPU path,
with the same function names and signatures as ``gradfuse._core``.
"""
from .loader import (FAMILIES, OPTIONS, PRELUDE, arch_option, available, compile_family, cupy, kernel,
                     module, module_path, source)
from .launch import OB_WARPS, THREADS, Resident, divisor_mode, resident
from .packing import div_f32, pack, unpack, unpack_div_f32
from .cast import cast_from16, cast_to16, pack_cast, sum16, unpack_cast
from .onebit import onebit_compress, onebit_compress_array, onebit_decompress_sum, onebit_decompress_sum_array
from .twobit import (twobit_block_compress, twobit_block_compress_array, twobit_block_decompress_sum,
                     twobit_block_decompress_sum_array, twobit_compress, twobit_compress_array,
                     twobit_decompress_sum, twobit_decompress_sum_array)
from .sparse import (randomk_compress, randomk_compress_array, randomk_indices, sparse_decompress_sum,
                     sparse_decompress_sum_array, topk_compress, topk_compress_array)
from .momentum import momentum_mask, momentum_update
from .adam import adam_apply, adam_moment, adam_onebit_compress, adam_plain
from .powersgd import psgd_gather, psgd_orthogonalize, psgd_scatter
from .verify import check_subnormals, compile_all

__all__ = [
    # loader
    "FAMILIES", "OPTIONS", "PRELUDE", "arch_option", "available", "compile_family", "cupy", "kernel",
    "module", "module_path", "source",
    # launch
    "OB_WARPS", "THREADS", "Resident", "divisor_mode", "resident",
    # kernel wrappers, one family each
    "div_f32", "pack", "unpack", "unpack_div_f32",
    "cast_from16", "cast_to16", "pack_cast", "sum16", "unpack_cast",
    "onebit_compress", "onebit_compress_array", "onebit_decompress_sum", "onebit_decompress_sum_array",
    "twobit_compress", "twobit_compress_array", "twobit_decompress_sum", "twobit_decompress_sum_array",
    "twobit_block_compress", "twobit_block_compress_array", "twobit_block_decompress_sum",
    "twobit_block_decompress_sum_array",
    "randomk_compress", "randomk_compress_array", "randomk_indices", "sparse_decompress_sum",
    "sparse_decompress_sum_array", "topk_compress", "topk_compress_array",
    "momentum_mask", "momentum_update",
    "adam_apply", "adam_moment", "adam_onebit_compress", "adam_plain",
    "psgd_gather", "psgd_orthogonalize", "psgd_scatter",
    # verify
    "check_subnormals", "compile_all",
]
