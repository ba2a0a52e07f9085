"""gradfuse.experiments: the ``transformer_lm`` task and the Adam / AdamW optimizers of the runner.

The data split and cache, the net (size, causality), the grid's optimizer options and
their errors here in-process; a few short real runs under the runner's own mpiexec
(marked ``mpi``, hence ``slow``): the LM trains end to end with AdamW, the same seed
gives the same bytes and losses, divergence and the correction axis are recorded.
"""
import csv
import hashlib
import json
import math
import os
import sys
from dataclasses import asdict

import numpy as np
import pytest

pytest.importorskip("mxnet")
pytest.importorskip("matplotlib")
from helpers import run_limited  # noqa: E402

from gradfuse.experiments import grid as G  # noqa: E402
from gradfuse.experiments import results as R  # noqa: E402
from gradfuse.experiments import tables as T  # noqa: E402
from gradfuse.experiments import transformer_lm as L  # noqa: E402
from gradfuse.experiments.tasks import TaskError, get_task  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"d_model": 32, "heads": 2, "layers": 1, "seq": 16, "steps_per_epoch": 3, "val_windows": 32}


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


# --- the data ------------------------------------------------------------------------
def test_corpus_is_the_stdlib_sources_without_tests_or_installed_packages():
    files = L.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") for f in files)
    assert "os.py" in files and os.path.join("json", "decoder.py") in files
    for f in files:
        parts = f.split(os.sep)
        assert not set(parts[:-1]) & L.SKIP_DIRS, f


def test_split_is_by_file_deterministic_and_seeded():
    files = L.stdlib_files()
    train, val = L.split_files(files, 0, 0.1)
    assert (train, val) == L.split_files(files, 0, 0.1)            # the same seed, the same split
    assert not set(train) & set(val) and sorted(train + val) == files
    assert len(val) == round(0.1 * len(files))
    other = L.split_files(files, 1, 0.1)
    assert other[1] != val                                           # another seed, another split
    assert L.split_files(["a.py", "b.py"], 0, 0.01)[1] in (["a.py"], ["b.py"])   # at least one each side


def test_windows_are_the_stream_cut_in_seq_plus_one_and_shifted_by_one():
    stream = np.arange(50, dtype=np.uint8)
    x, y = L.windows(stream, 6)
    assert x.shape == y.shape == (7, 6) and x.dtype == np.uint8
    assert (x[1] == np.arange(7, 13)).all() and (y[1] == np.arange(8, 14)).all()


def test_arrays_hold_the_split_files_bytes():
    task = get_task("transformer_lm", SMALL)
    x, y, xt, yt = task.arrays(0)
    info = task.data_info(0)
    assert x.dtype == np.uint8 and x.shape[1] == 16 and (x[:, 1:] == y[:, :-1]).all()
    assert len(x) == info["train_bytes"] // 17                    # every training byte, in windows of 17
    assert xt.shape == (32, 16)                                   # val_windows evenly spaced
    root = L.stdlib_root()
    train, val = L.split_files(L.stdlib_files(), 0, 0.1)
    head = b""
    for f in train:                                               # the training files, sorted, concatenated
        head += open(os.path.join(root, f), "rb").read()
        if len(head) >= 2 * 17:
            break
    assert bytes(x[0]) + bytes(y[0][-1:]) == head[:17] and bytes(x[1]) == head[17:33]
    assert info["train_files"] == len(train) and info["val_files"] == len(val)


def test_cache_is_written_once_and_keyed_by_the_data_options(tmp_path, monkeypatch):
    task = get_task("transformer_lm", SMALL)
    first = task.cached_arrays(0, str(tmp_path))
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("transformer_lm-")

    def no_generation(self, split_seed):
        raise AssertionError("the cached data was generated again")
    monkeypatch.setattr(L.TransformerLM, "arrays", no_generation)
    again = task.cached_arrays(0, str(tmp_path))
    assert all((a == b).all() for a, b in zip(first, again))
    # the net's size is not the data's: the same file; the sequence length is: another one
    wider = get_task("transformer_lm", dict(SMALL, d_model=64))
    assert wider.cache_path(0, str(tmp_path)) == task.cache_path(0, str(tmp_path))
    assert get_task("transformer_lm", dict(SMALL, seq=32)).cache_path(0, str(tmp_path)) != cached[0].as_posix()
    assert task.cache_path(1, str(tmp_path)) != cached[0].as_posix()
    assert task.cache_extra()["python"] == sys.version.split()[0]


