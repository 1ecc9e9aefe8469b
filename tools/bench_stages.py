"""Where one case's time goes, stage by stage: kfuzz's path against the bare loop.

    python tools/bench_stages.py [--targets softmax,gdn_fwd] [--device auto] [--cases 1000]
        [--specializations 12] [--seed 0] [--profile N] [--side-by-side S]

For each target it draws ``--cases`` cases from at most ``--specializations`` JIT
specializations (so that warming up compiles few kernels), runs every case once both ways
to warm up, then times each stage over all of them, in this one process, with no worker,
sandbox or pipe in between (so that no stage waits on another process):

- the bare loop (``tools/bench_campaign.py --bare``'s): inputs made on the device, the
  kernel (synchronized), the judge (``execute.judge``);
- kfuzz's process: inputs made on the CPU (``tensors.materialize``), the worker's message
  (``workers.program_message``); then the answer unpacked and the judge's message
  (``judges.judge_message``);
- the kernel's worker: the message unpacked, then ``programs.answer`` (inputs to the device,
  the call under the contract, the inputs' check, the outputs back as bytes);
- a judge: ``judges.judged`` (inputs and outputs to the device, oracle, trusted run, comparison).

Prints a table a target: microseconds a case for each stage, each side's sum, and the bare
loop's over kfuzz's busiest process: the ratio a pipelined campaign at ``--jobs 1`` could reach
if its processes never waited on each other (the GPU they share serializes their work in part).
``--profile N``: also a cProfile of the worker's side over N cases, by cumulative time.
``--side-by-side S``: also the worker's side and the judge's side each in a process of its own
for S seconds, alone and then both at once (as a campaign at ``--jobs 1`` runs them): their
microseconds a case, and how much each slows the other (on one GPU they share its time).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict


def draw(target, n: int, keys_at_most: int, seed: int) -> list:
    """``n`` cases of the random engine from at most ``keys_at_most`` specializations."""
    from kfuzz.engines.random import RandomEngine
    from kfuzz.schedule import specialization
    engine, cases, keys = RandomEngine(target, seed=seed), [], set()
    while len(cases) < n:
        case = engine.next_case()
        key = specialization(target, case)
        if key in keys or len(keys) < keys_at_most:
            keys.add(key)
            cases.append(case)
    return cases


def stages(target, cases: list, device: str, profile: int = 0) -> tuple[dict[str, float], str]:
    """Seconds a case for each stage (``side.stage``), after a warm-up over every case; and the
    worker side's profile text (``profile`` cases) or ''."""
    import torch

    from kfuzz.execute import as_outputs, judge
    from kfuzz.judges import judge_message, judged
    from kfuzz.programs import answer
    from kfuzz.tensors import materialize
    from kfuzz.wire import rebuild, unpack
    from kfuzz.workers import program_message, read_program
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    took: dict[str, float] = defaultdict(float)

    def tick(name: str, since: float) -> float:
        now = time.perf_counter()
        took[name] += now - since
        return now

    def bare(case) -> None:
        t = time.perf_counter()
        inputs = materialize(case, target, device)
        sync()
        t = tick("bare loop.inputs on the device", t)
        outputs = as_outputs(target.kernel(**inputs), target)
        sync()
        t = tick("bare loop.kernel", t)
        judge(case, target, inputs, outputs, device)
        sync()
        tick("bare loop.judge", t)

    def kfuzz_path(case, worker_side=None) -> None:
        t = time.perf_counter()
        inputs = materialize(case, target, "cpu")
        t = tick("kfuzz's process.inputs on the CPU", t)
        msg = program_message(case, "call", {}, {"case": inputs})
        t = tick("kfuzz's process.worker's message", t)
        header, storages = unpack(msg)
        told, name, params, layouts = read_program(header)
        t = tick("worker.message unpacked", t)
        reply, _ = (worker_side or answer)(target, told, name, params, layouts, storages, device, None)
        t = tick("worker.answer (programs.answer)", t)
        (_, back, _, _, _, _), storages = unpack(reply)
        outputs = {arg: rebuild(st, geo) for (_, arg, geo), st in zip(back, storages)}
        t = tick("kfuzz's process.answer unpacked", t)
        msg = judge_message(case, inputs, outputs)
        t = tick("kfuzz's process.judge's message", t)
        judged(msg, target, device)
        sync()
        tick("judge.judged", t)

    for case in cases:
        bare(case)
        kfuzz_path(case)
    took.clear()
    for case in cases:
        bare(case)
    for case in cases:
        kfuzz_path(case)
    per_case = {k: v / len(cases) for k, v in took.items()}
    text = ""
    if profile:
        profiler = cProfile.Profile()

        def profiled(*args):
            profiler.enable()
            try:
                return answer(*args)
            finally:
                profiler.disable()
        for case in cases[:profile]:
            kfuzz_path(case, profiled)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
        text = out.getvalue()
    return per_case, text


