"""Compression-accuracy experiments: ``gradfuse-experiments`` / ``python -m gradfuse.experiments``.

A tool on top of gradfuse: it trains real MXNet Gluon models with
``gradfuse.mxnet.DistributedTrainer`` (SGD, Adam or AdamW) over a grid of compressors x
options x error feedback x momentum correction x seeds x world sizes, starting
``mpiexec -n N`` itself for every run, and writes a tidy table (CSV and JSON), a paired-gap summary with 95 %
confidence intervals, Markdown tables and PNG plots. See docs/experiments.md.

Modules, one concern each: ``cli`` (command line), ``grid`` (grid files, expansion,
validation, the optimizers' options), ``builtin`` (the quick / default / acceptance
grids), ``tasks`` (models and data, the registry), ``transformer_lm`` (the byte-level
Transformer LM on the standard library's sources), ``taskbase`` (the tasks' base class),
``worker`` (one run, under mpiexec), ``launch`` (mpiexec, pinned threads), ``runner``
(resume, progress, failures), ``results`` (store, tidy table, summary), ``tables``
(Markdown), ``plots`` (matplotlib).

Example:
    >>> from gradfuse.experiments import load_grid, run_grid
    >>> res = run_grid(load_grid("quick"), "experiments-out/quick")   # doctest: +SKIP
"""
from .grid import GridError, RunSpec, UnsupportedError, expand, load_grid


def run_grid(grid, out_dir, **kw):
    """Run or resume ``grid`` into ``out_dir`` (see ``gradfuse.experiments.runner.run_grid``)."""
    from .runner import run_grid as _run
    return _run(grid, out_dir, **kw)


__all__ = ["GridError", "RunSpec", "UnsupportedError", "expand", "load_grid", "run_grid"]
