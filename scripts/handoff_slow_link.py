"""Does a 100 MB allreduce return to Python before its transfer is done?

Issue 15, "gradfuse blocks; Horovod does not": on a slow link, ``hvd.allreduce`` of a
100 MB NDArray must return from the call in well under a tenth of the time until its
result is ready, as Horovod's does (it pushes the work into MXNet's engine).

Run on a shaped loopback (see scripts/slow_loopback.sh), one launch per binding:

    scripts/slow_loopback.sh 1gbit -- mpiexec -n 2 python scripts/handoff_slow_link.py --impl gradfuse
    scripts/slow_loopback.sh 1gbit -- mpiexec -n 2 python scripts/handoff_slow_link.py --impl horovod

and, as a control, without the namespace (shared memory): ``mpiexec -n 2 python ...``.

Per round, on every rank: a fresh input (rank r holds ``base * (r + 1)``), waited for,
then a barrier; ``t_return`` is the time ``hvd.allreduce(x, op=Sum)`` (or
``allreduce_``) takes to return, ``t_ready`` the time until ``out.wait_to_read()``
returns. One warm-up round, then ``--rounds`` timed ones. Rank 0 prints, per method, the
medians over rounds (the larger of the ranks' medians) and return/ready. A plain
``mpi4py`` ``Allreduce`` of the same bytes is timed too: the transfer time of the link.

Every result is compared with the expected sum (exact: small integers in float32).
Exit status: 0; 1 if a result is wrong on any rank; 3 if ``--max-fraction F`` is given
and a binding's return/ready median is above F.

Methods: ``allreduce`` (out of place), ``allreduce_`` (in place), ``burstK`` (K in-place
calls of 1/K of the bytes, back to back: until the last returns / all are ready).
Columns CPU / runq / blocked split each call's wall time into the calling thread's CPU
time, its wait for a core (run queue) and its sleep (the GIL, a lock, an event), from
/proc/thread-self/schedstat (about 0.1 ms resolution; blocked may show small negatives).

Diagnosis, when a call takes long:
``--sample`` records the main thread's Python stack every millisecond during the timed
calls (a poor man's py-spy) and prints where the call spends its time: the innermost
frames and the innermost gradfuse frame, by share of samples.
``--profile`` (gradfuse) wraps the binding's call-time functions from here (the library
is not edited) and prints their inclusive ms per call.
``--switch-interval S`` sets ``sys.setswitchinterval`` (GIL hand-over) before init.

The script imports the gradfuse of the checkout it lies in (its parent folder).
"""
import argparse
import collections
import faulthandler
import os
import statistics
import sys
import threading
import time

# this checkout's gradfuse, not an installed one (a script's sys.path[0] is scripts/)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI          # initialise MPI first (THREAD_MULTIPLE), before either binding

import numpy as np


_SCHEDSTAT = None


def schedstat():
    """The calling thread's (CPU s, run-queue wait s) from /proc (Linux schedstat), or
    (thread_time, 0.0) where there is none. The file is opened once (by the thread that
    times the calls) and read with one pread, to keep the reads out of the figures."""
    global _SCHEDSTAT
    try:
        if _SCHEDSTAT is None:
            _SCHEDSTAT = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        cpu_ns, wait_ns = os.pread(_SCHEDSTAT, 128, 0).split()[:2]
        return int(cpu_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        _SCHEDSTAT = -1
        return time.thread_time(), 0.0


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=("gradfuse", "horovod"), default="gradfuse")
    p.add_argument("--mb", type=float, default=100.0, help="megabytes of float32 (default 100: 25M elements)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up (default 5)")
    p.add_argument("--methods", default="allreduce,allreduce_,burst4",
                   help="comma-separated: allreduce (out of place), allreduce_ (in place), burstK (K "
                        "in-place allreduce_ calls of 1/K of the bytes each, back to back: the time "
                        "until the last call returns, and until all K results are ready)")
    p.add_argument("--profile", action="store_true",
                   help="gradfuse only: time the binding's call-time functions (wrapped from here) "
                        "and print their inclusive ms per timed call")
    p.add_argument("--max-fraction", type=float, default=None,
                   help="exit 3 if a method's median return/ready is above this (the issue: 0.1)")
    p.add_argument("--sample", action="store_true", help="sample the main thread's stack during the calls")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval(S) before init (Python's default is 0.005 s): how long "
                        "a thread that wants the GIL back waits for a thread that holds it")
    p.add_argument("--watchdog", type=float, default=600.0,
                   help="dump every thread's traceback and exit if the run takes longer (seconds)")
    return p.parse_args()


