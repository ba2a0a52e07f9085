"""A call's arguments in, its ``Inputs`` and ``Outputs`` out: the two entry points.

Called once each per step on the caller's thread:

* ``read_inputs(grads, names, out)`` shapes the arguments (a list, tuple or dict of
  arrays, or a ``Deferred``; names; ``out=``) and hands the call's arrays, the ``out=``
  arrays with them, to ``gradfuse.fusion.intake.read``: it decides once what kind of
  arrays they are and has the host or device table builder (``host``, ``device``) read
  every pointer, byte size, dtype and shape;
* ``read_outputs(inputs, grads, out, entry)`` gives the call its outputs (the inputs
  themselves in place, ``out=``, or new arrays), checks that ``out=`` matches the inputs
  and overlaps nothing it must not, and returns ``Outputs``.

Bad input raises ``TypeError``/``ValueError`` naming the tensor; the pipeline announces
it to the other ranks, so that they raise too instead of waiting.

A binding whose arrays get their memory later (MXNet allocates lazily and hands the
memory over in its engine) passes a ``gradfuse.fusion.deferred.Deferred`` instead: names,
signature and byte sizes now, the data pointers on the communication thread.

Out-of-place calls without ``out=`` reuse their output arrays from one call to the next
when the caller no longer holds them (``gradfuse.fusion.pool.OutputPool``, one per
cached plan): fresh 100 MB outputs would pay a page fault per 4 KiB page at their first
touch, every step.

GPU tensors (cupy arrays, ``__cuda_array_interface__``, CUDA DLPack) become cupy views on
their device (no copies, except non-contiguous inputs); all tensors of a call must be on
one device. ``Outputs.ready`` is then an event on the caller's stream that the
communication thread's stream waits for.
"""
import numpy as np

from . import device, intake
from .call import Outputs
from .deferred import Deferred
from .plan import parse_signature
from .. import dtypes as _dt


# --- argument shaping --------------------------------------------------------------
_NAME_TYPES = {str, int}
#: name tuples ``flatten`` has checked, by id (held, so an id is never reused while here): a
#: binding that passes the same tuple every step (``gradfuse.mxnet``'s group names) skips
#: the two passes over its names (2000 names: ~0.15 ms a call)
_checked = {}
_CHECKED_MAX = 64


def flatten(grads, names):
    """Return (objects, names) for a list/tuple or dict of arrays (a ``Deferred``: no
    objects yet, its names)."""
    if isinstance(grads, Deferred):
        if names is not None:
            raise TypeError("names= cannot be combined with a Deferred (it carries its names)")
        objs, names = flatten([None] * len(grads.names), grads.names)
        # a checked tuple: the plan key is then this very tuple (no copy)
        return objs, (grads.names if type(grads.names) is tuple else names)
    if isinstance(grads, dict):
        if names is not None:
            raise TypeError("names= cannot be combined with a dict of gradients (the keys are the names)")
        keys = list(grads)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"gradient dict keys must be str names, got {k!r} ({type(k).__name__})")
        return list(grads.values()), keys
    if isinstance(grads, (list, tuple)):
        objs = list(grads)
        if names is None:
            return objs, list(range(len(objs)))
        given = names
        names = list(names)
        if len(names) != len(objs):
            raise ValueError(f"got {len(names)} names for {len(objs)} tensors")
        if _checked.get(id(given)) is given:      # a tuple checked before (it cannot have changed)
            return objs, names
        if not set(map(type, names)) <= _NAME_TYPES:      # one C pass; the loop names the culprit
            for n in names:
                if not isinstance(n, (str, int)) or isinstance(n, bool):
                    raise TypeError(f"tensor names must be str (or int positions), got {n!r}")
        if len(set(names)) != len(names):
            seen, dups = set(), []
            for n in names:
                if n in seen and n not in dups:
                    dups.append(n)
                seen.add(n)
            raise ValueError(f"duplicate tensor names: {', '.join(repr(d) for d in dups)}")
        if type(given) is tuple:
            if len(_checked) >= _CHECKED_MAX:
                _checked.clear()
            _checked[id(given)] = given
        return objs, names
    raise TypeError(f"gradients must be a list, tuple or dict of arrays, got {type(grads).__name__}; "
                    f"wrap a single array in a list")


def _out_objects(out, names):
    """The objects of ``out=``, which must have the gradients' structure and names."""
    out_objs, out_names = flatten(out, None if isinstance(out, dict) else names)
    if out_names != names:
        raise ValueError(f"out= must have the same structure and names as the gradients; "
                         f"got {out_names[:3]}... for {names[:3]}...")
    return out_objs


# --- output checks -------------------------------------------------------------------
def _check_out_signature(sig, out_sig, names):
    """Name the first output whose dtype or shape differs from its input."""
    if out_sig == sig:
        return
    for i, ((c1, s1), (c2, s2)) in enumerate(zip(parse_signature(sig), parse_signature(out_sig))):
        if (c1, s1) != (c2, s2):
            raise ValueError(f"tensor {names[i]!r}: output has dtype {_dt.name(c2)} shape "
                             f"{s2}, input has dtype {_dt.name(c1)} shape {s1}")


