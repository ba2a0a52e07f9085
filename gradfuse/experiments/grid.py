"""The grid: which runs an experiment set is made of, from a TOML file or a built-in grid.

A grid is a table with ``defaults`` (hyperparameters and axes shared by every
experiment) and a list of ``experiments``. An experiment names a task, its epochs, its
task options and its ``methods``; every method of an experiment gets the experiment's
hyperparameters, so a method entry may only hold compressor settings::

    [defaults]
    optimizer = "sgd"      # "sgd", "adam" (MXNet's) or "adamw" (gradfuse.mxnet's, torch's rule)
    lr = 0.1
    momentum = 0.9         # SGD only
    betas = [0.9, 0.999]   # Adam and AdamW only (MXNet's beta1, beta2)
    eps = 1e-8             # Adam and AdamW only (MXNet's epsilon)
    wd = 0.0               # SGD and Adam: L2 in the gradient; AdamW: decoupled decay
    batch_size = 32        # per rank
    workers = [2]          # axis: world sizes (each gets its own mpiexec -n N)
    seeds = [0, 1, 2, 3, 4]   # axis: training seeds, paired across methods
    split_seed = 0         # the train/test split (and synthetic data), fixed apart from the seed
    momentum_correction = ["default"]   # axis: "default", "on", "off"

    [[experiments]]
    name = "digits"
    task = "digits_cnn"
    epochs = 30
    methods = [
        {compress = "none"},
        {compress = "1bit", error_feedback = [true, false]},   # a list is an axis
        {compress = "topk", ratio = 0.01},
    ]

An experiment that sets a hyperparameter its optimizer does not take (``momentum`` with
Adam, ``betas`` or ``eps`` with SGD) is refused; one inherited from ``[defaults]`` is
left out of its runs (a run of Adam records momentum 0, a run of SGD no betas).

Expanding a grid gives one ``RunSpec`` per task x method x option values x momentum
correction x seed x world size. Every error names the grid, the experiment, the
method and the value (``GridError``).
"""
import copy
import hashlib
import itertools
import json
import os
from dataclasses import asdict, dataclass, field

from .tasks import TaskError, get_task

HYPER_KEYS = ("optimizer", "lr", "momentum", "betas", "eps", "wd", "batch_size")
AXIS_KEYS = ("workers", "seeds", "momentum_correction")
DEFAULT_KEYS = HYPER_KEYS + AXIS_KEYS + ("split_seed", "max_steps_per_epoch")
EXPERIMENT_KEYS = DEFAULT_KEYS + ("name", "task", "epochs", "task_options", "methods")
CORRECTION_MODES = ("default", "on", "off")
OPTIMIZERS = ("sgd", "adam", "adamw")
ADAM_FAMILY = ("adam", "adamw")
OWN_KEYS = {"sgd": ("momentum",), "adam": ("betas", "eps"), "adamw": ("betas", "eps")}


class GridError(ValueError):
    """A grid is malformed: the message names where and what."""


class UnsupportedError(RuntimeError):
    """A run asks for something this gradfuse cannot do (e.g. momentum correction)."""


@dataclass(frozen=True)
class RunSpec:
    """One run: a task x compressor config x momentum correction x seed x world size.

    ``options`` are the compressor options as given (error feedback included);
    ``compressor_config`` is what ``gradfuse.compressors.create(...).get_config()``
    resolved them to, defaults filled in, so a change of the library's defaults is a
    new run. ``momentum`` is 0 for Adam and AdamW; ``betas`` and ``eps`` are None for
    SGD (and then left out of the id, so an SGD run keeps its id).
    """

    experiment: str
    task: str
    task_options: dict
    compress: str
    options: dict
    compressor_config: dict
    momentum_correction: str
    optimizer: str
    lr: float
    momentum: float
    wd: float
    batch_size: int
    epochs: int
    seed: int
    split_seed: int
    workers: int
    max_steps_per_epoch: int = 0
    betas: list = None
    eps: float = None
    label: str = field(default="", compare=False)

    @property
    def id(self):
        """A stable id: readable prefix + hash of everything that defines the run."""
        d = asdict(self)
        d.pop("label")
        for k in ("betas", "eps"):
            if d[k] is None:
                d.pop(k)
        digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]
        safe = "".join(c if c.isalnum() else "-" for c in self.label).strip("-")
        return f"{self.experiment}-{safe}-s{self.seed}-w{self.workers}-{digest}"

    def to_dict(self):
        """The run as a plain dict of its fields (what the results store writes)."""
        return asdict(self)

    def optimizer_params(self):
        """The MXNet ``optimizer_params`` of this run (the same for every method)."""
        if self.optimizer in ADAM_FAMILY:
            return {"learning_rate": self.lr, "beta1": self.betas[0], "beta2": self.betas[1],
                    "epsilon": self.eps, "wd": self.wd}
        return {"learning_rate": self.lr, "momentum": self.momentum, "wd": self.wd}

    @classmethod
    def from_dict(cls, d):
        """The ``RunSpec`` of a ``to_dict()`` dict."""
        return cls(**d)


