"""Ending the whole job so that its reason reaches the user, and the timing rules that
order who speaks first (the control plane's stall timeout, then the watchdog)."""
import sys
import time

# MPI_Abort ends the job at once, and mpiexec drops output it has not forwarded yet
# (seen in CI: the "stall timeout" line written and flushed just before MPI_Abort never
# reached mpiexec's stderr). A job that aborts is already lost; a second spent so that
# the reason reaches the user is cheap.
ABORT_GRACE_S = 1.0
# the control plane's stall timeout fires at T on rank 0, which names the missing ranks,
# and at T + COORDINATOR_LEAD_S on the others, so that rank 0 speaks first
COORDINATOR_LEAD_S = 5.0


def announce_and_abort(message, abort, code=1):
    """Flush stdout, print ``message`` to stderr, let mpiexec forward it, then ``abort(code)``."""
    for stream, text in ((sys.stdout, None), (sys.stderr, message.rstrip("\n") + "\n")):
        try:
            if text:
                stream.write(text)
            stream.flush()
        except Exception:                      # a closed stream must not stop the abort
            pass
    time.sleep(ABORT_GRACE_S)
    abort(code)
