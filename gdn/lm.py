"""A small byte-level language model over a GDN-family mixer, its text and its training loop.

The text is the Python standard library's own source (the ``*.py`` files
under ``os.path.dirname(os.__file__)``, sorted by relative path, without
``site-packages``), present on every machine that runs Python: no download.
Tokens are bytes (vocabulary 256).  The last ``heldout`` fraction of the
concatenated bytes is the held-out split, never trained on.

`train` is a generator of `StepRecord`s: the caller renders progress and
decides what a non-finite loss means; the loop stops at the first one (a NaN
step is reported, not skipped).  Batches come from their own seeded generator,
so two models trained with the same seed see the same windows in the same
order whatever their backend.

Refuses: a corpus smaller than one training window, a held-out fraction
outside (0, 0.5].
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gdn.layers import FamilyMixer

VOCAB = 256


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files in a fixed order (sorted relative paths)."""
    root = Path(os.path.dirname(os.__file__))
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_bytes(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of the standard library's source, files concatenated in order."""
    out, n = [], 0
    for p in stdlib_files():
        if n >= max_bytes:
            break
        try:
            data = p.read_bytes()
        except OSError:   # an unreadable file is skipped: the order of the rest is unchanged
            continue
        out.append(data[:max_bytes - n])
        n += len(out[-1])
    return b"".join(out)


@dataclass(frozen=True, slots=True)
class Corpus:
    train: torch.Tensor   # uint8 [n_train]
    heldout: torch.Tensor  # uint8 [n_heldout]

    @classmethod
    def from_bytes(cls, data: bytes, heldout: float = 0.05) -> "Corpus":
        if not 0 < heldout <= 0.5:
            raise ValueError(f"held-out fraction must be in (0, 0.5]; got {heldout}")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        cut = len(t) - max(1, int(len(t) * heldout))
        return cls(t[:cut].clone(), t[cut:].clone())

    def batches(self, steps: int, batch: int, seq_len: int, seed: int):
        """``steps`` training batches [batch, seq_len + 1] (int64), random windows, seeded."""
        if len(self.train) <= seq_len + 1:
            raise ValueError(f"training text ({len(self.train)} bytes) shorter than one window "
                             f"({seq_len + 1})")
        gen = torch.Generator().manual_seed(seed)
        span = torch.arange(seq_len + 1)
        for _ in range(steps):
            start = torch.randint(0, len(self.train) - seq_len - 1, (batch, 1), generator=gen)
            yield self.train[start + span].long()

    def heldout_windows(self, batch: int, seq_len: int, max_windows: int):
        """The first ``max_windows`` consecutive non-overlapping held-out windows (fewer if
        the split is short), in batches of ``batch``."""
        n = min((len(self.heldout) - 1) // seq_len, max_windows)
        if n < 1:
            raise ValueError(f"held-out text ({len(self.heldout)} bytes) shorter than one window "
                             f"({seq_len + 1})")
        starts = torch.arange(n)[:, None] * seq_len
        w = self.heldout[starts + torch.arange(seq_len + 1)].long()
        return list(w.split(batch))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        a, b = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, member: str, d_model: int, heads: int, head_dim: int, backend: str,
                 op_dtype: torch.dtype):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d_model, eps=1e-5), nn.RMSNorm(d_model, eps=1e-5)
        self.mixer = FamilyMixer(member, d_model, heads, head_dim, backend, op_dtype)
        self.mlp = SwiGLU(d_model, 4 * d_model * 2 // 3)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """Byte embedding, ``layers`` blocks, final RMSNorm, head tied to the embedding."""

    def __init__(self, member: str, d_model: int, layers: int, heads: int, head_dim: int,
                 backend: str = "triton", op_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
        self.blocks = nn.ModuleList(Block(member, d_model, heads, head_dim, backend, op_dtype)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(d_model, eps=1e-5)

    def set_backend(self, backend: str) -> None:
        for b in self.blocks:
            b.mixer.backend = backend
            b.mixer._check_backend()

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.norm(x) @ self.embed.weight.t()

    def loss(self, window):
        """Mean next-byte cross-entropy (nats) of a window batch [B, T+1]."""
        logits = self(window[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), window[:, 1:].reshape(-1))


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int            # 1-based
    loss: float          # training loss of this step's batch, before the update
    tokens_per_s: float  # this step's tokens over its wall time (forward, backward, update)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(model: ByteLM, corpus: Corpus, *, steps: int, batch: int, seq_len: int, seed: int,
          device: torch.device | str, lr: float = 3e-3, warmup: int | None = None,
          clip: float = 1.0):
    """AdamW on ``corpus``'s training split; yields a `StepRecord` per step, and stops after
    the first non-finite loss (which it still yields)."""
    device = torch.device(device)
    warmup = max(1, steps // 10) if warmup is None else warmup
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    for i, window in enumerate(corpus.batches(steps, batch, seq_len, seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, steps, lr, warmup)
        t0 = time.perf_counter()
        loss = model.loss(window.to(device))
        value = loss.item()
        if not math.isfinite(value):   # no update from a non-finite loss: report it and stop
            yield StepRecord(i + 1, value, batch * seq_len / (time.perf_counter() - t0))
            return
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if device.type == "cuda":   # the step's time, not its launch time
            torch.cuda.synchronize(device)
        yield StepRecord(i + 1, value, batch * seq_len / (time.perf_counter() - t0))


@torch.no_grad()
def heldout_loss(model: ByteLM, corpus: Corpus, *, batch: int, seq_len: int,
                 device: torch.device | str, max_windows: int = 64) -> float:
    """Mean next-byte loss (nats) over fixed held-out windows."""
    model.eval()
    windows = corpus.heldout_windows(batch, seq_len, max_windows)
    total = sum(model.loss(w.to(device)).item() * len(w) for w in windows)
    model.train()
    return total / sum(len(w) for w in windows)


def gradient_gap(model: ByteLM, window: torch.Tensor, device: torch.device | str) -> dict[str, float]:
    """Per parameter, ||grad through triton - grad through reference|| / ||grad through
    reference|| of one batch's loss at ``model``'s weights (the absolute difference where the
    reference gradient is 0).  Unlike the gap between two training curves, nothing here is
    compounded by training: it is the op's own difference, seen through the whole model."""
    grads = {}
    for backend in ("triton", "reference"):
        m = copy.deepcopy(model)
        m.set_backend(backend)
        m.train()
        m.loss(window.to(device)).backward()
        grads[backend] = {n: p.grad for n, p in m.named_parameters()}
    out = {}
    for name, ref in grads["reference"].items():
        diff, norm = (grads["triton"][name] - ref).norm().item(), ref.norm().item()
        out[name] = diff / norm if norm > 0 else diff
    return out
