"""PNG figures from the tidy table (matplotlib, Agg backend: no display needed).

Per classification experiment:

* ``<experiment>_accuracy_vs_epoch.png``: test accuracy against epoch, one line per
  method (the mean over seeds) with a mean ± std band;
* ``<experiment>_accuracy_vs_bytes.png``: the same against the bytes one rank has sent
  so far (log scale), which puts the compressors' savings on the x axis;
* ``<experiment>_final_accuracy.png``: bars of the final accuracy (mean, ± std error
  bars, one dot per seed).

Per language-model experiment: ``<experiment>_loss_vs_epoch.png``,
``<experiment>_loss_vs_bytes.png`` and ``<experiment>_final_loss.png``, the same three
for the validation loss (nats/byte).

Per objective experiment (the counterexample): ``<experiment>_objective_vs_epoch.png``,
f(x) on a log scale, the median over seeds with a min-max band, and f(x0) dashed.
Per throughput experiment: ``<experiment>_throughput.png``, samples/s and bytes per step.
"""
import os

import numpy as np

from .tasks import TASKS


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def unavailable():
    """Why the figures cannot be drawn in this process (matplotlib missing or broken), or None.

    The runner asks before it trains, so a missing ``experiments`` extra costs the plots,
    not the runs.
    """
    try:
        _plt()
    except ImportError as exc:
        return f"matplotlib cannot be imported ({exc})"
    return None


def _series(rows, key):
    """{label: (epochs, matrix seeds x epochs of key, matrix of bytes)} for one experiment."""
    by_label = {}
    for r in rows:
        by_label.setdefault(r["label"], {}).setdefault(r["seed"], []).append(r)
    out = {}
    for label, seeds in by_label.items():
        n = min(len(v) for v in seeds.values())
        runs = [sorted(v, key=lambda r: r["epoch"])[:n] for v in seeds.values()]
        epochs = np.array([r["epoch"] for r in runs[0]])
        vals = np.array([[r[key] for r in run] for run in runs], float)
        sent = np.array([[r["bytes"] for r in run] for run in runs], float)
        out[label] = (epochs, vals, sent)
    return out


def _band(ax, x, vals, label, color, clip=(0, 1)):
    mean = np.nanmean(vals, axis=0)
    std = np.nanstd(vals, axis=0, ddof=1) if vals.shape[0] > 1 else np.zeros_like(mean)
    ax.plot(x, mean, label=f"{label} (n={vals.shape[0]})", color=color)
    # accuracy is a fraction: the band is clipped to [0, 1] (the std of a bimodal set of
    # seeds, one diverged and four trained, would otherwise reach past 1)
    ax.fill_between(x, np.clip(mean - std, *clip), np.clip(mean + std, *clip), color=color, alpha=0.2,
                    linewidth=0)


def _title(rows):
    r = rows[0]
    if r.get("optimizer", "sgd") in ("adam", "adamw"):
        opt = f"{'AdamW' if r['optimizer'] == 'adamw' else 'Adam'} lr {r['lr']:g} wd {r['wd']:g}"
    else:
        opt = f"SGD lr {r['lr']:g} momentum {r['momentum']:g}"
    return f"{r['experiment']}: {r['model']}, {r['workers']} workers, {opt}, batch {r['batch_size']}/rank"


# (column, y label, file stem, y limits of the bars, band clip) per kind of task
METRICS = {"classification": ("accuracy", "test accuracy", "accuracy", (0, 1), (0, 1)),
           "language_model": ("objective", "validation loss, nats/byte", "loss", None, (0, np.inf))}


