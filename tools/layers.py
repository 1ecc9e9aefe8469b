"""kfuzz's import graph and its layers: every import, checked against docs/architecture.md.

    python tools/layers.py            # the problems (exit 1 if any), then the graph by layer
    python tools/layers.py --counts   # the counts only

The graph has an edge for every ``import`` and ``from ... import`` of a module of the package
in its source, wherever it stands: at module level, inside a function (a function-local
import is a dependency all the same), under ``if TYPE_CHECKING:``. Relative imports are
resolved; ``from pkg import sub`` is an edge to the submodule ``pkg.sub``.

The layers are the table of docs/architecture.md: rows ``| N. name | `module`, ... |``, lowest
first. A module belongs to the row that names it or its closest enclosing package; the
package itself (its ``__init__``) only to a row that names it. Problems (``problems``):

- a module in no layer;
- an import of a module in a higher layer (against the layers);
- a cycle (a strongly connected set of modules, whatever their layers);
- a private name (``_name``, not ``__dunder__``) imported from, or read off, another module.
"""
from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    source: str        # the importing module
    target: str        # the imported module
    line: int
    name: str | None   # the name taken from it (``from m import name``), None for ``import m``
    local: bool        # inside a function


def modules(root: Path, package: str) -> dict[str, Path]:
    """The package's modules by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(root: Path, package: str) -> list[Import]:
    """Every import of one of the package's modules by another, anywhere in its source."""
    known = modules(root, package)
    found = []
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node, local in _walk(tree, False):
            pairs: list[tuple[str, str | None]] = []
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if is_package else mod.split(".")[:-1]
                    here = here[:len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                pairs = [(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, a.name) for a in node.names]
            for target, name in pairs:
                owner = _owner(target, known) if target.split(".")[0] == package else None
                if owner is not None and owner != mod:
                    found.append(Import(mod, owner, node.lineno, name, local))
        found.extend(_private_reads(mod, tree, known, package))
    return found


def named(root: Path, package: str) -> list[Import]:
    """Modules named by a string in another module's source (``importlib.import_module(name)``,
    preload lists, resolvers): imports made by name at run time, which ``problems`` does not
    judge; listed so that they are counted."""
    known = modules(root, package)
    found = []
    for mod, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known \
                    and node.value != mod and node.value != package:
                found.append(Import(mod, node.value, node.lineno, None, False))
    return found


def _walk(node: ast.AST, local: bool):
    for child in ast.iter_child_nodes(node):
        inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, inner
        yield from _walk(child, inner)


def _private_reads(mod: str, tree: ast.AST, known: dict[str, Path], package: str) -> list[Import]:
    """``alias._name`` where ``alias`` (or a dotted ``pkg.mod``) is another module of the package."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == package and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if f"{node.module}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node.value)
            target = aliases.get(dotted) if dotted else None
            if target is None and dotted in known:
                target = dotted
            if target is not None and target in known and target != mod:
                found.append(Import(mod, target, node.lineno, node.attr, False))
    return found


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def read_layers(path: Path = ARCHITECTURE) -> list[tuple[str, list[str]]]:
    """The layers of a document's table, lowest first: rows ``| N. name | `module`, ... |``."""
    layers = []
    for line in path.read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\.\s*([^|]+?)\s*\|([^|]*)\|", line)
        if m:
            layers.append((int(m.group(1)), m.group(2), re.findall(r"`([\w.]+)`", m.group(3))))
    return [(name, mods) for _, name, mods in sorted(layers)]


def layer_of(mod: str, layers: list[tuple[str, list[str]]], package: str) -> int | None:
    """The index of the layer of ``mod``: the row naming it or its closest enclosing package."""
    best, depth = None, -1
    for i, (_, names) in enumerate(layers):
        for name in names:
            covers = mod == name or (name != package and mod.startswith(name + "."))
            if covers and name.count(".") > depth:
                best, depth = i, name.count(".")
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def graph(found: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for i in found:
        edges.setdefault(i.source, set()).add(i.target)
    return edges


def problems(root: Path, package: str, layers: list[tuple[str, list[str]]]) -> list[str]:
    """What breaks the layers, in words: modules in no layer, upward imports, cycles, private names."""
    known = modules(root, package)
    found = imports(root, package)
    where = {m: layer_of(m, layers, package) for m in known}
    out = [f"{m}: in no layer" for m, i in where.items() if i is None]
    for i in found:
        a, b = where[i.source], where[i.target]
        if a is not None and b is not None and b > a:
            out.append(f"{i.source} ({layers[a][0]}) imports {i.target} ({layers[b][0]}) at line {i.line}: "
                       f"against the layers")
        if _private(i.name):
            out.append(f"{i.source} takes the private name {i.name} from {i.target} at line {i.line}")
    out.extend(f"cycle: {' <-> '.join(c)}" for c in cycles(graph(found)))
    return out


def counts(root: Path, package: str) -> dict[str, int]:
    found = imports(root, package)
    statements = {(i.source, i.line) for i in found if i.local}
    return {"modules": len(modules(root, package)), "edges": sum(map(len, graph(found).values())),
            "cycles": len(cycles(graph(found))), "function-local imports": len(statements),
            "private names across modules": sum(_private(i.name) for i in found),
            "modules named by a string": len(named(root, package))}


def main(argv: list[str]) -> int:
    layers = read_layers()
    bad = problems(ROOT, "kfuzz", layers)
    for line in bad:
        print(line)
    for k, v in counts(ROOT, "kfuzz").items():
        print(f"{k}: {v}")
    for i in named(ROOT, "kfuzz"):
        print(f"  named: {i.source} -> {i.target} (line {i.line})")
    if "--counts" not in argv:
        edges = graph(imports(ROOT, "kfuzz"))
        for i, (name, _) in enumerate(layers):
            print(f"\n{i + 1}. {name}")
            for m in sorted(m for m in modules(ROOT, "kfuzz") if layer_of(m, layers, "kfuzz") == i):
                print(f"  {m} -> {', '.join(sorted(edges.get(m, ()))) or '-'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
