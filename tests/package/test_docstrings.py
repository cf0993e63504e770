"""Every public function, class and method of the package has a docstring (inherited ones count:
a Lightning hook or ``nn.Module.forward`` override is documented by its base)."""
import importlib
import inspect
import pkgutil

import pytest

import instability_watch


def _modules():
    names = [instability_watch.__name__]
    for info in pkgutil.walk_packages(instability_watch.__path__, instability_watch.__name__ + "."):
        names.append(info.name)
    return sorted(names)


def _public(obj):
    return [(n, v) for n, v in vars(obj).items() if not n.startswith("_")]


@pytest.mark.parametrize("name", _modules())
def test_public_names_have_docstrings(name):
    module = importlib.import_module(name)
    missing = []
    for attr, value in _public(module):
        if getattr(value, "__module__", None) != name:
            continue  # imported from elsewhere: checked where it is defined
        if inspect.isfunction(value) or inspect.isclass(value):
            if not inspect.getdoc(value):
                missing.append(attr)
        if inspect.isclass(value):
            for meth, member in _public(value):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member) and not inspect.getdoc(getattr(value, meth)):
                    missing.append(f"{attr}.{meth}")
    assert not missing, f"{name}: no docstring for {', '.join(missing)}"
