"""Guard cost on latency-bound inference, as ratios measured in one run: the embedded classifier
(all-MiniLM-L6-v2 + head) on B texts x L tokens, plain vs guard "raise" (entry points, the default)
vs guard "raise" strict (the dispatch mode on every op: the route before issue 17) vs strict's floor (a
dispatch mode that only runs each op, with torch's Dynamo wrapper around it, and without it: Note [Dynamo
kept out at no cost] in src/mpsimpact/modes/base.py); with --resident GIB, a tensor of that many GiB (fp16,
below 2**31 elements: a model's weights) is held on the device throughout, so a gated strict guard (MPS,
CUDA: Note [Strict, gated]) watches every op from its entry (issue 61); with
--function-mode also the design the entry points were weighed against (issue 31): a TorchFunctionMode
that hands the same calls to the same guard, seeing them without replacing torch's callables, but
running Python on every torch call (about 220 a forward here, against 50 entry-point calls).

Run: python benchmarks/guard_latency.py [--device cpu --threads 1 --shapes 1x16 --reps 30]
     python benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30
     python benchmarks/guard_latency.py --device cuda --shapes 8x128 --reps 60 --resident 3
Each condition's figure is the median of `reps` interleaved repetitions (order rotating), after
warm-up. On CUDA every repetition synchronises before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mpsimpact.models.classifier import load_embedded_classifier
from mpsimpact.modes.entrypoint import ENTRY_POINTS
from mpsimpact.modes.guard import guard
from mpsimpact.modes.guard_mode import GuardMode


class EntryFunctionMode(TorchFunctionMode):
    """The alternative to the entry-point wrappers: the guard's `on_entry` for the same callables, found
    by identity in a TorchFunctionMode (nothing replaced; every torch call comes through here)."""

    NAMES = {getattr(owner, attribute): name for name, places in ENTRY_POINTS.items() for owner, attribute in places}

    def __init__(self, device: str) -> None:
        super().__init__()
        self.guard = GuardMode("raise", devices=(device,))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = self.NAMES.get(func)
        if name is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return self.guard.on_entry(name, func, args, kwargs or {})


class NoopDispatchMode(TorchDispatchMode):
    """strict's floor: a dispatch mode that only runs each op (what any Python dispatch mode costs)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class BareDispatchMode(TorchDispatchMode):
    """The floor without the torch._dynamo.disable wrapper torch puts around every mode's handler (the guard's
    and the emulator's mode keep Dynamo out themselves, at no cost where nothing compiled runs)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def conditions(device: str, function_mode: bool) -> dict[str, object]:
    conds = {
        "off": contextlib.nullcontext,
        "raise": lambda: guard("raise", devices=(device,)),
        "raise_strict": lambda: guard("raise", devices=(device,), strict=True),
        "dispatch_floor": NoopDispatchMode,
        "bare_floor": BareDispatchMode,
    }
    if function_mode:
        conds["function_mode"] = lambda: EntryFunctionMode(device)
    return conds


def measure(module, ids, mask, device: str, reps: int, function_mode: bool = False) -> dict[str, float]:
    conds = conditions(device, function_mode)
    names = list(conds)
    times: dict[str, list[float]] = {name: [] for name in names}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(5):
            module(ids, mask)
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                with conds[name]():
                    sync()
                    start = time.perf_counter()
                    module(ids, mask)
                    sync()
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def micro(device: str, n: int = 20000) -> str:
    """The guard's two costs apart: entering and leaving `guard("raise")` (the wrappers go in place and
    away), and one small F.linear call answered by the fast path, beside the plain call (us each)."""
    import timeit

    x, w = torch.randn(8, 16, device=device), torch.randn(16, 16, device=device)

    def enter() -> None:
        with guard("raise", devices=(device,)):
            pass

    linear = torch.nn.functional.linear
    enter()
    entering = min(timeit.repeat(enter, number=n // 10, repeat=5)) / (n // 10) * 1e6
    plain = min(timeit.repeat(lambda: linear(x, w), number=n, repeat=5)) / n * 1e6
    with guard("raise", devices=(device,)):
        guarded = min(timeit.repeat(lambda: torch.nn.functional.linear(x, w), number=n, repeat=5)) / n * 1e6
    if device == "cuda":
        torch.cuda.synchronize()
    return (f"entering and leaving guard('raise'): {entering:.1f} us; F.linear (8 x 16 @ 16 x 16): plain "
            f"{plain:.2f} us, guarded {guarded:.2f} us (+{guarded - plain:.2f} us a call; launch only on CUDA)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default="1x16")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--function-mode", action="store_true", help="also time the TorchFunctionMode design")
    parser.add_argument("--micro", action="store_true", help="also time entering a guard and one guarded call")
    parser.add_argument("--resident", type=float, default=0.0,
                        help="GiB of fp16 held on the device throughout (a model's weights), default none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_embedded_classifier()
    module = model.module.to(args.device)
    resident = torch.empty(int(args.resident * 2**30) // 2, dtype=torch.float16, device=args.device)  # noqa: F841
    held = f", {resident.numel() * 2 / 2**30:g} GiB resident (fp16)" if args.resident else ""
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads{held}")
    if args.micro:
        print(micro(args.device))
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        ids = torch.randint(1000, 20000, (batch, length), device=args.device)
        mask = torch.ones_like(ids)
        med = measure(module, ids, mask, args.device, args.reps, args.function_mode)
        extra = (f"; function mode {med['function_mode'] * 1e3:.2f} ms ({med['function_mode'] / med['off']:.3f}x)"
                 if args.function_mode else "")
        print(f"{batch} x {length}: off {med['off'] * 1e3:.2f} ms; guard raise {med['raise'] * 1e3:.2f} ms "
              f"({med['raise'] / med['off']:.3f}x); strict (dispatch on every op) {med['raise_strict'] * 1e3:.2f} ms "
              f"({med['raise_strict'] / med['off']:.3f}x); a dispatch mode that only runs each op "
              f"{med['dispatch_floor'] * 1e3:.2f} ms ({med['dispatch_floor'] / med['off']:.3f}x), without Dynamo's "
              f"wrapper {med['bare_floor'] * 1e3:.2f} ms ({med['bare_floor'] / med['off']:.3f}x){extra}")


if __name__ == "__main__":
    main()
