"""gradfuse.experiments: the runner end to end through mpiexec, and its pieces.

No mocks of the training: every run here is a real Gluon model trained with
``gradfuse.mxnet.DistributedTrainer`` on 2 ranks started by the runner's own mpiexec.
The whole file takes about 2 minutes on 2 cores (the quick grid is most of it).
"""
import csv
import json
import math
import os
import sys

import pytest

pytest.importorskip("mxnet")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
from helpers import run_limited  # noqa: E402

from gradfuse.experiments import grid as G  # noqa: E402
from gradfuse.experiments import results as R  # noqa: E402
from gradfuse.experiments.launch import LaunchError, find_mpiexec  # noqa: E402
from gradfuse.experiments.tasks import Counterexample  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_COLUMNS = ["method", "ratio", "error_feedback", "workers", "model", "accuracy", "throughput", "bytes"]


def cli(*args, timeout=600):
    """``python -m gradfuse.experiments ARGS`` with a hard time limit; (code, output)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code, out, timed_out = run_limited([sys.executable, "-m", "gradfuse.experiments", "--no-progress", *args],
                                       timeout=timeout, env=env, cwd=ROOT)
    assert not timed_out, f"gradfuse-experiments {' '.join(args)} timed out:\n{out[-3000:]}"
    return code, out


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_grid(path, text):
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick grid (what CI runs), once for the module."""
    out = tmp_path_factory.mktemp("quick")
    code, log = cli("--quick", "--out", str(out))
    assert code == 0, log[-4000:]
    return out, log


