"""Guard overhead, as ratios measured in one run (workloads defined as in the study, so figures compare).

Run: python benchmarks/guard_overhead.py [--steps 2000 --reps 5]
(1) small training loop: Linear(120, 512) -> Sigmoid -> Linear(512, 120), Adam, input (1024, 120),
    MSE to itself, 2000 steps.
(2) big forward: q (8, 32, 1024, 128) fp32 on CPU (the study: (64, 32, 1024, 128) fp16 on a GPU);
    w = (q @ q^T).softmax(-1); o = w @ q; 5 repetitions.
(3) chunk: workload (2) under emulate(index_bits=26), where q @ q^T (output 268M > 2**26, a transposed
    operand: wrong_all) and w @ q (w, 268M elements, wraps) both fault; guard "chunk" against the
    same batch split by hand into the same chunks.
Each condition's time is the fastest of interleaved rounds whose order rotates (the least
disturbed run on a shared machine). The baseline guard is the study's: a
TorchDispatchMode that checks the numel of every input and output of every op.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from mpsimpact.modes.emulator import emulate
from mpsimpact.modes.guard import guard

LIMIT = 2**32


class NumelCheckGuard(TorchDispatchMode):
    """The study's baseline: check every input and output of every op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.numel() > LIMIT:
                raise RuntimeError(f"{func}: input of {leaf.numel()} elements")
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.numel() > LIMIT:
                raise RuntimeError(f"{func}: output of {leaf.numel()} elements")
        return out


CONDITIONS = {
    "off": contextlib.nullcontext,
    "ours_raise": lambda: guard("raise", devices=("cpu",)),
    "ours_strict": lambda: guard("raise", devices=("cpu",), strict=True),
    "baseline": NumelCheckGuard,
}


def training_loop(steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(120, 512), torch.nn.Sigmoid(), torch.nn.Linear(512, 120))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(1024, 120)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x)
        loss.backward()
        optimizer.step()


def big_forward(q: torch.Tensor, reps: int) -> torch.Tensor:
    for _ in range(reps):
        w = (q @ q.transpose(-1, -2)).softmax(-1)  # (8, 32, 1024, 1024)
        o = w @ q
    return o


def big_forward_by_hand(q: torch.Tensor, reps: int, chunks: tuple[int, int]) -> torch.Tensor:
    """Workload (2) with both products split by hand into the chunks the guard chose."""
    flat = q.reshape(-1, *q.shape[2:])  # (256, 1024, 128)
    scores_chunk, out_chunk = chunks
    for _ in range(reps):
        s = flat.new_empty(flat.shape[0], flat.shape[1], flat.shape[1])  # (256, 1024, 1024)
        for start in range(0, flat.shape[0], scores_chunk):
            part = flat[start : start + scores_chunk]
            s[start : start + scores_chunk] = torch.bmm(part, part.transpose(-1, -2))
        w = s.softmax(-1)
        o = torch.empty_like(flat)
        for start in range(0, flat.shape[0], out_chunk):
            o[start : start + out_chunk] = torch.bmm(w[start : start + out_chunk], flat[start : start + out_chunk])
    return o.view_as(q)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ratios(workload, rounds: int) -> dict[str, float]:
    workload()  # warm-up: first-touch page faults and lazy initialisation
    times = {name: [] for name in CONDITIONS}
    names = list(CONDITIONS)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:  # rotate the order
            with CONDITIONS[name]():
                times[name].append(timed(workload))
    best = {name: min(values) for name, values in times.items()}  # least-disturbed run of each
    return {name: best[name] / best["off"] for name in best} | {"off_s": best["off"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    train = ratios(lambda: training_loop(args.steps), args.rounds)
    print(f"(1) training loop {args.steps} steps: off {train['off_s']:.2f}s  ours raise {train['ours_raise']:.3f}x  "
          f"ours strict (dispatch on every op) {train['ours_strict']:.3f}x  baseline {train['baseline']:.3f}x")
    q = torch.randn(8, 32, 1024, 128)
    fwd = ratios(lambda: big_forward(q, args.reps), args.rounds)
    print(f"(2) big forward x{args.reps}: off {fwd['off_s']:.2f}s  ours raise {fwd['ours_raise']:.3f}x  "
          f"ours strict {fwd['ours_strict']:.3f}x  baseline {fwd['baseline']:.3f}x")
    chunked, by_hand = [], []
    big_forward_by_hand(q, 1, (64, 64))  # warm-up
    for _ in range(args.rounds):
        with torch.inference_mode(), emulate(index_bits=26), guard("chunk") as g:
            chunked.append(timed(lambda: big_forward(q, args.reps)))
        chunks = (g.chunk_sizes[0], g.chunk_sizes[1])  # q @ q^T (wrong_all), then w @ q (wrap)
        by_hand.append(timed(lambda: big_forward_by_hand(q, args.reps, chunks)))
    print(f"(3) chunk under emulate(26): guard chunk {statistics.median(chunked):.2f}s  by hand {statistics.median(by_hand):.2f}s  ratio {statistics.median(chunked) / statistics.median(by_hand):.3f} (chunks {chunks} of 256 batches)")


if __name__ == "__main__":
    main()
