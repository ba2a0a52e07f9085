"""``gradfuse-experiments`` / ``python -m gradfuse.experiments``: the command line.

    gradfuse-experiments --quick                     # CI smoke grid, under 2 minutes
    gradfuse-experiments                             # the default grid: docs/experiments.md
    gradfuse-experiments --grid acceptance           # the full training-fidelity grid
    gradfuse-experiments --grid my.toml --out runs/  # your own grid (see --print-grid)

Results go to ``experiments-out/<grid name>/`` unless ``--out`` says otherwise; a second
invocation with the same output directory resumes (finished runs are skipped).
Exit status: 0 when every run finished (ok or diverged), 1 when a run failed or was
refused, 2 for a bad command line or grid, before any run starts and any file is written:
--experiments or --methods naming nothing in the grid (the message lists the valid
names), an --out that cannot be written, a --timeout that is not a number > 0. Without
matplotlib the runs and tables are made and the plots are not (one message says so first).
"""
import argparse
import math
import os
import signal
import sys
import tempfile
import threading

from .grid import GridError, expand, load_grid, select, to_toml
from .launch import LaunchError


def _ints(text, flag):
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise GridError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals:
        raise GridError(f"{flag} is empty")
    return vals


def _names(text):
    return None if text is None else [v.strip() for v in text.split(",") if v.strip()]


def _seconds(text):
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return v


def _check_out(out):
    """Make ``out`` and write a scratch file in it, so that an unwritable --out stops us
    before any run, not at the first result."""
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".gradfuse-write-check-", dir=out)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise GridError(f"--out {out!r} cannot be written: {exc.strerror or exc}") from None


def parser():
    """The argument parser (its --help is the runner's reference)."""
    p = argparse.ArgumentParser(prog="gradfuse-experiments", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--grid", default="default",
                   help="a built-in grid (quick, default, acceptance) or a TOML file (default: default)")
    p.add_argument("--quick", action="store_true", help="the CI grid (same as --grid quick)")
    p.add_argument("--out", help="output directory (default: experiments-out/<grid name>)")
    p.add_argument("--seeds", help="override the seeds of every experiment, e.g. 0,1,2")
    p.add_argument("--epochs", type=int, help="override the epochs of every experiment")
    p.add_argument("--workers", help="override the world sizes, e.g. 2,3")
    p.add_argument("--experiments", help="run only these experiments (comma-separated names)")
    p.add_argument("--methods", help="run only these methods: labels ('1bit no EF') or compressor names")
    p.add_argument("--fresh", action="store_true", help="rerun finished runs instead of skipping them")
    p.add_argument("--keep-stale", action="store_true", help="also skip runs finished with another gradfuse "
                                                            "build (by default they are run again)")
    p.add_argument("--timeout", type=_seconds, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--mpiexec", help="mpiexec to use (default: beside the interpreter, then PATH)")
    p.add_argument("--no-plots", action="store_true", help="write no PNG figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report", action="store_true", help="run nothing: rebuild tables and plots from the "
                                                        "finished runs")
    p.add_argument("--list", action="store_true", help="print the runs of the grid (after --experiments and "
                                                      "--methods) and exit")
    p.add_argument("--print-grid", action="store_true", help="print the grid as TOML and exit")
    return p


def _override(grid, args):
    if args.seeds:
        seeds = _ints(args.seeds, "--seeds")
    if args.workers:
        workers = _ints(args.workers, "--workers")
    for table in [grid.setdefault("defaults", {})] + list(grid.get("experiments", [])):
        if args.seeds:
            table["seeds"] = seeds
        if args.workers:
            table["workers"] = workers
    if args.epochs is not None:
        for exp in grid.get("experiments", []):
            exp["epochs"] = args.epochs
    return grid


def main(argv=None):
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    args = parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM as an exception, so a run in flight is stopped (launch.run_one) and no ranks outlive us
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        grid = _override(load_grid("quick" if args.quick else args.grid), args)
        if args.print_grid:
            sys.stdout.write(to_toml(grid))
            return 0
        experiments, methods = _names(args.experiments), _names(args.methods)
        specs = select(expand(grid), experiments, methods, flags=("--experiments", "--methods"))
        if args.list:
            for s in specs:
                print(f"{s.id}\t{s.experiment}\t{s.label}\tseed {s.seed}\t{s.workers} workers\t{s.epochs} epochs")
            print(f"{len(specs)} runs", file=sys.stderr)
            return 0
        from .runner import run_grid
        out = args.out or os.path.join("experiments-out", grid.get("name", "grid"))
        _check_out(out)
        res = run_grid(grid, out, fresh=args.fresh, timeout=args.timeout, mpiexec=args.mpiexec,
                       progress=not args.no_progress, make_plots=not args.no_plots,
                       experiments=experiments, methods=methods, run=not args.report,
                       keep_stale=args.keep_stale)
    except (GridError, LaunchError) as exc:
        print(f"gradfuse-experiments: error: {exc}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{v} {k}" for k, v in sorted(res["counts"].items()))
    print(f"{res['runs']} runs ({counts}; {res['skipped']} skipped as finished) in {res['wall_s']:.0f} s; "
          f"results in {out}", file=sys.stderr)
    if "tables" in res["paths"]:
        print(f"tables: {res['paths']['tables']}", file=sys.stderr)
    for rid, err in res["failed"]:
        print(f"failed: {rid}: {err}", file=sys.stderr)
    for rid, err in res["refused"]:
        print(f"refused: {rid}: {err}", file=sys.stderr)
    return 1 if res["failed"] or res["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
