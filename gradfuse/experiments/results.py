"""Results: the per-run store (resume), the tidy table, and the paired-gap summary.

Layout of an output directory::

    runs/<run id>.json    one finished run: its spec and its result (the resume store)
    results.csv / .json   the tidy table, one row per run and epoch
    runs.csv              one row per run: final metrics, status, error
    summary.csv / .json   one row per experiment x method x world size
    tables.md             the summary as the Markdown tables of docs/experiments.md

The tidy table carries the columns GRACE published its data in (method, ratio,
error_feedback, workers, model, accuracy, throughput, bytes) and the rest of the run's
definition. ``bytes`` is what one rank sent so far (``trainer.stats.bytes_sent``: the
compressor's payloads as its collective sends them; an uncompressed allreduce counted as
a bandwidth-optimal one's 2 (p-1)/p of its bytes); ``ratio`` is the compressor's own
ratio option (top-k, random-k), as in GRACE; the ratio of bytes to fp32 is in the summary.

Paired gap: for each seed that both the method and the fp32 baseline (``none``, same
experiment, world size and seed) finished, ``d = acc_method - acc_fp32``; the summary
gives ``mean(d)`` and its 95 % confidence interval ``mean(d) +- t(0.975, n-1) sd(d)/sqrt(n)``
(Student's t, ``sd`` with n-1 degrees of freedom). The metric is the task's
``gap_metric``: the test accuracy, or for the language model the validation loss
(``objective``, nats/byte), where a positive gap is worse. The relative gap does the
same with ``d = metric_method / metric_fp32 - 1``.
"""
import csv
import hashlib
import json
import math
import os

import numpy as np

from .tasks import TASKS

DONE = ("ok", "diverged")
COLUMNS = ["experiment", "task", "model", "method", "label", "ratio", "error_feedback", "momentum_correction",
           "workers", "seed", "split_seed", "epoch", "epochs", "steps", "train_loss", "accuracy", "objective",
           "throughput", "bytes", "bytes_per_step", "bytes_reduced", "compression", "train_s", "wall_s",
           "diverged", "status", "optimizer", "lr", "momentum", "betas", "eps", "wd", "batch_size", "options",
           "bits_per_byte", "build", "run_id"]
# t(0.975, df) for df = 1..30, for when scipy is missing
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


BUILD_SUFFIXES = (".py", ".pyx", ".pxi", ".h", ".so")
BUILD_TOOL_FILES = ("tasks.py", "taskbase.py", "transformer_lm.py", "worker.py")  # the parts that define a run


def fingerprint(package_dir=None):
    """A hash of the gradfuse build a run trains with (its sources and compiled kernels).

    Covers every ``.py``/``.pyx``/``.pxi``/``.h``/``.so`` file of the gradfuse package,
    except this tool's own modules other than ``BUILD_TOOL_FILES`` (the tasks and the
    worker: a new plot does not make old runs stale; a changed compressor, task or
    training loop does).
    """
    root = package_dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha1()
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        rel = os.path.relpath(d, root)
        for name in sorted(files):
            if not name.endswith(BUILD_SUFFIXES):
                continue
            if rel == "experiments" and name not in BUILD_TOOL_FILES:
                continue
            with open(os.path.join(d, name), "rb") as f:
                h.update(os.path.join(rel, name).encode() + b"\0" + hashlib.sha1(f.read()).digest())
    return h.hexdigest()[:16]


class Store:
    """The finished runs of one output directory, one JSON file each (the resume state)."""

    def __init__(self, out_dir):
        self.dir = os.path.join(out_dir, "runs")
        os.makedirs(self.dir, exist_ok=True)

    def path(self, run_id):
        return os.path.join(self.dir, f"{run_id}.json")

    def load(self, run_id):
        """The stored result of ``run_id``, or None (also for an unreadable file)."""
        try:
            with open(self.path(run_id)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def done(self, run_id, build=None):
        """True when ``run_id`` finished (ok or diverged), with gradfuse build ``build`` if given."""
        r = self.load(run_id)
        return r is not None and r.get("status") in DONE and (build is None or r.get("build") == build)

    def save(self, spec, result):
        result = dict(result, spec=spec.to_dict(), run_id=spec.id)
        tmp = self.path(spec.id) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, allow_nan=True)
        os.replace(tmp, self.path(spec.id))


