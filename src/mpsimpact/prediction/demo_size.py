"""Sizing the demo to the machine people bring: how much memory a Mac lends the GPU, and per dtype
the smallest run that shows the effect clearly and fits, or why none does."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mpsimpact.blocked_attention import NAME as BLOCKED, REASON
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.engine.mac_memory import MEASURED, MacMemory, call_bytes, smallest_showing
from mpsimpact.prediction.outcome import predict
from mpsimpact.prediction.memory import estimate_peak_bytes, in_gib, largest_fitting_batch
from mpsimpact.prediction.safe_size import largest_safe_batch, plan_at
from mpsimpact.config import GIB

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEMO_LENGTHS = (512, 384, 256, 128)
# The Macs of the README's table (engine.mac_memory: Metal lends a process about two thirds of unified
# memory, and allocates one buffer of at most about half; `--memory auto` asks the machine instead).
MAC_SIZES_GB = (16, 24, 32, 48, 64, 96, 128, 192)
# The estimate ran 2.6 % to 2.9 % below measured peaks on an H200 (benchmarks/README.md): keep a margin.
HEADROOM = 1.05
# "Clearly": at least this many texts corrupted, and at least this share of the batch.
MIN_VISIBLE_TEXTS, MIN_VISIBLE_SHARE = 64, 0.05
# blocked_eager is the demo for a Mac whose memory binds: each text past the first corrupted one adds 7 MiB
# at 512 tokens in half precision (6 of them P's), so it shows the fewest texts that still make a run of
# wrong outputs in the by-position figure. At 1398 x 512 the forward peaks near 9.8 GiB (P alone 8.2).
BLOCKED_VISIBLE_TEXTS = 32


def working_set_words(mac: MacMemory) -> str:
    """How much the GPU may use on `mac`, and how that was worked out."""
    if mac.unified_gb is not None and mac.basis != MEASURED and mac.working_set == MacMemory.of_size(
            mac.unified_gb).working_set:
        return (f"{mac.working_set / GIB:.1f} GiB (about 2/3 of {mac.unified_gb:g} GB unified memory, "
                "Metal's recommended maximum)")
    return f"{mac.working_set / GIB:.1f} GiB (torch.mps.recommended_max_memory() on this Mac)"


def largest_tensor_bytes(plan: Any, dtype: str) -> int:
    """The largest single tensor of a traced plan's calls, in bytes, were its floating tensors in `dtype` (the
    plans are traced in float32): what must fit under a Mac's largest buffer."""
    return max((call_bytes(c, DTYPE_BYTES[dtype]) for c in plan.calls), default=0)


def visible_batch(first_corrupted: int, texts: int = MIN_VISIBLE_TEXTS, share: float = MIN_VISIBLE_SHARE) -> int:
    """The smallest batch that corrupts at least `texts` texts, and `share` of the batch, past the first
    corrupted one."""
    return first_corrupted + max(texts, math.ceil(share * first_corrupted / (1 - share)))


def demo_options(traced: dict[int, list], config: Any, heads: int, safe: dict[int, int], index_bits: int,
                 profile: Any, dtypes: tuple[str, ...] = tuple(DTYPE_BYTES)) -> list[dict[str, Any]]:
    """Per dtype and length: the smallest clearly-visible run of eager attention under `profile`'s rules,
    its predicted corruption and peak."""
    options = []
    for length in (L for L in DEMO_LENGTHS if L in traced):
        batch = visible_batch(safe[length] + 1) if safe[length] else None
        if batch is None:
            continue
        plan = plan_at(traced[length], batch, index_bits, profile)
        options += _options(predict(plan, batch, heads), plan, config, batch, length, "eager", dtypes)
    return options


def product_safe_batch(calls: list, heads: int, index_bits: int, profile: Any) -> int:
    """The largest batch whose P V call (eager's forward bmm with the largest first operand per batch: P,
    (B*H, L, Lk)) is clean on its own; the rest of a blocked_eager pass runs in small blocks."""
    products = [p for p in calls if p.call.family == "bmm" and p.call.phase == "forward"]
    if not products:
        return 0
    return largest_safe_batch([max(products, key=lambda p: p.call.a.per_batch)], heads, index_bits, profile)


