"""The summary as Markdown: the tables of docs/experiments.md.

One table per experiment, shaped by its task's kind: accuracy with the paired gap to
fp32 (classification), the validation loss with its paired gap to fp32, absolute and
relative (the language model), the objective against f(x0) (the counterexample), or
throughput and bytes (the ResNet on random data).
"""
import math

from .tasks import TASKS


def _f(v, fmt="{:.3f}"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _bytes(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.0f}".replace(",", " ")


def _gap(s):
    if s["gap_n"] == 0 or s["method"] == "none":
        return "-"
    pts = f"{100 * s['gap_mean']:+.2f}"
    if math.isnan(s["gap_ci_low"]):
        return f"{pts} (n = {s['gap_n']})"
    return f"{pts} [{100 * s['gap_ci_low']:+.2f}, {100 * s['gap_ci_high']:+.2f}]"


def classification_table(rows):
    lines = ["| method | final test accuracy, mean ± std | min / max | paired gap to fp32, points [95 % CI] "
             "| diverged | bytes sent per step per rank | ratio to fp32 |",
             "|---|---|---|---|---|---|---|"]
    for s in rows:
        lines.append(f"| {s['label']} | {_f(s['accuracy_mean'])} ± {_f(s['accuracy_std'])} (n = {s['n']}) "
                     f"| {_f(s['accuracy_min'])} / {_f(s['accuracy_max'])} | {_gap(s)} "
                     f"| {s['n_diverged']} of {s['n']} | {_bytes(s['bytes_per_step'])} "
                     f"| {_f(s['ratio_fp32'], '{:.1f}x')} |")
    return lines


def _loss_gap(s):
    if s["gap_n"] == 0 or s["method"] == "none":
        return "-", "-"
    if math.isnan(s["gap_ci_low"]):
        return (f"{s['gap_mean']:+.4f} (n = {s['gap_n']})", f"{100 * s['gap_rel_mean']:+.2f} % (n = {s['gap_n']})")
    return (f"{s['gap_mean']:+.4f} [{s['gap_ci_low']:+.4f}, {s['gap_ci_high']:+.4f}]",
            f"{100 * s['gap_rel_mean']:+.2f} % [{100 * s['gap_rel_ci_low']:+.2f}, {100 * s['gap_rel_ci_high']:+.2f}]")


def language_model_table(rows):
    lines = ["| method | final validation loss, nats/byte, mean ± std | bits per byte | paired gap to fp32, "
             "nats/byte [95 % CI] | relative gap [95 % CI] | diverged | bytes sent per step per rank "
             "| ratio to fp32 |",
             "|---|---|---|---|---|---|---|---|"]
    for s in rows:
        gap, rel = _loss_gap(s)
        lines.append(f"| {s['label']} | {_f(s['objective_mean'], '{:.4f}')} ± {_f(s['objective_std'], '{:.4f}')} "
                     f"(n = {s['n']}) | {_f(s['bits_per_byte_mean'])} | {gap} | {rel} "
                     f"| {s['n_diverged']} of {s['n']} | {_bytes(s['bytes_per_step'])} "
                     f"| {_f(s['ratio_fp32'], '{:.1f}x')} |")
    return lines


def optimizer_text(spec):
    """``'SGD lr 0.1 momentum 0.9 wd 0'`` / ``'AdamW lr 0.001 betas (0.9, 0.999) eps 1e-08 wd 0.01'``."""
    if spec.optimizer in ("adam", "adamw"):
        name = {"adam": "Adam", "adamw": "AdamW"}[spec.optimizer]
        return (f"{name} lr {spec.lr:g} betas ({spec.betas[0]:g}, {spec.betas[1]:g}) eps {spec.eps:g} "
                f"wd {spec.wd:g}")
    return f"SGD lr {spec.lr:g} momentum {spec.momentum:g} wd {spec.wd:g}"


def objective_table(rows, f0=None):
    head = "f(x0)" if f0 is None else f"f(x0) = {f0:g}"
    lines = [f"| method | final f(x), mean ± std | largest final f(x) | smallest f(x) reached | vs {head} "
             f"| bytes sent per step per rank |",
             "|---|---|---|---|---|---|"]
    for s in rows:
        verdict = "-"
        if f0 is not None and not math.isnan(s["objective_max"]):
            if s["objective_best"] >= f0 * (1 - 1e-6):
                verdict = "never below f(x0)"
            elif s["objective_max"] < 1e-3 * f0:
                verdict = "every seed below 1e-3 f(x0)"
            else:
                verdict = "mixed"
        lines.append(f"| {s['label']} | {_f(s['objective_mean'], '{:.3g}')} ± {_f(s['objective_std'], '{:.2g}')} "
                     f"(n = {s['n']}) | {_f(s['objective_max'], '{:.3g}')} | {_f(s['objective_best'], '{:.3g}')} "
                     f"| {verdict} | {_bytes(s['bytes_per_step'])} |")
    return lines


def throughput_table(rows):
    lines = ["| method | throughput, samples/s (all ranks) | bytes sent per step per rank | ratio to fp32 "
             "| training time, s (all epochs) |",
             "|---|---|---|---|---|"]
    for s in rows:
        lines.append(f"| {s['label']} | {_f(s['throughput_mean'], '{:.0f}')} | {_bytes(s['bytes_per_step'])} "
                     f"| {_f(s['ratio_fp32'], '{:.1f}x')} | {_f(s['wall_s_mean'], '{:.1f}')} |")
    return lines


def markdown(summary, specs=()):
    """All experiments of ``summary`` as Markdown, each under a heading with its setting."""
    by_exp, order = {}, []
    for s in summary:
        if s["experiment"] not in by_exp:
            order.append(s["experiment"])
        by_exp.setdefault(s["experiment"], []).append(s)
    first_spec = {}
    for sp in specs:
        first_spec.setdefault(sp.experiment, sp)
    out = []
    for exp in order:
        rows = by_exp[exp]
        if len({s["workers"] for s in rows}) > 1:          # several world sizes: say which row is which
            rows = [dict(s, label=f"{s['label']} (p={s['workers']})") for s in rows]
        s0 = rows[0]
        sp = first_spec.get(exp)
        workers = ", ".join(str(w) for w in sorted({s["workers"] for s in rows}))
        setting = f"task `{s0['task']}`, {s0['epochs']} epochs, {workers} workers"
        if sp is not None:
            if TASKS[sp.task].kind == "language_model":
                steps = sp.epochs * TASKS[sp.task](**sp.task_options).options["steps_per_epoch"]
                if sp.max_steps_per_epoch:
                    steps = sp.epochs * min(sp.max_steps_per_epoch, steps // sp.epochs)
                setting += f" ({steps} steps)"
            setting += (f", {optimizer_text(sp)}, batch {sp.batch_size} per "
                        f"rank, split seed {sp.split_seed}, seeds {', '.join(map(str, s0['seeds']))}")
        builds = sorted({b for s in rows for b in s.get("builds", [])})
        setting += f"; gradfuse build {', '.join(builds)}" if len(builds) < 3 else f"; {len(builds)} gradfuse builds"
        out += [f"### {exp}", "", setting, ""]
        kind = TASKS[s0["task"]].kind
        if kind == "objective":
            f0 = None
            if sp is not None:
                f0 = TASKS[sp.task](**sp.task_options).f0()
            out += objective_table(rows, f0)
        elif kind == "throughput":
            out += throughput_table(rows)
        elif kind == "language_model":
            out += language_model_table(rows)
        else:
            out += classification_table(rows)
        out.append("")
    return "\n".join(out)