# --- end to end ------------------------------------------------------------------------
@pytest.mark.mpi
def test_quick_grid_writes_tables_and_plots(quick):
    out, log = quick
    rows = read_csv(out / "results.csv")
    assert rows and all(c in rows[0] for c in GRACE_COLUMNS + ["train_loss", "wall_s", "epoch", "seed"])
    with open(out / "results.json") as f:
        assert len(json.load(f)) == len(rows)
    specs = G.expand(G.load_grid("quick"))
    assert {r["run_id"] for r in rows} == {s.id for s in specs}
    assert len(rows) == sum(s.epochs + 1 for s in specs)          # epochs 0..E of every run
    assert all(r["status"] == "ok" for r in read_csv(out / "runs.csv"))
    digits = [r for r in rows if r["experiment"] == "digits" and r["epoch"] == "3"]
    none = [r for r in digits if r["method"] == "none"]
    assert all(float(r["accuracy"]) > 0.5 for r in none), none    # fp32 learns in 3 epochs
    onebit = [r for r in digits if r["method"] == "1bit"]
    assert {r["error_feedback"] for r in onebit} == {"True", "False"}
    for r in onebit:                                               # ~30x fewer bytes than fp32
        assert 25 < float(none[0]["bytes_per_step"]) / float(r["bytes_per_step"]) < 35
    summary = read_csv(out / "summary.csv")
    assert {s["label"] for s in summary if s["experiment"] == "digits"} == {"none", "1bit EF", "1bit no EF"}
    tables = (out / "tables.md").read_text()
    assert "| 1bit no EF |" in tables and "paired gap to fp32" in tables
    pngs = sorted(p.name for p in (out / "plots").iterdir())
    for name in ("digits_accuracy_vs_epoch.png", "digits_accuracy_vs_bytes.png", "digits_final_accuracy.png",
                 "counterexample_objective_vs_epoch.png", "mlp_final_accuracy.png", "resnet_throughput.png"):
        assert name in pngs
        with open(out / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.mpi
def test_counterexample_sign_fails_without_error_feedback_and_converges_with_it(quick):
    out, _ = quick
    f0 = Counterexample().f0()                  # 8 eps^2 = 2 at eps 0.5
    with open(out / "results.json") as f:
        rows = [r for r in json.load(f) if r["experiment"] == "counterexample"]
    by = {}
    for r in rows:
        by.setdefault(r["label"], []).append(r)
    no_ef, ef, sgd = by["1bit no EF"], by["1bit EF"], by["none"]
    # without error feedback: never below f(x0), the iterates stay on x1 + x2 = 2
    assert min(r["objective"] for r in no_ef) >= f0 * (1 - 1e-5)
    for name in os.listdir(out / "runs"):
        res = json.load(open(out / "runs" / name))
        if res["spec"]["experiment"] == "counterexample" and res["spec"]["options"] == {"error_feedback": False}:
            assert all(abs(sum(e["x"]) - 2.0) < 1e-5 for e in res["epochs"])
    # with it (and plain SGD): f falls by many orders of magnitude
    last = max(r["epoch"] for r in rows)
    for runs in (ef, sgd):
        assert max(r["objective"] for r in runs if r["epoch"] == last) < 1e-6 * f0


@pytest.mark.mpi
def test_resume_skips_finished_runs(quick, tmp_path):
    out, _ = quick
    # --keep-stale: the other sessions editing this tree must not turn "finished" into "stale"
    # between the two invocations (the build check itself is test_store_done_checks_the_build)
    mtimes = {p: os.path.getmtime(p) for p in (out / "runs").iterdir()}
    code, log = cli("--quick", "--out", str(out), "--keep-stale")
    assert code == 0, log
    assert f"{len(mtimes)} skipped as finished" in log, log
    assert {p: os.path.getmtime(p) for p in (out / "runs").iterdir()} == mtimes
    victim = sorted(p for p in mtimes if "digits-none-s1" in p.name)[0]
    os.remove(victim)
    code, log = cli("--quick", "--out", str(out), "--keep-stale")
    assert code == 0 and f"{len(mtimes) - 1} skipped as finished" in log, log
    assert victim.exists()


def test_store_done_checks_the_build(tmp_path):
    spec = G.expand(base())[0]
    store = R.Store(str(tmp_path))
    assert not store.done(spec.id)
    store.save(spec, {"status": "failed", "error": "x", "build": "b1"})
    assert not store.done(spec.id)                          # failed runs are tried again
    store.save(spec, {"status": "diverged", "epochs": [], "build": "b1"})
    assert store.done(spec.id) and store.done(spec.id, "b1") and not store.done(spec.id, "b2")
    fp = R.fingerprint()
    assert fp == R.fingerprint() and len(fp) == 16


TINY = """
name = "tiny"
[defaults]
seeds = [{seed}]
max_steps_per_epoch = 8
[[experiments]]
name = "digits"
task = "digits_cnn"
epochs = 2
methods = [{{compress = "1bit"}}, {{compress = "none"}}]
"""


@pytest.mark.mpi
def test_same_seed_gives_identical_metrics(tmp_path):
    metrics = []
    for i, seed in enumerate((3, 3, 4)):
        cfg = write_grid(tmp_path / f"tiny{i}.toml", TINY.format(seed=seed))
        code, log = cli("--grid", cfg, "--out", str(tmp_path / f"out{i}"), "--no-plots")
        assert code == 0, log
        rows = read_csv(tmp_path / f"out{i}" / "results.csv")
        metrics.append([(r["label"], r["epoch"], r["train_loss"], r["accuracy"], r["bytes"]) for r in rows])
    assert metrics[0] == metrics[1]             # same seed: bit-identical losses, accuracies, bytes
    assert metrics[0] != metrics[2]             # another seed: another run


# --- failures, divergence, refusals ----------------------------------------------------
TROUBLE = """
name = "trouble"
[defaults]
seeds = [0]
[[experiments]]
name = "toobig"
task = "digits_cnn"
epochs = 1
batch_size = 1000
methods = [{compress = "none"}]
[[experiments]]
name = "diverge"
task = "digits_cnn"
epochs = 2
lr = 1.0e20
max_steps_per_epoch = 10
methods = [{compress = "none"}, {compress = "1bit"}]
"""


@pytest.mark.mpi
def test_failure_is_reported_and_the_grid_goes_on_divergence_is_a_result(tmp_path):
    cfg = write_grid(tmp_path / "trouble.toml", TROUBLE)
    code, log = cli("--grid", cfg, "--out", str(tmp_path / "out"))
    assert code == 1, log
    assert "FAILED run toobig-none-s0-w2" in log and "fewer samples per rank than one batch of 1000" in log, log
    assert '"batch_size": 1000' in log                      # the failing run's config is printed
    runs = {r["experiment"] + " " + r["label"]: r for r in read_csv(tmp_path / "out" / "runs.csv")}
    assert runs["toobig none"]["status"] == "failed"
    for label in ("diverge none", "diverge 1bit EF"):       # NaN is recorded, not a failure
        assert runs[label]["status"] == "diverged", runs[label]
        assert float(runs[label]["accuracy"]) == pytest.approx(0.1) and runs[label]["train_loss"] == "nan"


def test_momentum_correction_is_mapped_or_refused(tmp_path):
    import inspect

    import gradfuse.mxnet as hvd
    from gradfuse.compressors import create
    specs = G.expand({"name": "mc", "defaults": {"seeds": [0], "momentum_correction": ["on", "off", "default"]},
                      "experiments": [{"task": "digits_cnn", "epochs": 1,
                                       "methods": [{"compress": "none"}, {"compress": "1bit"}]}]})
    on, off, default = (s for s in specs if s.compress == "1bit")
    assert (on.label, off.label, default.label) == ("1bit EF +MC", "1bit EF -MC", "1bit EF")
    params = inspect.signature(hvd.DistributedTrainer).parameters
    assert G.correction_options(default, params) == {}
    if "momentum_correction" in params:           # the trainer has the axis as its keyword
        assert G.correction_options(on, params) == {"momentum_correction": True}
        assert G.correction_options(off, params) == {"momentum_correction": False}
        return
    try:
        create("1bit", momentum=0.9)
    except TypeError:
        pass
    else:                                         # a compressor option without the trainer's
        assert G.correction_options(on, params) == {"momentum": 0.9}
        return
    # a gradfuse without the correction: "on" is refused, never run without it
    assert G.correction_options(off, params) == {}
    with pytest.raises(G.UnsupportedError, match=r"momentum correction.*does not support it.*refused"):
        G.correction_options(on, params)
    cfg = write_grid(tmp_path / "mc.toml", """
name = "mc"
[defaults]
seeds = [0]
momentum_correction = ["on"]
[[experiments]]
name = "digits"
task = "digits_cnn"
epochs = 1
methods = [{compress = "1bit"}, {compress = "none", momentum_correction = "default"}]
""")
    code, log = cli("--grid", cfg, "--out", str(tmp_path / "out"), "--methods", "1bit EF +MC", "--no-plots")
    assert code == 1 and "REFUSED run digits-1bit-EF--MC-s0-w2" in log and "does not support it" in log, log
    runs = read_csv(tmp_path / "out" / "runs.csv")
    assert runs[0]["status"] == "refused" and "refused rather than run" in runs[0]["error"]


# --- the grid and its errors ------------------------------------------------------------
def base(**exp):
    e = {"name": "e", "task": "digits_cnn", "epochs": 1, "methods": [{"compress": "none"}]}
    e.update(exp)
    return {"name": "g", "defaults": {"seeds": [0]}, "experiments": [e]}


@pytest.mark.parametrize("grid, message", [
    (base(methods=[{"compress": "none"}, {"compress": "3bit"}]), r"unknown compressor '3bit'; valid names: .*1bit"),
    (base(methods=[{"compress": "none"}, {"compress": "topk", "lr": 0.5}]),
     r"method 'topk' sets lr; hyperparameters are per experiment"),
    (base(methods=[{"compress": "none"}, {"compress": "topk", "ratio": 2.0}]), r"'ratio' must be .* got 2.0"),
    (base(methods=[{"compress": "none"}, {"compress": "1bit", "blocksize": 64}]), r"unknown option\(s\) blocksize"),
    (base(task="cifar"), r"unknown task 'cifar'; valid tasks: counterexample, digits_cnn, mlp, resnet"),
    (base(task_options={"depth": 3}), r"task 'digits_cnn': unknown option\(s\) depth"),
    (base(workers=[1], methods=[{"compress": "none"}, {"compress": "1bit"}]), r"workers=1 with compressor '1bit'"),
    (base(seeds=[0, 0]), r"'seeds' repeats a seed"),
    (base(momentum_correction=["maybe"]), r"'momentum_correction' must be one of default, on, off.*'maybe'"),
    (base(momentum=0.0, momentum_correction=["on"]), r"needs momentum > 0"),
    (base(methods=[{"compress": "1bit"}]), r"no 'none' method"),
    (base(lr=-1), r"'lr' must be a number > 0, got -1"),
    (base(epoch=3), r"unknown key\(s\) epoch"),
    ({"name": "g", "defaults": {"seed": [0]}, "experiments": []}, r"unknown key\(s\) in \[defaults\]: seed"),
])
def test_bad_grid_raises_an_error_naming_the_problem(grid, message):
    with pytest.raises(G.GridError, match=message):
        G.expand(grid)


def test_bad_grid_file_on_the_command_line_exits_2(tmp_path):
    bad = write_grid(tmp_path / "bad.toml", "[defaults\nlr = 0.1\n")
    code, log = cli("--grid", bad, "--list")
    assert code == 2 and "invalid TOML" in log, log
    code, log = cli("--grid", "nosuchgrid", "--list")
    assert code == 2 and "neither a built-in grid (acceptance, default, quick)" in log, log
    code, log = cli("--quick", "--seeds", "0,x", "--list")
    assert code == 2 and "--seeds takes comma-separated integers, got '0,x'" in log, log


def test_builtin_grids_expand_and_round_trip_through_toml(tmp_path):
    for name in ("quick", "default", "acceptance"):
        g = G.load_grid(name)
        specs = G.expand(g)
        path = write_grid(tmp_path / f"{name}.toml", G.to_toml(g))
        assert [s.id for s in G.expand(G.load_grid(path))] == [s.id for s in specs]
        assert len({s.id for s in specs}) == len(specs)
    labels = {s.label for s in G.expand(G.load_grid("default")) if s.experiment == "digits"}
    assert labels == {"none", "fp16", "bf16", "1bit EF", "1bit no EF", "2bit EF", "topk 1% EF", "randomk 1% EF"}
    acc = [s for s in G.expand(G.load_grid("acceptance")) if s.experiment == "digits"]
    assert {s.epochs for s in acc} == {30} and {s.seed for s in acc} == {0, 1, 2, 3, 4}
    assert {(s.lr, s.momentum, s.batch_size, s.workers) for s in acc} == {(0.1, 0.9, 32, 2)}


def test_mpiexec_is_found_beside_the_interpreter_first():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(beside):
        assert find_mpiexec() == beside
    with pytest.raises(LaunchError, match="is not an executable file"):
        find_mpiexec("/nonexistent/mpiexec")


# --- the statistics ----------------------------------------------------------------------
def test_paired_gap_and_confidence_interval_by_hand():
    method = [0.95, 0.93, 0.96, 0.94, 0.97]
    fp32 = [0.96, 0.95, 0.96, 0.96, 0.97]
    # d = -0.01, -0.02, 0, -0.02, 0: mean -0.01; sd = sqrt(4 * 0.0001 / 4) = 0.01;
    # t(0.975, 4) = 2.7764; half width = 2.7764 * 0.01 / sqrt(5) = 0.012416
    mean, low, high, n = R.paired_gap(method, fp32)
    assert n == 5 and mean == pytest.approx(-0.01)
    assert low == pytest.approx(-0.01 - 0.012416, abs=2e-6) and high == pytest.approx(-0.01 + 0.012416, abs=2e-6)
    assert R.t_quantile(4) == pytest.approx(2.7764, abs=1e-4)
    mean, low, high, n = R.paired_gap([0.9], [0.8])
    assert n == 1 and mean == pytest.approx(0.1) and math.isnan(low) and math.isnan(high)


def test_summary_pairs_by_seed():
    def row(label, method, seed, acc):
        return {"experiment": "e", "task": "digits_cnn", "model": "m", "label": label, "method": method,
                "ratio": "", "error_feedback": "", "momentum_correction": "default", "workers": 2, "seed": seed,
                "epoch": 5, "epochs": 5, "accuracy": acc, "objective": float("nan"), "bytes_per_step": 100.0,
                "compression": 1.0, "throughput": 1.0, "wall_s": 1.0, "diverged": False, "run_id": f"{label}{seed}"}
    rows = [row("none", "none", s, a) for s, a in ((0, 0.90), (1, 0.80), (2, 0.70))]
    rows += [row("x", "1bit", s, a) for s, a in ((2, 0.60), (0, 0.85), (5, 0.10))]   # seed 5 has no baseline
    s = {r["label"]: r for r in R.summarize(rows)}["x"]
    assert s["gap_n"] == 2 and s["gap_mean"] == pytest.approx(((0.85 - 0.90) + (0.60 - 0.70)) / 2)
    assert s["n"] == 3 and s["accuracy_mean"] == pytest.approx((0.60 + 0.85 + 0.10) / 3)