def method_label(compress, options, compressor_config, correction):
    """A short human label: ``'topk 1% EF'``, ``'1bit no EF'``, ``'fp16'``, ``'1bit EF +MC'``."""
    parts = [compress]
    for k, v in sorted(options.items()):
        if k in ("error_feedback",):
            continue
        if k == "ratio":
            parts.append(f"{100 * float(v):g}%")
        else:
            parts.append(f"{k}={v}")
    if "error_feedback" in compressor_config:
        ef = compressor_config["error_feedback"]
        default_off = compress in ("fp16", "bf16")
        if ef or not default_off:
            parts.append("EF" if ef else "no EF")
    if correction == "on":
        parts.append("+MC")
    elif correction == "off":
        parts.append("-MC")
    return " ".join(parts)


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _check_number(where, key, v, kind, minimum=None, strict=False):
    ok = isinstance(v, kind) and not isinstance(v, bool)
    if ok and minimum is not None:
        ok = v > minimum if strict else v >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum}"
        raise GridError(f"{where}: {key!r} must be a{'n integer' if kind is int else ' number'}{bound}, got {v!r}")
    return v


def _validate_optimizer(where, s, exp):
    """Check the optimizer and its own hyperparameters; ``exp``: the experiment's own keys."""
    opt = s["optimizer"]
    if opt not in OPTIMIZERS:
        raise GridError(f"{where}: optimizer {opt!r} is not supported; valid: {', '.join(OPTIMIZERS)}")
    foreign = sorted({k for keys in OWN_KEYS.values() for k in keys if k in exp and k not in OWN_KEYS[opt]})
    if foreign:
        raise GridError(f"{where}: sets {', '.join(map(repr, foreign))}, which optimizer {opt!r} does not take "
                        f"({opt} takes lr, {', '.join(OWN_KEYS[opt])} and wd)")
    if opt in ADAM_FAMILY:
        betas = s["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise GridError(f"{where}: 'betas' must be a list of two numbers in [0, 1), got {betas!r}")
        for i, b in enumerate(betas):
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
                raise GridError(f"{where}: 'betas' must be a list of two numbers in [0, 1), got {betas!r} "
                                f"(beta{i + 1} = {b!r})")
        _check_number(where, "eps", s["eps"], (int, float), 0)
    else:
        _check_number(where, "momentum", s["momentum"], (int, float), 0)
        if s["momentum"] >= 1:
            raise GridError(f"{where}: 'momentum' must be in [0, 1), got {s['momentum']!r}")


def _validate_settings(where, s, exp=()):
    _validate_optimizer(where, s, exp)
    _check_number(where, "lr", s["lr"], (int, float), 0, strict=True)
    _check_number(where, "wd", s["wd"], (int, float), 0)
    _check_number(where, "batch_size", s["batch_size"], int, 1)
    _check_number(where, "epochs", s["epochs"], int, 1)
    _check_number(where, "split_seed", s["split_seed"], int, 0)
    _check_number(where, "max_steps_per_epoch", s["max_steps_per_epoch"], int, 0)
    for w in _as_list(s["workers"]):
        _check_number(where, "workers", w, int, 1)
    seeds = _as_list(s["seeds"])
    if not seeds:
        raise GridError(f"{where}: 'seeds' is empty")
    for seed in seeds:
        _check_number(where, "seeds", seed, int, 0)
    if len(set(seeds)) != len(seeds):
        raise GridError(f"{where}: 'seeds' repeats a seed: {seeds}")
    for m in _as_list(s["momentum_correction"]):
        _correction_mode(where, m)


def _correction_mode(where, m):
    if m is True:
        return "on"
    if m is False:
        return "off"
    if m not in CORRECTION_MODES:
        raise GridError(f"{where}: 'momentum_correction' must be one of {', '.join(CORRECTION_MODES)} "
                        f"(or true/false), got {m!r}")
    return m


BASE_DEFAULTS = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "betas": [0.9, 0.999], "eps": 1e-8,
                 "wd": 0.0, "batch_size": 32,
                 "workers": [2], "seeds": [0, 1, 2, 3, 4], "split_seed": 0,
                 "momentum_correction": ["default"], "max_steps_per_epoch": 0}