def blocked_options(trace: Callable[[int, int], Any], traced: dict[int, list], config: Any, heads: int,
                    index_bits: int, profile: Any,
                    dtypes: tuple[str, ...] = tuple(DTYPE_BYTES)) -> list[dict[str, Any]]:
    """blocked_eager's smallest clearly-visible run per dtype, at the longest demo length (where P leaves
    the least room to the rest), predicted from a trace of its own calls: `trace(batch, length)`."""
    length = next((L for L in DEMO_LENGTHS if L in traced), None)
    safe = product_safe_batch(traced[length], heads, index_bits, profile) if length else 0
    if not safe:
        return []
    batch = visible_batch(safe + 1, BLOCKED_VISIBLE_TEXTS, share=0)
    plan = trace(batch, length)
    return _options(predict(plan, batch, heads), plan, config, batch, length, BLOCKED, dtypes)


def _options(prediction: Any, plan: Any, config: Any, batch: int, length: int, attention: str,
             dtypes: tuple[str, ...]) -> list[dict[str, Any]]:
    if prediction.outcome != "wrong":
        return []  # a run that stops (or aborts) shows an error, not the silent effect
    return [{"attention": attention, "dtype": dtype, "max_length": length, "batch_size": batch,
             "first_corrupted_text": prediction.first_corrupted_text,
             "corrupted_count": prediction.corrupted_count, "outcome": prediction.describe(),
             "estimated_peak_gib": in_gib(estimate_peak_bytes(config, batch, length, DTYPE_BYTES[dtype],
                                                              attention)),
             "largest_tensor_gib": round(largest_tensor_bytes(plan, dtype) / GIB, 2)}
            for dtype in dtypes]


def largest_pass_batch(config: Any, length: int, dtype: str, budget: int, attention: str = "eager") -> int:
    """The largest batch at `length` whose device pass (its estimated peak, with headroom) fits in `budget`
    bytes (0: none); memory.largest_fitting_batch searches it."""
    def estimate(batch: int) -> float:
        return estimate_peak_bytes(config, batch, length, DTYPE_BYTES[dtype], attention) * HEADROOM

    return int(largest_fitting_batch(estimate, budget))


def fits(option: dict[str, Any], mac: MacMemory) -> bool:
    """Whether a demo option runs on `mac`: its peak (with headroom) within the working set, and its largest
    tensor under the largest buffer (at or past it, MPS raises "Invalid buffer size")."""
    return (option["estimated_peak_gib"] * GIB * HEADROOM <= mac.working_set
            and option["largest_tensor_gib"] * GIB < mac.largest_buffer)


