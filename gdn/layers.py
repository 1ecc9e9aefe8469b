"""Token-mixing layers of the GDN family, each calling one attention backend.

One class, `FamilyMixer`, parameterized by a `Member`: the projections, short
convolution, key/query normalization, gates and output norm that the member's
paper puts around the recurrence of `gdn.oracle`.  The recurrence itself runs
through ``backend``: "triton" (`gdn.op.gdn_attention`, our forward and
backward kernels) or "reference" (`gdn.reference.chunked`, float32 PyTorch,
differentiated by autograd).  Both backends see the same inputs, cast to the
same ``op_dtype``, so a model trained through each differs only by the op.

| member          | gate                   | delta | short conv | q, k  | output norm        |
| --------------- | ---------------------- | ----- | ---------- | ----- | ------------------ |
| gated_deltanet  | scalar, -A*softplus    | on    | SiLU       | L2    | RMSNorm * SiLU(z)  |
| deltanet        | none                   | on    | SiLU       | L2    | RMSNorm            |
| kda             | per key, -A*softplus   | on    | SiLU       | L2    | RMSNorm * sigm(z)  |
| mamba2          | scalar, -A*dt          | off   | SiLU       | raw   | RMSNorm * SiLU(z)  |
| gla             | per key, logsigmoid/16 | off   | none       | raw   | RMSNorm * SiLU(z)  |

(Gated DeltaNet, Yang et al. 2024; DeltaNet as parallelized by Yang et al.
2024; KDA from Kimi Linear, 2025; Mamba2, Dao and Gu 2024, with v scaled by dt
and the D skip term, per-head keys in place of shared B/C groups; GLA, Yang et
al. 2023.)  Every log gate is <= 0 by construction and beta = sigmoid(.) is in
(0, 1), the op's domain.  The attention scale is K^-0.5 for every member.

Refuses: an unknown member or backend, a head size outside the op's [16, 256].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("triton", "reference")


@dataclass(frozen=True, slots=True)
class Member:
    """Where a family member departs from the shared recurrence and layer."""
    name: str
    gate: str | None       # "scalar" [B,T,H], "vector" [B,T,H,K], or None
    delta: bool            # the delta rule (beta) on or off
    conv: bool             # short causal depthwise convolution + SiLU on q, k, v
    l2_qk: bool            # L2-normalized queries and keys
    out_gate: str | None   # activation of the output gate z, or None (plain RMSNorm)
    title: str


MEMBERS = {m.name: m for m in (
    Member("gated_deltanet", "scalar", True, True, True, "silu", "Gated DeltaNet"),
    Member("deltanet", None, True, True, True, None, "DeltaNet"),
    Member("kda", "vector", True, True, True, "sigmoid", "KDA-style"),
    Member("mamba2", "scalar", False, True, False, "silu", "Mamba2-style"),
    Member("gla", "vector", False, False, False, "silu", "GLA-style"),
)}

GLA_GATE_NORMALIZER = 16.0   # GLA divides logsigmoid by 16 so that decays start near 1
GATE_RANK = 16               # low-rank per-key gate projections (GLA, KDA)


def member(name: str) -> Member:
    if name not in MEMBERS:
        raise ValueError(f"unknown GDN family member {name!r}; known: {', '.join(MEMBERS)}")
    return MEMBERS[name]


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over time followed by SiLU; [B,T,C] -> [B,T,C]."""

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels,
                              padding=kernel_size - 1, bias=False)

    def forward(self, x):
        T = x.shape[1]
        return F.silu(self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2))


def _dt_bias(n: int, lo: float = 1e-3, hi: float = 1e-1) -> torch.Tensor:
    """Mamba's initialization: softplus(bias) = dt log-uniform in [lo, hi]."""
    dt = torch.exp(torch.rand(n) * (math.log(hi) - math.log(lo)) + math.log(lo))
    return dt + torch.log(-torch.expm1(-dt))