def _expand_method(where, entry, compressors):
    if not isinstance(entry, dict) or "compress" not in entry:
        raise GridError(f"{where}: a method must be a table with a 'compress' key, got {entry!r}")
    hyper = sorted(set(entry) & set(HYPER_KEYS + ("epochs", "seeds", "workers", "split_seed")))
    if hyper:
        raise GridError(f"{where}: method {entry['compress']!r} sets {', '.join(hyper)}; hyperparameters are "
                        f"per experiment, the same for every compressor")
    name = entry["compress"]
    if name not in compressors.available():
        raise GridError(f"{where}: unknown compressor {name!r}; valid names: {', '.join(compressors.available())}")
    opts = {k: v for k, v in entry.items() if k not in ("compress", "momentum_correction")}
    keys = sorted(opts)
    out = []
    for values in itertools.product(*(_as_list(opts[k]) for k in keys)):
        chosen = dict(zip(keys, values))
        try:
            cfg = compressors.create(name, **chosen).get_config()
        except (TypeError, ValueError) as exc:
            raise GridError(f"{where}: compressor {name!r} with {chosen}: {exc}") from None
        out.append((name, chosen, cfg, entry.get("momentum_correction")))
    return out


def expand(grid):
    """All the ``RunSpec`` of a grid dict, in grid order (experiment, method, seed, world size).

    Raises:
        GridError: naming the grid, the experiment, the method and the bad value.
    """
    from .. import compressors

    gname = grid.get("name", "grid")
    unknown = sorted(set(grid) - {"name", "description", "defaults", "experiments"})
    if unknown:
        raise GridError(f"grid {gname!r}: unknown top-level key(s) {', '.join(unknown)}; "
                        f"valid: name, description, defaults, experiments")
    defaults = dict(BASE_DEFAULTS)
    extra = sorted(set(grid.get("defaults", {})) - set(DEFAULT_KEYS))
    if extra:
        raise GridError(f"grid {gname!r}: unknown key(s) in [defaults]: {', '.join(extra)}; "
                        f"valid: {', '.join(DEFAULT_KEYS)}")
    defaults.update(grid.get("defaults", {}))
    exps = grid.get("experiments")
    if not exps:
        raise GridError(f"grid {gname!r} has no experiments")
    runs, names = [], set()
    for i, exp in enumerate(exps):
        ename = exp.get("name", exp.get("task", f"#{i}"))
        where = f"grid {gname!r}, experiment {ename!r}"
        bad = sorted(set(exp) - set(EXPERIMENT_KEYS))
        if bad:
            raise GridError(f"{where}: unknown key(s) {', '.join(bad)}; valid: {', '.join(EXPERIMENT_KEYS)}")
        if ename in names:
            raise GridError(f"{where}: the experiment name is used twice")
        names.add(ename)
        for key in ("task", "epochs", "methods"):
            if key not in exp:
                raise GridError(f"{where}: missing {key!r}")
        try:
            task = get_task(exp["task"], exp.get("task_options", {}))
        except TaskError as exc:
            raise GridError(f"{where}: {exc}") from None
        s = {**defaults, **{k: v for k, v in exp.items() if k in DEFAULT_KEYS}, "epochs": exp["epochs"]}
        _validate_settings(where, s, exp)
        adam = s["optimizer"] in ADAM_FAMILY
        methods = []
        for j, entry in enumerate(exp["methods"]):
            methods += _expand_method(f"{where}, method #{j + 1}", entry, compressors)
        if not any(m[0] == "none" for m in methods):
            raise GridError(f"{where}: no 'none' method; the paired gaps need the fp32 baseline")
        for name, opts, cfg, mc_override in methods:
            modes = _as_list(mc_override if mc_override is not None else s["momentum_correction"])
            for mc in (_correction_mode(where, m) for m in modes):
                if mc == "on" and not adam and s["momentum"] == 0:
                    raise GridError(f"{where}: momentum_correction 'on' needs momentum > 0, got momentum 0")
                for seed in _as_list(s["seeds"]):
                    for w in _as_list(s["workers"]):
                        if w < 2 and name != "none":
                            raise GridError(f"{where}: workers={w} with compressor {name!r}: DistributedTrainer "
                                            f"does not reduce on a single rank, so nothing would be compressed; "
                                            f"use workers >= 2")
                        runs.append(RunSpec(
                            experiment=ename, task=task.name, task_options=dict(task.options), compress=name,
                            options=opts, compressor_config=cfg, momentum_correction=mc,
                            optimizer=s["optimizer"], lr=float(s["lr"]),
                            momentum=0.0 if adam else float(s["momentum"]),
                            betas=[float(b) for b in s["betas"]] if adam else None,
                            eps=float(s["eps"]) if adam else None, wd=float(s["wd"]), batch_size=int(s["batch_size"]), epochs=int(s["epochs"]),
                            seed=int(seed), split_seed=int(s["split_seed"]), workers=int(w),
                            max_steps_per_epoch=int(s["max_steps_per_epoch"]),
                            label=method_label(name, opts, cfg, mc)))
    return runs


