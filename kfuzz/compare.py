"""Comparison with the float64 oracle: the nonfinite check and the error bound.

Nonfinite (tolerance-free): the kernel's NaN set and its +Inf and -Inf sets must
equal those of the oracle's output rounded to the output dtype. The latitude is
where an honest kernel could land either way:

- where the oracle's value lies within the elementwise bound (below: C times the
  trusted implementation's largest error, at least C * F units of roundoff) of the
  dtype's largest finite value, on either side (an honest kernel's error may land it
  on either side): a finite value, judged by the bound against the oracle's float64
  value, or an Inf of the oracle's sign (a value the bound admits, past the range);
- where the oracle is finite in float64 but past the dtype's range, and the
  trusted implementation overflows there too (it stays non-finite on the inputs
  with their NaN and Inf replaced by 0): any non-finite value (a sum of Infs of
  both signs is NaN in an honest kernel); a finite value still fails;
- where the trusted implementation at the kernel's precision is non-finite while
  the oracle is finite, or non-finite of another kind, and it stays non-finite on
  the inputs with their NaN and Inf replaced by 0: any value, and the position
  leaves the bound. No special value of the inputs made it so, only an overflow
  (an fp32 running total of values near fp32's maximum overflows in any honest
  kernel, and where a sum holds Infs of both signs it is NaN, where the true sum
  is beyond the range, of either sign). So a NaN the inputs carry, which the
  trusted implementation spread where the math does not, excuses no kernel;
- where the trusted implementation and the oracle are both non-finite, of other
  kinds, and not by an overflow: any non-finite value. The kind that arithmetic
  on an Inf gives depends on the algorithm (a chunked WY form and the step-by-step
  recurrence turn an Inf outside an argument's domain into NaN or into an Inf at
  different positions), while the set of non-finite positions does not: a finite
  value there, or a NaN or Inf where the oracle is finite, still fails;
- where the oracle is non-finite and the trusted implementation is non-finite of the same
  kind by an overflow (it stays non-finite on the inputs with their NaN and Inf replaced
  by 0): any non-finite value. Its value there is its overflow, which witnesses no kind:
  an honest kernel that does not overflow there carries a finite state on, and where the
  chunked form's rounding of a state far larger than the answer gives that state the
  other sign, an Inf step applied to it takes another kind; a finite value still fails.

- where the oracle's answer swings across classes under the rounding of its inputs
  (``envelope``: the oracle's value minus and plus the farthest it goes on copies of the
  inputs moved by one unit of the compute precision's roundoff, ``kfuzz.execute.oracle_envelope``),
  such as an output that cancels terms far past the dtype's range (float64 itself then keeps
  only their rounding noise): any value inside the envelope, rounded to the dtype; a NaN
  fails there. Where the oracle is non-finite, the envelope also holds the non-finite kinds
  it takes on those copies, and any of them passes: an Inf times a sum that cancels to its
  rounding noise is an Inf whose sign that noise picks, and added to another Inf it is NaN or
  an Inf by that sign (a NaN passes only where a copy is NaN).

Without a trusted implementation (gate G05) every kind must match; gate G06
(range) is the strict check of the overflow latitude.

The bound (on the positions where both are finite), normwise and elementwise,
so that a single wrong element in a large tensor fails:

    ||k - o||_2  <= C * max(||t - o||_2,   F * u * ||o||_2)   + F * tiny * sqrt(n)
    |k_i - o_i|  <= C * max(||t - o||_inf, F * u * |o_i|)     + F * tiny

k is the kernel's output, o the float64 oracle's, t the trusted implementation's
at the kernel's own precision (its error is the honest error for these inputs:
it grows with size and conditioning), u the output dtype's unit roundoff, tiny
its smallest normal. C = ``BOUND_C`` is set by the calibration sweep
(``tools/calibrate.py``); F = ``FLOOR_ULPS`` keeps the bound from collapsing
when the trusted implementation happens to be exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kfuzz.dtypes import torch_dtype, unit_roundoff, widen_float8

BOUND_C = 8.0
FLOOR_ULPS = 4.0


@dataclass(frozen=True, slots=True)
class Finding:
    """One output's comparison: ``kind`` is None when it passes."""

    kind: str | None
    detail: str = ""
    ratio: float = 0.0
    metrics: tuple = ()


