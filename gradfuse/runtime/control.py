"""Control plane: the ranks agree on every collective before any data moves.

Protocol, per collective (run on the communication thread, in submission order):

1. Each rank reduces its request (op, names, order, shapes, dtypes, options and the
   fusion layout) to a 16-byte digest, cached with the plan.
2. Every rank other than 0 sends ``(sequence number, digest)`` to rank 0 with a
   non-blocking send; rank 0 posts one receive per rank. Because each rank's message
   arrives separately, rank 0 always knows which ranks have not arrived yet.
3. Rank 0 compares the digests and broadcasts a one-byte verdict (non-blocking).
   The repeated case thus costs p-1 messages of 32 bytes (sequence number, digest and
   the step tag of a compressed pipeline) and a 1-byte broadcast.
4. On a mismatch every rank gathers every rank's full description (JSON, never
   pickle) and computes the same error message from the same data, so every rank
   raises the same ``MismatchError`` naming the tensor, the ranks and both values.
   A rank whose own input was invalid raises its own ``TypeError``/``ValueError``;
   the others raise ``RemoteInputError`` naming that rank.

All waits poll with a deadline. After ``GRADFUSE_STALL_WARNING_S`` rank 0 warns with
the ranks that have not arrived and what it is waiting for; after
``GRADFUSE_STALL_TIMEOUT_S`` (0 = never) the job is aborted with that message.
"""
import hashlib
import json
import struct
import time
import warnings

from .. import config
from ..errors import GradfuseError, MismatchError, RemoteInputError
from .abort import COORDINATOR_LEAD_S, announce_and_abort

_MSG = struct.Struct("<Q16sQ")     # sequence number, request digest, step tag
OK, MISMATCH = 0, 1


class StallWarning(UserWarning):
    """A collective has waited longer than GRADFUSE_STALL_WARNING_S for other ranks."""


class Request:
    """What one rank proposes for one collective.

    Args:
        op: the collective, e.g. ``"allreduce"``.
        names, shapes, dtypes: per tensor, in the order given.
        options: everything else that must agree (average, compressor, layout, ...).
        error: a local ``TypeError``/``ValueError`` if this rank's input was invalid.
    """

    def __init__(self, op, names=(), shapes=(), dtypes=(), options=None, error=None):
        self.op = op
        self.names = list(names)
        self.shapes = [list(s) for s in shapes]
        self.dtypes = list(dtypes)
        self.options = dict(options or {})
        self.error = error
        self._digest = None

    def describe(self):
        d = {"op": self.op, "names": self.names, "shapes": self.shapes,
             "dtypes": self.dtypes, "options": self.options}
        if self.error is not None:
            e = self.error
            text = str(e) if isinstance(e, (TypeError, ValueError)) else f"{type(e).__name__}: {e}"
            d = {"op": self.op, "error": text}
        return d

    @property
    def digest(self):
        if self._digest is None:
            blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
            self._digest = hashlib.blake2b(blob, digest_size=16).digest()
        return self._digest

    def summary(self):
        if self.error is not None:
            return f"{self.op} (invalid input)"
        head = ", ".join(repr(n) for n in self.names[:3])
        more = f", ... ({len(self.names)} tensors)" if len(self.names) > 3 else ""
        return f"{self.op} of [{head}{more}]"


def _ranks(rs):
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def _fmt(v):
    return str(tuple(v)) if isinstance(v, list) else repr(v)


def _disagreement(label, values):
    """'label: rank 0 sent A, rank 1 sent B' for the distinct values by rank."""
    groups = {}
    for r, v in enumerate(values):
        groups.setdefault(json.dumps(v, sort_keys=True), []).append(r)
    parts = []
    for key, rs in sorted(groups.items(), key=lambda kv: kv[1][0]):
        parts.append(f"{_ranks(rs)} sent {_fmt(json.loads(key))}")
    return f"{label}: " + ", ".join(parts)


def explain(descs):
    """The one error message every rank computes from all ranks' descriptions."""
    ops = [d["op"] for d in descs]
    if len(set(ops)) > 1:
        return _disagreement("collective mismatch (ranks called different operations)", ops)
    op = ops[0]
    errs = [(r, d["error"]) for r, d in enumerate(descs) if "error" in d]
    if errs:
        return "; ".join(f"rank {r} rejected its input for {op}: {e}" for r, e in errs)
    counts = [len(d["names"]) for d in descs]
    names = [d["names"] for d in descs]
    if len(set(counts)) > 1:
        sets = [set(n) for n in names]
        extra = []
        for r, s in enumerate(sets):
            others = set().union(*(sets[:r] + sets[r + 1:]))
            only = sorted(s - others)[:3]
            if only:
                extra.append(f"only rank {r} has {', '.join(repr(x) for x in only)}")
        tail = ("; " + "; ".join(extra)) if extra else ""
        return _disagreement(f"{op}: ranks sent different numbers of tensors", counts) + tail
    for i in range(counts[0]):
        col = [n[i] for n in names]
        if len(set(col)) > 1:
            same_set = all(set(n) == set(names[0]) for n in names)
            what = "tensors in a different order" if same_set else "different tensor names"
            return _disagreement(f"{op}: {what}, at position {i}", col)
    for i, name in enumerate(names[0]):
        for field, label in (("shapes", "shape"), ("dtypes", "dtype")):
            col = [d[field][i] for d in descs]
            if len(set(json.dumps(c) for c in col)) > 1:
                return _disagreement(f"{op}: tensor {name!r}: {label}", col)
    keys = sorted(set().union(*(d["options"] for d in descs)))
    for k in keys:
        col = [d["options"].get(k) for d in descs]
        if len(set(json.dumps(c, sort_keys=True) for c in col)) > 1:
            return _disagreement(f"{op}: option {k!r}", col)
    steps = [d.get("step", 0) for d in descs]
    if len(set(steps)) > 1:
        return _disagreement(f"{op}: compressor step counter (drives warm-up and random-k; were the "
                             f"ranks restored from different checkpoints?)", steps)
    return f"{op}: ranks disagree, but their descriptions are identical (digest collision?)"


