"""kfuzz's modules in layers (docs/architecture.md): no import against the layers, no cycle, no
private name taken from another module; the checker (tools/layers.py) catches each on a small
package; kfuzz's top level exports its public API without importing torch."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("kfuzz_layers", ROOT / "tools" / "layers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


layers = _checker()


def test_kfuzz_keeps_its_layers():
    assert layers.problems(ROOT, "kfuzz", layers.read_layers()) == []


def test_the_one_module_named_against_the_layers_is_the_kernelbench_resolver():
    """Imports by name (a string in the source) are not judged by ``problems``; the only one that
    names a higher layer is ``kfuzz.target.RESOLVERS`` (docs/architecture.md, "Imports by name")."""
    table = layers.read_layers()
    where = {m: layers.layer_of(m, table, "kfuzz") for m in layers.modules(ROOT, "kfuzz")}
    upward = {(i.source, i.target) for i in layers.named(ROOT, "kfuzz") if where[i.target] > where[i.source]}
    assert upward == {("kfuzz.target", "kfuzz.kernelbench")}


def test_the_layer_table_names_the_modules_that_exist():
    table = layers.read_layers()
    assert [name for name, _ in table] == ["core", "execution", "search", "checks", "kernelbench and audit",
                                          "interfaces"]
    known = layers.modules(ROOT, "kfuzz")
    named = [m for _, mods in table for m in mods]
    assert sorted(set(named) - set(known)) == []
    assert len(named) == len(set(named))


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


CLEAN = {
    "__init__.py": "",
    "low.py": "VALUE = 1\n",
    "a.py": "from pkg.low import VALUE\n",
    "b.py": "from pkg import a\n",
    "high.py": "from pkg.b import a\n\ndef f():\n    from pkg.low import VALUE\n    return VALUE\n",
    "plugin.py": "",
}
LAYERS = [("bottom", ["pkg.low", "pkg.a", "pkg.b"]), ("top", ["pkg.high", "pkg.plugin", "pkg"])]


def test_the_checker_passes_a_package_in_its_layers(tmp_path):
    _package(tmp_path, CLEAN)
    assert layers.problems(tmp_path, "pkg", LAYERS) == []


def test_the_checker_reports_upward_imports_cycles_private_names_and_stray_modules(tmp_path):
    _package(tmp_path, {
        **CLEAN,
        # an upward import inside a function, and a cycle closed by a function-local import
        "low.py": "VALUE = 1\n_SECRET = 2\n\ndef g():\n    from pkg import plugin\n    return plugin\n",
        "a.py": "from pkg.low import VALUE\n\ndef h():\n    from . import b\n    return b\n",
        # a private name imported, and one read off a module
        "high.py": "from pkg.b import a\nfrom pkg.low import _SECRET\nimport pkg.low as low\n\n"
                   "def f():\n    return low._SECRET\n",
        "stray.py": "",
    })
    found = layers.problems(tmp_path, "pkg", LAYERS)
    assert "pkg.low (bottom) imports pkg.plugin (top) at line 5: against the layers" in found
    assert "cycle: pkg.a <-> pkg.b" in found
    assert "pkg.high takes the private name _SECRET from pkg.low at line 2" in found
    assert "pkg.high takes the private name _SECRET from pkg.low at line 6" in found
    assert "pkg.stray: in no layer" in found
    assert len(found) == 5, found


def test_counts_include_function_local_imports(tmp_path):
    _package(tmp_path, CLEAN)
    assert layers.counts(tmp_path, "pkg") == {"modules": 6, "edges": 4, "cycles": 0, "function-local imports": 1,
                                             "private names across modules": 0, "modules named by a string": 0}


def test_the_top_level_exports_its_api_without_importing_torch():
    code = ("import sys, kfuzz\n"
            "assert 'torch' not in sys.modules\n"
            "import pkgutil\n"
            "subs = {m.name for m in pkgutil.iter_modules(kfuzz.__path__)}\n"
            "clash = sorted(set(kfuzz.__all__) & subs)\n"
            "assert not clash, clash\n"
            "missing = [n for n in kfuzz.__all__ if getattr(kfuzz, n, None) is None]\n"
            "assert not missing, missing\n"
            "assert kfuzz.Target.__module__ == 'kfuzz.target' and kfuzz.run_campaign.__module__ == 'kfuzz.campaign'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)   # this tree first
    assert r.returncode == 0, r.stderr