def select(specs, experiments=None, methods=None, flags=("experiments=", "methods=")):
    """Keep only the runs of the named experiments and methods (None keeps all).

    ``methods`` holds method labels (``'1bit no EF'``) or compressor names (``'topk'``),
    matched within the chosen experiments. A name that matches no run is an error, so a
    typo never selects nothing (or less than asked) in silence.

    Args:
        specs: the ``RunSpec`` of a grid (``expand``).
        experiments, methods: lists of names, or None.
        flags: what to call the two filters in messages (the CLI passes its options).

    Raises:
        GridError: an empty filter, or a name that matches no run; it lists the valid names.
    """
    if experiments is not None:
        valid = list(dict.fromkeys(s.experiment for s in specs))
        _check_names(flags[0], experiments, valid, "experiment", f"valid experiments: {', '.join(valid)}")
        specs = [s for s in specs if s.experiment in experiments]
    if methods is not None:
        labels = list(dict.fromkeys(s.label for s in specs))
        names = list(dict.fromkeys(s.compress for s in specs))
        where = f" of experiment(s) {', '.join(experiments)}" if experiments else ""
        _check_names(flags[1], methods, labels + names, f"run{where}",
                     f"valid method labels: {', '.join(map(repr, labels))}; compressor names: {', '.join(names)}")
        specs = [s for s in specs if s.label in methods or s.compress in methods]
    return specs


def _check_names(flag, asked, valid, what, listing):
    if not asked:
        raise GridError(f"{flag} is empty; {listing}")
    unknown = [a for a in asked if a not in valid]
    if unknown:
        raise GridError(f"{flag} {', '.join(map(repr, unknown))} matches no {what}; {listing}")


