"""Train a small byte-level LM for each GDN family member, through our Triton op and
through the float32 chunked reference, with the same seed and the same data order.

    python tools/train_family.py [--out reports/training/cpu] [--members gated_deltanet,deltanet,kda,mamba2,gla]
        [--steps N] [--seq-len T] [--batch B] [--d-model D] [--layers L] [--heads H]
        [--head-dim K] [--device cuda|cpu] [--seed S] [--op-dtype float32|bfloat16]
        [--lr LR] [--data-bytes N] [--heldout-windows N]

Writes under DIR, after every member (so a run cut short keeps what it finished):
``losses.csv`` (member, backend, step, loss, tokens_per_s), ``curves.png`` (every
member's two curves and the gap between them), ``summary.md`` (the table below, the
configuration and the versions).  Prints the summary table.  Exit 0 when every loss of
every run is finite; 1 when any is NaN/Inf (that run stops there and the table says so)
or a run raised (the other runs still go on); 2 on bad arguments.

Both backends get the same initial weights (one model, copied), the same batches, and
the same op inputs (cast to ``--op-dtype``; default bfloat16 on CUDA, float32 on the
CPU, where the kernels run under the Triton interpreter).  The gap between the curves
is therefore the op's own difference, compounded through training.
"""
from __future__ import annotations

