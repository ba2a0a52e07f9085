"""One rank of a training loop dies (or hangs) at step 3; how does the job end?

    mpiexec -n N python tests/scripts/die.py MODE [--plain] [MARKER]

MODE: exit0 | exit1 | abort | sigkill | exception   (the five death modes)
      os_exit      os._exit(3): no hook runs (only the watchdog can help)
      data_hang    the victim never enters a data-plane collective that was already
                   negotiated (only the watchdog can help)
      exit0_plainwait  sys.exit(0) while the others wait in a plain MPI barrier, not in
                   gradfuse (only the leaving rank's exit timeout can help)
      exit0_slow   sys.exit(0) while the others compute 1.5 s before entering the allreduce
                   (the goodbye arrives before they enter)
      clean        nobody dies: every rank finishes and the job must exit 0
      clean_late   nobody dies, but rank 0 works 3 s longer after training (a checkpoint):
                   the job must still exit 0
--plain: the same loop on plain mpi4py (MPI.COMM_WORLD.Allreduce), no gradfuse.
MARKER: any other argument is ignored; tests pass one to find leftover processes.

The victim is the last rank. The others keep calling allreduce, so they are inside
(or entering) a collective that the victim never joins.
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

MODE = sys.argv[1]
PLAIN = "--plain" in sys.argv[2:]
STEPS, DEATH_STEP = 12, 3

if PLAIN:
    # SIGUSR1 prints every thread's Python stack: shows where a hung plain run waits
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)
else:
    import gradfuse
    import gradfuse.runtime.context
    gradfuse.init()
    pipe = gradfuse.Pipeline(average=False)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
victim = size - 1


def die():
    # CLOCK_MONOTONIC is system-wide on Linux: the test measures from this instant
    print(f"die.py: rank {rank} dies now ({MODE}) at monotonic {time.monotonic():.3f}", flush=True)
    if MODE in ("exit0", "exit0_plainwait", "exit0_slow"):
        sys.exit(0)
    if MODE == "exit1":
        sys.exit(1)
    if MODE == "abort":
        os.abort()
    if MODE == "sigkill":
        os.kill(os.getpid(), 9)
    if MODE == "exception":
        raise RuntimeError("user code failed at step 3")
    if MODE == "os_exit":
        os._exit(3)
    if MODE in ("data_hang",):
        time.sleep(600)
    raise SystemExit(f"unknown mode {MODE!r}")


def raw_allreduce(x):
    """A data-plane collective run on the communication thread, with no negotiation first."""
    ctx = gradfuse.runtime.context.default_context()
    return ctx.engine.submit(lambda: ctx.comm.allreduce_inplace(x), "raw-allreduce").wait()


for step in range(STEPS):
    if step == DEATH_STEP and rank == victim and not MODE.startswith("clean"):
        die()
    x = np.full(1000, rank + 1.0, np.float32)
    if MODE == "exit0_slow" and step == DEATH_STEP:
        time.sleep(1.5)                     # compute: the victim is gone before we enter
    if PLAIN:
        world.Allreduce(MPI.IN_PLACE, x)
    elif MODE == "exit0_plainwait" and step >= DEATH_STEP:
        world.Barrier()
    elif MODE == "data_hang" and step >= DEATH_STEP:
        raw_allreduce(x)
    else:
        x = pipe.allreduce([x])[0]
    assert x[0] == size * (size + 1) / 2, x[0]
    time.sleep(0.01)
print(f"die.py: rank {rank} finished all {STEPS} steps", flush=True)
if MODE == "clean_late" and rank == 0:
    time.sleep(3)
    print("die.py: rank 0 saved its checkpoint", flush=True)
