"""The package's layout holds: folders in data-flow order, each importing only folders before it; no import
cycle; no module importing another's private name; no module over 600 lines (CONTRIBUTING.md, "Layout")."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

from helpers import REPO

PACKAGE = REPO / "instability_watch"
# The folders in the order data flows through them; a module may import its own folder and folders before it.
# Base modules (imported from anywhere, importing no folder): ranks, errors. Entry modules (importing
# anything, imported by nothing but each other and tests): the package's __init__, cli, demo, mechanism,
# experimental.
FOLDERS = ("probe", "kernels", "model", "observe", "detect", "act", "engine", "outputs", "callbacks")
BASE = ("ranks", "errors")
ENTRY = ("__init__", "cli", "demo", "mechanism", "experimental")
MAX_LINES = 600


def _modules() -> Dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> List[Tuple[str, List[str], int]]:
    """``(module imported, names taken from it, line)`` for every import of a package module, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("instability_watch"):
                continue
            names = [a.name for a in node.names]
            # `from pkg import module` imports the module
            subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES]
            out.extend((s, [], node.lineno) for s in subs)
            if len(subs) < len(names):
                out.append((mod, [n for n in names if f"{mod}.{n}" not in MODULES], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names if a.name.startswith("instability_watch"))
    return out


def _place(name: str) -> Tuple[str, int]:
    """``("base" | "folder" | "entry", rank)``: where a module sits in the order."""
    parts = name.split(".")
    if len(parts) == 1:
        return "entry", len(FOLDERS)
    top = parts[1]
    if top in BASE:
        return "base", -1
    if top in FOLDERS:
        return "folder", FOLDERS.index(top)
    if top in ENTRY:
        return "entry", len(FOLDERS)
    raise AssertionError(f"{name}: a module outside the documented layout (add its folder to FOLDERS and "
                         f"CONTRIBUTING.md, or make it an entry module)")


def test_no_module_is_over_600_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert not {n: k for n, k in long.items() if k > MAX_LINES}


def test_folders_import_only_folders_before_them():
    wrong = []
    for name, path in MODULES.items():
        kind, rank = _place(name)
        for mod, _, line in _imports(name, path):
            if mod not in MODULES:
                continue
            target_kind, target_rank = _place(mod)
            if kind == "base" and target_kind != "base":
                wrong.append(f"{name}:{line} (a base module) imports {mod}")
            elif kind == "folder" and (target_kind == "entry" or target_rank > rank):
                wrong.append(f"{name}:{line} imports {mod}, which comes later in {FOLDERS}")
            elif kind == "entry" and target_kind == "entry" and mod != "instability_watch" and name != "instability_watch":
                if mod.split(".")[1] not in ENTRY:
                    wrong.append(f"{name}:{line} imports {mod}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph: Dict[str, Set[str]] = {n: set() for n in MODULES}
    for name, path in MODULES.items():
        for mod, _, _ in _imports(name, path):
            if mod in MODULES and mod != name and mod != "instability_watch":
                graph[name].add(mod)
    # a package imports its submodules to re-export them: that edge is the package itself, not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles


def test_no_module_imports_another_modules_private_name():
    private = []
    for name, path in MODULES.items():
        for mod, names, line in _imports(name, path):
            if mod == name:
                continue
            private += [f"{name}:{line} takes {n} from {mod}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not private, "\n".join(private)


def test_the_layout_test_sees_every_folder():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FOLDERS)
    tops = {p.stem for p in PACKAGE.glob("*.py")}
    assert tops == set(BASE) | set(ENTRY)
