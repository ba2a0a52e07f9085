"""gradfuse-experiments' command line: what it refuses (exit 2) before any run or file, and
what it does without matplotlib.

The command line runs in-process (``cli.main``) where it stops before training, and in a
subprocess where matplotlib must be unimportable (a ``sys.meta_path`` finder that refuses
it, set before gradfuse is imported).
"""
import json
import os
import re
import signal
import sys

import pytest

from helpers import run_limited

from gradfuse.experiments import cli
from gradfuse.experiments import grid as G
from gradfuse.experiments import results as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# two runs of the counterexample (about 25 s through mpiexec on 2 busy cores)
TINY = """name = "tiny"
[defaults]
seeds = [0]
[[experiments]]
name = "counter"
task = "counterexample"
epochs = 2
lr = 0.1
momentum = 0.0
batch_size = 1
methods = [{compress = "none"}, {compress = "1bit"}]
"""
NO_MATPLOTLIB = """
import sys
class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, NoMatplotlib())
from gradfuse.experiments.cli import main
sys.exit(main(sys.argv[1:]))
"""
OUTPUTS = ("results.csv", "results.json", "runs.csv", "summary.csv", "tables.md")


@pytest.fixture
def main():
    """``cli.main`` in-process; the SIGTERM handler it installs is put back afterwards."""
    saved = signal.getsignal(signal.SIGTERM)
    yield lambda *args: cli.main(["--no-progress", *args])
    signal.signal(signal.SIGTERM, saved)


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return str(path)


def without_matplotlib(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code, out, timed_out = run_limited([sys.executable, "-c", NO_MATPLOTLIB, "--no-progress", *args],
                                       timeout=timeout, env=env, cwd=ROOT)
    assert not timed_out, out[-3000:]
    return code, out


@pytest.mark.parametrize("args, message", [
    (["--experiments", "countr"], r"--experiments 'countr' matches no experiment; valid experiments: counter"),
    (["--methods", "1bitt"], r"--methods '1bitt' matches no run; valid method labels: 'none', '1bit EF'; "
                             r"compressor names: none, 1bit"),
    (["--methods", "1bit EF,topk"], r"--methods 'topk' matches no run"),
    (["--experiments", "counter", "--methods", "fp16"], r"--methods 'fp16' matches no run of experiment\(s\) "
                                                        r"counter; valid method labels: 'none', '1bit EF'"),
    (["--experiments", ",", "--report"], r"--experiments is empty; valid experiments: counter"),
])
def test_a_filter_that_matches_nothing_exits_2_and_touches_no_file(main, tiny, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    out.mkdir()
    for name in OUTPUTS:
        (out / name).write_text(f"the earlier {name}\n")
    assert main("--grid", tiny, "--out", str(out), *args) == 2
    err = capsys.readouterr().err
    assert "gradfuse-experiments: error: " in err
    assert re.search(message, err), err
    assert sorted(os.listdir(out)) == sorted(OUTPUTS), "no runs/ store, no plots/"
    for name in OUTPUTS:
        assert (out / name).read_text() == f"the earlier {name}\n", f"{name} was rewritten"


def test_list_applies_the_filters(main, capsys):
    assert main("--quick", "--list", "--experiments", "digits,mlp", "--methods", "1bit no EF,2bit") == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    rows = [line.split("\t")[1:3] for line in lines]
    assert rows == [["digits", "1bit no EF"]] * 2 + [["mlp", "2bit EF"]], lines
    assert "3 runs" in captured.err
    assert main("--quick", "--list", "--methods", "nosuch") == 2
    assert "--methods 'nosuch' matches no run" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_exits_2_naming_it(main, tiny, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    for out in (a_file, a_file / "sub"):
        assert main("--grid", tiny, "--out", str(out), "--report") == 2
        err = capsys.readouterr().err
        assert f"--out {str(out)!r} cannot be written:" in err, err
    assert a_file.read_text() == "not a folder\n"


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "five"])
def test_a_timeout_that_is_not_a_number_above_0_exits_2_naming_it(main, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main("--quick", "--list", "--timeout", value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --timeout: must be a number of seconds > 0, got {value!r}" in err, err


def test_the_filters_check_what_run_grid_is_given_too(tiny):
    specs = G.expand(G.load_grid(tiny))
    with pytest.raises(G.GridError, match=r"methods= 'fp16' matches no run"):
        G.select(specs, None, ["fp16"])
    assert [s.label for s in G.select(specs, ["counter"], ["1bit"])] == ["1bit EF"]
    assert G.select(specs) == specs


def _finished_store(grid_path, out):
    """The store of a finished tiny grid, as the worker writes it (the fields the tables read)."""
    store = R.Store(str(out))
    for spec in G.expand(G.load_grid(grid_path)):
        epochs = [{"epoch": e, "steps": 25 * e, "train_loss": 1.0 / (e + 1), "bytes_sent": 100 * e,
                   "bytes_reduced": 800 * e, "train_s": 0.1 * e, "wall_s": 0.1 * e, "throughput": 250.0,
                   "diverged": False, "test_accuracy": float("nan"), "objective": 2.0 / (e + 1)}
                  for e in range(spec.epochs + 1)]
        store.save(spec, {"status": "ok", "diverged_at": None, "epochs": epochs, "build": "test"})


def test_without_matplotlib_the_report_writes_the_tables_and_says_why_there_are_no_plots(tiny, tmp_path):
    out = tmp_path / "out"
    _finished_store(tiny, out)
    code, log = without_matplotlib("--grid", tiny, "--out", str(out), "--report")
    assert code == 0, log
    assert "Traceback" not in log, log
    assert log.count("matplotlib cannot be imported") == 1, log
    assert "the runs and tables are made, the plots are not" in log
    for name in OUTPUTS:
        assert (out / name).exists(), name
    assert not (out / "plots").exists()
    with open(out / "summary.json") as f:
        assert {r["label"] for r in json.load(f)} == {"none", "1bit EF"}
    # --no-plots asks for none: no message
    code, log = without_matplotlib("--grid", tiny, "--out", str(out), "--report", "--no-plots")
    assert code == 0 and "cannot be imported" not in log, log


@pytest.mark.mpi
def test_without_matplotlib_a_grid_trains_writes_the_tables_and_says_why_there_are_no_plots(tiny, tmp_path):
    pytest.importorskip("mxnet", reason="the runs train MXNet models")
    out = tmp_path / "out"
    code, log = without_matplotlib("--grid", tiny, "--out", str(out))
    assert code == 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert log.count("matplotlib cannot be imported") == 1, log
    assert log.index("matplotlib cannot be imported") < log.index("2 runs (2 ok; 0 skipped"), log
    with open(out / "runs.csv") as f:
        assert f.read().count(",ok,") == 2
    assert (out / "tables.md").exists() and not (out / "plots").exists()