def _side(name: str, side: str, device: str, n: int, keys_at_most: int, seed: int, seconds: float,
          ready, go, out) -> None:
    """One side (``worker``: the message unpacked and ``programs.answer``; ``judge``: ``judges.
    judged``) looped over ``n`` cases for ``seconds`` once ``go`` is set; microseconds a case to ``out``."""
    import torch

    from kfuzz.execute import as_outputs
    from kfuzz.judges import judge_message, judged
    from kfuzz.programs import answer
    from kfuzz.target import get_target
    from kfuzz.tensors import materialize
    from kfuzz.wire import unpack
    from kfuzz.workers import program_message, read_program
    target = get_target(name)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    messages = []
    for case in draw(target, n, keys_at_most, seed):
        inputs = materialize(case, target, "cpu")
        if side == "worker":
            messages.append(program_message(case, "call", {}, {"case": inputs}))
        else:
            outputs = as_outputs(target.kernel(**{k: v.to(device) for k, v in inputs.items()}), target)
            messages.append(judge_message(case, inputs, {k: v.cpu() for k, v in outputs.items()}))

    def once(msg) -> None:
        if side == "worker":
            header, storages = unpack(msg)
            case, program, params, layouts = read_program(header)
            answer(target, case, program, params, layouts, storages, device, None)
        else:
            judged(msg, target, device)
        sync()
    for msg in messages:      # warm: compiles
        once(msg)
    ready.set()
    go.wait()
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for msg in messages:
            once(msg)
            done += 1
    out.put((side, 1e6 * (time.perf_counter() - start) / done))


def side_by_side(name: str, device: str, n: int, keys_at_most: int, seed: int, seconds: float) -> str:
    """The worker's and the judge's sides alone, then at once, each in a spawned process."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")

    def run(sides: tuple[str, ...]) -> dict[str, float]:
        out, go = ctx.Queue(), ctx.Event()
        ready = [ctx.Event() for _ in sides]
        procs = [ctx.Process(target=_side, args=(name, side, device, n, keys_at_most, seed, seconds, r, go, out))
                 for side, r in zip(sides, ready)]
        for p in procs:
            p.start()
        for r in ready:
            r.wait()
        go.set()
        got = dict(out.get() for _ in procs)
        for p in procs:
            p.join()
        return got
    alone = {**run(("worker",)), **run(("judge",))}
    together = run(("worker", "judge"))
    rows = [f"#### {name} on {device}: the worker's and the judge's sides, {seconds:g} s each", "",
            "| side | alone, us a case | side by side, us a case | slowdown |", "| --- | --- | --- | --- |"]
    rows += [f"| {side} | {alone[side]:.1f} | {together[side]:.1f} | {together[side] / alone[side]:.2f} |"
             for side in ("worker", "judge")]
    return "\n".join(rows + [""])


def table(name: str, device: str, n: int, per_case: dict[str, float]) -> str:
    sides = defaultdict(float)
    for k, v in per_case.items():
        sides[k.split(".")[0]] += v
    rows = [f"### {name} on {device}: {n} cases, microseconds a case", "",
            "| side | stage | us |", "| --- | --- | --- |"]
    rows += [f"| {k.split('.')[0]} | {k.split('.', 1)[1]} | {1e6 * v:.1f} |" for k, v in per_case.items()]
    rows += [f"| {side} | all | {1e6 * v:.1f} |" for side, v in sides.items()]
    busiest = max(v for side, v in sides.items() if side != "bare loop")
    rows += ["", f"bare loop / kfuzz's busiest process: {sides['bare loop'] / busiest:.2f}", ""]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="softmax")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--specializations", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, help="cases of the worker's side to profile")
    ap.add_argument("--side-by-side", type=float, default=0, help="seconds for each side alone and together")
    args = ap.parse_args()
    from kfuzz.devices import resolve_device
    from kfuzz.target import get_target
    device = resolve_device(args.device)
    for name in args.targets.split(","):
        target = get_target(name)
        per_case, text = stages(target, draw(target, args.cases, args.specializations, args.seed), device,
                                args.profile)
        print(table(name, device, args.cases, per_case))
        if text:
            print(text)
        if args.side_by_side:
            print(side_by_side(name, device, args.cases, args.specializations, args.seed, args.side_by_side))


if __name__ == "__main__":
    main()
