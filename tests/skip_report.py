"""A pytest plugin for runs under mpiexec: each rank writes the tests it skipped to a file.

``tests/test_mpi_launch.py`` loads it in every rank (``-p skip_report``, with tests/ on
``PYTHONPATH``) and sets ``GRADFUSE_SKIP_REPORT`` to a folder; rank r (``PMI_RANK``, which
MPICH's mpiexec sets, else 0) writes ``rank<r>.json`` there at the end of its session:
``[[nodeid, reason], ...]``. An mpiexec run's exit code counts failures only; the
launcher reads these files to report the skips and to fail on unexpected ones.
"""
import json
import os

_skipped = []


def pytest_runtest_logreport(report):
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    _skipped.append([report.nodeid, reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason])


def pytest_sessionfinish(session):
    folder = os.environ.get("GRADFUSE_SKIP_REPORT")
    if not folder:
        return
    rank = os.environ.get("PMI_RANK", "0")
    path = os.path.join(folder, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(_skipped, f)
    os.replace(path + ".tmp", path)