# --- the net ---------------------------------------------------------------------------
def _net(**options):
    task = get_task("transformer_lm", options)
    net = task.build_net()
    net.initialize(task.initializer())
    return task, net


def test_default_net_has_the_issue_size_and_the_tied_head_shares_the_embedding():
    _, net = _net()
    params = net.collect_params()
    assert sum(int(np.prod(p.shape)) for p in params.values()) == 470784
    assert len(params.keys()) == 30
    _, tied = _net(tie_head=True)
    assert sum(int(np.prod(p.shape)) for p in tied.collect_params().values()) == 470784 - 256 * 128


def test_net_is_causal_and_hybridizes_to_the_same_logits():
    import mxnet as mx
    task, net = _net(**SMALL)
    x = mx.nd.array(np.random.default_rng(0).integers(0, 256, (2, 16)), dtype="float32")
    eager = net(x).asnumpy()
    assert eager.shape == (2, 16, 256)
    net.hybridize()
    np.testing.assert_array_equal(net(x).asnumpy(), eager)
    changed = x.copy()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    out = net(changed).asnumpy()
    np.testing.assert_array_equal(out[:, :9], eager[:, :9])         # nothing reads a later byte
    assert np.abs(out[:, 9:] - eager[:, 9:]).max() > 0


def test_evaluate_reports_nats_bits_and_accuracy_by_hand():
    import mxnet as mx
    task, net = _net(**SMALL)
    x, y, xt, yt = task.arrays(0)
    m = task.evaluate(net, {"x_test": xt, "y_test": yt}, chunk=5)
    logits = net(mx.nd.array(xt, dtype="float32")).asnumpy().astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, yt[..., None].astype(np.int64), -1).mean()
    assert m["objective"] == pytest.approx(nll, rel=1e-5)
    assert m["bits_per_byte"] == pytest.approx(m["objective"] / math.log(2))
    assert m["test_accuracy"] == pytest.approx((logits.argmax(-1) == yt).mean())
    assert task.diverged_metrics() == {"test_accuracy": 1 / 256, "objective": math.log(256), "bits_per_byte": 8.0}
    assert task.progress_text(m).startswith("val ") and "bpb" in task.progress_text(m)


@pytest.mark.parametrize("options, message", [
    ({"d_model": 30, "heads": 4}, r"d_model = 30 is not a multiple of heads = 4"),
    ({"val_fraction": 1.5}, r"'val_fraction' must be in \(0, 1\), got 1.5"),
    ({"seq": 0}, r"option 'seq' must be a positive int, got 0"),
    ({"tie_head": 1}, r"option 'tie_head' must be a positive bool"),
    ({"vocab": 512}, r"unknown option\(s\) vocab; valid options: d_model, heads"),
])
def test_bad_task_options_are_named(options, message):
    with pytest.raises(TaskError, match=message):
        get_task("transformer_lm", options)


# --- the optimizers in the grid -----------------------------------------------------------
def lm_grid(**exp):
    e = {"name": "lm", "task": "transformer_lm", "epochs": 1, "task_options": SMALL,
         "methods": [{"compress": "none"}, {"compress": "1bit"}]}
    e.update(exp)
    return {"name": "g", "defaults": {"seeds": [0]}, "experiments": [e]}


def test_adam_and_adamw_reach_the_runs_with_their_hyperparameters():
    specs = G.expand(lm_grid(optimizer="adamw", lr=1e-3, betas=[0.9, 0.95], eps=1e-6, wd=0.01))
    assert {s.compress for s in specs} == {"none", "1bit"}
    for s in specs:                                # every method, the fp32 baseline included
        assert (s.optimizer, s.lr, s.betas, s.eps, s.wd, s.momentum) == ("adamw", 1e-3, [0.9, 0.95], 1e-6, 0.01, 0.0)
        assert s.optimizer_params() == {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-6,
                                        "wd": 0.01}
        assert G.RunSpec.from_dict(json.loads(json.dumps(s.to_dict()))).id == s.id
    adam = G.expand(lm_grid(optimizer="adam"))[0]
    assert (adam.betas, adam.eps, adam.momentum) == ([0.9, 0.999], 1e-8, 0.0)      # MXNet's defaults
    sgd = G.expand(lm_grid())[0]
    assert sgd.optimizer_params() == {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.0}
    assert (sgd.betas, sgd.eps) == (None, None)


