"""Start ``torch.distributed`` from whichever launcher started the process.

Launchers, in the order they are looked for (the first whose rank and size are set wins):

1. ``torchrun``: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, and its own
   ``MASTER_ADDR``/``MASTER_PORT``;
2. ``mpiexec``: MPICH/Hydra's ``PMI_RANK``/``PMI_SIZE`` (local: ``MPI_LOCALRANKID``/
   ``MPI_LOCALNRANKS``), Open MPI's ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``; the
   rendezvous is ``MASTER_ADDR``/``MASTER_PORT`` (set them yourself; defaults 127.0.0.1:29500);
3. Slurm's ``srun``: ``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``)/
   ``SLURM_LOCALID``, read only inside a job step (``SLURM_STEP_ID`` set): in the batch
   script itself ``SLURM_NTASKS`` counts tasks that were never started. Unless the user set
   them, ``MASTER_ADDR`` is the first host of ``SLURM_STEP_NODELIST`` (Slurm's compressed
   host list, ``node[01-03,07],gpu5``) and ``MASTER_PORT`` is 15000 plus the last four
   digits of ``SLURM_JOB_ID`` (Lightning's ``SLURMEnvironment`` rule, so both agree).

No MPI is initialised: mpiexec and srun only start the processes.
"""
import os
import re

# (launcher, rank, size, local rank, local size); the first whose rank and size are set wins
_RANK_VARS = (("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
              ("mpiexec (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
              ("mpiexec (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"))


def _int(env, var):
    try:
        return int(env[var])
    except ValueError:
        raise ValueError(f"gradfuse.torch: {var}={env[var]!r} is not an integer") from None


def expand_hostlist(spec):
    """Slurm's compressed host list as a list of host names.

    Args:
        spec: e.g. ``"node[01-03,07],gpu5"`` (ranges keep their zero padding; several
            bracket groups in one name, ``"r[1-2]n[1-2]"``, expand as a product).

    Returns:
        The host names in order, e.g. ``["node01", "node02", "node03", "node07", "gpu5"]``.

    Example:
        >>> expand_hostlist("node[01-03,07],gpu5")[0]
        'node01'
    """
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(spec + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            item = spec[start:i].strip()
            if item:
                hosts.extend(_expand_one(item, spec))
            start = i + 1
    if depth != 0 or not hosts:
        raise ValueError(f"gradfuse.torch: cannot read the Slurm host list {spec!r}")
    return hosts


def _expand_one(item, spec):
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ValueError(f"gradfuse.torch: cannot read the Slurm host list {spec!r}")
        return [item]
    head, body, tail = m.groups()
    out = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"gradfuse.torch: cannot read the range {part!r} of the Slurm host list {spec!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(head + str(n).zfill(width) + rest for rest in _expand_one(tail, spec))
    return out


def _tasks_per_node(spec):
    """``"2(x3),1"`` -> [2, 2, 2, 1] (Slurm's SLURM_STEP_TASKS_PER_NODE)."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"gradfuse.torch: cannot read SLURM_STEP_TASKS_PER_NODE={spec!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _slurm(env):
    """Slurm's rank, size and local layout inside an srun step, or None outside one."""
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if size_var not in env:
        return None
    r, s = _int(env, "SLURM_PROCID"), _int(env, size_var)
    lr = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    ls = 1
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts = _tasks_per_node(per_node)
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        ls = counts[node] if node < len(counts) else counts[-1]
    ls = max(ls, lr + 1)
    return r, s, lr, ls, "SLURM_PROCID", size_var


def launcher_env(environ=None):
    """``(rank, world_size, local_rank, local_size, rank variable)`` of the launcher, or None.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        The tuple of the first launcher found (torchrun, then PMI/Open MPI, then Slurm
        inside an srun step), or None when none is.

    Example:
        >>> launcher_env({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "4"})[:2]
        (1, 4)
    """
    env = os.environ if environ is None else environ
    found = None
    for _, rank, size, lrank, lsize in _RANK_VARS:
        if rank in env and size in env:
            r, s = _int(env, rank), _int(env, size)
            lr = _int(env, lrank) if lrank in env else r
            ls = _int(env, lsize) if lsize in env else s
            found = (r, s, lr, ls, rank, size)
            break
    if found is None:
        found = _slurm(env)
    if found is None:
        return None
    r, s, lr, ls, rank, size = found
    if not 0 <= r < s:
        raise ValueError(f"gradfuse.torch: {rank}={r} is not a rank of {size}={s}")
    return r, s, lr, ls, rank


def rendezvous(environ=None):
    """``(MASTER_ADDR, MASTER_PORT)`` to use: the user's where set, else Slurm's first host
    and a port from the job id inside an srun step, else 127.0.0.1:29500.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``(address, port)`` as strings.

    Example:
        >>> rendezvous({"SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"})
        ('gpu07', '18456')
    """
    env = os.environ if environ is None else environ
    addr, port = "127.0.0.1", "29500"
    if "SLURM_STEP_ID" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodes:
            addr = expand_hostlist(nodes)[0]
        job = env.get("SLURM_JOB_ID", "")
        if job.isdigit():
            port = str(15000 + int(job[-4:]))
    return env.get("MASTER_ADDR", addr), env.get("MASTER_PORT", port)


def init_process_group(backend="gloo", **kwargs):
    """``torch.distributed.init_process_group`` with the rank and world size of torchrun,
    mpiexec (MPICH's PMI_*, Open MPI's OMPI_COMM_WORLD_*) or srun (SLURM_*); a no-op if
    already done.

    Args:
        backend: "gloo" (CPU; default) or "nccl".
        **kwargs: passed on (``timeout=...``).

    Returns:
        ``(rank, world_size)``.

    Example:
        >>> rank, size = gradfuse.torch.init_process_group("nccl")     # under srun or torchrun
    """
    import torch.distributed as dist
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    found = launcher_env()
    if found is None:
        raise RuntimeError("gradfuse.torch: no launcher environment (RANK/WORLD_SIZE of torchrun, PMI_RANK/"
                           "PMI_SIZE of MPICH's mpiexec, OMPI_COMM_WORLD_* of Open MPI's, SLURM_PROCID/"
                           "SLURM_NTASKS inside an srun step)")
    rank, size, lrank, lsize, _ = found
    addr, port = rendezvous()
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", port)
    # TorchCommunicator reads the node layout from torchrun's names
    os.environ.setdefault("LOCAL_RANK", str(lrank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(lsize))
    dist.init_process_group(backend, rank=rank, world_size=size, **kwargs)
    return rank, size
