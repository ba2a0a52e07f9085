"""Start one run under ``mpiexec -n N`` and collect its result.

The runner starts mpiexec itself, once per run, so a crash stays inside its run. The
environment pins every thread pool to one thread, which is what makes the same seed
give identical metrics (``tests/test_experiments.py`` checks it):
``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``,
``MXNET_CPU_WORKER_NTHREADS``, ``MXNET_CPU_PRIORITY_NTHREADS``, ``MXNET_OMP_MAX_THREADS``
= 1 and ``PYTHONHASHSEED`` = 0. ``GRADFUSE_STALL_TIMEOUT_S`` defaults to 120 s here (a
rank that dies mid-collective aborts the job instead of holding the grid for 10 minutes).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .worker import CACHE_ENV, PROGRESS

PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
          "MXNET_CPU_WORKER_NTHREADS": "1", "MXNET_CPU_PRIORITY_NTHREADS": "1", "MXNET_OMP_MAX_THREADS": "1",
          "PYTHONHASHSEED": "0"}
STDERR_TAIL = 3000


class LaunchError(RuntimeError):
    """mpiexec cannot be found or started."""


def find_mpiexec(explicit=None):
    """The mpiexec to use: ``explicit``, else the one beside ``sys.executable``, else PATH's.

    Raises:
        LaunchError: none found (the message says where it looked).
    """
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise LaunchError(f"--mpiexec {explicit!r} is not an executable file")
        return explicit
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if found:
        return found
    raise LaunchError(f"mpiexec not found beside {sys.executable} nor on PATH; install an MPI "
                      f"(pip install mpich) or pass --mpiexec")


def worker_env(cache_dir=None):
    """The workers' environment: this one, thread pools pinned, gradfuse importable."""
    env = dict(os.environ)
    if cache_dir:
        env[CACHE_ENV] = os.path.abspath(cache_dir)
    env.update(PINNED)
    env.setdefault("GRADFUSE_STALL_TIMEOUT_S", "120")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _stop(proc, grace=10.0):
    """End the run's process group: SIGTERM (mpiexec forwards it to the ranks), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)            # the group mpiexec leads: this run only
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(spec, mpiexec, timeout=900.0, on_progress=None, cache_dir=None):
    """Run ``spec`` under ``mpiexec -n spec.workers``; return its result dict.

    The result has ``status`` ``ok``/``diverged``/``refused`` (from the worker) or
    ``failed`` (non-zero exit, no result file, or ``timeout`` seconds passed; then
    ``error`` holds the exit status and the tail of stderr). ``on_progress(obj)`` is
    called for each epoch line rank 0 prints. ``cache_dir`` keeps generated data
    sets between runs (``GRADFUSE_EXPERIMENTS_CACHE``).
    """
    with tempfile.TemporaryDirectory(prefix="gradfuse-exp-") as tmp:
        spec_path, out_path, err_path = (os.path.join(tmp, n) for n in ("spec.json", "result.json", "stderr"))
        with open(spec_path, "w") as f:
            json.dump(spec.to_dict(), f)
        cmd = [mpiexec, "-n", str(spec.workers), sys.executable, "-m", "gradfuse.experiments.worker",
               spec_path, out_path]
        t0 = time.perf_counter()
        with open(err_path, "w") as err:
            try:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=worker_env(cache_dir),
                                        text=True, start_new_session=True)
            except OSError as exc:
                raise LaunchError(f"cannot start {cmd[0]}: {exc}") from None
            timed_out = threading.Event()

            def expire():
                timed_out.set()
                _stop(proc)

            timer = threading.Timer(timeout, expire)
            timer.start()
            other = []
            try:
                for line in proc.stdout:
                    if line.startswith(PROGRESS):
                        if on_progress is not None:
                            on_progress(json.loads(line[len(PROGRESS):]))
                    else:
                        other.append(line)
                code = proc.wait()
            except BaseException:                   # Ctrl-C or an error here: leave no ranks behind
                _stop(proc, grace=3.0)
                raise
            finally:
                timer.cancel()
        wall = time.perf_counter() - t0
        with open(err_path, errors="replace") as f:
            tail = f.read()[-STDERR_TAIL:]
        if timed_out.is_set():
            return {"status": "failed", "error": f"timed out after {timeout:.0f} s", "stderr_tail": tail,
                    "launch_s": wall}
        if code != 0 or not os.path.exists(out_path):
            why = f"exit status {code}" if code != 0 else "exit status 0 but no result was written"
            return {"status": "failed", "error": why, "stderr_tail": tail,
                    "stdout_tail": "".join(other)[-STDERR_TAIL:], "launch_s": wall}
        with open(out_path) as f:
            result = json.load(f)
        result["launch_s"] = wall
        return result