def test_an_sgd_run_keeps_its_id():
    spec = G.expand(lm_grid())[0]
    d = asdict(spec)
    for k in ("label", "betas", "eps"):
        d.pop(k)
    digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]
    assert spec.id.endswith(digest)                 # the hash of the fields SGD runs always had


def test_momentum_from_the_defaults_is_left_out_of_an_adam_run():
    g = lm_grid(optimizer="adamw")
    g["defaults"]["momentum"] = 0.9
    assert {s.momentum for s in G.expand(g)} == {0.0}


@pytest.mark.parametrize("exp, message", [
    ({"optimizer": "rmsprop"}, r"experiment 'lm': optimizer 'rmsprop' is not supported; valid: sgd, adam, adamw"),
    ({"optimizer": "adamw", "momentum": 0.9},
     r"sets 'momentum', which optimizer 'adamw' does not take \(adamw takes lr, betas, eps and wd\)"),
    ({"betas": [0.9, 0.999]}, r"sets 'betas', which optimizer 'sgd' does not take \(sgd takes lr, momentum and wd\)"),
    ({"optimizer": "sgd", "eps": 1e-8}, r"sets 'eps', which optimizer 'sgd' does not take"),
    ({"optimizer": "adam", "betas": [0.9]}, r"'betas' must be a list of two numbers in \[0, 1\), got \[0.9\]"),
    ({"optimizer": "adam", "betas": [0.9, 1.0]}, r"got \[0.9, 1.0\] \(beta2 = 1.0\)"),
    ({"optimizer": "adam", "betas": 0.9}, r"'betas' must be a list of two numbers"),
    ({"optimizer": "adamw", "eps": -1e-8}, r"'eps' must be a number >= 0, got -1e-08"),
    ({"optimizer": "adamw", "lr": 0}, r"'lr' must be a number > 0, got 0"),
    ({"optimizer": "adamw", "methods": [{"compress": "none"}, {"compress": "1bit", "betas": [0.9, 0.9]}]},
     r"method '1bit' sets betas; hyperparameters are per experiment"),
])
def test_bad_optimizer_options_raise_an_error_naming_them(exp, message):
    with pytest.raises(G.GridError, match=message):
        G.expand(lm_grid(**exp))


def test_the_correction_axis_for_adam_asks_the_trainer_or_refuses():
    on, off, default = G.expand(lm_grid(optimizer="adamw", momentum_correction=["on", "off", "default"],
                                        methods=[{"compress": "1bit"}, {"compress": "none"}]))[:3]
    assert (on.label, off.label, default.label) == ("1bit EF +MC", "1bit EF -MC", "1bit EF")
    assert G.correction_options(default, ["momentum_correction"]) == {}
    assert G.correction_options(on, ["momentum_correction"]) == {"momentum_correction": True}
    assert G.correction_options(off, ["momentum_correction"]) == {"momentum_correction": False}
    # a trainer without the keyword: no SGD-style compressor momentum for Adam; "on" is refused
    assert G.correction_options(off, ["compress"]) == {}
    with pytest.raises(G.UnsupportedError, match=r"Adam correction was asked for .*optimizer 'adamw'.*refused"):
        G.correction_options(on, ["compress"])
    err = G.correction_refused(on, ValueError("momentum_correction=True needs an SGD or NAG optimizer"))
    assert isinstance(err, G.UnsupportedError)
    assert "optimizer 'adamw', compress '1bit'" in str(err) and "needs an SGD or NAG" in str(err)