def classification_plots(rows, out_dir, exp, kind="classification"):
    key, ylabel, stem, ylim, clip = METRICS[kind]
    plt = _plt()
    series = _series(rows, key)
    colors = plt.get_cmap("tab10")
    paths = []
    for xkey in ("epoch", "bytes"):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for i, (label, (epochs, acc, sent)) in enumerate(series.items()):
            x = epochs if xkey == "epoch" else np.nanmean(sent, axis=0)
            keep = x > 0 if xkey == "bytes" else np.ones(len(x), bool)    # epoch 0 sent nothing
            _band(ax, x[keep], acc[:, keep], label, colors(i % 10), clip)
        if xkey == "bytes":
            ax.set_xscale("log")
            ax.set_xlabel("bytes sent by one rank so far (log scale)")
        elif kind == "classification":
            ax.set_xlabel("epoch")
        else:
            last = max(rows, key=lambda r: r["epoch"])
            ax.set_xlabel(f"epoch ({last['steps'] // max(last['epoch'], 1)} steps each)")
        ax.set_ylabel(f"{ylabel} (mean ± std over seeds)")
        ax.set_title(_title(rows), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right" if kind == "classification" else "upper right")
        path = os.path.join(out_dir, f"{exp}_{stem}_vs_{xkey}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    labels = list(series)
    finals = [series[lab][1][:, -1] for lab in labels]
    means = [float(np.nanmean(v)) for v in finals]
    stds = [float(np.nanstd(v, ddof=1)) if len(v) > 1 else 0.0 for v in finals]
    ax.bar(range(len(labels)), means, yerr=stds, color=[colors(i % 10) for i in range(len(labels))],
           alpha=0.7, capsize=4)
    for i, v in enumerate(finals):
        ax.scatter(np.full(len(v), i), v, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"final {ylabel}")
    if ylim is not None:
        ax.set_ylim(*ylim)
    else:                       # the loss: start near the lowest bar so that the gaps show
        lo = min(float(np.nanmin(v)) for v in finals)
        ax.set_ylim(0.95 * lo if np.isfinite(lo) else 0, None)
    ax.set_title(_title(rows), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{exp}_final_{stem}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return paths + [path]


def objective_plot(rows, out_dir, exp, f0=None):
    plt = _plt()
    colors = plt.get_cmap("tab10")
    series = _series(rows, "objective")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (label, (epochs, vals, _)) in enumerate(series.items()):
        c = colors(i % 10)
        ax.plot(epochs, np.nanmedian(vals, axis=0), color=c, label=f"{label} (n={vals.shape[0]})")
        ax.fill_between(epochs, np.nanmin(vals, axis=0), np.nanmax(vals, axis=0), color=c, alpha=0.2,
                        linewidth=0)
    if f0 is not None:
        ax.axhline(f0, color="gray", linestyle="--", linewidth=1, label=f"f(x0) = {f0:g}")
    ax.set_yscale("log")
    ax.set_xlabel(f"epoch ({rows[0]['steps'] // max(rows[0]['epoch'], 1)} steps each)")
    ax.set_ylabel("f(x) (median, min-max band over seeds)")
    ax.set_title(_title(rows), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{exp}_objective_vs_epoch.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def throughput_plot(summary, out_dir, exp):
    plt = _plt()
    labels = [s["label"] for s in summary]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    axes[0].bar(range(len(labels)), [s["throughput_mean"] for s in summary], color="tab:blue", alpha=0.7)
    axes[0].set_ylabel("samples/s, all ranks (shared memory, 2 cores)")
    axes[1].bar(range(len(labels)), [s["bytes_per_step"] for s in summary], color="tab:orange", alpha=0.7)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("bytes sent per step per rank (log)")
    for ax in axes:
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{exp}: {summary[0]['model']}, {summary[0]['workers']} workers", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{exp}_throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def make_all(rows, summary, out_dir, specs=()):
    """Every figure for the experiments in ``rows``; returns the PNG paths."""
    os.makedirs(out_dir, exist_ok=True)
    f0s = {}
    for sp in specs:
        if TASKS[sp.task].kind == "objective" and sp.experiment not in f0s:
            f0s[sp.experiment] = TASKS[sp.task](**sp.task_options).f0()
    paths = []
    for exp in dict.fromkeys(r["experiment"] for r in rows):
        exp_rows = [r for r in rows if r["experiment"] == exp]
        for workers in sorted({r["workers"] for r in exp_rows}):
            sub = [r for r in exp_rows if r["workers"] == workers]
            name = exp if len({r["workers"] for r in exp_rows}) == 1 else f"{exp}_w{workers}"
            kind = TASKS[sub[0]["task"]].kind
            if kind == "objective":
                paths += objective_plot(sub, out_dir, name, f0s.get(exp))
            elif kind == "throughput":
                summ = [s for s in summary if s["experiment"] == exp and s["workers"] == workers]
                paths += throughput_plot(summ, out_dir, name)
            else:
                paths += classification_plots(sub, out_dir, name, kind if kind in METRICS else "classification")
    return paths
