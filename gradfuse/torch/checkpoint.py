"""The hook state as ``torch.save`` keeps it: tensors and plain Python values.

``CompressionState.state_dict()`` holds CPU tensors (residuals, velocities) and plain
values (ints, floats, strings, lists, tuples, dicts, None), so ``torch.load(path)`` with
PyTorch's default ``weights_only=True`` restores it, and the restored state continues
bit-exactly. Format ``gradfuse-torch-2``; a ``gradfuse-torch-1`` dict (the same with numpy
arrays) loads too, from memory or from a file loaded with ``weights_only=False``; any other
format is refused by name.

``gather`` / ``pick`` carry every rank's state through one file (Lightning writes its
checkpoint on rank 0 only): the states travel as ``torch.save`` bytes over the hook's gloo
control group and are read back with ``weights_only=True`` (nothing is unpickled).
"""
import io

import numpy as np
import torch
import torch.distributed as dist

from .device import all_gather_into

FORMAT = "gradfuse-torch-2"
FORMATS = ("gradfuse-torch-1", FORMAT)
RANKS_FORMAT = "gradfuse-torch-ranks-1"


def to_tensors(obj):
    """``obj`` with every numpy array as a CPU tensor (a copy) and numpy scalars as Python's."""
    if isinstance(obj, dict):
        return {k: to_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_tensors(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj, copy=True, order="C"))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def to_numpy(obj):
    """The inverse of ``to_tensors``: every tensor as a numpy array (a copy, on the host)."""
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_numpy(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    return obj


def check_format(sd):
    """Raise ValueError, naming the format found, unless ``sd`` is a hook state of a known format."""
    got = sd.get("format") if isinstance(sd, dict) else None
    if got not in FORMATS:
        what = repr(got) if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"not a gradfuse.torch CompressionState state_dict: format {what}, expected one of "
                         f"{', '.join(FORMATS)}")


def _to_bytes(sd):
    f = io.BytesIO()
    torch.save(sd, f)
    return f.getvalue()


def _from_bytes(raw):
    return torch.load(io.BytesIO(raw), weights_only=True)


def gather(sd, group):
    """Every rank's ``sd`` (a state_dict of tensors and plain values), by rank, on every
    rank of ``group`` (gloo). Collective.

    Args:
        sd: this rank's ``CompressionState.state_dict()``.
        group: a gloo process group of the hook's ranks (its control group).

    Returns:
        ``{"format": "gradfuse-torch-ranks-1", "world_size": p, "ranks": [sd_0, ..., sd_p-1]}``.
    """
    raw = _to_bytes(sd)
    p = dist.get_world_size(group)
    sizes = torch.zeros(p, dtype=torch.int64)
    all_gather_into(sizes, torch.tensor([len(raw)], dtype=torch.int64), group)
    width = max(1, int(sizes.max()))
    send = torch.zeros(width, dtype=torch.uint8)
    send[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    recv = torch.empty(width * p, dtype=torch.uint8)
    all_gather_into(recv, send, group)
    data = recv.numpy().tobytes()
    ranks = [_from_bytes(data[r * width:r * width + int(n)]) for r, n in enumerate(sizes.tolist())]
    return {"format": RANKS_FORMAT, "world_size": p, "ranks": ranks}


def pick(saved, rank, size, where="the checkpoint"):
    """This rank's state from a ``gather`` result.

    Saved on another number of ranks, it is the state of rank ``rank % saved ranks``:
    ``CompressionState.load_state_dict`` then keeps from it what every rank shares (the
    step counters, an Adam correction's moments, PowerSGD's Q) and starts the residuals and
    velocities from zero, with a warning naming them.

    Args:
        saved: what ``gather`` returned (as loaded from a checkpoint).
        rank, size: this rank and the world size now.
        where: the file, for the messages.

    Returns:
        A ``state_dict`` to restore.
    """
    if not isinstance(saved, dict) or saved.get("format") != RANKS_FORMAT:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"gradfuse.torch: {where} holds hook states of format {got!r}, expected "
                         f"{RANKS_FORMAT!r}")
    ranks = saved.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != saved.get("world_size") or not ranks:
        raise ValueError(f"gradfuse.torch: {where} says it holds the hook states of {saved.get('world_size')!r} "
                         f"ranks and holds {len(ranks) if isinstance(ranks, list) else ranks!r}")
    return ranks[rank % len(ranks)]