# --- the summary and the table ------------------------------------------------------------
def test_summary_pairs_the_validation_loss_and_its_relative_gap():
    def row(label, method, seed, loss):
        return {"experiment": "lm", "task": "transformer_lm", "model": "m", "label": label, "method": method,
                "ratio": "", "error_feedback": "", "momentum_correction": "default", "workers": 2, "seed": seed,
                "epoch": 6, "epochs": 6, "accuracy": 0.5, "objective": loss, "bits_per_byte": loss / math.log(2),
                "bytes_per_step": 100.0, "compression": 1.0, "throughput": 1.0, "wall_s": 1.0, "diverged": False,
                "run_id": f"{label}{seed}"}
    rows = [row("none", "none", s, v) for s, v in ((0, 1.60), (1, 1.50), (2, 1.55))]
    rows += [row("1bit EF", "1bit", s, v) for s, v in ((0, 1.68), (1, 1.56), (2, 1.643))]
    s = {r["label"]: r for r in R.summarize(rows)}["1bit EF"]
    assert s["gap_metric"] == "objective" and s["gap_n"] == 3
    assert s["gap_mean"] == pytest.approx((0.08 + 0.06 + 0.093) / 3)
    assert s["gap_rel_mean"] == pytest.approx((0.08 / 1.6 + 0.06 / 1.5 + 0.093 / 1.55) / 3)
    assert s["gap_rel_ci_low"] < s["gap_rel_mean"] < s["gap_rel_ci_high"]
    assert s["bits_per_byte_mean"] == pytest.approx(np.mean([1.68, 1.56, 1.643]) / math.log(2))
    table = "\n".join(T.language_model_table(R.summarize(rows)))
    assert "| 1bit EF | 1.6277 ± " in table and "+0.0777 [" in table and "+5.00 % [" in table


# --- end to end under mpiexec ---------------------------------------------------------------
# the LM's 1-bit method: the Adam correction (on by default) runs exact Adam until its freeze
# point; freezing after the first step, the run's later steps are compressed
LM1 = "1bit warmup_steps=1 EF"
LM_TOML = """
name = "lmtest"
[defaults]
optimizer = "adamw"
lr = 1.0e-3
betas = [0.9, 0.999]
eps = 1.0e-8
wd = 0.01
batch_size = 8
seeds = [{seeds}]
[[experiments]]
name = "lm"
task = "transformer_lm"
epochs = 2
methods = [{{compress = "none"}}, {{compress = "1bit", warmup_steps = 1}}]
[experiments.task_options]
d_model = 32
heads = 2
layers = 1
seq = 16
steps_per_epoch = 3
val_windows = 32
[[experiments]]
name = "lm_mc"
task = "transformer_lm"
epochs = 1
seeds = [3]
methods = [{{compress = "none"}}, {{compress = "1bit", momentum_correction = "on"}}]
[experiments.task_options]
d_model = 32
heads = 2
layers = 1
seq = 16
steps_per_epoch = 2
val_windows = 32
[[experiments]]
name = "lm_diverge"
task = "transformer_lm"
epochs = 2
lr = 1.0e20
seeds = [3]
methods = [{{compress = "none"}}]
[experiments.task_options]
d_model = 32
heads = 2
layers = 1
seq = 16
steps_per_epoch = 3
val_windows = 32
"""


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """The LM grid above: seeds 3 and 4, the correction asked for, a divergence."""
    tmp = tmp_path_factory.mktemp("lm")
    cfg = tmp / "lm.toml"
    cfg.write_text(LM_TOML.format(seeds="3, 4"))
    code, log = cli("--grid", str(cfg), "--out", str(tmp / "out"), "--methods", "none,1bit warmup_steps=1 EF,1bit EF +MC")
    return tmp, cfg, code, log