def _first_overlap(starts, ends, names, labels):
    """Slow path: name the first two intervals that overlap (for the error message)."""
    idx = sorted(range(len(starts)), key=lambda i: starts[i])
    active = []
    for i in idx:
        for j in active:
            if ends[j] > starts[i]:
                return names[j], labels[j], names[i], labels[i]
        active = [j for j in active if ends[j] > starts[i]] + [i]
    return None


def check_overlaps(in_ptrs, in_nb, out_ptrs, out_nb, names):
    """Raise ValueError if outputs overlap each other or another tensor's input.

    An output that *is* its own input (same address, same size) is the in-place
    case and allowed. Vectorised: O(n log n) in numpy, run only when pointers change.
    """
    same = (in_ptrs == out_ptrs) & (in_nb == out_nb)
    w = out_nb > 0
    ws, we = out_ptrs[w], out_ptrs[w] + out_nb[w]
    order = np.argsort(ws, kind="stable")
    bad = bool(ws.size > 1 and np.any(we[order][:-1] > ws[order][1:]))
    r = (~same) & (in_nb > 0)
    if not bad and r.any():
        rs, re = in_ptrs[r], in_ptrs[r] + in_nb[r]
        ro = np.argsort(rs, kind="stable")
        rs, pmax = rs[ro], np.maximum.accumulate(re[ro])
        k = np.searchsorted(rs, we, side="left")
        hit = (k > 0) & (pmax[np.maximum(k - 1, 0)] > ws)
        bad = bool(hit.any())
    if not bad:
        return
    starts = list(out_ptrs) + [p for p, keep in zip(in_ptrs, ~same) if keep]
    ends = list(out_ptrs + out_nb) + [p + s for p, s, keep in zip(in_ptrs, in_nb, ~same) if keep]
    tnames = list(names) + [n for n, keep in zip(names, ~same) if keep]
    labels = ["output"] * len(names) + ["input"] * int((~same).sum())
    found = _first_overlap(starts, ends, tnames, labels)
    if found is None:
        raise ValueError("outputs overlap inputs or each other")
    a, la, b, lb = found
    raise ValueError(f"tensor {a!r} {la} overlaps tensor {b!r} {lb}: outputs may be their own "
                     f"input exactly (in place) but must not partly overlap any input or output")


# --- the two entry points ----------------------------------------------------------
def read_inputs(grads, names, out=None):
    """The ``Inputs`` of a call to ``allreduce_async(grads, out=out, names=names)``: the
    gradients and, for ``out=`` other arrays, those too, in one pass (``intake.read``)."""
    objs, names = flatten(grads, names)
    d = grads if isinstance(grads, Deferred) else None
    outs = None
    if d is not None:
        if out is not None and out is not grads:
            raise TypeError("out= cannot be combined with a Deferred (it carries its outputs)")
        if (out is grads) != (d.out_ptrs is None):
            raise ValueError("a Deferred with out_ptrs is reduced out of place (out=None), "
                             "one without in place (out=itself)")
    elif out is not None and out is not grads:
        outs = _out_objects(out, names)
    return intake.read(objs, names, out is grads, outs, d)


def read_outputs(inputs, grads, out, entry):
    """The ``Outputs`` of a call: the inputs (``out is grads``), ``out=`` (read with the
    inputs, checked here), or new arrays; a ``Deferred``'s own.

    ``entry`` is the cached plan (its ``codes``/``shapes`` shape new outputs, and its
    ``verified`` pair of pointer tables skips the overlap check while they repeat).
    """
    d, xp = inputs.deferred, inputs.xp
    objs, ptrs, result, ready = inputs.objs, inputs.ptrs, out, None
    if d is not None:       # the binding's own outputs (or the inputs): nothing to check
        ptrs = inputs.ptrs if d.out_ptrs is None else d.out_ptrs
        result = d.result
    elif out is not None:
        out_sig, ptrs, out_nbytes = (inputs.sig, inputs.ptrs, inputs.nbytes) if out is grads else inputs.out_tables
        if entry.verified is None or not (np.array_equal(entry.verified[0], inputs.ptrs)
                                          and np.array_equal(entry.verified[1], ptrs)):
            check_overlaps(inputs.ptrs, inputs.nbytes, ptrs, out_nbytes, inputs.names)
            entry.verified = (inputs.ptrs, ptrs)
        if out is not grads:
            _check_out_signature(inputs.sig, out_sig, inputs.names)
            objs = inputs.outs
    elif xp is np:
        objs, ptrs = entry.outputs.take(entry)
    else:
        with xp.cuda.Device(inputs.device):
            objs, ptrs = device.new_outputs(entry, xp)
    if d is None and out is None:     # new arrays, in the structure of the gradients
        result = (dict(zip(grads.keys(), objs)) if isinstance(grads, dict)
                  else tuple(objs) if isinstance(grads, tuple) else list(objs))
    if xp is not np:
        # the communication thread's stream waits for the work queued so far on the caller's
        # stream (the producer of the gradients)
        with xp.cuda.Device(inputs.device):
            ready = xp.cuda.Event(disable_timing=True)
            ready.record(xp.cuda.get_current_stream())
    return Outputs(objs, ptrs, result, ready)
