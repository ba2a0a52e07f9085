"""Check a built wheel against the source tree, and (with --imports) import every module.

    python scripts/check_wheel.py dist/gradfuse-*.whl          # contents
    python scripts/check_wheel.py --imports                     # in the venv the wheel went into

Contents: every module and every package-data file of every package that pyproject.toml
lists is in the wheel, the compiled kernels too, and every package directory of the tree
is listed (a new subpackage or .pxi/.h file cannot go missing without a failure).
Imports: every module of the installed package imports (``gradfuse.mxnet`` needs MXNet,
the GPU modules import cupy only when used).
"""
import fnmatch
import os
import sys
import zipfile

GENERATED = (".so", ".pyd", ".c", ".cpp", ".html", ".pyc")
SKIP_DIRS = ("__pycache__", "build", ".pytest_cache")


def _toml(path):
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def project_version(root):
    return _toml(os.path.join(root, "pyproject.toml"))["project"]["version"]


def setuptools_config(root):
    """pyproject.toml's [tool.setuptools]: packages, package-dir, package-data."""
    st = _toml(os.path.join(root, "pyproject.toml"))["tool"]["setuptools"]
    return {"packages": list(st["packages"]), "package-dir": dict(st.get("package-dir", {})),
            "package-data": {k: list(v) for k, v in st.get("package-data", {}).items()}}


def _pkg_dir(root, cfg, pkg):
    """The source directory of package ``pkg`` (package-dir mapping, else by its name)."""
    pdir = cfg["package-dir"]
    parts = pkg.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in pdir:
            return os.path.join(root, pdir[head], *parts[i:])
    return os.path.join(root, *parts)


def _files_of(d):
    return sorted(f for f in os.listdir(d)
                  if os.path.isfile(os.path.join(d, f)) and not f.endswith(GENERATED) and not f.startswith("."))


def package_dirs(root, cfg):
    """Every package the tree has: directories under gradfuse/ (and mapped ones) holding files."""
    base = _pkg_dir(root, cfg, "gradfuse")
    found = set()
    for d, dirs, _ in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith(".")
                         and not x.endswith(".egg-info"))
        if _files_of(d):
            rel = os.path.relpath(d, base)
            found.add("gradfuse" if rel == "." else "gradfuse." + rel.replace(os.sep, "."))
    for pkg in cfg["package-dir"]:
        if pkg != "gradfuse" and os.path.isdir(_pkg_dir(root, cfg, pkg)):
            found.add(pkg)
    return sorted(found)


def source_files(root, cfg):
    """(path relative to the wheel, package, file name) of every file the packages hold."""
    out = []
    for pkg in cfg["packages"]:
        d = _pkg_dir(root, cfg, pkg)
        if not os.path.isdir(d):
            continue
        for f in _files_of(d):
            out.append(("/".join(pkg.split(".") + [f]), pkg, f))
    return out


def check_contents(wheel, root):
    cfg = setuptools_config(root)
    problems = []
    missing_pkgs = sorted(set(package_dirs(root, cfg)) - set(cfg["packages"]))
    if missing_pkgs:
        problems.append(f"package directories not listed in pyproject.toml: {missing_pkgs}")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = []
    for rel, pkg, f in source_files(root, cfg):
        if f.endswith(".py") or any(fnmatch.fnmatch(f, g) for g in cfg["package-data"].get(pkg, [])):
            expected.append(rel)
        else:
            problems.append(f"{rel}: no package-data glob of {pkg} ships it")
    missing = sorted(set(expected) - names)
    if missing:
        problems.append(f"missing from the wheel: {missing}")
    if not any(fnmatch.fnmatch(n, "gradfuse/_core.*.so") or fnmatch.fnmatch(n, "gradfuse/_core.*.pyd") for n in names):
        problems.append("the compiled kernels gradfuse/_core.*.so are not in the wheel")
    return problems, len(expected)


def import_everything():
    import importlib
    import importlib.util
    import pkgutil
    import gradfuse
    failed, done = [], 0
    for m in pkgutil.walk_packages(gradfuse.__path__, "gradfuse."):
        if m.name.endswith("__main__"):
            continue
        # the torch binding is an optional extra: its modules import where torch is installed
        if m.name.startswith("gradfuse.torch") and importlib.util.find_spec("torch") is None:
            continue
        # each Lightning strategy imports its own package, which is optional too
        if m.name == "gradfuse.torch.lightning" and importlib.util.find_spec("lightning") is None:
            continue
        if m.name == "gradfuse.torch.pytorch_lightning" and importlib.util.find_spec("pytorch_lightning") is None:
            continue
        try:
            importlib.import_module(m.name)
            done += 1
        except Exception as e:              # report every module that fails, not just the first
            failed.append(f"{m.name}: {type(e).__name__}: {e}")
    return done, failed


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if argv[:1] == ["--imports"]:
        done, failed = import_everything()
        import gradfuse
        where = os.path.dirname(gradfuse.__file__)
        print(f"check_wheel: imported {done} modules from {where}")
        if os.path.realpath(where) == os.path.realpath(os.path.join(root, "gradfuse")):
            failed.append(f"gradfuse was imported from the checkout ({where}), not from the installed wheel")
        for f in failed:
            print("check_wheel: FAILED", f)
        return 1 if failed else 0
    problems, n = check_contents(argv[0], root)
    for p in problems:
        print("check_wheel: FAILED", p)
    if not problems:
        print(f"check_wheel: {os.path.basename(argv[0])} holds all {n} files of the tree's packages "
              f"and the compiled kernels")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
