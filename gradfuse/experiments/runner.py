"""Run a grid: skip finished runs, launch the rest one by one, then write tables and plots.

A run that asks for something this gradfuse cannot do (a momentum correction the
trainer does not offer for its optimizer) is refused by its worker before any training,
with the reason, and recorded as ``refused``. A run whose worker
fails (non-zero exit, no result, time limit) is reported with its config and the tail
of its stderr, recorded as ``failed``, and the grid goes on; refused and failed runs are
tried again by the next invocation, finished ones (``ok`` or ``diverged``) are not.
"""
import json
import os
import sys
import time

from . import plots, results, tables
from .grid import expand, select
from .launch import find_mpiexec, run_one
from .tasks import TASKS


def _bar(total, initial, desc, enabled):
    try:
        from tqdm import tqdm
    except ImportError:             # the runner works without tqdm, just without a bar
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit="run", disable=not enabled, dynamic_ncols=True,
                file=sys.stderr)


def _say(bar, text):
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


def _failure_report(spec, res):
    cfg = json.dumps(spec.to_dict(), sort_keys=True)
    tail = (res.get("stderr_tail") or "").rstrip() or "(stderr empty)"
    return (f"FAILED run {spec.id} ({spec.label}, seed {spec.seed}, {spec.workers} workers): {res['error']}\n"
            f"  config: {cfg}\n  stderr tail:\n    " + tail.replace("\n", "\n    "))


def _metric(p):
    """A progress line's metric when the worker sent no text of its own."""
    m = p["test_accuracy"] if p["test_accuracy"] == p["test_accuracy"] else p["objective"]
    return f"{m:.4g}"


def run_grid(grid, out_dir, fresh=False, timeout=900.0, mpiexec=None, progress=True, make_plots=True,
             experiments=None, methods=None, run=True, keep_stale=False):
    """Run (or resume) ``grid`` into ``out_dir`` and write its tables and plots.

    Args:
        grid: a grid dict (``grid.load_grid``).
        out_dir: the output directory; ``out_dir/runs`` is the resume store.
        fresh: run every run again, even the finished ones.
        timeout: seconds one run may take before it is killed and reported.
        mpiexec: path of mpiexec (default: beside sys.executable, then PATH).
        progress: show the tqdm bar.
        make_plots: write the PNG figures into ``out_dir/plots``; without matplotlib the
            runner says so before it trains, and writes the tables only.
        experiments, methods: run only these experiments / method labels or names
            (``grid.select``: a name that matches no run raises ``GridError`` before any file
            is touched).
        run: False only rebuilds tables and plots from the finished runs.
        keep_stale: also skip runs finished with another gradfuse build (``fingerprint``);
            by default they are run again, so a table never mixes builds unasked.

    Returns:
        dict with ``counts`` (per status), ``failed`` and ``refused`` (lists of
        ``(run id, message)``), ``wall_s``, ``summary`` and the written ``paths``.
    """
    t0 = time.perf_counter()
    specs = select(expand(grid), experiments, methods)
    if make_plots:
        why = plots.unavailable()
        if why:
            print(f"gradfuse-experiments: {why}: the runs and tables are made, the plots are not (pip install "
                  f"'gradfuse[experiments]' for them; --no-plots or make_plots=False silences this)",
                  file=sys.stderr, flush=True)
            make_plots = False
    store = results.Store(out_dir)
    build = results.fingerprint()
    done = {s.id for s in specs if not fresh and store.done(s.id, None if keep_stale else build)}
    stale = [s for s in specs if s.id not in done and not fresh and store.done(s.id)]
    todo = [s for s in specs if s.id not in done] if run else []
    failed, refused = [], []
    if todo:
        mpiexec = find_mpiexec(mpiexec)
    bar = _bar(len(specs), len(specs) - len(todo), grid.get("name", "grid"), progress) if todo else None
    if done and todo:
        _say(bar, f"resuming: {len(done)} of {len(specs)} runs already finished in {out_dir}, skipped")
    if stale and todo:
        _say(bar, f"{len(stale)} finished runs were made with another gradfuse build than {build}: running them "
                  f"again (--keep-stale keeps them)")
    try:
        for k, spec in enumerate(todo):
            tag = f"{spec.experiment} {spec.label} s{spec.seed} w{spec.workers}"
            if bar is not None:
                bar.set_postfix_str(tag)
            def on_progress(p, tag=tag):
                if bar is not None:
                    bar.set_postfix_str(f"{tag} epoch {p['epoch']}/{p['epochs']} step {p.get('steps', '?')} "
                                        f"{p.get('progress') or _metric(p)}")
            # the worker decides what momentum correction maps to (it sees DistributedTrainer)
            res = run_one(spec, mpiexec, timeout=timeout, on_progress=on_progress,
                          cache_dir=os.path.join(out_dir, "cache"))
            res["build"] = build
            store.save(spec, res)
            if res["status"] == "failed":
                failed.append((spec.id, res["error"]))
                _say(bar, _failure_report(spec, res))
            elif res["status"] == "refused":
                refused.append((spec.id, res["error"]))
                _say(bar, f"REFUSED run {spec.id}: {res['error']}")
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    paths = write_outputs(specs, store, out_dir, make_plots)
    counts = {}
    for s in specs:
        st = (store.load(s.id) or {}).get("status", "missing")
        counts[st] = counts.get(st, 0) + 1
    return {"counts": counts, "failed": failed, "refused": refused, "wall_s": time.perf_counter() - t0,
            "summary": paths.pop("_summary"), "paths": paths, "runs": len(specs),
            "skipped": len(done) if run else sum(store.done(s.id) for s in specs)}


def write_outputs(specs, store, out_dir, make_plots=True):
    """Write results/runs/summary tables, tables.md and the plots for ``specs``."""
    models = {name: cls.model for name, cls in TASKS.items()}
    rows = results.tidy_rows(specs, store, models)
    summary = results.summarize(rows)
    paths = {}
    paths["results"] = results.write_table(os.path.join(out_dir, "results"), rows, results.COLUMNS)
    paths["runs"] = results.write_csv(os.path.join(out_dir, "runs.csv"), results.run_rows(specs, store))
    if summary:
        paths["summary"] = results.write_table(os.path.join(out_dir, "summary"), summary)
        md = os.path.join(out_dir, "tables.md")
        with open(md, "w") as f:
            f.write(tables.markdown(summary, specs))
        paths["tables"] = md
    if make_plots and rows:
        paths["plots"] = plots.make_all(rows, summary, os.path.join(out_dir, "plots"), specs)
    paths["_summary"] = summary
    return paths
