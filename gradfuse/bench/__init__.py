"""Benchmarks: ratios measured side by side in one run (this machine is shared and noisy).

    python -m gradfuse.bench fusion                  # pack+unpack GB/s vs np.copyto
    python -m gradfuse.bench compress                # compressor kernels vs numpy and copy bandwidth
    mpiexec -n 2 python -m gradfuse.bench allreduce  # vs per-tensor mpi4py, naive fusion, Horovod
    mpiexec -n 2 python -m gradfuse.bench threshold  # gradfuse time per fusion threshold
    mpiexec -n 3 python -m gradfuse.bench collectives  # every compressor: time and bytes per rank
    python -m gradfuse.bench gpu [--pipeline]        # CUDA kernels vs a D2D copy (gradfuse.bench.gpu)

Every method runs once per round, methods alternate inside a round, and the table
reports the median over rounds, so drifting machine load hits all methods alike.
Nothing here asserts a target: the numbers are what they are. docs/benchmarks.md
holds the tables these commands printed.
"""