def error_scale(trusted_err_norm: float, u: float, oracle_norm: float) -> float:
    """What C multiplies in the normwise bound: the trusted implementation's error, floored at
    FLOOR_ULPS units of roundoff of the answer (tools/calibrate.py reads C back through it)."""
    return max(trusted_err_norm, FLOOR_ULPS * u * oracle_norm)


def _f64(t: torch.Tensor, device=None) -> torch.Tensor:
    """``t`` as float64 on ``device`` (None: the CPU)."""
    return t.detach().to(device or "cpu", torch.float64)


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element is finite: the least and the largest are (both are NaN where one
    element is), a reduction that costs a fraction of a mask."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(widen_float8(x))
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def rounds_finite(o: torch.Tensor, dt: torch.dtype) -> bool:
    """Whether every element of ``o`` rounds to a finite value of ``dt``: its least and its
    largest do (rounding is monotonic; a NaN makes both NaN), with no copy of ``o`` in ``dt``."""
    if o.numel() == 0:
        return True
    return bool(torch.isfinite(widen_float8(torch.stack(torch.aminmax(o)).to(dt))).all())


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` as two comparisons (NaN compares false), a third of its cost on the CPU."""
    x = widen_float8(x)
    return (x > -math.inf) & (x < math.inf)


def same_classes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one shape, any float dtypes) are finite at the same positions and
    take the same non-finite value (NaN, +Inf or -Inf) at the others: ``_class`` equal everywhere,
    with the classes worked out only where a value is not finite."""
    a, b = widen_float8(a), widen_float8(b)
    finite = _finite(a)
    if not torch.equal(finite, _finite(b)):
        return False
    na, nb = a[~finite], b[~finite]
    nan = torch.isnan(na)
    return torch.equal(nan, torch.isnan(nb)) and bool((na[~nan] == nb[~nan]).all())


def _class(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +Inf, 3 -Inf."""
    x = widen_float8(x)
    if all_finite(x):
        return torch.zeros(x.shape, dtype=torch.int8, device=x.device)
    out = torch.isnan(x).to(torch.int8)
    out.masked_fill_(x == math.inf, 2)
    out.masked_fill_(x == -math.inf, 3)
    return out


def near_overflow(o: torch.Tensor, dtype: str, c: float, reach: float = 0.0) -> torch.Tensor:
    """Where the float64 oracle lies within the elementwise bound of the dtype's largest
    finite value: ``c`` times the larger of ``reach`` (the trusted implementation's largest
    error) and FLOOR_ULPS units of the dtype's roundoff of the oracle's value.  An honest
    kernel may land finite or on the Inf of the oracle's sign."""
    big, w = float(torch.finfo(torch_dtype(dtype)).max), c * FLOOR_ULPS * unit_roundoff(dtype)
    mag = o.abs()
    band = torch.clamp(mag * w, min=c * reach)
    return _finite(o) & (mag - band <= big) & (mag + band >= big)


NONFINITE_KINDS = 2 | 4 | 8   # NaN, +Inf and -Inf as ``kinds`` writes them


def kinds(x: torch.Tensor) -> torch.Tensor:
    """Each element's non-finite class as a bit set (``1 << _class``: 2 NaN, 4 +Inf, 8 -Inf;
    0 where finite), so that the kinds of several tensors combine by bitwise or."""
    c = _class(x).to(torch.int32)
    return torch.where(c > 0, torch.bitwise_left_shift(torch.ones_like(c), c), 0)


def swinging(o_rounded: torch.Tensor,
             envelope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
             dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(where the envelope, rounded to ``dt``, reaches another class than the oracle's, its
    low end, its high end, the non-finite kinds it holds (``kinds``)) or None without an
    envelope; on ``o_rounded``'s device."""
    if envelope is None:
        return None
    lo, hi = (_f64(x, o_rounded.device).to(dt).to(torch.float64) for x in envelope[:2])
    held = envelope[2].to(o_rounded.device)
    return (_class(lo) != _class(o_rounded)) | (_class(hi) != _class(o_rounded)), lo, hi, held


def nonfinite_mismatch(k: torch.Tensor, o_rounded: torch.Tensor, near: torch.Tensor,
                       free: torch.Tensor | None = None, any_class: torch.Tensor | None = None,
                       swing: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                       ) -> str | None:
    """Where NaN/+Inf/-Inf sets differ; ``near`` positions may be finite or an Inf of the oracle's
    sign, ``free`` positions anything, ``any_class`` positions any non-finite value, ``swing``
    positions (``swinging``) any value between its two ends, or a non-finite value of a kind
    its envelope holds."""
    latitude = near & (_finite(k) | (torch.isinf(k) & (torch.sign(k) == torch.sign(o_rounded))))
    if swing is not None:
        where, lo, hi, held = swing
        latitude = latitude | (where & (k >= lo) & (k <= hi)) | ((held & kinds(k)) != 0)
    for name, fn in (("NaN", torch.isnan), ("+Inf", lambda x: torch.isposinf(x)),
                     ("-Inf", lambda x: torch.isneginf(x))):
        km, om = fn(k), fn(o_rounded)
        diff = (km != om) & ~latitude
        if free is not None:
            diff &= ~free
        if any_class is not None:
            diff &= ~(any_class & ~_finite(k))
        if diff.any():
            idx = diff.reshape(-1).nonzero()[0].item()
            n = int(diff.sum())
            return (f"{name} set differs at {n} position(s), first at flat index {idx}: "
                    f"kernel {k.reshape(-1)[idx].item()!r}, oracle {o_rounded.reshape(-1)[idx].item()!r}")
    return None


def compare(kernel_out: torch.Tensor, oracle_out: torch.Tensor, trusted_out: torch.Tensor | None,
            dtype: str, c: float = BOUND_C,
            trusted_clean: torch.Tensor | Callable[[], torch.Tensor] | None = None,
            envelope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            values: bool = True, device=None) -> Finding:
    """Judge one output; ``dtype`` is the output's dtype name. ``trusted_clean``: the trusted
    implementation's output on the inputs with every NaN and Inf replaced by 0 (or a function
    that computes it, called only when needed); None where the inputs hold no NaN or Inf.
    ``envelope``: the oracle's (low, high) ends under the rounding of its inputs and the
    non-finite kinds it takes there (``kinds``; see the module docstring), or None.
    ``values=False``: the nonfinite check alone, no bound (a gate that judges only where the
    output is NaN or Inf). ``device``: where the comparison runs (None: the CPU; a GPU judges a
    large output far faster, with the same verdicts up to the order of a norm's sum)."""
    o = _f64(oracle_out, device)
    dt = torch_dtype(dtype)
    if not dt.is_floating_point:
        k = _f64(kernel_out, device)
        if torch.equal(k, o):
            return Finding(None)
        n = int((k != o).sum())
        return Finding("bound", f"{n} integer element(s) differ from the oracle", math.inf)
    # the kernel's and the trusted outputs keep their own dtype: arithmetic with the oracle
    # promotes them to float64 exactly, and a value's class (finite, NaN, +Inf, -Inf) is the same
    k = widen_float8(kernel_out.detach().to(device or "cpu"))
    t = None if trusted_out is None else widen_float8(trusted_out.detach().to(device or "cpu"))
    finite = all_finite(k) and (t is None or all_finite(t)) and rounds_finite(o, dt)
    if finite and envelope is None:
        # no position takes a latitude of the nonfinite check: every one is judged by the bound
        return _bound(k, o, t, None, dtype, c) if values else Finding(None)
    o_low = o.to(dt)
    o_rounded = o_low.to(torch.float64) if envelope is not None else None
    swing = swinging(o_rounded, envelope, dt)
    if finite and not bool(swing[0].any()):
        # (with an envelope) nor does any position swing across classes
        return _bound(k, o, t, None, dtype, c) if values else Finding(None)
    if t is None and swing is None and not values and same_classes(k, o_low):
        return Finding(None)     # the nonfinite check alone, and the NaN, +Inf and -Inf sets are equal
    ck, co = _class(k), _class(o_low)
    o_finite = _finite(o) if t is not None or values else None
    free = any_class = None
    if t is not None:
        ct = _class(t)
        # where the honest same-precision implementation is non-finite and the oracle is finite
        # (or non-finite of another kind), so may the kernel be, where that is an overflow: where
        # it stays non-finite on the inputs without their NaN and Inf.  Where both are
        # non-finite but of other kinds, the kernel must be non-finite, of any kind
        free = (ct != 0) & ((co == 0) | (ct != co))
        # the oracle past the range in float64 where the trusted one overflows: the kernel must
        # overflow too, to any kind
        past = (ct != 0) & o_finite & (co != 0)
        # the same non-finite kind as the oracle's, where the kernel's differs: excused only
        # if the trusted one's is an overflow, which witnesses no kind
        same = (co != 0) & (ct == co) & (ck != co)
        overflow = None
        if trusted_clean is not None and bool((free | past | same).any()):
            clean = trusted_clean() if callable(trusted_clean) else trusted_clean
            overflow = ~_finite(_f64(clean, device))
            any_class = (free & ~overflow & ~o_finite) | (same & overflow)
            free &= overflow
        past = past if overflow is None else past & overflow
        any_class = past if any_class is None else any_class | past
    if bool((ck != co).any()):   # else the NaN, +Inf and -Inf sets are equal: no latitude needed
        reach = 0.0
        if t is not None:
            d = (t - o).abs()
            d = d[_finite(d)]
            reach = float(d.max()) if d.numel() else 0.0
        near = near_overflow(o, dtype, c, reach)
        if o_rounded is None:
            o_rounded = o_low.to(torch.float64)
        bad = nonfinite_mismatch(k, o_rounded, near, free, any_class, swing)
        if bad:
            return Finding("nonfinite", bad, math.inf)
    if not values:
        return Finding(None)

    # positions near the dtype's max where the kernel is finite are judged by the bound; a
    # value inside an envelope that swings across classes has passed (the module docstring)
    finite = (ck == 0) & o_finite
    if free is not None:
        finite &= ~free
    if swing is not None:
        finite &= ~(swing[0] & (k >= swing[1]) & (k <= swing[2]))
    return _bound(k, o, t, finite, dtype, c)


# output elements the bound takes at a time: its float64 temporaries stay 8 MB on a CPU and
# 128 MB on a GPU (whose memory the audit's kernels and oracles share) however large the output,
# and a GPU's chunk still keeps its launches few
BOUND_CHUNK = {"cpu": 1 << 20, "cuda": 1 << 24}


def _chunks(x: torch.Tensor):
    n, step = x.numel(), BOUND_CHUNK.get(x.device.type, BOUND_CHUNK["cpu"])
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def largest(a: torch.Tensor, b: torch.Tensor, difference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
            ) -> float:
    """The largest element of ``difference(x, y)`` over the elements of ``a`` and ``b`` (one
    shape; ``b`` moved to ``a``'s device), taken in float64 ``BOUND_CHUNK`` elements at a time:
    no float64 copy of a whole output is made, which at a KernelBench problem's nominal size
    (a billion elements) would not fit beside the kernel's and the reference's outputs. A NaN
    that ``difference`` gives is the answer (a maximum keeps it); 0.0 where there are no elements."""
    x, y = a.detach().reshape(-1), b.detach().to(a.device).reshape(-1)
    if not x.numel():
        return 0.0
    return _max([difference(widen_float8(x[at]).double(), widen_float8(y[at]).double()).max() for at in _chunks(x)])


def _norm(parts: list[torch.Tensor]) -> float:
    """The 2-norm of a vector from its chunks' 2-norms (one chunk: its own, exactly)."""
    return float(torch.stack(parts).norm()) if parts else 0.0


def _max(parts: list[torch.Tensor]) -> float:
    return float(torch.stack(parts).max()) if parts else 0.0


def _bound(k: torch.Tensor, o: torch.Tensor, t: torch.Tensor | None, judged: torch.Tensor | None,
           dtype: str, c: float) -> Finding:
    """The normwise and elementwise bound over the ``judged`` positions (a mask; None: every
    position) of the kernel's output ``k``, the oracle's ``o`` and the trusted implementation's
    ``t``. Positions not judged count as zero error and zero oracle, which changes no norm or
    maximum. Taken ``BOUND_CHUNK`` elements (by device) at a time, in two passes: the norms and maxima,
    then each position's ratio to the elementwise bound, which needs the trusted error's
    maximum over all of them."""
    kf, of = k.reshape(-1), o.reshape(-1)
    tf = None if t is None else t.reshape(-1)
    jf = None if judged is None else judged.reshape(-1)

    def only(x, at):
        return x if jf is None else torch.where(jf[at], x, 0)
    u, tiny = unit_roundoff(dtype), float(torch.finfo(torch_dtype(dtype)).tiny)
    e_norms, e_maxes, t_norms, t_maxes, o_norms, unknowns = [], [], [], [], [], []
    for at in _chunks(kf):
        oc = only(of[at], at)
        err = only((kf[at] - of[at]).abs_(), at)
        e_norms.append(err.norm())
        e_maxes.append(err.max())
        o_norms.append(oc.norm())
        if tf is not None:
            terr = only((tf[at] - of[at]).abs_(), at)
            if not all_finite(terr):     # the trusted one's NaN or Inf here: not in the bound
                spread = ~_finite(terr)
                unknowns.append(spread.sum())
                terr = terr.masked_fill_(spread, 0)
            t_norms.append(terr.norm())
            t_maxes.append(terr.max())
    unknown = int(torch.stack(unknowns).sum()) if unknowns else 0
    n = kf.numel() if jf is None else int(jf.sum())
    t_norm, t_max, o_norm = _norm(t_norms), _max(t_maxes), _norm(o_norms)
    e_norm, max_err = _norm(e_norms), _max(e_maxes)
    norm_bound = c * error_scale(t_norm, u, o_norm) + FLOOR_ULPS * tiny * math.sqrt(max(1, n))

    def elem_bound(oc: torch.Tensor) -> torch.Tensor:
        """c * max(t_max, F * u * |o_i|) + F * tiny (in one new buffer)."""
        return oc.abs().mul_(FLOOR_ULPS * u).clamp_(min=t_max).mul_(c).add_(FLOOR_ULPS * tiny)
    ratio_maxes, ratio_at = [], []
    for at in _chunks(kf):
        err = only((kf[at] - of[at]).abs_(), at)
        ratios = err.div_(elem_bound(only(of[at], at)))
        best = ratios.max(0)
        ratio_maxes.append(best.values)
        ratio_at.append(best.indices + at.start)
    norm_ratio = e_norm / norm_bound if norm_bound > 0 else (math.inf if e_norm > 0 else 0.0)
    elem_ratio = _max(ratio_maxes) if n else 0.0
    rel = e_norm / o_norm if o_norm > 0 else e_norm
    metrics = (("rel_err", rel), ("err_norm", e_norm), ("bound_norm", norm_bound),
               ("trusted_err_norm", t_norm), ("max_err", max_err), ("trusted_max_err", t_max))
    ratio = max(norm_ratio, elem_ratio)
    if ratio <= 1.0:
        return Finding(None, ratio=ratio, metrics=metrics)
    if elem_ratio >= norm_ratio:
        i = int(ratio_at[int(torch.stack(ratio_maxes).argmax())])
        ki, oi = kf[i].item(), of[i].item()
        detail = (f"element {i}: kernel {ki:.6g}, oracle {oi:.6g}, "
                  f"error {abs(ki - oi):.3g} > bound {elem_bound(of[i:i + 1]).item():.3g} "
                  f"({elem_ratio:.3g}x)")
    else:
        detail = (f"normwise error {e_norm:.3g} > bound {norm_bound:.3g} ({norm_ratio:.3g}x; "
                  f"relative {rel:.3g}, trusted {t_norm / o_norm if o_norm else t_norm:.3g})")
    if unknown:
        detail += (f"; the trusted implementation is non-finite at {unknown} of the {n} "
                   f"positions judged (where the oracle is finite), so its error there is not in the bound")
    return Finding("bound", detail, ratio, metrics)
