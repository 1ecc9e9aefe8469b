"""The GDN kernels' launch configuration: one frozen `GDNConfig`, and `DEFAULT`.

Every launch choice of the forward (`gdn.chunk_fwd`, `gdn.fwd_prep`, `gdn.fwd_state`) and the
backward (`gdn.chunk_bwd`) that is a product choice (tile widths, warps, pipeline stages,
register caps, the state pass's configs and how one is picked) is a field here.
`gdn.chunk_fwd.chunk_gdn_fwd`, `gdn.chunk_bwd.chunk_gdn_bwd` and `gdn.op.gdn_attention` take a
``config=`` (``DEFAULT`` when left out); another choice is ``dataclasses.replace(DEFAULT,
...)``, passed per call.  Nothing here reads the environment.

The algorithm's own constants (chunk sizes, the matrix path's bounds) are not launch choices:
they live in `gdn.common` and the launchers.  The numbers below were chosen on an H200 (sm_90,
Triton 3.6) at bf16 B8 T4096 H16 K=V=128 unless a field says otherwise; register and
shared-memory counts are from offline compiles for sm_90 (`tools/kernel_resources.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

# How the forward's state pass picks a config of ``state_configs`` for a new autotune key:
# "tune": Triton's autotuner times them all and keeps the fastest (for users);
# "spread": one config per key, picked from the key alone (the first, in an order that the
#     key's CRC starts, that fits the GPU's shared memory): every process runs the same config
#     for a shape, so a failure replays and minimizes, a launch compiles one config instead of
#     all, and different shapes exercise different configs (kfuzz's GDN targets);
# "first": the first config that fits, in their own order (accuracy sweeps and benchmarks
#     that must not time the tuner).
STATE_PICKS = ("tune", "spread", "first")


@dataclass(frozen=True)
class OutLaunch:
    """One launch of the forward's output kernel (`gdn.chunk_fwd.out_launch`)."""

    bv: int                      # V tile width (at least 64, at most V's next power of 2)
    warps: int
    bk: int = 0                  # K slice width of the matrix part's pipelined loop; 0: K whole
    stages: int | None = None    # that loop's num_stages; None: Triton's default
    maxnreg: int | None = None   # registers a thread; None: uncapped


