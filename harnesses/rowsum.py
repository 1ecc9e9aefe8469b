"""Row sum as a Triton kernel: a loop over column blocks with an fp32 running total.

Planted bugs: ``rowsum.fp16acc`` keeps the running total in fp16 (lost once
the total is large: 2048 + 1 = 2048 in fp16); ``rowsum.droptail`` loops over
whole blocks only and drops the last D mod 64 columns.
"""
import torch
import triton
import triton.language as tl

from kfuzz.target import Arg, Dim, Output, target, variant

BLOCK = 64


@triton.jit
def _rowsum(x_ptr, out_ptr, stride_xr, stride_xc, n_cols,
            BLOCK: tl.constexpr, ACC_FP16: tl.constexpr, DROP_TAIL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if ACC_FP16:
        acc = tl.zeros((BLOCK,), dtype=tl.float16)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
    end = n_cols
    if DROP_TAIL:
        end = (n_cols // BLOCK) * BLOCK
    for start in range(0, end, BLOCK):
        idx = start + cols
        x = tl.load(x_ptr + row * stride_xr + idx * stride_xc, mask=idx < n_cols, other=0.0)
        acc += x.to(acc.dtype)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + row, total.to(out_ptr.dtype.element_ty))


def _launch(x, acc_fp16=False, drop_tail=False):
    n, d = x.shape
    out = torch.empty((n,), dtype=x.dtype, device=x.device)
    _rowsum[(n,)](x, out, x.stride(0), x.stride(1), d, BLOCK=BLOCK,
                  ACC_FP16=acc_fp16, DROP_TAIL=drop_tail)
    return out


@target("rowsum", reference=lambda x: x.sum(dim=-1),
        args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
        dims={"N": Dim(1, 32), "D": Dim(1, 2048)},
        description="sum over the last dim of [N, D], Triton, fp32 running total")
def rowsum(x):
    return _launch(x)


variant("rowsum", "rowsum.fp16acc", lambda x: _launch(x, acc_fp16=True),
        planted_bug="running total kept in fp16: large sums lose their low bits")
variant("rowsum", "rowsum.droptail", lambda x: _launch(x, drop_tail=True),
        planted_bug="loops over whole blocks only: drops the tail when D is not a multiple of 64")
