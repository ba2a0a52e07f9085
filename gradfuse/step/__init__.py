"""The communication-thread half of a step: its stages, the exchange jobs, the overlap thread.

``Pipeline.allreduce_async`` prepares a ``Step`` on the caller's thread (pointer tables
read, plan looked up, outputs ready) and submits it to the communicator's one
communication thread, which calls it. A step runs these stages, each a function of one
bucket (or of the step), in ``run.Step.run``:

1. ``negotiate(step)`` (``run``): every rank agrees on the request
   (``gradfuse.runtime.control``).
2. Compressed buckets (float32, a lossy compressor, past warm-up), one exchange job each
   (``compressed``; ``jobs`` picks the job class, ``exchange``, ``twophase`` and
   ``sparse_allreduce`` hold them): ``compress(job)`` (residual add, compress, new
   residual, one fused kernel) and ``exchange(job)`` (the job's collectives); pipelined, the
   exchange of one bucket overlaps the next one's compression (``grouped``: the allgather
   and sparse-allreduce buckets in exchange groups posted from this thread, the others on
   ``overlap``'s exchange thread). Before the first in-place residual update the ranks
   agree on the inputs' bound (``verdict.input_bound``); a *settled* step (nothing can
   overflow, ``verdict.settled``) decodes its grouped buckets as their groups arrive
   (stage 5 early).
3. ``check_finite(step, jobs)`` (``verdict``): every rank has the same non-finite verdict
   here; a bad step raises ``NonFiniteError`` on every rank before anything is written.
4. Plain buckets (``plain``): ``pack``, ``reduce`` (the MPI library's or NCCL's own
   allreduce, in place), ``unpack`` (dividing when averaging). Tensors of ``direct``
   buckets are reduced where they lie (``reduce_direct``). Between the ranks of one host,
   all plain buckets' tensors are summed where they lie in one call instead
   (``reduce_rows``: no pack, no unpack; ``gradfuse.comm.cma``).
5. ``decode(job)`` (``compressed``): decode-sum-divide into the outputs, and commit the
   new residuals.

On a GPU the stages run on the backend's stream, after an event on the caller's stream;
it syncs at the end. ``Stats`` (``stats``) are a pipeline's counters.
"""
from .compressed import COMPRESSIBLE
from .jobs import register_job
from .overlap import Overlap
from .run import Step, StepConfig
from .stats import Stats
from .verdict import NONFINITE

__all__ = ["Step", "StepConfig", "Stats", "Overlap", "COMPRESSIBLE", "NONFINITE", "register_job"]
