"""A planted chunked kernel for ``gdn_fwd_linear``'s contract, ``gdn_fwd_linear.maskafter``:
linear attention (no gate, no delta) by chunks of 16 tokens, right in every finite case,
whose in-chunk causal mask is applied to q k^T by selection and then reaches v through the
product: the mask's zeros meet a later token's NaN or Inf in v (0 * NaN is NaN), so one
special value spreads to the earlier tokens of its chunk, where the recurrence never takes
it.  Registered by importing this module (it is not among the package's target entry
points): the positive control of a campaign's nonfinite judgment on a chunked kernel."""
from __future__ import annotations

import torch

from kfuzz.target import variant

import harnesses.gdn  # noqa: F401  (registers gdn_fwd_linear, the contract)

CHUNK = 16


def mask_after_the_product(q, k, v, h0):
    """(o in q's dtype, final state fp32) by chunks: o_c = scale (q_c S + M (q_c k_c^T) v_c),
    with M the causal selection; S += k_c^T v_c."""
    B, T, H, K = q.shape
    scale = K ** -0.5
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))      # [B, H, T, *]
    S = h0.float().clone()
    o = torch.empty(B, H, T, v.shape[-1], dtype=torch.float32, device=q.device)
    for c0 in range(0, T, CHUNK):
        qc, kc, vc = qf[:, :, c0:c0 + CHUNK], kf[:, :, c0:c0 + CHUNK], vf[:, :, c0:c0 + CHUNK]
        idx = torch.arange(qc.shape[2], device=q.device)
        causal = idx[:, None] >= idx[None, :]
        p = torch.where(causal, qc @ kc.transpose(-1, -2), 0.)
        o[:, :, c0:c0 + CHUNK] = scale * (qc @ S + p @ vc)
        S = S + kc.transpose(-1, -2) @ vc
    return o.transpose(1, 2).to(q.dtype), S


variant("gdn_fwd_linear", "gdn_fwd_linear.maskafter", mask_after_the_product,
        planted_bug="the in-chunk causal mask reaches v through a product: a NaN in a later "
                    "token's v spreads to the earlier tokens of its chunk (0 * NaN)")