class Sampler:
    """Samples one thread's Python stack every ``interval`` seconds while ``on``."""

    def __init__(self, thread_id, interval=0.001):
        self.tid, self.interval = thread_id, interval
        self.on = threading.Event()
        self.stop = False
        self.leaf = collections.Counter()       # innermost frame
        self.ours = collections.Counter()       # innermost gradfuse/horovod frame
        self.n = 0
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    @staticmethod
    def _where(f):
        c = f.f_code
        path = c.co_filename
        for key in ("gradfuse", "horovod", "mxnet"):
            i = path.rfind(os.sep + key + os.sep)
            if i >= 0:
                path = path[i + 1:]
                break
        else:
            path = os.path.basename(path)
        return f"{path}:{f.f_lineno} {c.co_name}"

    def _loop(self):
        while not self.stop:
            if not self.on.wait(0.05):
                continue
            f = sys._current_frames().get(self.tid)
            if f is not None:
                self.n += 1
                self.leaf[self._where(f)] += 1
                g = f
                while g is not None:
                    fn = g.f_code.co_filename
                    if (os.sep + "gradfuse" + os.sep in fn or os.sep + "horovod" + os.sep in fn) \
                            and "scripts" + os.sep not in fn:
                        self.ours[self._where(g)] += 1
                        break
                    g = g.f_back
            time.sleep(self.interval)

    def report(self, top=8):
        lines = [f"  {self.n} samples of the main thread inside the calls"]
        for title, cnt in (("innermost frame", self.leaf), ("innermost gradfuse/horovod frame", self.ours)):
            lines.append(f"  by {title}:")
            for where, k in cnt.most_common(top):
                lines.append(f"    {100.0 * k / max(self.n, 1):5.1f}%  {where}")
        return "\n".join(lines)


# the binding's functions that run on the caller's thread during an allreduce call
_PROFILED = [
    ("gradfuse.mxnet.mpi_ops", "_allreduce"),
    ("gradfuse.mxnet.mpi_ops", "_names"),
    ("gradfuse.mxnet.jobs", "allreduce"),
    ("gradfuse.mxnet.jobs", "_tables"),
    ("gradfuse.mxnet.jobs", "refuse"),
    ("gradfuse.mxnet.fence", "Tables"),
    ("gradfuse.mxnet.fence", "new_op"),
    ("gradfuse.mxnet.fence", "push"),
    ("gradfuse.mxnet.fence", "reorder_inputs"),
    ("gradfuse.mxnet.fence", "wait_at_call"),
    ("gradfuse.mxnet.handoff", "not_ndarrays"),
    ("gradfuse.mxnet.handoff", "check"),
    ("gradfuse.mxnet.handoff", "empty_like"),
    ("gradfuse.mxnet.handoff", "reduce_pipeline"),
    ("gradfuse.mxnet.handoff", "pipeline_call"),
    ("gradfuse.mxnet.handoff", "submit"),
    ("gradfuse.mxnet.handoff", "Call.__init__"),
    ("gradfuse.mxnet.handoff", "Call.push"),
    ("gradfuse.mxnet.handoff", "Deferred.__init__"),
    ("gradfuse.mxnet.handoff", "Pipeline.allreduce_async"),
    ("gradfuse.pipeline", "Pipeline._prepare"),
    ("gradfuse.mxnet.handoff", "_wait"),
]


