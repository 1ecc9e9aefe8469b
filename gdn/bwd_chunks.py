"""Where each chunk of the GDN backward lies: the chunk table of a fixed-length or varlen batch.

The host side (``chunk_plan``) numbers the chunks of every sequence globally; the Triton
helpers turn a global chunk id (``_coords``, and ``_chunk_rows`` for the chunk-parallel
kernels) or a sequence index (``_seq``, and ``_seq_tile`` for the sequential kernels) back
into token ranges.  Varlen batches need
B == 1 and int32 offsets; nothing here checks shapes (the launcher does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn.common import kept_plan


@triton.jit
def _coords(cid, T, cu, tab, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within it, first token, end token) of a global chunk id."""
    if IS_VARLEN:
        n = tl.load(tab + cid * 2).to(tl.int32)
        ic = tl.load(tab + cid * 2 + 1).to(tl.int32)
        bos = tl.load(cu + n).to(tl.int32)
        eos = tl.load(cu + n + 1).to(tl.int32)
    else:
        nt = tl.cdiv(T, C)
        n = cid // nt
        ic = cid % nt
        bos = n * T
        eos = bos + T
    return n, ic, bos, eos


@triton.jit
def _seq(n, T, cu, coff, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first token, end token, global id of its first chunk) of sequence n."""
    if IS_VARLEN:
        bos = tl.load(cu + n).to(tl.int32)
        eos = tl.load(cu + n + 1).to(tl.int32)
        cbase = tl.load(coff + n).to(tl.int32)
    else:
        bos = n * T
        eos = bos + T
        cbase = n * tl.cdiv(T, C)
    return bos, eos, cbase


@triton.jit
def _chunk_rows(cid, ih, T, H, cu, tab, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A chunk-parallel program's rows: (sequence, chunk within it, first token, end token,
    row index [C], token [C], row valid [C], and the chunk's 64-bit base row in a [.., H, ..]
    tensor, as `gdn.common.tile` takes it with the row index)."""
    n, ic, bos, eos = _coords(cid, T, cu, tab, C, IS_VARLEN)
    rows = tl.arange(0, C)
    tok = bos + ic * C + rows
    rv = tok < eos
    return n, ic, bos, eos, rows, tok, rv, _chunk_base(bos + ic * C, ih, H)


@triton.jit
def _chunk_base(t0, ih, H):
    """The 64-bit base row of the chunk from token t0 at head ih in a [.., H, ..] tensor, as
    `gdn.common.tile` takes it."""
    return t0.to(tl.int64) * H + ih


@triton.jit
def _seq_tile(inh, iv, T, H, K, V, cu, coff, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              IS_VARLEN: tl.constexpr):
    """A sequential program's sequence and [BK, BV] state tile: (sequence, head, first token, end token,
    first chunk's global id, row index [C], key index [BK], key valid, value index [BV],
    value valid, tile valid [BK, BV], offset in a [K, V] state [BK, BV], 32-bit: K V <= 2^16)."""
    n = inh // H
    bos, eos, cbase = _seq(n, T, cu, coff, C, IS_VARLEN)
    ck = tl.arange(0, BK)
    mk = ck < K
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < V
    return (n, inh % H, bos, eos, cbase, tl.arange(0, C), ck, mk, cv, mv, mk[:, None] & mv[None, :],
            ck[:, None] * V + cv[None, :])


def chunk_plan(cu_seqlens, B: int, T: int, C: int):
    """(sequences, total chunks, chunk table [NC, 2] int32 or None, first chunk
    of each sequence [N] int32 or None) for fixed-length or varlen batches; a varlen
    batch's tables kept per cu_seqlens tensor and version (`gdn.common.kept_plan`: their
    count is read on the host, which waits for the GPU)."""
    if cu_seqlens is None:
        return B, B * triton.cdiv(T, C), None, None
    return kept_plan(cu_seqlens, ("bwd", C), lambda: _varlen_tables(cu_seqlens, C))


def _varlen_tables(cu_seqlens, C: int):
    """`chunk_plan`'s tables of a varlen batch, built (one read on the host)."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    counts = (lens + C - 1) // C
    N = len(lens)
    coff = torch.cumsum(counts, 0) - counts
    NC = int(counts.sum().item())
    seq = torch.repeat_interleave(torch.arange(N, device=cu.device), counts)
    within = torch.arange(NC, device=cu.device) - coff[seq]
    tab = torch.stack([seq, within], 1).to(torch.int32).contiguous()
    return N, NC, tab, coff.to(torch.int32).contiguous()


def generic_v(kernel):
    """`kernel` (a jitted backward kernel) compiled with V a plain integer, for launches at
    V == 1.  Triton makes an integer argument equal to 1 a constant, and on the H200 (Triton
    3.6) that compile at K 32, bf16, gives NaN dk and dbeta off by 0.4 where V 16 (same tiles)
    is right; compiled generically, V 1 is right at every K and gate (tools/sweep_gdn_gpu.py).
    Only V == 1 takes it: compiling V generically everywhere also drops its divisibility-by-16
    hint, which slows every other launch."""
    return triton.jit(kernel.fn, do_not_specialize=["V"])
