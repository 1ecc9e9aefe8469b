"""A KernelBench pair's two sources: checked by parsing, and run as modules.

``load_pair`` checks that the reference defines ``Model``, ``get_inputs`` and
``get_init_inputs`` and the solution ``ModelNew`` (parsing only: nothing is
run); ``size_constants`` reads the reference's module-level ``NAME = <positive
int>`` constants with ``ast`` (tuple and chained assignments too); ``pair_module`` executes a source as a module,
once per process, and ``sized`` sets its size constants for a while.
``pair_module(pair, "new")`` runs untrusted code: call it in a sandboxed worker.

Refuses (``KernelBenchError``): sources that are empty, do not parse, or lack
the names above.
"""
from __future__ import annotations

import ast
import hashlib
import linecache
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kfuzz.errors import KfuzzError

SEED = 42                 # the standard test's seed; the models' weights come from it
PREFIX = "kb:"            # target names kb:<corpus file>:<row>


class KernelBenchError(KfuzzError):
    """A KernelBench source the adapter cannot use; the message says which and why."""


@dataclass(frozen=True)
class KernelBenchPair:
    """A reference and a generated solution, with where they came from."""

    name: str
    ref_code: str
    custom_code: str
    level: int | None = None
    problem: int | None = None
    model: str = ""              # the generating model
    source: str = ""             # "<corpus file>:<row>", how a worker finds the pair again
    eval_mode: bool = False      # the accepting harness put both models in eval mode (CUDA-L1 does,
                                 # KernelBench does not): BatchNorm's running statistics, no dropout

    @property
    def sha(self) -> str:
        return hashlib.sha256(f"{self.ref_code}\0{self.custom_code}".encode()).hexdigest()[:16]

    @property
    def custom_sha(self) -> str:
        """The solution's own hash: the compile cache's key."""
        return hashlib.sha256(self.custom_code.encode()).hexdigest()[:16]

    @property
    def target_name(self) -> str:
        return PREFIX + (self.source or self.name)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _parse(code: str, what: str, name: str, needs: tuple[str, ...]) -> ast.Module:
    if not isinstance(code, str) or not code.strip():
        raise KernelBenchError(f"{name}: {what} is empty")
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise KernelBenchError(f"{name}: {what} does not parse (line {e.lineno}: {e.msg})") from None
    missing = [n for n in needs if n not in _top_level_names(tree)]
    if missing:
        raise KernelBenchError(f"{name}: {what} defines no {', '.join(missing)}")
    return tree


def load_pair(ref_code: str, custom_code: str, name: str, **meta) -> KernelBenchPair:
    """A pair from its two sources (checked by parsing only; nothing is run)."""
    _parse(ref_code, "the reference", name, ("Model", "get_inputs", "get_init_inputs"))
    _parse(custom_code, "the solution", name, ("ModelNew",))
    return KernelBenchPair(name=name, ref_code=ref_code, custom_code=custom_code, **meta)


def _bindings(node: ast.stmt) -> list[tuple[str, ast.expr | None]]:
    """The (name, value) pairs a module-level statement binds: ``a = 1``, ``a: int = 1``,
    ``a = b = 1``, ``a, b = 1, 2``; a name bound to something unknown gets ``None``."""
    if isinstance(node, ast.AnnAssign):
        return [(node.target.id, node.value)] if isinstance(node.target, ast.Name) else []
    if not isinstance(node, ast.Assign):
        return []
    out = []
    for target in node.targets:
        if isinstance(target, ast.Name):
            out.append((target.id, node.value))
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) \
                and len(node.value.elts) == len(target.elts) else [None] * len(target.elts)
            out += [(t.id, v) for t, v in zip(target.elts, values) if isinstance(t, ast.Name)]
    return out


def size_constants(ref_code: str) -> dict[str, int]:
    """The reference's module-level ``NAME = <positive int>`` bindings (also ``a, b = 16, 16``
    and ``a = b = 16``), in source order."""
    out = {}
    for node in ast.parse(ref_code).body:
        for name, value in _bindings(node):
            if isinstance(value, ast.Constant) and type(value.value) is int and value.value > 0:
                out[name] = value.value
            else:
                out.pop(name, None)      # reassigned to something else: not a size constant
    return out


# integer arithmetic a derived size binding may hold (``groups = in_channels``, ``pad = k // 2``)
_ARITHMETIC = (ast.Expression, ast.Name, ast.Load, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub,
               ast.Mult, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)


def derived_sizes(code: str) -> list[tuple[str, types.CodeType, frozenset[str]]]:
    """The module-level bindings ``NAME = <integer arithmetic on other names>`` (``out_channels =
    in_channels``, ``padding = kernel_size // 2``), in source order: (name, the compiled
    expression, the names it reads). Where kfuzz changes a size constant, ``sized`` evaluates
    these again, as the module would have with that constant."""
    out = []
    for node in ast.parse(code).body:
        for name, value in _bindings(node):
            if value is None or isinstance(value, ast.Constant):
                continue
            expr = ast.Expression(value)
            if all(isinstance(n, _ARITHMETIC) for n in ast.walk(expr)):
                reads = frozenset(n.id for n in ast.walk(expr) if isinstance(n, ast.Name))
                if reads:
                    out.append((name, compile(expr, "<size>", "eval"), reads))
    return out