class Profile:
    """Wraps the functions of ``_PROFILED`` (from this script; the library is not edited)
    and sums their inclusive wall time while ``on``."""

    def __init__(self, enabled):
        self.enabled, self.on, self.calls = enabled, False, 0
        self.total = collections.defaultdict(float)
        self.count = collections.Counter()
        self.missing = []
        if enabled:
            for mod, qual in _PROFILED:
                self._wrap(mod, qual)

    def _wrap(self, modname, qual):
        import importlib
        mod = importlib.import_module(modname)
        owner, attr = mod, qual
        if "." in qual:
            cls, attr = qual.split(".")
            owner = getattr(mod, cls, None)
        orig = getattr(owner, attr, None) if owner is not None else None
        if orig is None:
            self.missing.append(f"{modname}.{qual}")
            return
        label = f"{modname.rsplit('.', 1)[-1]}.{qual}"
        prof = self

        def wrapped(*a, **kw):          # also a class called as a constructor (fence.Tables)
            if not prof.on:
                return orig(*a, **kw)
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                prof.total[label] += time.perf_counter() - t
                prof.count[label] += 1
        setattr(owner, attr, wrapped)

    def report(self):
        lines = [f"  {'function':<40} {'ms/call':>9} {'times':>6}"]
        for label, tot in sorted(self.total.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:<40} {tot * 1e3 / max(self.calls, 1):>9.3f} {self.count[label]:>6}")
        if self.missing:
            lines.append("  not found (not wrapped): " + ", ".join(self.missing))
        return "\n".join(lines)


