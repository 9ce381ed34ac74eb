"""Sizing the demo to the machine people bring: how much memory a Mac lends the GPU, and per dtype
the smallest run that shows the effect clearly and fits, or why none does."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from mpsimpact.blocked_attention import NAME as BLOCKED, REASON
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.prediction import memory
from mpsimpact.errors import UsageError
from mpsimpact.prediction.outcome import predict
from mpsimpact.prediction.memory import estimate_peak_bytes, in_gib
from mpsimpact.prediction.safe_size import largest_safe_batch, plan_at
from mpsimpact.config import GIB

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEMO_LENGTHS = (512, 384, 256, 128)
MAC_SIZES_GB = (16, 24, 32, 48, 64, 96, 128, 192)
# Metal lends a process about two thirds of unified memory (torch.mps.recommended_max_memory():
# about 21 GiB of a 32 GB Mac, 43 GiB of 64 GB); `--memory auto` asks the machine instead.
RECOMMENDED_SHARE = 2 / 3
# The estimate ran 2.6 % to 2.9 % below measured peaks on an H200 (benchmarks/README.md): keep a margin.
HEADROOM = 1.05
# "Clearly": at least this many texts corrupted, and at least this share of the batch.
MIN_VISIBLE_TEXTS, MIN_VISIBLE_SHARE = 64, 0.05
# blocked_eager is the demo for a Mac whose memory binds: each text past the first corrupted one adds 7 MiB
# at 512 tokens in half precision (6 of them P's), so it shows the fewest texts that still make a run of
# wrong outputs in the by-position figure. At 1398 x 512 the forward peaks near 9.8 GiB (P alone 8.2).
BLOCKED_VISIBLE_TEXTS = 32


def usable_bytes(memory: str) -> tuple[int, str]:
    """(bytes the GPU may use, how that was worked out) for "32GB" (a Mac's unified memory) or "auto"."""
    if memory == "auto":
        import torch

        if not torch.backends.mps.is_available():
            raise UsageError("--memory auto reads torch.mps.recommended_max_memory() and needs a Mac with "
                             "MPS; give a size such as 32GB.")
        value = int(torch.mps.recommended_max_memory())
        return value, f"{value / GIB:.1f} GiB (torch.mps.recommended_max_memory() on this Mac)"
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|G|GIB)?\s*", memory.upper())
    if not match or float(match[1]) <= 0:
        raise UsageError(f"--memory must be a size such as 32GB, or auto; got '{memory}'.")
    value = int(float(match[1]) * GIB * RECOMMENDED_SHARE)  # Apple's "32 GB" of unified memory is 32 GiB
    return value, (f"{value / GIB:.1f} GiB (about 2/3 of {float(match[1]):g} GB unified memory, "
                   "Metal's recommended maximum)")


def visible_batch(first_corrupted: int, texts: int = MIN_VISIBLE_TEXTS, share: float = MIN_VISIBLE_SHARE) -> int:
    """The smallest batch that corrupts at least `texts` texts, and `share` of the batch, past the first
    corrupted one."""
    return first_corrupted + max(texts, math.ceil(share * first_corrupted / (1 - share)))


def demo_options(traced: dict[int, list], config: Any, heads: int, safe: dict[int, int],
                 index_bits: int = MPS_INDEX_BITS, profile: Any = None,
                 dtypes: tuple[str, ...] = tuple(DTYPE_BYTES)) -> list[dict[str, Any]]:
    """Per dtype and length: the smallest clearly-visible run of eager attention under `profile`'s rules,
    its predicted corruption and peak."""
    options = []
    for length in (L for L in DEMO_LENGTHS if L in traced):
        batch = visible_batch(safe[length] + 1) if safe[length] else None
        if batch is None:
            continue
        prediction = predict(plan_at(traced[length], batch, index_bits, profile), batch, heads)
        options += _options(prediction, config, batch, length, "eager", dtypes)
    return options


def product_safe_batch(calls: list, heads: int, index_bits: int = MPS_INDEX_BITS, profile: Any = None) -> int:
    """The largest batch whose P V call (eager's forward bmm with the largest first operand per batch: P,
    (B*H, L, Lk)) is clean on its own; the rest of a blocked_eager pass runs in small blocks."""
    products = [p for p in calls if p.call.family == "bmm" and p.call.phase == "forward"]
    if not products:
        return 0
    return largest_safe_batch([max(products, key=lambda p: p.call.a.per_batch)], heads, index_bits,
                              profile=profile)


def blocked_options(trace: Callable[[int, int], Any], traced: dict[int, list], config: Any, heads: int,
                    index_bits: int = MPS_INDEX_BITS, profile: Any = None,
                    dtypes: tuple[str, ...] = tuple(DTYPE_BYTES)) -> list[dict[str, Any]]:
    """blocked_eager's smallest clearly-visible run per dtype, at the longest demo length (where P leaves
    the least room to the rest), predicted from a trace of its own calls: `trace(batch, length)`."""
    length = next((L for L in DEMO_LENGTHS if L in traced), None)
    safe = product_safe_batch(traced[length], heads, index_bits, profile) if length else 0
    if not safe:
        return []
    batch = visible_batch(safe + 1, BLOCKED_VISIBLE_TEXTS, share=0)
    return _options(predict(trace(batch, length), batch, heads), config, batch, length, BLOCKED, dtypes)