@pytest.mark.mpi
def test_lm_trains_with_adamw_end_to_end(lm_runs):
    tmp, _, code, log = lm_runs
    runs = {(r["experiment"], r["label"], r["seed"]): r for r in read_csv(tmp / "out" / "runs.csv")}
    for key in (("lm", "none", "3"), ("lm", LM1, "3"), ("lm", "none", "4"), ("lm", LM1, "4")):
        assert runs[key]["status"] == "ok", (key, log[-3000:])
    rows = [r for r in read_csv(tmp / "out" / "results.csv") if r["experiment"] == "lm"]
    assert {r["optimizer"] for r in rows} == {"adamw"} and {r["betas"] for r in rows} == {"[0.9, 0.999]"}
    by = {(r["label"], r["seed"], r["epoch"]): r for r in rows}
    for label in ("none", LM1):
        first, last = by[(label, "3", "0")], by[(label, "3", "2")]
        assert int(last["steps"]) == 6
        assert float(last["accuracy"]) < 1 and float(last["objective"]) < float(first["objective"])
        assert float(last["bits_per_byte"]) == pytest.approx(float(last["objective"]) / math.log(2))
    # bytes: fp32 sends the parameters' bytes (2 (p-1)/p = 1 at p = 2); 1bit about 30x fewer
    res = [json.load(open(p)) for p in (tmp / "out" / "runs").iterdir()]
    none = next(r for r in res if r["spec"]["experiment"] == "lm" and r["spec"]["compress"] == "none")
    assert float(by[("none", "3", "2")]["bytes_per_step"]) == 4 * none["n_params"]
    # the second epoch's steps, all past the freeze (bytes_per_step is the run's mean so far)
    late = lambda lb: (float(by[(lb, "3", "2")]["bytes_per_step"]) * int(by[(lb, "3", "2")]["steps"])  # noqa: E731
                       - float(by[(lb, "3", "1")]["bytes_per_step"]) * int(by[(lb, "3", "1")]["steps"]))
    assert 25 < late("none") / late(LM1)
    assert none["optimizer_params"] == {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
                                        "wd": 0.01}
    assert none["data"]["train_files"] > 0 and none["data"]["corpus"] == L.stdlib_root()
    tables = (tmp / "out" / "tables.md").read_text()
    assert "AdamW lr 0.001 betas (0.9, 0.999) eps 1e-08 wd 0.01" in tables and "(6 steps)" in tables
    assert "relative gap" in tables
    pngs = {p.name for p in (tmp / "out" / "plots").iterdir()}
    assert {"lm_loss_vs_epoch.png", "lm_loss_vs_bytes.png", "lm_final_loss.png"} <= pngs


@pytest.mark.mpi
def test_lm_same_seed_gives_identical_losses_and_bytes(lm_runs):
    tmp, cfg, _, _ = lm_runs
    code, log = cli("--grid", str(cfg), "--out", str(tmp / "again"), "--experiments", "lm", "--methods", "1bit",
                    "--seeds", "3", "--no-plots")
    assert code == 0, log

    def metrics(out, seed):
        return [(r["epoch"], r["train_loss"], r["objective"], r["accuracy"], r["bytes"])
                for r in read_csv(out / "results.csv")
                if r["experiment"] == "lm" and r["label"] == LM1 and r["seed"] == seed]
    assert metrics(tmp / "again", "3") == metrics(tmp / "out", "3") != []
    assert metrics(tmp / "out", "4") != metrics(tmp / "out", "3")


@pytest.mark.mpi
def test_lm_divergence_is_recorded_at_chance(lm_runs):
    tmp, _, _, log = lm_runs
    runs = {r["experiment"]: r for r in read_csv(tmp / "out" / "runs.csv") if r["label"] == "none"}
    assert runs["lm_diverge"]["status"] == "diverged", log[-3000:]
    assert float(runs["lm_diverge"]["objective"]) == pytest.approx(math.log(256))
    assert float(runs["lm_diverge"]["accuracy"]) == pytest.approx(1 / 256)


@pytest.mark.mpi
def test_lm_correction_on_is_run_or_refused_never_run_without_it(lm_runs):
    tmp, _, code, log = lm_runs
    res = [json.load(open(p)) for p in (tmp / "out" / "runs").iterdir()]
    mc = next(r for r in res if r["spec"]["experiment"] == "lm_mc" and r["spec"]["compress"] == "1bit")
    if mc["status"] == "refused":        # this gradfuse's trainer has no Adam correction: it says so
        assert code == 1 and "REFUSED run lm_mc-1bit-EF--MC-s3-w2" in log, log[-3000:]
        assert "momentum correction was asked for" in mc["error"] and "optimizer 'adamw'" in mc["error"]
        assert "refused rather than run without it" in mc["error"]
    else:                                # it has: the run trained with the keyword
        assert mc["status"] == "ok", mc
        assert mc["trainer_kwargs"]["momentum_correction"] is True