def t_quantile(df):
    """Student's t 0.975 quantile with ``df`` degrees of freedom."""
    try:
        from scipy.stats import t
        return float(t.ppf(0.975, df))
    except ImportError:
        return _T975[df - 1] if df <= len(_T975) else 1.96


def paired_gap(method, baseline):
    """Mean of ``method[i] - baseline[i]`` with its 95 % t confidence interval.

    Args:
        method, baseline: equal-length sequences, paired by position (by seed).

    Returns:
        ``(mean, low, high, n)``; low/high are nan when n < 2.
    """
    d = np.asarray(method, float) - np.asarray(baseline, float)
    n = len(d)
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    mean = float(d.mean())
    if n < 2:
        return mean, float("nan"), float("nan"), n
    half = t_quantile(n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half, n


def _ef(spec):
    ef = spec["compressor_config"].get("error_feedback")
    return "" if ef is None else bool(ef)


def tidy_rows(specs, store, models):
    """One row per run and epoch for the finished runs among ``specs``."""
    rows = []
    for spec in specs:
        res = store.load(spec.id)
        if res is None or res.get("status") not in DONE:
            continue
        s = spec.to_dict()
        for e in res["epochs"]:
            steps = e.get("steps") or 0
            rows.append({
                "experiment": spec.experiment, "task": spec.task, "model": models.get(spec.task, spec.task),
                "method": spec.compress, "label": spec.label,
                "ratio": spec.compressor_config.get("ratio", ""), "error_feedback": _ef(s),
                "momentum_correction": spec.momentum_correction, "workers": spec.workers, "seed": spec.seed,
                "split_seed": spec.split_seed, "epoch": e["epoch"], "epochs": spec.epochs, "steps": steps,
                "train_loss": e["train_loss"], "accuracy": e["test_accuracy"], "objective": e["objective"],
                "throughput": e["throughput"], "bytes": e["bytes_sent"],
                "bytes_per_step": e["bytes_sent"] / steps if steps else float("nan"),
                "bytes_reduced": e["bytes_reduced"],
                "compression": e["bytes_reduced"] / e["bytes_sent"] if e["bytes_sent"] else float("nan"),
                "train_s": e["train_s"], "wall_s": e["wall_s"], "diverged": bool(e["diverged"]),
                "status": res["status"], "optimizer": spec.optimizer, "lr": spec.lr, "momentum": spec.momentum,
                "betas": json.dumps(spec.betas) if spec.betas is not None else "",
                "eps": spec.eps if spec.eps is not None else "", "wd": spec.wd,
                "batch_size": spec.batch_size, "options": json.dumps(spec.options, sort_keys=True),
                "bits_per_byte": e.get("bits_per_byte", float("nan")),
                "build": res.get("build", "unknown"), "run_id": spec.id})
    return rows


def run_rows(specs, store):
    """One row per run of ``specs``: status, final metrics, error (missing runs: 'missing')."""
    rows = []
    for spec in specs:
        res = store.load(spec.id) or {"status": "missing"}
        last = res.get("epochs", [{}])[-1] if res.get("epochs") else {}
        rows.append({"run_id": spec.id, "experiment": spec.experiment, "label": spec.label,
                     "workers": spec.workers, "seed": spec.seed, "status": res.get("status"),
                     "accuracy": last.get("test_accuracy"), "objective": last.get("objective"),
                     "train_loss": last.get("train_loss"), "bytes": last.get("bytes_sent"),
                     "wall_s": last.get("wall_s"), "launch_s": res.get("launch_s"),
                     "diverged_at": res.get("diverged_at"), "build": res.get("build", ""),
                     "error": res.get("error", "")})
    return rows


def _final(rows):
    """Last epoch row of each run: {run_id: row}."""
    last = {}
    for r in rows:
        if r["run_id"] not in last or r["epoch"] > last[r["run_id"]]["epoch"]:
            last[r["run_id"]] = r
    return last


def _mean_std(v):
    v = np.asarray([x for x in v if x is not None], float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(np.mean(v)), float(np.std(v, ddof=1)) if v.size > 1 else 0.0


def summarize(rows):
    """One summary row per experiment x label x world size (see the module docstring)."""
    final = _final(rows)
    best = {}
    for r in rows:
        o = r["objective"]
        if isinstance(o, float) and math.isfinite(o):
            best[r["run_id"]] = min(best.get(r["run_id"], o), o)
    groups = {}
    for r in final.values():
        groups.setdefault((r["experiment"], r["label"], r["workers"]), []).append(r)
    out = []
    for (exp, label, workers), runs in groups.items():
        runs.sort(key=lambda r: r["seed"])
        mc = runs[0]["momentum_correction"]
        base = [r for r in final.values() if r["experiment"] == exp and r["workers"] == workers
                and r["method"] == "none" and r["momentum_correction"] == mc]
        if not base:
            base = [r for r in final.values() if r["experiment"] == exp and r["workers"] == workers
                    and r["method"] == "none" and r["momentum_correction"] == "default"]
        base_by_seed = {r["seed"]: r for r in base}
        metric = getattr(TASKS.get(runs[0]["task"]), "gap_metric", "accuracy")
        paired = [(r[metric], base_by_seed[r["seed"]][metric]) for r in runs if r["seed"] in base_by_seed]
        none = (float("nan"),) * 3 + (0,)
        gap = paired_gap([p[0] for p in paired], [p[1] for p in paired]) if paired else none
        rel = [p[0] / p[1] - 1.0 if p[1] else float("nan") for p in paired]
        gap_rel = paired_gap(rel, [0.0] * len(rel)) if paired else none
        acc_m, acc_s = _mean_std([r["accuracy"] for r in runs])
        obj_m, obj_s = _mean_std([r["objective"] for r in runs])
        bps = float(np.mean([r["bytes_per_step"] for r in runs]))
        base_bps = float(np.mean([r["bytes_per_step"] for r in base])) if base else float("nan")
        out.append({
            "experiment": exp, "task": runs[0]["task"], "model": runs[0]["model"], "label": label,
            "method": runs[0]["method"], "ratio": runs[0]["ratio"], "error_feedback": runs[0]["error_feedback"],
            "momentum_correction": mc, "workers": workers, "epochs": runs[0]["epochs"],
            "seeds": [r["seed"] for r in runs], "n": len(runs),
            "n_diverged": sum(bool(r["diverged"]) for r in runs),
            "accuracy_mean": acc_m, "accuracy_std": acc_s,
            "accuracy_min": float(np.min([r["accuracy"] for r in runs])),
            "accuracy_max": float(np.max([r["accuracy"] for r in runs])),
            "gap_metric": metric, "gap_mean": gap[0], "gap_ci_low": gap[1], "gap_ci_high": gap[2], "gap_n": gap[3],
            "gap_rel_mean": gap_rel[0], "gap_rel_ci_low": gap_rel[1], "gap_rel_ci_high": gap_rel[2],
            "bits_per_byte_mean": _mean_std([r.get("bits_per_byte", float("nan")) for r in runs])[0],
            "objective_mean": obj_m, "objective_std": obj_s,
            "objective_max": float(np.nanmax([r["objective"] for r in runs])) if not math.isnan(obj_m) else float("nan"),
            "objective_best": min((best[r["run_id"]] for r in runs if r["run_id"] in best), default=float("nan")),
            "bytes_per_step": bps, "ratio_fp32": base_bps / bps if bps else float("nan"),
            "compression": float(np.mean([r["compression"] for r in runs])),
            "builds": sorted({r.get("build", "unknown") for r in runs}),
            "throughput_mean": _mean_std([r["throughput"] for r in runs])[0],
            "wall_s_mean": _mean_std([r["wall_s"] for r in runs])[0]})
    order = {}
    for r in rows:
        order.setdefault((r["experiment"], r["label"], r["workers"]), len(order))
    out.sort(key=lambda s: order[(s["experiment"], s["label"], s["workers"])])
    return out


def _csv_value(v):
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def write_table(path_base, rows, columns=None):
    """Write ``rows`` to ``path_base.csv`` and ``path_base.json``; return the two paths."""
    columns = columns or (list(rows[0]) if rows else [])
    with open(path_base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in columns})
    with open(path_base + ".json", "w") as f:
        json.dump(rows, f, indent=1, allow_nan=True)
    return path_base + ".csv", path_base + ".json"


def write_csv(path, rows):
    columns = list(rows[0]) if rows else []
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(v) for k, v in r.items()})
    return path
