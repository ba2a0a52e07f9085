"""The package's shape, checked so that later work cannot slip back (docs/design.md).

* The import layers of pyproject.toml's ``[tool.importlinter]`` contracts hold
  (``lint-imports``): imports run one way, down, and there are no cycles.
* Nothing inside the package imports the face of a package it is in (``gradfuse``
  itself, ``gradfuse.mxnet``, ``gradfuse.gpu``, ...): it imports the defining module.
* No Python module of gradfuse/ is over 500 lines.
* pyproject.toml lists every package directory (the wheel gets exactly those), and
  every file a package holds is either a module or covered by its package-data globs;
  ``.ci/run`` then builds the wheel and checks its contents (scripts/check_wheel.py).
"""
import fnmatch
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "gradfuse")
MAX_LINES = 500

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import check_wheel  # noqa: E402


def _graph():
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the test extra)")
    return grimp.build_graph("gradfuse", cache_dir=None)


def test_import_layers_hold():
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(exe):
        exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("lint-imports (import-linter, the test extra) is not installed")
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout, res.stdout[-3000:]


def test_no_module_imports_a_face_above_it():
    g = _graph()
    packages = sorted(m for m in g.modules if g.find_children(m))
    bad = []
    for pkg in packages:
        for importer in g.find_modules_that_directly_import(pkg):
            if importer.startswith(pkg + "."):
                bad.append(f"{importer} imports {pkg} (a package face above it)")
    assert not bad, "\n".join(sorted(bad))


def test_modules_are_at_most_500_lines():
    long = []
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    n = sum(1 for _ in fh)
                if n > MAX_LINES:
                    long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): " + ", ".join(long)


def test_pyproject_lists_every_package_and_its_data():
    cfg = check_wheel.setuptools_config(ROOT)
    listed = set(cfg["packages"])
    found = set(check_wheel.package_dirs(ROOT, cfg))
    assert found - listed == set(), f"package directories missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
    uncovered = [rel for rel, pkg, name in check_wheel.source_files(ROOT, cfg)
                 if not name.endswith(".py") and not any(fnmatch.fnmatch(name, g)
                                                         for g in cfg["package-data"].get(pkg, []))]
    assert not uncovered, f"files no package-data glob ships: {uncovered}"


def test_versions_agree():
    from gradfuse._version import __version__
    assert check_wheel.project_version(ROOT) == __version__