def main():
    args = parse()
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    sync = world.Dup()          # this script's own barriers and result exchange
    faulthandler.dump_traceback_later(args.watchdog, exit=True)

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    import mxnet as mx
    if args.impl == "gradfuse":
        import gradfuse.mxnet as hvd
    else:
        import horovod.mxnet as hvd
    hvd.init()
    assert hvd.size() == size and hvd.rank() == rank, (hvd.size(), size, hvd.rank(), rank)

    n = int(args.mb * 1e6) // 4
    base = (np.arange(n, dtype=np.int64) % 1021).astype(np.float32)   # exact in float32 up to sums of 2^24
    expected = base * float(sum(r + 1 for r in range(size)))
    mine = base * float(rank + 1)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in ("allreduce", "allreduce_") and not (m.startswith("burst") and m[5:].isdigit()
                                                         and int(m[5:]) > 0):
            sys.exit(f"unknown method {m!r}")
    prof = Profile(args.profile and args.impl == "gradfuse")
    sampler = Sampler(threading.get_ident()) if args.sample else None

    # the link's transfer time: a plain blocking MPI Allreduce of the same bytes
    recv = np.empty_like(mine)
    mpi_times = []
    for i in range(args.rounds + 1):
        sync.Barrier()
        t0 = time.perf_counter()
        world.Allreduce(mine, recv, op=MPI.SUM)
        dt = time.perf_counter() - t0
        if i:
            mpi_times.append(dt)
    bad = [] if np.array_equal(recv, expected) else ["mpi4py.Allreduce"]
    del recv

    results = {}
    for m in methods:
        k = int(m[5:]) if m.startswith("burst") else 0
        fn = getattr(hvd, "allreduce_" if k else m)
        bounds = np.linspace(0, n, k + 1).astype(np.int64) if k else None
        ret, rdy, cpu, runq = [], [], [], []
        for i in range(args.rounds + 1):
            if k:
                xs = [mx.nd.array(mine[bounds[j]:bounds[j + 1]], dtype=np.float32) for j in range(k)]
            else:
                xs = [mx.nd.array(mine, dtype=np.float32)]
            for x in xs:
                x.wait_to_read()
            x = xs[0]
            sync.Barrier()
            if sampler and i:
                sampler.on.set()
            prof.on = bool(i)
            c0, q0 = schedstat()
            t0 = time.perf_counter()
            outs = [fn(x, op=hvd.Sum, name=f"slowlink.{m}.{i}.{j}") for j, x in enumerate(xs)]
            t1 = time.perf_counter()
            c1, q1 = schedstat()
            prof.on = False
            if sampler:
                sampler.on.clear()
            for out in outs:
                out.wait_to_read()
            t2 = time.perf_counter()
            got = np.concatenate([out.asnumpy() for out in outs])
            if not np.array_equal(got, expected):
                wrong = int(np.count_nonzero(got != expected))
                bad.append(f"{m} round {i}: {wrong} of {n} elements wrong "
                           f"(first: got {got[np.argmax(got != expected)]!r})")
            if m == "allreduce" and not np.array_equal(x.asnumpy(), mine):
                bad.append(f"{m} round {i}: the input was modified")
            del x, xs, outs, got
            if i:
                ret.append(t1 - t0)
                rdy.append(t2 - t0)
                cpu.append(c1 - c0)
                runq.append(q1 - q0)
        results[m] = (statistics.median(ret), statistics.median(rdy), statistics.median(cpu),
                      statistics.median(runq), statistics.median([r - c - q for r, c, q in zip(ret, cpu, runq)]))

    prof.calls = args.rounds * sum(int(m[5:]) if m.startswith("burst") else 1 for m in methods)
    mpi_med = statistics.median(mpi_times)
    mine_summary = (mpi_med, {m: results[m] for m in methods}, bad)
    everyone = sync.gather(mine_summary, root=0)
    rc = 0
    if rank == 0:
        mb = n * 4 / 1e6
        link_mpi = max(s[0] for s in everyone)
        print(f"\n{args.impl}: {size} ranks, {n} float32 ({mb:.0f} MB), {args.rounds} timed rounds "
              f"after 1 warm-up; medians over rounds, the larger of the ranks' "
              f""
              f"\nCPU, runq, blocked: how the calling thread spent the call (running; runnable but waiting "
              f"for a core; asleep: the GIL, a lock), from /proc/thread-self/schedstat")
        print(f"module: {hvd.__name__} from {os.path.dirname(hvd.__file__)}; "
              f"sys.getswitchinterval() = {sys.getswitchinterval()} s")
        print(f"environment: MPIR_CVAR_NOLOCAL={os.environ.get('MPIR_CVAR_NOLOCAL', '-')} "
              f"MPIR_CVAR_CH4_NETMOD={os.environ.get('MPIR_CVAR_CH4_NETMOD', '-')} "
              f"FI_PROVIDER={os.environ.get('FI_PROVIDER', '-')}")
        # a 2-rank allreduce sends (and receives) about the array's bytes per rank
        sent = 2 * (size - 1) / size * mb * size
        print(f"mpi4py.Allreduce (blocking, the link's transfer time): {link_mpi * 1e3:.1f} ms "
              f"= {sent / link_mpi:.0f} MB/s of all ranks' sends together "
              f"({sent * 8 / link_mpi / 1e3:.2f} Gbit/s)")
        print(f"{'method':<28} {'call-return ms':>15} {'ready ms':>10} {'return/ready':>13} "
              f"{'CPU ms':>8} {'runq ms':>8} {'blocked ms':>11}")
        worst = {}
        for m in methods:
            r = max(s[1][m][0] for s in everyone)
            d = max(s[1][m][1] for s in everyone)
            c = max(s[1][m][2] for s in everyone)
            q = max(s[1][m][3] for s in everyone)
            b = max(s[1][m][4] for s in everyone)
            worst[m] = r / d
            print(f"{args.impl + '.' + m:<28} {r * 1e3:>15.2f} {d * 1e3:>10.1f} {r / d:>13.3f} "
                  f"{c * 1e3:>8.2f} {q * 1e3:>8.2f} {b * 1e3:>11.2f}")
        for k, s in enumerate(everyone):
            for b in s[2]:
                print(f"WRONG on rank {k}: {b}")
                rc = 1
        if rc == 0:
            print("results: correct on every rank (exact sums)")
        if args.max_fraction is not None:
            over = {m: f for m, f in worst.items() if f > args.max_fraction}
            if over:
                print(f"FAIL: return/ready above {args.max_fraction}: "
                      + ", ".join(f"{m} {f:.3f}" for m, f in over.items()))
                rc = rc or 3
            else:
                print(f"OK: return/ready at most {args.max_fraction} for every method")
    if prof.enabled:
        reps = sync.gather(prof.report(), root=0)
        if rank == 0:
            for k, r in enumerate(reps):
                print(f"\ncall-time functions, rank {k} (inclusive ms per timed call, mean over "
                      f"{prof.calls} calls; nested rows overlap):\n{r}")
    if sampler:
        sampler.stop = True
        rep = sampler.report()
        reps = sync.gather(rep, root=0)
        if rank == 0:
            for k, r in enumerate(reps):
                print(f"\nwhere the calls spend their time, rank {k}:\n{r}")
    rc = sync.bcast(rc, root=0)
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    hvd.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