@dataclass(frozen=True)
class GDNConfig:
    """The GDN kernels' launch choices (see the module docstring)."""

    # --- forward: the state pass (gdn.fwd_state) ---
    # The matrix part's configs on GPUs, (BV, warps, stages).  BV 32 at an odd K or at one
    # stage is never launched (`gdn.fwd_state._sound_configs`: ptxas 12.8 miscompiles it).
    # Under the interpreter one config runs: BV 32, 4 warps, 1 stage.
    state_configs: tuple[tuple[int, int, int], ...] = (
        (32, 4, 2), (16, 4, 2), (64, 4, 3), (64, 4, 2), (64, 8, 2), (32, 8, 2), (16, 2, 2), (32, 4, 3))
    state_pick: str = "tune"     # one of STATE_PICKS
    # The resume part's tile: the narrowest of the matrix part's, so that each resume tile lies
    # inside one matrix tile and its columns share one stopping chunk.  A power of two of at
    # least 16: the output kernel's token-by-token part leaves to it whole 16-column slices.
    state_resume_bv: int = 16
    state_resume_warps: int = 4

    # --- forward: the WY prep (gdn.fwd_prep) ---
    # V tiles of the prep (the output kernel's are at least as wide, `gdn.chunk_fwd.out_launch`):
    # 64 wide at any V, masked past it.  Narrower ones miscompile (bf16: 16-wide give o 100%
    # wrong, 32-wide at V 32, K >= 64 o 0.36-0.7 off or an illegal address).
    prep_bv: int = 64
    # The inverse's warps and its register cap on GPUs for bf16 inputs (None: uncapped).  At 128
    # registers (no spill, 158 uncapped) 4 programs share an SM instead of 3, which is faster;
    # fp32 and fp16 inputs hold fp32 tiles and are not capped (at fp32 K = V = 128 the cap
    # spills 592 bytes).
    prep_inv_warps: int = 4
    prep_inv_maxnreg: int | None = 128
    # w and u of a chunk in one program, a pipelined loop over V tiles at 3 stages, capped at
    # 128 registers for bf16 inputs (124 used, no spill); 2 stages at 96 registers are slower.
    prep_wu_warps: int = 4
    prep_wu_stages: int = 3
    prep_wu_maxnreg: int | None = 128
    # For the bf16 products (bf16 inputs, a chunk of 32 or more) T is stored in bf16 (the
    # inverse's scratch then fp32 in the same bytes: the diagonal blocks only), and w and u take
    # one bf16 product a tile (T diag(beta Gamma) rounded to bf16, as fla's A is).  It halves T's
    # bytes written, read by `_prep_wu` and kept for the backward, at the same error against the
    # float64 oracle (3.02e-3 on o, 2.25e-3 on the final state at B2 T300).
    prep_t_bf16: bool = True
    # For the bf16 products the four block merges of the inverse (F = Dinv A_below, the Neumann
    # steps, P Dinv) take bf16 operands (fp32 sums) instead of tf32 ones; the diagonal blocks'
    # own substitution stays fp32.  A third of the shared memory, none of tf32's bank conflicts
    # on the operand stores; error against the float64 oracle within 2% of tf32's (normalized
    # keys: o 3.02e-3 either way).  The backward's own inverse keeps tf32 merges.
    prep_merge_bf16: bool = True

    # --- forward: the output kernel (gdn.chunk_fwd) ---
    # bf16 inputs where K is wider than ``out_sliced.bk`` (and the gate is not a vector one,
    # whose 16-token chunks keep one product): the matrix part runs K in a pipelined loop of
    # 64-wide slices at 128-wide V tiles and 8 warps, q k^T once a chunk at 124 registers (the
    # fastest of the launches swept, against K whole at 64/4 or 128/8 and slices at 32 or with
    # 64-wide V tiles).
    out_sliced: OutLaunch = OutLaunch(bv=128, warps=8, bk=64)
    # K in one piece (the other dtypes, and K at most ``out_sliced.bk``)
    out_whole: OutLaunch = OutLaunch(bv=64, warps=4)
    # fp32 inputs at K over 128: in one piece the kernel needs 262144 bytes of shared memory at
    # K = V = 256, more than any GPU has; 64-wide slices at 64-wide V tiles, 2 stages: 114688.
    out_wide_fp32: OutLaunch = OutLaunch(bv=64, warps=4, bk=64, stages=2)
    # The chunks one program of the token-by-token part looks at (their marks in one load)
    out_chunks: int = 16

    # --- backward (gdn.chunk_bwd) ---
    # V tiles of _prep, _states and the gradients: 64 wide at any K.  Narrower ones miscompile
    # on the H200 with Triton 3.6 (BK 32 with BV 16: NaN gradients; BK 64 with BV 32: dq/dk/dbeta
    # 0.2-0.6 off; BK 128 with BV 32: every chunk sent to the exact path, NaN gradients; BK 256
    # with BV 16: illegal addresses), and narrow V is not where the time goes.
    bwd_bv: int = 64
    # _prep: 4 warps, 2 stages; on the forward's T or saved states also 4 (8 is slower there)
    bwd_prep_warps: int = 4
    bwd_prep_stages: int = 2
    bwd_prep_given_warps: int = 4
    # _states (matrix part, pipelined) and _exact: 4 warps; _states at 2 stages (3 is slower)
    bwd_seq_warps: int = 4
    bwd_seq_stages: int = 2
    # _dstates: 8 warps (at 4 it spills 880 bytes of stack), 2 stages (as fast as 3, and 155904
    # B of shared memory at bf16 K=V=128 against 229888, within an A100's 164 KB)
    bwd_dstates_warps: int = 8
    bwd_dstates_stages: int = 2
    # _dstates's V tile, 64 or 128; None: `gdn.chunk_bwd.dstates_tile`'s choice by waves
    bwd_dstates_bv: int | None = None
    # A 128-wide _dstates program takes this many times a 64-wide one (it forms its P^T dO's
    # Q K^T once a head instead of once a tile): 128 is taken where the waves it saves outweigh it
    bwd_dstates_wide_cost: float = 1.82
    # _grads_wy and _grads_p: 4 warps, 3 stages, K in 64-wide slices, 64-wide V tiles (8 warps,
    # 32-wide slices or a program per K slice are slower)
    bwd_grads_bv: int = 64
    bwd_grads_bk: int = 64
    bwd_grads_stages: int = 3
    bwd_grads_p_warps: int = 4
    bwd_grads_wy_warps: int = 4
    # A V that is not a multiple of 16 (compiled without Triton's divisibility-by-16 hint) keeps
    # 8 warps and 2 stages for the gradients: at 4 warps the H200 gives dq 0.87 and dk 1.4 off at
    # K 32, V 1, bf16; 8 warps is right at every such V swept (1, 2, 3, 8, 15, 24, 80).
    bwd_unhinted_grads_stages: int = 2
    bwd_unhinted_grads_p_warps: int = 8
    bwd_unhinted_grads_wy_warps: int = 8
    # The chunks of a head one `_exact` program looks at (their flags in one load)
    bwd_exact_chunks: int = 16
    # _exact's float64 [BK, BV] tiles hold about this many elements (a small stack)
    bwd_exact_elements: int = 2048

    def __post_init__(self):
        if self.state_pick not in STATE_PICKS:
            raise ValueError(f"state_pick must be one of {STATE_PICKS}; got {self.state_pick!r}")
        if not self.state_configs or any(len(c) != 3 for c in self.state_configs):
            raise ValueError(f"state_configs must be (BV, warps, stages) triples; got {self.state_configs!r}")
        if self.state_resume_bv < 16 or self.state_resume_bv & (self.state_resume_bv - 1):
            raise ValueError(f"state_resume_bv must be a power of two of at least 16 (the output "
                             f"kernel's 16-column slices); got {self.state_resume_bv!r}")
        if self.bwd_dstates_bv not in (None, 64, 128):
            raise ValueError(f"bwd_dstates_bv must be None, 64 or 128; got {self.bwd_dstates_bv!r}")

    def at_v(self, V: int) -> "GDNConfig":
        """The backward's launch at V: the ``bwd_unhinted_*`` choices where V % 16 != 0."""
        if V % 16 == 0:
            return self
        return replace(self, bwd_grads_stages=self.bwd_unhinted_grads_stages,
                       bwd_grads_p_warps=self.bwd_unhinted_grads_p_warps,
                       bwd_grads_wy_warps=self.bwd_unhinted_grads_wy_warps)

    @classmethod
    def from_dict(cls, values: dict) -> "GDNConfig":
        """``DEFAULT`` with the fields named in ``values`` replaced (for a tool's command line);
        an unknown name is an error naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GDN config field(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        for name in ("out_sliced", "out_whole", "out_wide_fp32"):
            if isinstance(values.get(name), dict):
                values[name] = OutLaunch(**values[name])
        if "state_configs" in values:
            values["state_configs"] = tuple(tuple(c) for c in values["state_configs"])
        return replace(DEFAULT, **values)


DEFAULT = GDNConfig()