def best_option(options: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run to type of `options`: eager attention before blocked_eager (the model as it is), then the longest
    length, float32 first, then half precision."""
    return min(options, default=None, key=lambda o: (o["attention"] != "eager", -o["max_length"],
                                                     list(DTYPE_BYTES).index(o["dtype"])))


def run_command(scenario: str, option: dict[str, Any], device: str | None = None) -> str:
    """The `mpsimpact run` command of a demo option (on `device`, where given)."""
    command = f"mpsimpact run {scenario}" + (f" --device {device}" if device else "")
    command += f" --batch-size {option['batch_size']} --max-length {option['max_length']}"
    command += f" --dtype {option['dtype']}" if option["dtype"] != "float32" else ""
    return command + (f" --attention {option['attention']}" if option["attention"] != "eager" else "")


def recommend(options: list[dict[str, Any]], mac: MacMemory, scenario: str) -> dict[str, Any]:
    """The run to type on `mac` (`best_option` of those that fit), or why there is none and what instead: the
    smallest Mac that can, and the emulated run on any machine."""
    for option in options:
        option["fits"] = fits(option, mac)
    if not options:
        return {"command": None, "why": (
            "No run shows the silent effect: at every demo length the first batch past the largest safe one "
            "stops the run (an error or a process abort) instead of returning wrong values; the prediction "
            "says where.")}
    best = best_option([o for o in options if o["fits"]])
    if best is not None:
        how = f" with {BLOCKED} attention ({REASON})" if best["attention"] == BLOCKED else ""
        return {"command": run_command(scenario, best), "option": best, "why": (
            f"{best['batch_size']} x {best['max_length']} in {best['dtype']}{how}: about "
            f"{best['estimated_peak_gib']} GiB of {mac.working_set / GIB:.1f}, its largest tensor "
            f"{best['largest_tensor_gib']} GiB under the {mac.largest_buffer / GIB:.1f} GiB buffer; "
            f"{best['outcome']}.")}
    return _instead(options, mac, scenario)


def _instead(options: list[dict[str, Any]], mac: MacMemory, scenario: str) -> dict[str, Any]:
    """No option fits `mac`: why (its largest buffer, or its working set), the smallest Mac that can show the
    effect and its command, and the emulated run on any machine (--device cpu)."""
    buffer_gib = mac.largest_buffer / GIB
    if all(o["largest_tensor_gib"] * GIB >= mac.largest_buffer for o in options):
        half, full = (2**MPS_INDEX_BITS * n / GIB for n in (2, 4))
        why = (f"No run can show the silent fault on {mac.label}: it needs one tensor of more than 2^32 numbers "
               f"({half:.0f} GiB in half precision, {full:.0f} GiB in float32), and Metal refuses any single "
               f"buffer of {buffer_gib:.1f} GiB or more there ({mac.source()}): MPS stops with 'Invalid buffer "
               "size' before a wrong value.")
    else:
        demo = min(options, key=lambda o: o["estimated_peak_gib"])
        why = (f"No run shows the effect in {mac.working_set / GIB:.1f} GiB: the faulting batch's P alone is "
               f"2^{MPS_INDEX_BITS} elements at any length; the smallest demo ({demo['batch_size']} x "
               f"{demo['max_length']}, {demo['dtype']}, {demo['attention']} attention) needs about "
               f"{demo['estimated_peak_gib']} GiB.")
    found = smallest_showing(lambda other: any(fits(o, other) for o in options))
    emulated = best_option([o for o in options if o["dtype"] == "float32"] or options)
    answer: dict[str, Any] = {"command": None, "why": why,
                              "emulated_command": run_command(scenario, emulated, device="cpu")}
    if found is not None:
        chosen = best_option([o for o in options if fits(o, found)])
        answer["smallest_mac"] = {"mac_gb": found.unified_gb, "command": run_command(scenario, chosen),
                                  "outcome": chosen["outcome"]}
    return answer


def largest_batch_under(calls: list, buffer: int, dtype: str, ceiling: int = 1 << 40) -> int:
    """The largest batch whose every tensor of the per-text `calls` (each grows by a whole amount per text)
    stays under `buffer` bytes, were its floating tensors in `dtype` (0: not even one text)."""
    largest = ceiling
    for p in calls:
        one, two = p.bytes_at(1, DTYPE_BYTES[dtype]), p.bytes_at(2, DTYPE_BYTES[dtype])
        if one >= buffer:
            return 0
        if two > one:  # bytes(B) = one + (two - one) * (B - 1) < buffer
            largest = min(largest, 1 + (buffer - 1 - one) // (two - one))
    return largest


def mac_table(config: Any, first_corrupted: int, calls: list, length: int = 512, blocked_first: int | None = None,
              dtypes: tuple[str, ...] = tuple(DTYPE_BYTES)) -> list[dict[str, Any]]:
    """Per Mac memory size: the largest batch at `length` that fits (its peak within the working set, its
    largest tensor under the largest buffer: the per-text `calls` traced at `length`) and the texts it
    corrupts, per dtype, and under "blocked_eager" the same with that attention (whose first corrupted text
    is `blocked_first`; its P is eager's)."""
    def cells(attention: str, first: int, mac: MacMemory) -> dict[str, dict[str, int]]:
        batches = {dtype: min(largest_pass_batch(config, length, dtype, mac.working_set, attention),
                              largest_batch_under(calls, mac.largest_buffer, dtype))
                   for dtype in dtypes}
        return {dtype: {"largest_batch": batch, "corrupted_texts": max(0, batch - first)}
                for dtype, batch in batches.items()}

    rows = []
    for gb in MAC_SIZES_GB:
        mac = MacMemory.of_size(gb)
        row: dict[str, Any] = {"mac_gb": gb, "usable_gib": in_gib(mac.working_set),
                               "largest_buffer_gib": in_gib(mac.largest_buffer),
                               **cells("eager", first_corrupted, mac)}
        if blocked_first is not None:
            row[BLOCKED] = cells(BLOCKED, blocked_first, mac)
        rows.append(row)
    return rows