class Coordinator:
    """Runs the agreement protocol over a communicator's control channel."""

    def __init__(self, comm):
        self.comm = comm
        self.seq = 0
        self.negotiations = 0
        self.mismatches = 0
        # set by the exit protocol (gradfuse.runtime.watchdog) once every rank has ended
        # its script: a collective then fails at once, naming why
        self.closed = None

    def negotiate(self, request, step=0):
        """Return when all ranks proposed the same ``request``; raise on every rank if not.

        ``step`` is a per-call number that must also agree (a pipeline's compressor step
        counter); it travels beside the digest, so it costs nothing extra.
        """
        self.seq += 1
        self.negotiations += 1
        comm = self.comm
        if self.closed is not None and comm.size > 1:
            raise GradfuseError(f"{self.closed}: collective #{self.seq} ({request.summary()}) refused")
        if comm.size == 1:
            if request.error is not None:
                raise request.error
            return
        msg = _MSG.pack(self.seq, request.digest, int(step) & 0xFFFFFFFFFFFFFFFF)
        verdict = bytearray(1)
        if comm.rank == 0:
            bufs = [bytearray(_MSG.size) for _ in range(comm.size - 1)]
            reqs = [comm.ctl_irecv(bufs[r - 1], r) for r in range(1, comm.size)]
            self._wait(reqs, request, lambda pending: [r + 1 for r in pending])
            verdict[0] = OK if all(bytes(b) == msg for b in bufs) else MISMATCH
            self._wait([comm.ctl_ibcast(verdict, 0)], request, lambda p: [])
        else:
            send = comm.ctl_isend(msg, 0)
            bcast = comm.ctl_ibcast(verdict, 0)
            self._wait([send, bcast], request, lambda pending: [0])
        if verdict[0] == MISMATCH:
            self.mismatches += 1
            desc = dict(request.describe(), step=int(step))
            gather = comm.ctl_iallgather_bytes(json.dumps(desc).encode())
            self._wait([gather], request, lambda p: ["(some)"])
            descs = [json.loads(b) for b in gather.result()]
            message = explain(descs)
            if request.error is not None:
                if isinstance(request.error, (TypeError, ValueError)):
                    raise type(request.error)(message) from request.error
                raise request.error        # any other local error: the original, with its traceback
            if any("error" in d for d in descs):
                raise RemoteInputError(message)
            raise MismatchError(message)
        if request.error is not None:
            raise request.error

    def _wait(self, reqs, request, missing_of):
        """Poll ``reqs`` until all complete, warning and finally aborting on a stall."""
        comm = self.comm
        done = [False] * len(reqs)
        start = time.monotonic()
        warn_s = config.stall_warning_s()
        user_timeout_s = timeout_s = config.stall_timeout_s()
        if timeout_s and comm.rank != 0:
            timeout_s += COORDINATOR_LEAD_S    # the coordinator, which names the culprits, goes first
        next_warn = warn_s if warn_s else None
        delay = 0.0
        while True:
            for i, r in enumerate(reqs):
                if not done[i] and comm.test(r):
                    done[i] = True
            if all(done):
                return
            waited = time.monotonic() - start
            if next_warn is not None and waited >= next_warn:
                next_warn += warn_s
                warnings.warn(self._stall_message(request, missing_of, done, waited), StallWarning,
                              stacklevel=2)
            if timeout_s and waited >= timeout_s:
                # the value the user set (and where): this rank's lead over rank 0 is ours
                lead = (f", and {COORDINATOR_LEAD_S:g} s more on ranks other than 0 so that rank 0 "
                        f"speaks first" if timeout_s != user_timeout_s else "")
                text = (f"gradfuse: stall timeout ({config.source('GRADFUSE_STALL_TIMEOUT_S')}="
                        f"{user_timeout_s:g}{lead}): ") + self._stall_message(request, missing_of, done, waited)
                announce_and_abort(text + "; aborting the job", comm.abort, 1)
            # spin briefly (latency), then back off to at most 1 ms (CPU for compute)
            if waited > 1e-4:
                delay = min(max(delay * 2, 2e-5), 1e-3)
                time.sleep(delay)

    def _stall_message(self, request, missing_of, done, waited):
        pending = [i for i, d in enumerate(done) if not d]
        missing = missing_of(pending)
        who = (f"waiting for {_ranks(missing)}" if missing and missing != ["(some)"]
               else "waiting for other ranks")
        if self.comm.rank != 0 and missing == [0]:
            who = "waiting for the coordinator, rank 0 (it names the missing ranks)"
        return (f"rank {self.comm.rank}: collective #{self.seq} ({request.summary()}) has waited "
                f"{waited:.1f} s, {who}")
