"""Every public function, class and method of the documented API has a docstring.

The API reference (docs/api/) is generated from these docstrings, so a public name without
one is a hole in the site. "Public" is the ``__all__`` of each documented module (the
registry module has no ``__all__``: its public names are listed here), plus every method and
property a public class defines itself whose name does not start with ``_`` (``__init__``
is covered by the class docstring, as napoleon renders it). A method that overrides a
documented one of a base class (``compress`` of a compressor, ``allreduce`` of a
communicator) inherits its docstring, as autodoc shows it (``inspect.getdoc``); a class needs
its own.
"""
import importlib
import inspect

import pytest

# the modules docs/api/ documents; gradfuse.torch needs torch (the np2 leg of CI has it)
MODULES = ["gradfuse", "gradfuse.compressors", "gradfuse.compressors.registry",
           "gradfuse.compressors.base", "gradfuse.comm.cma", "gradfuse.experiments", "gradfuse.mxnet",
           "gradfuse.torch"]
# modules without __all__: their public names
EXPLICIT = {"gradfuse.compressors.registry": ["register_compressor", "available", "create"],
            "gradfuse.compressors.base": ["Compressor", "BucketContext", "NoneCompressor"]}
# framework-only modules: skipped (with a reason) where the framework is not installed
NEEDS = {"gradfuse.mxnet": "mxnet", "gradfuse.torch": "torch"}


def _doc(obj):
    return (getattr(obj, "__doc__", None) or "").strip()


def _own_members(cls):
    """(name, object) of the public methods/properties that ``cls`` itself defines."""
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if isinstance(attr, property) or inspect.isfunction(attr) or inspect.isroutine(attr):
            yield name, getattr(cls, name, attr)


def missing_docstrings(module):
    names = EXPLICIT.get(module.__name__, getattr(module, "__all__", None))
    assert names, f"{module.__name__} has no __all__ and no explicit list"
    missing = []
    for name in names:
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            continue                        # a submodule: documented on its own
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue                        # a constant (Average, Sum, ...): no docstring of its own
        where = f"{module.__name__}.{name}"
        if not _doc(obj):
            missing.append(where)
        if inspect.isclass(obj):
            for mname, member in _own_members(obj):
                if not (inspect.getdoc(member) or "").strip():
                    missing.append(f"{where}.{mname}")
    return missing


@pytest.mark.parametrize("modname", MODULES)
def test_public_api_has_docstrings(modname):
    if modname in NEEDS:
        pytest.importorskip(NEEDS[modname])
    module = importlib.import_module(modname)
    assert _doc(module), f"module {modname} has no docstring"
    missing = missing_docstrings(module)
    assert not missing, "public names without a docstring:\n  " + "\n  ".join(missing)


def test_the_check_sees_a_missing_docstring():
    """The walk itself: an undocumented function and method are named, documented ones not."""
    import types

    class Documented:
        """A class."""

        def good(self):
            """A method."""

        def bad(self):
            pass

        def _private(self):
            pass

    def undocumented():
        pass

    mod = types.ModuleType("fake")
    mod.__all__ = ["Documented", "undocumented"]
    mod.Documented, mod.undocumented = Documented, undocumented
    assert missing_docstrings(mod) == ["fake.Documented.bad", "fake.undocumented"]


def test_register_compressor_example_runs():
    """The docstring example of ``register_compressor`` (a user's own compressor, on one rank)
    runs and prints what it says; the name it registers is removed again."""
    import doctest

    from gradfuse.compressors import registry
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(registry) if t.name.endswith("register_compressor")]
    assert tests and tests[0].examples
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    try:
        for t in tests:
            runner.run(t)
    finally:
        registry._REGISTRY.pop("sign8", None)
    assert runner.failures == 0 and runner.tries >= 6, runner.summarize()