class FamilyMixer(nn.Module):
    """[B, T, d_model] -> [B, T, d_model] through one GDN-family recurrence."""

    def __init__(self, member_name: str, d_model: int, heads: int, head_dim: int,
                 backend: str = "triton", op_dtype: torch.dtype = torch.float32):
        super().__init__()
        if not 16 <= head_dim <= 256:
            raise ValueError(f"head_dim must be in [16, 256] (the op's K, V); got {head_dim}")
        self.member = m = member(member_name)
        self.backend = backend   # checked at call time too: the switch is a plain attribute
        self._check_backend()
        self.op_dtype = op_dtype
        self.H, self.K = heads, head_dim
        inner = heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        if m.conv:
            self.q_conv, self.k_conv, self.v_conv = (ShortConv(inner) for _ in range(3))
        if m.delta:
            self.b_proj = nn.Linear(d_model, heads, bias=True)
        if m.gate == "scalar":
            self.a_proj = nn.Linear(d_model, heads, bias=False)
            self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
            self.dt_bias = nn.Parameter(_dt_bias(heads))
        elif m.gate == "vector":
            self.gk_proj = nn.Sequential(nn.Linear(d_model, GATE_RANK, bias=False),
                                         nn.Linear(GATE_RANK, inner, bias=True))
            if m.delta:   # KDA: -A_h * softplus(. + dt_bias) per key
                self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
                self.dt_bias = nn.Parameter(_dt_bias(inner))
        if m.name == "mamba2":
            self.D = nn.Parameter(torch.ones(heads))
        if m.out_gate:
            self.z_proj = nn.Linear(d_model, inner, bias=False)
        self.o_norm = nn.RMSNorm(head_dim, eps=1e-5)
        self.o_proj = nn.Linear(inner, d_model, bias=False)

    def _check_backend(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}; got {self.backend!r}")

    def _gate_and_dt(self, x, B, T):
        """(log gate g <= 0 in float32 or None, Mamba2's dt [B,T,H] or None)."""
        m, H, K = self.member, self.H, self.K
        if m.gate == "scalar":
            dt = F.softplus(self.a_proj(x).float() + self.dt_bias)
            return -torch.exp(self.A_log) * dt, dt
        if m.gate == "vector":
            a = self.gk_proj(x).float().view(B, T, H, K)
            if m.delta:
                dt = F.softplus(a + self.dt_bias.view(H, K))
                return -torch.exp(self.A_log)[:, None] * dt, None
            return F.logsigmoid(a) / GLA_GATE_NORMALIZER, None
        return None, None

    def forward(self, x):
        self._check_backend()
        m, H, K = self.member, self.H, self.K
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if m.conv:
            q, k, v = self.q_conv(q), self.k_conv(k), self.v_conv(v)
        q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))
        if m.l2_qk:
            q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
        g, dt = self._gate_and_dt(x, B, T)
        v_in = v * dt[..., None].to(v.dtype) if dt is not None and not m.delta else v
        beta = torch.sigmoid(self.b_proj(x)) if m.delta else None
        cast = lambda t: None if t is None else t.to(self.op_dtype).contiguous()  # noqa: E731
        args = (cast(q), cast(k), cast(v_in), None if g is None else g.float().contiguous(),
                cast(beta))
        if self.backend == "triton":
            from gdn.op import gdn_attention
            o, _ = gdn_attention(*args, delta=m.delta)
        else:
            from gdn.reference import chunked
            o, _ = chunked(*args, delta=m.delta, output_final_state=False)
        o = o.to(x.dtype)
        if m.name == "mamba2":
            o = o + self.D[:, None] * v
        o = self.o_norm(o)
        if m.out_gate:
            z = self.z_proj(x).view(B, T, H, K)
            o = o * (F.silu(z) if m.out_gate == "silu" else torch.sigmoid(z))
        return self.o_proj(o.reshape(B, T, H * K))
