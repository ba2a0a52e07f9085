"""Every GRADFUSE_* variable: only unset means the default; any other value parses or
raises an error that names the variable (docs/reliability.md has the table)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import gradfuse
from gradfuse import config
from gradfuse.runtime import watchdog
from gradfuse.comm import SingleProcessCommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ODD = ["", "abc", "-1", "1e3", "4294967296", " ", "\t\n", "nan", "inf", "1_000", "0x10", "١٢"]


def _outcome(fn, var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    try:
        return fn()
    except ValueError as exc:
        assert f"{var}=" in str(exc) and repr(value) in str(exc), str(exc)
        return "error"


# expected outcome per value: a parsed value, or "error" (ValueError naming the variable)
BYTES = {"": "error", "abc": "error", "-1": "error", "1e3": "error", "4294967296": 4294967296,
         " ": "error", "\t\n": "error", "nan": "error", "inf": "error", "1_000": "error",
         "0x10": "error", "١٢": "error", " 65536 ": 65536, "+8": 8, "0": 0,
         str(1 << 40): 1 << 40, str((1 << 40) + 1): "error"}
SECONDS = {"": "error", "abc": "error", "-1": "error", "1e3": 1000.0, "4294967296": "error",
           " ": "error", "\t\n": "error", "nan": "error", "inf": "error", "1_000": "error",
           "0x10": "error", "١٢": "error", " 2.5 ": 2.5, "0": 0.0, ".5": 0.5, "604800": 604800.0,
           "604801": "error", "-0": 0.0}
FLAG = {"": "error", "abc": "error", "-1": "error", "1e3": "error", "4294967296": "error",
        " ": "error", "\t\n": "error", "nan": "error", "inf": "error", "1_000": "error",
        "0x10": "error", "١٢": "error", "0": False, "1": True, " 1\n": True, "true": "error",
        "01": "error"}

SECONDS_VARS = {"GRADFUSE_STALL_WARNING_S": config.stall_warning_s,
                "GRADFUSE_STALL_TIMEOUT_S": config.stall_timeout_s,
                "GRADFUSE_EXIT_TIMEOUT_S": config.exit_timeout_s}


@pytest.mark.parametrize("value", sorted(BYTES))
def test_fusion_threshold(value, monkeypatch):
    assert _outcome(config.fusion_threshold, "GRADFUSE_FUSION_THRESHOLD", value, monkeypatch) \
        == BYTES[value]


@pytest.mark.parametrize("var", sorted(SECONDS_VARS))
@pytest.mark.parametrize("value", sorted(SECONDS))
def test_seconds(var, value, monkeypatch):
    assert _outcome(SECONDS_VARS[var], var, value, monkeypatch) == SECONDS[value]


@pytest.mark.parametrize("value", sorted(FLAG))
def test_cma_flag(value, monkeypatch):
    assert _outcome(config.cma, "GRADFUSE_CMA", value, monkeypatch) == FLAG[value]


@pytest.mark.parametrize("value", sorted(FLAG))
def test_mxnet_direct_flag(value, monkeypatch):
    assert _outcome(config.mxnet_direct, "GRADFUSE_MXNET_DIRECT", value, monkeypatch) == FLAG[value]


def test_every_variable_is_in_the_readme_table():
    """Every GRADFUSE_* name the package reads (not the C headers' include guards) has a
    row in README.md's table of environment variables."""
    import re
    read = set()
    for d, _, files in os.walk(os.path.join(ROOT, "gradfuse")):
        for f in files:
            if f.endswith((".py", ".pyx")):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    read |= set(re.findall(r"GRADFUSE_[A-Z0-9_]+", fh.read()))
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as fh:
        read |= set(re.findall(r"GRADFUSE_[A-Z0-9_]+", fh.read()))
    read = {v for v in read if not v.endswith("_H") and not v.endswith("_")}
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        rows = set(re.findall(r"^\| `(GRADFUSE_[A-Z0-9_]+)`", fh.read(), re.M))
    assert read - rows == set(), f"not in README.md's table: {sorted(read - rows)}"


@pytest.mark.parametrize("value", sorted(FLAG))
def test_hooks_flag(value, monkeypatch):
    assert _outcome(watchdog.hooks_enabled, "GRADFUSE_HOOKS", value, monkeypatch) == FLAG[value]


def test_unset_means_default(monkeypatch):
    for var in ["GRADFUSE_FUSION_THRESHOLD", "GRADFUSE_HOOKS", *SECONDS_VARS, *config.HOROVOD_NAMES.values()]:
        monkeypatch.delenv(var, raising=False)
    assert config.fusion_threshold() == config.DEFAULT_FUSION_THRESHOLD
    assert config.stall_warning_s() == config.DEFAULT_STALL_WARNING_S
    assert config.stall_timeout_s() == config.DEFAULT_STALL_TIMEOUT_S
    assert config.exit_timeout_s() == config.DEFAULT_STALL_TIMEOUT_S
    monkeypatch.setenv("GRADFUSE_STALL_TIMEOUT_S", "7")
    assert config.exit_timeout_s() == 7.0          # follows the stall timeout when unset
    assert watchdog.hooks_enabled() is True
    assert watchdog.hooks_enabled(False) is False   # the argument wins over the variable


# Horovod's variables: read by the same rules when the GRADFUSE_* one is unset
HOROVOD_VARS = {"HOROVOD_FUSION_THRESHOLD": (config.fusion_threshold, BYTES),
                "HOROVOD_STALL_CHECK_TIME_SECONDS": (config.stall_warning_s, SECONDS),
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": (config.stall_timeout_s, SECONDS)}


@pytest.fixture
def no_gradfuse_vars(monkeypatch):
    for var in list(config.HOROVOD_NAMES) + list(config.HOROVOD_NAMES.values()):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("var,value", [(v, x) for v in sorted(HOROVOD_VARS) for x in sorted(HOROVOD_VARS[v][1])])
def test_horovod_variables_parse_by_the_same_rules(var, value, monkeypatch, no_gradfuse_vars):
    fn, table = HOROVOD_VARS[var]
    assert _outcome(fn, var, value, monkeypatch) == table[value]


@pytest.mark.parametrize("gf_var", sorted(config.HOROVOD_NAMES))
def test_gradfuse_variable_wins_over_horovods(gf_var, monkeypatch, no_gradfuse_vars):
    hv_var = config.HOROVOD_NAMES[gf_var]
    fn = {"GRADFUSE_FUSION_THRESHOLD": config.fusion_threshold, **SECONDS_VARS}[gf_var]
    monkeypatch.setenv(hv_var, "7")
    assert fn() == 7 and config.source(gf_var) == hv_var          # honoured when GRADFUSE_ is unset
    monkeypatch.setenv(gf_var, "9")
    assert fn() == 9 and config.source(gf_var) == gf_var          # ... and not read when it is set
    monkeypatch.setenv(hv_var, "abc")
    assert fn() == 9                                               # (not even to refuse it)
    monkeypatch.delenv(gf_var)
    with pytest.raises(ValueError, match=f"{hv_var}='abc'"):
        fn()


def test_horovod_defaults_are_not_gradfuses(monkeypatch, no_gradfuse_vars):
    """Unset everywhere: gradfuse's own defaults (1 MiB, 60 s, 600 s), not Horovod's (128 MiB, 60 s, never)."""
    assert config.fusion_threshold() == config.DEFAULT_FUSION_THRESHOLD == 1 << 20
    assert config.stall_timeout_s() == 600.0 and config.exit_timeout_s() == 600.0
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0")     # Horovod's "never"
    assert config.stall_timeout_s() == 0.0 and config.exit_timeout_s() == 0.0
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(64 << 20))
    assert gradfuse.Pipeline(comm=SingleProcessCommunicator()).fusion_threshold == 64 << 20


def test_bad_horovod_value_fails_init_naming_it(monkeypatch, no_gradfuse_vars):
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "-5")
    with pytest.raises(ValueError, match="HOROVOD_STALL_CHECK_TIME_SECONDS='-5' is out of range"):
        gradfuse.init(SingleProcessCommunicator())
    monkeypatch.delenv("HOROVOD_STALL_CHECK_TIME_SECONDS")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a whole number"):
        gradfuse.Pipeline(comm=SingleProcessCommunicator())