import argparse
import copy
import csv
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MEMBER_NAMES = ("gated_deltanet", "deltanet", "kda", "mamba2", "gla")
BACKENDS = ("triton", "reference")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Run:
    member: str
    backend: str
    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    heldout: float = float("nan")
    wall_s: float = 0.0
    grad_gap: tuple[str, float] | None = None   # (parameter, relative gap), see gradient_gap
    error: str | None = None   # an exception that ended the run (the other runs still go on)

    @property
    def nonfinite(self) -> bool:
        return any(not (x == x and abs(x) != float("inf")) for x in self.losses)

    @property
    def failed(self) -> bool:
        return self.nonfinite or self.error is not None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", default=",".join(MEMBER_NAMES),
                   help="comma-separated, from: " + ", ".join(MEMBER_NAMES))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--op-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the op's q, k, v, beta (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-bytes", type=int, default=16 << 20,
                   help="bytes of standard-library source to read (5%% of them held out)")
    p.add_argument("--heldout-windows", type=int, default=64,
                   help="held-out windows of --seq-len bytes evaluated after training")
    p.add_argument("--out", default=Path("reports/training/cpu"), type=Path)
    a = p.parse_args(argv)
    a.members = [m.strip() for m in a.members.split(",") if m.strip()]
    bad = [m for m in a.members if m not in MEMBER_NAMES]
    if bad or not a.members:
        p.error(f"--members: unknown {bad or 'empty list'}; choose from {', '.join(MEMBER_NAMES)}")
    for name in ("steps", "seq_len", "batch", "d_model", "layers", "heads", "data_bytes",
                 "heldout_windows"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 16 <= a.head_dim <= 256:
        p.error("--head-dim must be in [16, 256] (the op's K and V)")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device here")
    a.op_dtype = DTYPES[a.op_dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")]
    return a


def final_loss(run: Run) -> float:
    """Mean training loss over the last tenth of the steps (one batch is noisy)."""
    tail = run.losses[-max(1, len(run.losses) // 10):]
    return sum(tail) / len(tail) if tail else float("nan")


def steady_tokens_per_s(run: Run) -> float:
    """Median over the steps after the first (which pays the Triton compile)."""
    xs = run.tokens_per_s[1:] or run.tokens_per_s
    return statistics.median(xs) if xs else float("nan")


def max_gap(a: Run, b: Run) -> tuple[float, int]:
    """Largest |loss_a - loss_b| over the steps both have, and its step (NaN counts as inf)."""
    best, at = 0.0, 0
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        d = abs(x - y)
        d = float("inf") if d != d else d
        if d > best:
            best, at = d, i + 1
    return best, at


def summary_rows(runs: dict[tuple[str, str], Run], members) -> list[dict]:
    rows = []
    for m in members:
        t, r = runs.get((m, "triton")), runs.get((m, "reference"))
        if t is None or r is None:
            continue
        gap, at = max_gap(t, r)
        nan = [f"{x.backend} at step {len(x.losses)}" for x in (t, r) if x.nonfinite]
        nan += [f"{x.backend} raised {x.error}" for x in (t, r) if x.error]
        rows.append({
            "member": m, "final_triton": final_loss(t), "final_reference": final_loss(r),
            "heldout_triton": t.heldout, "heldout_reference": r.heldout,
            "max_gap": gap, "max_gap_step": at or "-",
            "grad_gap": f"{r.grad_gap[1]:.1e} ({r.grad_gap[0]})" if r.grad_gap else "-",
            "tok_s_triton": steady_tokens_per_s(t), "tok_s_reference": steady_tokens_per_s(r),
            "wall_triton": t.wall_s, "wall_reference": r.wall_s,
            "nan": ", ".join(nan) if nan else "none",
        })
    return rows


COLUMNS = [("member", "member", "{}"), ("final_triton", "final loss (triton)", "{:.4f}"),
           ("final_reference", "final loss (reference)", "{:.4f}"),
           ("heldout_triton", "held-out (triton)", "{:.4f}"),
           ("heldout_reference", "held-out (reference)", "{:.4f}"),
           ("max_gap", "max abs gap", "{:.2e}"), ("max_gap_step", "at step", "{}"),
           ("grad_gap", "grad rel gap at end", "{}"),
           ("tok_s_triton", "tokens/s (triton)", "{:,.0f}"),
           ("tok_s_reference", "tokens/s (reference)", "{:,.0f}"),
           ("wall_triton", "wall s (triton)", "{:.1f}"),
           ("wall_reference", "wall s (reference)", "{:.1f}"), ("nan", "NaN/Inf or error", "{}")]


def markdown(rows, args, env: dict, corpus_sizes) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "|".join(" --- " for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(f.format(r[k]) for k, _, f in COLUMNS) + " |" for r in rows]
    cfg = (f"steps {args.steps}, batch {args.batch} x seq {args.seq_len} bytes, d_model "
           f"{args.d_model}, {args.layers} layer{'s' * (args.layers != 1)}, {args.heads} heads x {args.head_dim}, op dtype "
           f"{str(args.op_dtype).removeprefix('torch.')}, lr {args.lr}, seed {args.seed}, "
           f"device {env['device']}")
    return "\n".join([
        "# GDN family training: Triton op vs float32 chunked reference", "",
        f"Configuration: {cfg}.", "",
        f"Text: Python {platform.python_version()} standard-library source, "
        f"{corpus_sizes[0]:,} training bytes, {corpus_sizes[1]:,} held-out bytes.", "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "device") + ".", "",
        "Final loss: mean training loss over the last tenth of the steps. Held-out: mean loss "
        f"over the first {args.heldout_windows} held-out windows after training. Max abs gap: "
        "largest |triton - reference| training loss at one step (same batch). Grad rel gap at end: the largest relative "
        "difference of one parameter's gradient, triton vs reference, at the reference run's "
        "final weights on a held-out batch (not compounded by training). Tokens/s: median "
        "over steps 2..N.", "",
        head, sep, *body, ""])


def plot(runs, members, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, m in zip(axes.flat, members):
        for backend, style in (("triton", "-"), ("reference", "--")):
            run = runs.get((m, backend))
            if run:
                ax.plot(range(1, len(run.losses) + 1), run.losses, style, lw=1, label=backend)
        ax.set_title(m)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/byte)")
        if ax.lines:
            ax.legend()
    gap_ax = axes.flat[5]
    for m in members:
        t, r = runs.get((m, "triton")), runs.get((m, "reference"))
        if t and r:
            gaps = [max(abs(x - y), 1e-9) for x, y in zip(t.losses, r.losses)]
            gap_ax.semilogy(range(1, len(gaps) + 1), gaps, lw=1, label=m)
    gap_ax.set_title("|triton - reference| per step (0 drawn at 1e-9)")
    gap_ax.set_xlabel("step")
    if gap_ax.lines:
        gap_ax.legend()
    for ax in list(axes.flat)[len(members):5]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions(device: str) -> dict:
    import triton
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu"
    interp = " (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return {"device": name + interp, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}


def train_one(model, run: Run, corpus, args, log, progress) -> None:
    """One member through one backend: the steps (logged as they come), then the held-out loss."""
    from gdn.lm import heldout_loss, train
    t0 = time.perf_counter()
    for rec in train(model, corpus, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                     seed=args.seed, device=args.device, lr=args.lr):
        run.losses.append(rec.loss)
        run.tokens_per_s.append(rec.tokens_per_s)
        log.writerow([run.member, run.backend, rec.step, repr(rec.loss), f"{rec.tokens_per_s:.1f}"])
        progress(rec.step, rec.loss)
    run.wall_s = time.perf_counter() - t0
    if not run.nonfinite:
        run.heldout = heldout_loss(model, corpus, batch=args.batch, seq_len=args.seq_len,
                                   device=args.device, max_windows=args.heldout_windows)


def worst_gradient_gap(model, corpus, args) -> tuple[str, float]:
    """(parameter, relative gap) of the parameter whose gradient differs most between the
    backends, at ``model``'s weights, on the first held-out batch."""
    from gdn.lm import gradient_gap
    window = corpus.heldout_windows(args.batch, args.seq_len, args.batch)[0]
    return max(gradient_gap(model, window, args.device).items(), key=lambda kv: kv[1])


def guarded(run: Run, console, what: str, fn) -> None:
    """Run ``fn``; an exception becomes the run's error (shown, then the other runs go on:
    one member's failure must not hide the others' results)."""
    try:
        fn()
    except Exception as e:
        run.error = f"{what}: {type(e).__name__}: {e}".splitlines()[0]
        console.print_exception()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":   # must precede the first import of the kernels (triton.jit reads it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # cuDNN may pick a nondeterministic convolution backward (the short convolutions): noise
    # in both curves that is not the op's
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from gdn.lm import ByteLM, Corpus, stdlib_bytes

    console = Console(stderr=True)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = Corpus.from_bytes(stdlib_bytes(args.data_bytes))
    try:   # a machine without the standard library's sources fails here, not in every run
        next(corpus.batches(1, args.batch, args.seq_len, args.seed))
        corpus.heldout_windows(args.batch, args.seq_len, args.heldout_windows)
    except ValueError as e:
        console.print(f"[red]error:[/red] standard-library text: {e}")
        return 2
    env = versions(args.device)
    runs: dict[tuple[str, str], Run] = {}
    csv_path = args.out / "losses.csv"
    with open(csv_path, "w", newline="") as f, Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=console) as bar:
        log = csv.writer(f)
        log.writerow(["member", "backend", "step", "loss", "tokens_per_s"])
        for m in args.members:
            torch.manual_seed(args.seed)
            model0 = ByteLM(m, args.d_model, args.layers, args.heads, args.head_dim,
                            op_dtype=args.op_dtype).to(args.device)
            for backend in BACKENDS:
                model = copy.deepcopy(model0)
                model.set_backend(backend)
                run = runs[(m, backend)] = Run(m, backend)
                task = bar.add_task(f"{m:>15} {backend:>9}", total=args.steps, loss="-")

                def progress(step, loss, task=task):
                    bar.update(task, completed=step, loss=f"{loss:.4f}")
                guarded(run, console, "training",
                        lambda: train_one(model, run, corpus, args, log, progress))
                f.flush()
                if backend == "reference" and not run.failed and not runs[(m, "triton")].failed:
                    guarded(run, console, "gradient check",
                            lambda: setattr(run, "grad_gap", worst_gradient_gap(model, corpus, args)))
                bar.console.log(f"{m} {backend}: {len(run.losses)} steps, final {final_loss(run):.4f}, "
                                f"held-out {run.heldout:.4f}, {steady_tokens_per_s(run):,.0f} tok/s, "
                                f"{run.wall_s:.1f} s" + (" [red]NaN/Inf loss[/red]" if run.nonfinite else "")
                                + (f" [red]{run.error}[/red]" if run.error else ""))
            table = markdown(summary_rows(runs, args.members), args, env,
                             (len(corpus.train), len(corpus.heldout)))
            (args.out / "summary.md").write_text(table)
            plot(runs, args.members, args.out / "curves.png")
    print(table)
    failed = [f"{r.member}/{r.backend}" for r in runs.values() if r.failed]
    if failed:
        console.print(f"[red]FAIL: non-finite loss or error in {', '.join(failed)}[/red]")
        return 1
    console.print(f"all {len(runs)} runs finite; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