def correction_options(spec, trainer_params=(), compressors=None):
    """Trainer keywords that realise ``spec.momentum_correction``, or ``UnsupportedError``.

    The correction moves the optimizer's state into the compressor state, where error
    feedback runs on it: DGC's momentum correction for SGD (each worker's velocity is what
    error feedback compresses; the optimizer then runs without momentum), and for Adam and
    AdamW whatever ``DistributedTrainer`` does under the same keyword. This is the one
    place that maps the grid's axis to the library, and it asks the library what it
    supports:

    * ``"default"``: nothing is passed; whatever gradfuse does by default.
    * a ``DistributedTrainer`` with a ``momentum_correction`` parameter (its name in
      ``trainer_params``): ``momentum_correction=True`` for ``"on"``, ``False`` for ``"off"``
      (a trainer that then refuses the optimizer makes the run refused: the worker
      turns its error into ``correction_refused``'s);
    * else, for SGD, a compressor that takes a ``momentum`` option: ``momentum=<the
      optimizer's>`` for ``"on"``, nothing for ``"off"``;
    * else ``"on"`` is refused (``UnsupportedError``: the run is never made without it),
      and ``"off"`` passes nothing (there is no correction to turn off).

    Args:
        spec: the ``RunSpec``.
        trainer_params: the parameter names of ``gradfuse.mxnet.DistributedTrainer``
            (the worker passes them; the runner, which does not import MXNet, does not).
    """
    if compressors is None:
        from .. import compressors
    mode = spec.momentum_correction
    if mode == "default":
        return {}
    if "momentum_correction" in trainer_params:
        return {"momentum_correction": mode == "on"}
    if spec.optimizer in ADAM_FAMILY:
        if mode == "off":
            return {}
        raise UnsupportedError(
            f"run {spec.id}: the Adam correction was asked for (momentum_correction='on', optimizer "
            f"{spec.optimizer!r}) but this gradfuse does not support it: DistributedTrainer has no "
            f"'momentum_correction' parameter; the run is refused rather than run without it.")
    try:
        compressors.create(spec.compress, **spec.options, momentum=spec.momentum)
    except TypeError as exc:
        if mode == "off":
            return {}
        raise UnsupportedError(
            f"run {spec.id}: momentum correction was asked for (momentum_correction='on', momentum="
            f"{spec.momentum}) but this gradfuse does not support it: DistributedTrainer has no "
            f"'momentum_correction' parameter and compressor {spec.compress!r} takes no 'momentum' option "
            f"({exc}); the run is refused rather than run without it.") from None
    return {"momentum": spec.momentum} if mode == "on" else {}


def correction_refused(spec, exc):
    """The ``UnsupportedError`` of a run whose trainer refused ``momentum_correction=True``.

    Args:
        spec: the ``RunSpec`` (its ``momentum_correction`` is ``"on"``).
        exc: the trainer's ``ValueError`` or ``TypeError``; its message is kept.
    """
    return UnsupportedError(
        f"run {spec.id}: momentum correction was asked for (momentum_correction='on', optimizer "
        f"{spec.optimizer!r}, compress {spec.compress!r}) but this gradfuse's DistributedTrainer refuses it: "
        f"{exc}; the run is refused rather than run without it.")


def load_grid(source):
    """A grid dict from a built-in name (``quick``, ``default``, ``acceptance``) or a TOML path.

    Raises:
        GridError: unknown name, unreadable or malformed TOML.
    """
    from .builtin import BUILTIN
    if source in BUILTIN:
        return copy.deepcopy(BUILTIN[source])
    if not os.path.exists(source):
        raise GridError(f"grid {source!r} is neither a built-in grid ({', '.join(sorted(BUILTIN))}) "
                        f"nor an existing TOML file")
    try:
        import tomllib
    except ImportError:            # Python < 3.11
        import tomli as tomllib
    try:
        with open(source, "rb") as f:
            grid = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"grid file {source!r}: invalid TOML: {exc}") from None
    grid.setdefault("name", os.path.splitext(os.path.basename(source))[0])
    return grid


def _toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(grid):
    """The grid dict as TOML text (``load_grid`` reads it back to the same dict)."""
    lines = []
    for k in ("name", "description"):
        if k in grid:
            lines.append(f"{k} = {_toml_value(grid[k])}")
    if grid.get("defaults"):
        lines += ["", "[defaults]"] + [f"{k} = {_toml_value(v)}" for k, v in grid["defaults"].items()]
    for exp in grid.get("experiments", []):
        lines += ["", "[[experiments]]"]
        for k, v in exp.items():
            if k == "methods":
                lines.append("methods = [")
                lines += [f"    {_toml_value(m)}," for m in v]
                lines.append("]")
            elif k != "task_options":
                lines.append(f"{k} = {_toml_value(v)}")
        if exp.get("task_options"):
            lines += ["[experiments.task_options]"] + [f"{k} = {_toml_value(v)}"
                                                       for k, v in exp["task_options"].items()]
    return "\n".join(lines) + "\n"