_MODULES: dict[tuple[str, str], types.ModuleType] = {}
_DERIVED: dict[str, list] = {}     # module name -> derived_sizes of its code


def pair_module(pair: KernelBenchPair, role: str) -> types.ModuleType:
    """The reference (``role="ref"``) or the solution (``"new"``) executed as a module, once
    per process. Its filename, ``kb_<role>_<sha>.py``, names it in tracebacks and signatures.
    The solution runs in a namespace that holds the reference's module-level names first, as
    the accepting harness ran it (KernelBench's ``eval_kernel_against_ref`` executes both
    sources into one dict, the reference first): a solution may read the reference's size
    constants and helpers without defining them. The reference's derived sizes that the
    solution does not bind itself are then the solution module's too (``sized``)."""
    key = (pair.sha, role)
    if key not in _MODULES:
        code = pair.ref_code if role == "ref" else pair.custom_code
        modname = f"kfuzz_kb_{role}_{pair.sha}"
        filename = f"kb_{role}_{pair.sha}.py"
        mod = types.ModuleType(modname)
        mod.__file__ = filename
        derived = derived_sizes(code)
        if role == "new":
            ref = pair_module(pair, "ref")
            mod.__dict__.update({k: v for k, v in vars(ref).items() if not k.startswith("__")})
            own = _top_level_names(ast.parse(code))
            derived = [d for d in _DERIVED[ref.__name__] if d[0] not in own] + derived
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        sys.modules[modname] = mod       # dataclasses, pickling and inspect look a module up by name
        try:
            exec(compile(code, filename, "exec"), mod.__dict__)
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        _DERIVED[modname] = derived
        _MODULES[key] = mod
    return _MODULES[key]


@contextmanager
def sized(mod: types.ModuleType, values: dict[str, int]):
    """The module's size constants set to ``values`` for the duration, and the sizes it derives
    from them (``derived_sizes``: ``groups = in_channels``) evaluated again with them."""
    values = dict(values)
    changed = {k for k, v in values.items() if mod.__dict__.get(k) != v}
    for name, expr, reads in _DERIVED.get(mod.__name__, ()):
        if name in values or name not in mod.__dict__ or not reads & changed \
                or not reads <= mod.__dict__.keys() | values.keys():
            continue
        try:
            value = eval(expr, {"__builtins__": {}}, {**mod.__dict__, **values})
        except ArithmeticError:
            continue
        if isinstance(value, int) and value != mod.__dict__.get(name):
            values[name] = value
            changed.add(name)
    old = {k: mod.__dict__[k] for k in values}
    mod.__dict__.update(values)
    try:
        yield
    finally:
        mod.__dict__.update(old)


# torch's process-wide precision flags that a solution may set (TF32 in matmuls and convolutions,
# cuDNN's autotuning), and the values the trusted run and the kernel are both judged under: full
# float32 precision (cuDNN's TF32 is on by default; a solution turning TF32 on in ``__init__``
# would otherwise leak it into every later matmul of its process)
PRECISION = {"float32_matmul_precision": "highest", "torch.backends.cuda.matmul.allow_tf32": False,
             "torch.backends.cudnn.allow_tf32": False, "torch.backends.cudnn.benchmark": False,
             "torch.backends.cudnn.deterministic": False}


def _flag(path: str):
    owner, attr = path.rsplit(".", 1)
    obj = torch
    for part in owner.split(".")[1:]:
        obj = getattr(obj, part)
    return obj, attr


def precision_flags() -> dict:
    """The ``PRECISION`` flags as they are now."""
    return {k: torch.get_float32_matmul_precision() if k == "float32_matmul_precision" else getattr(*_flag(k))
            for k in PRECISION}


def set_precision_flags(values: dict) -> None:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, v in values.items():      # the matmul precision first: it also sets matmul TF32
            if k == "float32_matmul_precision":
                torch.set_float32_matmul_precision(v)
        for k, v in values.items():
            if k != "float32_matmul_precision":
                setattr(*_flag(k), v)


@contextmanager
def precision(fixed: dict | None, changed: set):
    """Run the block under the precision flags ``fixed`` (``None``: as they are); add to ``changed``
    the flags the block changed, and put every flag back as it was before."""
    before = precision_flags()
    if fixed is not None:
        set_precision_flags(fixed)
    start = precision_flags()
    try:
        yield
    finally:
        now = precision_flags()
        changed.update(f"{k}={now[k]}" for k in now if now[k] != start[k])
        set_precision_flags(before)


def own_constants(mod: types.ModuleType, dims: dict) -> dict:
    """The ``dims`` that ``mod`` defines as module-level names (a solution's own copies of the
    reference's size constants)."""
    return {k: v for k, v in dims.items() if k in mod.__dict__}


def reads_names(code: str, cls: str, names) -> bool:
    """Class ``cls`` of ``code`` reads one of ``names`` (a module-level size constant) anywhere in
    its body."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    names = set(names)
    return any(isinstance(node, ast.ClassDef) and node.name == cls and any(
        isinstance(n, ast.Name) and n.id in names for n in ast.walk(node)) for node in tree.body)


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def outputs_of(result) -> tuple:
    """A model's result as a tuple of outputs (one tensor, or a tuple or list of them)."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
