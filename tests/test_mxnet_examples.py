"""The MXNet examples under mpiexec -n 2, and the Horovod switch script against Horovod."""
import os
import re
import sys

import pytest

pytest.importorskip("mxnet")
from conftest import mpiexec_path  # noqa: E402
from helpers import run_limited  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.mpi


def _run(args, n=2, timeout=120):
    mpiexec = mpiexec_path()
    assert mpiexec, "mpiexec not found"
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code, out, timed_out = run_limited([mpiexec, "-n", str(n), sys.executable] + args,
                                       timeout=timeout, env=env, cwd=ROOT)
    assert not timed_out, out[-3000:]
    assert code == 0, out[-3000:]
    return out


def test_digits_example_learns_and_reports_bytes():
    pytest.importorskip("sklearn")
    out = _run(["examples/mxnet_gluon_digits.py", "--epochs", "4", "--min-accuracy", "0.9"])
    acc = float(re.search(r"final test accuracy: ([0-9.]+)", out).group(1))
    assert acc >= 0.9, out
    assert re.search(r"epoch 4/4: loss [0-9.]+, train accuracy", out), out
    sent, reduced = map(int, re.search(r"bytes communicated by rank 0: (\d+) sent \(estimate\) for (\d+) gradient "
                                       r"bytes reduced", out).groups())
    assert sent == reduced > 0          # compress none, 2 ranks: 2 (p-1)/p of the bytes


def test_digits_example_with_1bit_compression():
    pytest.importorskip("sklearn")
    out = _run(["examples/mxnet_gluon_digits.py", "--epochs", "2", "--compress", "1bit"])
    sent, reduced = map(int, re.search(r"bytes communicated by rank 0: (\d+) sent \(estimate\) for (\d+) gradient "
                                       r"bytes reduced", out).groups())
    assert 0 < sent * 8 < reduced       # 1 bit per 32-bit value, plus scales


def test_switch_script_runs_unchanged_and_matches_horovod(tmp_path):
    out = _run(["examples/mxnet_horovod_switch.py"])
    assert "size=2 ok" in out
    ours = re.search(r"parameter checksum on every rank: (.*)", out).group(1)
    try:
        import horovod.mxnet  # noqa: F401
    except Exception:
        pytest.skip("horovod.mxnet is not installed: compared with nothing")
    with open(os.path.join(ROOT, "examples", "mxnet_horovod_switch.py")) as f:
        src = f.read()
    assert src.count("import gradfuse.mxnet as hvd") == 1
    script = tmp_path / "hvd_switch.py"
    script.write_text(src.replace("import gradfuse.mxnet as hvd", "import horovod.mxnet as hvd"))
    theirs_out = _run([str(script)], timeout=90)
    theirs = re.search(r"parameter checksum on every rank: (.*)", theirs_out).group(1)
    acc = re.findall(r"average train accuracy ([0-9.]+)", out)
    assert acc == re.findall(r"average train accuracy ([0-9.]+)", theirs_out)
    assert [round(float(v), 4) for v in ours.split()] == [round(float(v), 4) for v in theirs.split()]