def _options(prediction: Any, config: Any, batch: int, length: int, attention: str,
             dtypes: tuple[str, ...]) -> list[dict[str, Any]]:
    if prediction.outcome != "wrong":
        return []  # a run that stops (or aborts) shows an error, not the silent effect
    return [{"attention": attention, "dtype": dtype, "max_length": length, "batch_size": batch,
             "first_corrupted_text": prediction.first_corrupted_text,
             "corrupted_count": prediction.corrupted_count, "outcome": prediction.describe(),
             "estimated_peak_gib": in_gib(estimate_peak_bytes(config, batch, length, DTYPE_BYTES[dtype],
                                                              attention))}
            for dtype in dtypes]


def largest_pass_batch(config: Any, length: int, dtype: str, budget: int, attention: str = "eager") -> int:
    """The largest batch at `length` whose device pass (its estimated peak, with headroom) fits in `budget`
    bytes (0: none); memory.largest_fitting_batch searches it."""
    def estimate(batch: int) -> float:
        return estimate_peak_bytes(config, batch, length, DTYPE_BYTES[dtype], attention) * HEADROOM

    return int(memory.largest_fitting_batch(estimate, budget))


def recommend(options: list[dict[str, Any]], budget: int, scenario: str) -> dict[str, Any]:
    """The run to type: eager attention before blocked_eager (the model as it is), then the longest length
    that fits, float32 first, then half precision."""
    for option in options:
        option["fits"] = option["estimated_peak_gib"] * GIB * HEADROOM <= budget
    fitting = [o for o in options if o["fits"]]
    if not options:
        return {"command": None, "why": (
            "No run shows the silent effect: at every demo length the first batch past the largest safe one "
            "stops the run (an error or a process abort) instead of returning wrong values; the prediction "
            "says where.")}
    if not fitting:
        demo = min(options, key=lambda o: o["estimated_peak_gib"])
        return {"command": None, "why": (
            f"No run shows the effect in {budget / GIB:.1f} GiB: the faulting batch's P alone is "
            f"2^{MPS_INDEX_BITS} elements ({2**MPS_INDEX_BITS * 2 / GIB:.0f} GiB in half precision, "
            f"{2**MPS_INDEX_BITS * 4 / GIB:.0f} GiB in float32) at any length; the smallest demo "
            f"({demo['batch_size']} x {demo['max_length']}, {demo['dtype']}, {demo['attention']} attention) "
            f"needs about {demo['estimated_peak_gib']} GiB. Use a Mac with more memory, or emulate on a CPU "
            "or CUDA machine.")}
    best = min(fitting, key=lambda o: (o["attention"] != "eager", -o["max_length"],
                                       list(DTYPE_BYTES).index(o["dtype"])))
    command = f"mpsimpact run {scenario} --batch-size {best['batch_size']} --max-length {best['max_length']}"
    command += f" --dtype {best['dtype']}" if best["dtype"] != "float32" else ""
    command += f" --attention {best['attention']}" if best["attention"] != "eager" else ""
    how = f" with {BLOCKED} attention ({REASON})" if best["attention"] == BLOCKED else ""
    return {"command": command, "option": best, "why": (
        f"{best['batch_size']} x {best['max_length']} in {best['dtype']}{how}: about "
        f"{best['estimated_peak_gib']} GiB of {budget / GIB:.1f}; {best['outcome']}.")}


def mac_table(config: Any, first_corrupted: int, length: int = 512, blocked_first: int | None = None,
              dtypes: tuple[str, ...] = tuple(DTYPE_BYTES)) -> list[dict[str, Any]]:
    """Per Mac memory size: the largest batch at `length` that fits and the texts it corrupts, per dtype, and
    under "blocked_eager" the same with that attention (whose first corrupted text is `blocked_first`)."""
    def cells(attention: str, first: int, budget: int) -> dict[str, dict[str, int]]:
        batches = {dtype: largest_pass_batch(config, length, dtype, budget, attention) for dtype in dtypes}
        return {dtype: {"largest_batch": batch, "corrupted_texts": max(0, batch - first)}
                for dtype, batch in batches.items()}

    rows = []
    for gb in MAC_SIZES_GB:
        budget = int(gb * GIB * RECOMMENDED_SHARE)
        row: dict[str, Any] = {"mac_gb": gb, "usable_gib": in_gib(budget),
                               **cells("eager", first_corrupted, budget)}
        if blocked_first is not None:
            row[BLOCKED] = cells(BLOCKED, blocked_first, budget)
        rows.append(row)
    return rows
