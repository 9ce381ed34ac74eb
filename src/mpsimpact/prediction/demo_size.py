"""Sizing the demo to the machine people bring: how much memory a Mac lends the GPU, and per dtype
the smallest run that shows the effect clearly and fits, or why none does."""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Callable
from typing import Any

from mpsimpact.attention.blocked import NAME as BLOCKED, REASON
from mpsimpact.engine.faults import INDEX_BITS_RANGE, MPS_INDEX_BITS
from mpsimpact.engine.mac_memory import MEASURED, MacMemory, call_bytes, smallest_showing
from mpsimpact.prediction.outcome import Prediction, predict, spoken
from mpsimpact.prediction.memory import estimate_peak_bytes, in_gib, largest_batch_where, largest_fitting_batch
from mpsimpact.prediction.safe_size import PerTextCall, distinct_calls, largest_safe_batch, plan_at, silent_batches
from mpsimpact.config import GIB, QUICK_BATCH_FACTOR

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
    for length in (L for L in DEMO_LENGTHS if L in traced and safe[L]):
        batch = visible_batch(safe[length] + 1)
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
            and not mac.refuses(option["largest_tensor_gib"] * GIB))


def best_option(options: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run to type of `options`: eager attention before blocked_eager (the model as it is), then the longest
    length, float32 first, then half precision."""
    return min(options, default=None, key=lambda o: (o["attention"] != "eager", -o["max_length"],
                                                     list(DTYPE_BYTES).index(o["dtype"])))


@dataclasses.dataclass(frozen=True)
class RunAsked:
    """What chose the runs a plan recommends beyond each option's own sizes, dtype and attention: the scenario, its
    model (--model; None: the scenario's own) and the index width. Every `mpsimpact run` command it writes carries
    them, so that the command runs what the plan describes."""

    scenario: str
    model: str | None = None
    index_bits: int = MPS_INDEX_BITS

    def command(self, option: dict[str, Any] | None = None, device: str | None = None) -> str:
        """The `mpsimpact run` command of a demo option (on `device`, where given); without one, the quick demo
        of this model (--quick sets its own index width)."""
        words = ["mpsimpact", "run", self.scenario, *(["--model", self.model] if self.model else [])]
        if option is None:
            return shlex.join([*words, "--quick"])
        words += [*(["--device", device] if device else []), "--batch-size", str(option["batch_size"]),
                  "--max-length", str(option["max_length"])]
        words += ["--dtype", option["dtype"]] if option["dtype"] != "float32" else []
        words += ["--attention", option["attention"]] if option["attention"] != "eager" else []
        return shlex.join(words + (["--index-bits", str(self.index_bits)] if self.index_bits != MPS_INDEX_BITS
                                   else []))


def recommend(options: list[dict[str, Any]], mac: MacMemory, asked: RunAsked) -> dict[str, Any]:
    """The run to type on `mac` (`best_option` of those that fit), or why there is none and what instead: the
    smallest Mac that can, and the emulated run on any machine; each command with what `asked` says."""
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
        return {"command": asked.command(best), "option": best, "why": (
            f"{best['batch_size']} x {best['max_length']} in {best['dtype']}{how}: about "
            f"{best['estimated_peak_gib']} GiB of {mac.working_set / GIB:.1f}, its largest tensor "
            f"{best['largest_tensor_gib']} GiB under the {mac.largest_buffer / GIB:.1f} GiB buffer; "
            f"{best['outcome']}.")}
    return _instead(options, mac, asked)


def _instead(options: list[dict[str, Any]], mac: MacMemory, asked: RunAsked) -> dict[str, Any]:
    """No option fits `mac`: why (its largest buffer, or its working set), the smallest Mac that can show the
    effect and its command, and the emulated run on any machine (--device cpu; --quick the same in seconds)."""
    buffer_gib = mac.largest_buffer / GIB
    if all(mac.refuses(o["largest_tensor_gib"] * GIB) for o in options):
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
    answer: dict[str, Any] = {"command": None, "why": why, "emulated_command": asked.command(emulated, device="cpu"),
                              "quick_command": asked.command()}
    if found is not None:
        chosen = best_option([o for o in options if fits(o, found)])
        answer["smallest_mac"] = {"mac_gb": found.unified_gb, "command": asked.command(chosen),
                                  "outcome": chosen["outcome"]}
    return answer


def largest_batch_under(calls: list, mac: MacMemory, dtype: str) -> int:
    """The largest batch none of whose tensors of the per-text `calls` `mac` refuses, were its floating tensors
    in `dtype` (0: not even one text). Each call grows by a whole amount per text: one + step * (batch - 1)."""
    ones = [p.bytes_at(1, DTYPE_BYTES[dtype]) for p in calls]
    steps = [max(0, p.bytes_at(2, DTYPE_BYTES[dtype]) - one) for p, one in zip(calls, ones)]
    return largest_batch_where(lambda batch: not any(
        mac.refuses(one + step * (batch - 1)) for one, step in zip(ones, steps)))


def mac_table(config: Any, first_corrupted: int, calls: list, length: int = 512, blocked_first: int | None = None,
              dtypes: tuple[str, ...] = tuple(DTYPE_BYTES)) -> list[dict[str, Any]]:
    """Per Mac memory size: the largest batch at `length` that fits (its peak within the working set, its
    largest tensor under the largest buffer: the per-text `calls` traced at `length`) and the texts it
    corrupts, per dtype, and under "blocked_eager" the same with that attention (whose first corrupted text
    is `blocked_first`; its P is eager's)."""
    def cells(attention: str, first: int, mac: MacMemory) -> dict[str, dict[str, int]]:
        batches = {dtype: min(largest_pass_batch(config, length, dtype, mac.working_set, attention),
                              largest_batch_under(calls, mac, dtype))
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


# The published demo's share of wrong texts (683 of 2048, docs/fault-model.md "The published downstream demo"):
# of the geometries that show the silent effect, --quick takes the one whose share is nearest it.
PUBLISHED_SHARE = 683 / 2048
SHORTEST_DEMO_LENGTH = 16  # tokens: the shortest length --quick and the silent sizes look at


def power_lengths(positions: int) -> list[int]:
    """The power-of-two lengths from SHORTEST_DEMO_LENGTH up to `positions`, longest first: an emulated run
    replays the plan of these exactly at a reduced length (a wrap's period maps only for powers of two)."""
    return [1 << n for n in range(max(positions, 1).bit_length() - 1, SHORTEST_DEMO_LENGTH.bit_length() - 2, -1)]


def quick_geometry(calls_at: Callable[[int], list[PerTextCall]], asked: tuple[int, int, int], free: set[str],
                   positions: int, heads: int, profile: Any, mac: Any = None) -> tuple[tuple[int, int, int] | None,
                                                                                         Prediction]:
    """--quick's geometry (batch, length, index bits) for a model, and the prediction at `asked`. `asked` itself
    where it shows the silent effect (a forward pass silently wrong, its texts known, nothing stopping); else,
    varying the sizes named in `free` ("batch_size", "max_length", "index_bits"; a power-of-two length up to
    `positions`, an index width in INDEX_BITS_RANGE, a batch up to QUICK_BATCH_FACTOR times the asked one), the
    geometry that does, closest to the asked batch, then with the share of wrong texts nearest the published
    demo's, then the longest length and the widest index; None where none does. `calls_at(length)`: the
    per-text calls at that length."""
    batch, length, bits = asked
    at_asked = predict(plan_at(distinct_calls(calls_at(length)), batch, bits, profile, mac), batch, heads)
    if at_asked.outcome == "wrong":
        return asked, at_asked
    found = []
    for size in power_lengths(positions) if "max_length" in free else [length]:
        for width in range(INDEX_BITS_RANGE[1], INDEX_BITS_RANGE[0] - 1, -1) if "index_bits" in free else [bits]:
            stretches = silent_batches(calls_at(size), heads, width, profile, QUICK_BATCH_FACTOR * batch, mac) \
                if "batch_size" in free else [(batch, batch)]
            texts = min((min(max(batch, first), last) for first, last in stretches), key=lambda n: abs(n - batch),
                        default=None)
            prediction = predict(plan_at(distinct_calls(calls_at(size)), texts, width, profile, mac), texts,
                                 heads) if texts else None
            if prediction is not None and prediction.outcome == "wrong":
                share = prediction.corrupted_count / texts
                found.append(((abs(texts - batch), abs(share - PUBLISHED_SHARE), -size, -width), (texts, size, width)))
    return min(found)[1] if found else None, at_asked


def silent_sizes(calls_at: Callable[[int], list[PerTextCall]], length: int, positions: int, heads: int,
                 index_bits: int, profile: Any, ceiling: int, mac: Any = None) -> dict[str, Any]:
    """Where a run that stops would show the silent effect instead, under `profile`'s rules (on `mac`, with its
    largest buffer): the stretches of batches (safe_size.silent_batches, up to `ceiling`) at `length`, else at the
    longest power-of-two length up to `positions` that has any, with the first wrong text of the first stretch,
    the batch of it whose share of wrong texts is nearest the published demo's, and all of it in a sentence;
    "batches" empty where none does at any of them."""
    lengths = [length, *(size for size in power_lengths(positions) if size != length)]
    sizes = {"max_length": None, "index_bits": index_bits, "batches": [], "first_corrupted_text": None,
             "example_batch": None, "ceiling": ceiling, "lengths": lengths, "mac": mac.label if mac else None}
    for size in lengths:
        stretches = silent_batches(calls_at(size), heads, index_bits, profile, ceiling, mac)
        if stretches:
            first = stretches[0][0]
            text = predict(plan_at(calls_at(size), first, index_bits, profile, mac), first, heads).first_corrupted_text
            shown = min(max(first, round(text / (1 - PUBLISHED_SHARE))), stretches[0][1])  # the published share
            sizes |= {"max_length": size, "batches": [list(s) for s in stretches], "first_corrupted_text": text,
                      "example_batch": shown}
            break
    return sizes | {"sentence": silent_sizes_words(sizes, profile.label)}


def silent_sizes_words(sizes: dict[str, Any], release: str) -> str:
    """`silent_sizes` in one sentence: which batches of how many tokens show the silent effect on `release`, or
    that none does."""
    bits = sizes["index_bits"]
    narrowed = f" at the {bits}-bit index" if bits != MPS_INDEX_BITS else ""
    release += f" on {sizes['mac']}" if sizes.get("mac") else ""
    if not sizes["batches"]:
        lengths = sizes["lengths"]
        at = f"{lengths[0]} tokens" + (f" or any power-of-two length from {lengths[-1]} to {max(lengths)}"
                                       if len(lengths) > 1 else "")
        return (f"No batch of up to {sizes['ceiling']:,} texts at {at}{narrowed} shows the silent effect on torch "
                f"{release} for this model: wherever a call crosses a limit, the run stops first (or its wrong "
                "values are not characterised).")
    (first, last), *more = sizes["batches"]
    # Counts of texts in plain digits, as the table's "first wrong text 1365" and the run's "2731 of 4096" say them
    # (the search's ceiling above, 16,777,216, is a bound nobody compares with a row, read more easily grouped)
    upto = f"at least {last}" if last >= sizes["ceiling"] else f"{last}"
    others = f" (and {len(more)} more stretch{'es' if len(more) > 1 else ''} of batches)" if more else ""
    return (f"The silent effect shows instead from {first} to {upto} texts of {sizes['max_length']} tokens"
            f"{narrowed}{others} on torch {release} for this model: wrong from text {sizes['first_corrupted_text']}, "
            f"and nothing stops (e.g. --batch-size {sizes['example_batch']} --max-length {sizes['max_length']}).")


def quick_words(asked: tuple[int, int, int], chosen: tuple[int, int, int] | None, at_asked: Prediction,
                judged: Any, sized_on: Any) -> str:
    """What --quick did for a model whose usual geometry (`asked`) shows no silent effect: the geometry it chose
    instead, on which release's rules (`sized_on`: the `judged` one's, or the published demo's where none is silent
    on it or nobody measured it) and why, or that it found none and runs the usual one. "" where it kept `asked`."""
    if chosen == asked:
        return ""
    usual = f"{asked[0]} texts of {asked[1]} tokens at a {asked[2]}-bit index"
    if sized_on.ref == judged.ref:
        on = f" on torch {judged.label}"
    else:
        unknown = (f"nobody measured torch {judged.release} on MPS" if judged.conservative
                   else f"none is on torch {judged.label}")
        on = f" on torch {sized_on.label}, a release measured on Macs where the bug is silent ({unknown})"
    if chosen is None:
        return (f"--quick found no geometry that shows the silent effect for this model{on}, so it runs its usual "
                f"{usual}.")
    return (f"--quick chose {chosen[0]} texts of {chosen[1]} tokens at a {chosen[2]}-bit index for this model, where "
            f"the damage is silent{on}: at its usual {usual}, torch {sized_on.label} {spoken(at_asked)}.")
