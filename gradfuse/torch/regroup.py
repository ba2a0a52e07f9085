"""A restarted DDP's first iteration, run on the bucket layouts a restored state was saved for.

DDP rebuilds its buckets after its first iteration, in the order the gradients became
ready; a state saved after that holds the rebuilt layouts. A restarted DDP (a resumed
job) runs its first iteration on its initial buckets, which group the same tensors
differently (one large first bucket where the rebuilt ones are several, or the reverse,
or another order). Run on those, the first iteration after a resume would start from
zero residuals and velocities, and the run would not continue bit-exactly.

``Regroup`` gives each tensor of such a bucket to the restored layout that holds it (by
parameter name and shape) and runs a restored layout's step as soon as all its tensors
have arrived, in that layout's order, on its restored pipeline: exactly the step the
uninterrupted run made. A DDP bucket's future completes when every step holding one of
its tensors has (DDP waits for the futures only at the end of the backward pass, so a
bucket may wait for a later one). A restored layout still incomplete at the iteration's
last bucket, or when a bucket comes that the restored layouts do not hold, runs with what
it got, on a fresh pipeline.
"""
from .buckets import bare


class _Call:
    """One DDP bucket in the regrouped iteration: its future and the steps it waits for."""

    __slots__ = ("io", "fut", "pending", "error")

    def __init__(self, io):
        self.io, self.fut, self.pending, self.error = io, io.future(), set(), None


class Regroup:
    """Routes the tensors of a restarted DDP's buckets to the restored layouts.

    Args:
        restored: ``{pipeline key: layout}`` of the restored layouts not yet in use (the
            key is ``(warm, bucket index, layout)``).
        finisher: the executor that waits for steps and completes futures (one thread).
        on_error: called with a step's exception (the state's ``last_error``).
    """

    def __init__(self, restored, finisher, on_error):
        self.layouts = dict(restored)
        self.owner = {}
        for key, (names, shapes, _) in self.layouts.items():
            for n, s in zip(names, shapes):
                self.owner[(bare(n), tuple(s))] = key
        self.got = {key: {} for key in self.layouts}      # key -> {(name, shape): (view, call)}
        self.finisher, self.on_error = finisher, on_error

    def covers(self, io):
        """Whether every tensor of ``io`` belongs to a restored layout of its dtype, not yet taken."""
        for n, s in zip(io.layout[0], io.layout[1]):
            key = self.owner.get((bare(n), tuple(s)))
            if key is None or key not in self.got or key[2][2] != io.layout[2] or (bare(n), tuple(s)) in self.got[key]:
                return False
        return True

    @property
    def done(self):
        return not self.got

    def add(self, io, submit, last):
        """Take DDP bucket ``io``; run every restored layout it completes (``submit(key,
        layout, views, io)`` returns the step's handle), and at the iteration's ``last``
        bucket every layout that got anything. Returns the bucket's future."""
        call = _Call(io)
        touched = []
        for view, n, s in zip(io.views, io.layout[0], io.layout[1]):
            t = (bare(n), tuple(s))
            key = self.owner[t]
            self.got[key][t] = (view, call)
            call.pending.add(key)
            if key not in touched:
                touched.append(key)
        for key in [k for k in touched if len(self.got[k]) == len(self.layouts[k][0])]:
            self._run(key, submit, io)
        if last:
            self.flush(submit, io)
        return call.fut

    def flush(self, submit, io):
        """Run every restored layout that got some of its tensors, with what it got (the
        iteration ended, or a bucket came that no restored layout holds), and end."""
        for key in [k for k in self.got if self.got[k]]:
            self._run(key, submit, io)
        self.got.clear()

    def _run(self, key, submit, io):
        names, shapes, dtype = self.layouts[key]
        parts = self.got.pop(key)
        order = [(n, tuple(s)) for n, s in zip(names, shapes) if (bare(n), tuple(s)) in parts]
        views = [parts[(bare(n), s)][0] for n, s in order]
        layout = self.layouts[key] if len(order) == len(names) else (
            tuple(n for n, _ in order), tuple(s for _, s in order), dtype)
        calls = []
        for _, c in parts.values():
            if c not in calls:
                calls.append(c)
        try:
            handle = submit(key, layout, views, io)
        except BaseException as exc:        # carried by the futures, as a step's own error is
            self._done(key, calls, exc)
            return
        self.finisher.submit(self._wait, handle, key, calls)

    def _wait(self, handle, key, calls):
        try:
            handle.wait()
        except BaseException as exc:        # DDP re-raises it in backward's finalization
            self._done(key, calls, exc)
        else:
            self._done(key, calls, None)

    def _done(self, key, calls, exc):
        if exc is not None:
            self.on_error(exc)
        for c in calls:
            c.pending.discard(key)
            if exc is not None and c.error is None:
                c.error = exc
            if c.pending:
                continue
            try:
                if c.error is None:
                    c.io.finish()
            except BaseException as e:
                c.error = e
                self.on_error(e)
            if c.error is not None:
                c.fut.set_exception(c.error)
            else:
                c.fut.set_result(c.io.buf)
