"""Every name the README, the docs and the examples import from the package imports from that path; the public
API's names stay where they were (issue 42: the layout changed, the documented paths did not)."""
from __future__ import annotations

import importlib
import re

import pytest

from helpers import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.py"))]
FROM_IMPORT = re.compile(r"from (instability_watch[\w.]*) import ([\w, ]+)")
DOTTED = re.compile(r"`(instability_watch(?:\.[a-z_]+)+\.[A-Za-z_]\w*)`")


def _documented():
    found = set()
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for module, names in FROM_IMPORT.findall(text):
            found.update((module, n.strip(), path.name) for n in names.split(",") if n.strip())
        for dotted in DOTTED.findall(text):
            module, _, name = dotted.rpartition(".")
            found.add((module, name, path.name))
    return sorted(found)


DOCUMENTED = _documented()


def test_the_documents_name_the_public_api():
    names = {(m, n) for m, n, _ in DOCUMENTED}
    for name in ("InstabilityWatch", "WatchConfig", "InstabilityWatchCallback"):
        assert ("instability_watch", name) in names
    assert ("instability_watch.callbacks.hf", "InstabilityWatchTrainerCallback") in names


@pytest.mark.parametrize("module,name,where", DOCUMENTED, ids=[f"{w}:{m}.{n}" for m, n, w in DOCUMENTED])
def test_each_documented_name_imports_from_its_documented_path(module, name, where):
    pytest.importorskip("transformers") if module.endswith(".hf") else None
    mod = importlib.import_module(module)
    assert hasattr(mod, name), f"{where} names {module}.{name}, which does not exist"


@pytest.mark.parametrize("name", ["InstabilityWatch", "WatchConfig", "AttentionLayer", "load_run",
                                  "InstabilityWatchCallback", "RunWriter", "ConsoleReporter", "ReadBack",
                                  "flash_attention", "Probe", "Alert", "Event", "StepMetrics", "WatchError",
                                  "ALERT_KINDS", "KINDS"])
def test_the_package_exports(name):
    import instability_watch

    assert name in instability_watch.__all__ and getattr(instability_watch, name) is not None