def test_horovod_settings_gradfuse_does_not_read_are_named_at_init(monkeypatch):
    """HOROVOD_CYCLE_TIME and the other tuning variables of Horovod gradfuse does not read:
    gradfuse.mxnet's init() warns (rank 0), naming the ones set, instead of dropping them
    silently (HOROVOD_TIMELINE is read: tests/test_timeline.py)."""
    pytest.importorskip("mxnet")
    import warnings
    import gradfuse.mxnet as hvd
    for var in config.HOROVOD_UNREAD:
        monkeypatch.delenv(var, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd.init()                                   # nothing set: no warning
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    assert config.horovod_unread() == ["HOROVOD_CYCLE_TIME", "HOROVOD_AUTOTUNE"]
    with pytest.warns(UserWarning, match="does not read HOROVOD_CYCLE_TIME, HOROVOD_AUTOTUNE"):
        hvd.init()


def test_a_4_gib_threshold_works(monkeypatch):
    monkeypatch.setenv("GRADFUSE_FUSION_THRESHOLD", "4294967296")
    pipe = gradfuse.Pipeline(comm=SingleProcessCommunicator())
    assert pipe.fusion_threshold == 4294967296
    g = {"a": np.arange(5, dtype=np.float32), "b": np.ones((2, 3))}
    out = pipe.allreduce(g)
    assert np.array_equal(out["a"], g["a"]) and np.array_equal(out["b"], g["b"])
    assert len(pipe._plans) == 1 and len(next(iter(pipe._plans.values())).plan.buckets) == 2


def test_bad_value_fails_pipeline_and_init_naming_the_variable(monkeypatch):
    monkeypatch.setenv("GRADFUSE_FUSION_THRESHOLD", "abc")
    with pytest.raises(ValueError, match="GRADFUSE_FUSION_THRESHOLD='abc'"):
        gradfuse.Pipeline(comm=SingleProcessCommunicator())
    monkeypatch.delenv("GRADFUSE_FUSION_THRESHOLD")
    monkeypatch.setenv("GRADFUSE_STALL_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="GRADFUSE_STALL_TIMEOUT_S='-1' is out of range"):
        gradfuse.init(SingleProcessCommunicator())


def _run(code, **env):
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.pop("GRADFUSE_FORCE_SCALAR", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_force_scalar_is_read_at_import():
    """One subprocess checks every value (read once, when gradfuse._core is imported)."""
    code = r"""
import os, subprocess, sys, json
res = {}
for v in %r:
    env = dict(os.environ, GRADFUSE_FORCE_SCALAR=v)
    p = subprocess.run([sys.executable, "-c",
        "import gradfuse._core as c; print(int(c.simd_info()['using_avx2']))"],
        env=env, capture_output=True, text=True)
    res[v] = p.stdout.strip() if p.returncode == 0 else "error:" + p.stderr.strip().splitlines()[-1]
print(json.dumps(res))
""" % (sorted(FLAG),)
    p = _run(code)
    assert p.returncode == 0, p.stderr
    import json
    res = json.loads(p.stdout)
    avx2 = gradfuse._core.simd_info()["cpu_avx2_f16c"]
    for value, want in FLAG.items():
        got = res[value]
        if want == "error":
            assert got.startswith("error:ValueError: GRADFUSE_FORCE_SCALAR=" + repr(value)), (value, got)
        elif want is True:
            assert got == "0", (value, got)                 # forced scalar
        else:
            assert got == str(int(avx2)), (value, got)


@pytest.mark.parametrize("value", ["", "abc", "-1", "yes", " "])
def test_debug_build_flag_is_strict(value):
    """setup.py refuses a GRADFUSE_DEBUG_BUILD it cannot read (before any compiling)."""
    p = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, GRADFUSE_DEBUG_BUILD=value))
    assert p.returncode != 0
    assert f"GRADFUSE_DEBUG_BUILD={value!r}: expected 0 or 1" in p.stderr
