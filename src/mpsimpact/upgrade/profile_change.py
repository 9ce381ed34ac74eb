"""The difference between two measured release profiles in plain words ("2.15.0 no longer aborts on a view
operand of 2^31 to 2^32 elements; now raises on it; P V still wraps"), behaviour by behaviour of the bmm
rules, saying where a sweep left a behaviour open instead of guessing it."""

from __future__ import annotations

from collections.abc import Callable

from mpsimpact.engine.release import FaultProfile

# Each behaviour: (what it is about, its phrase for one setting of the bmm fields). A phrase reads after
# "still", "no longer" and "now".
BEHAVIOURS: dict[str, Callable[[FaultProfile], str | None]] = {
    "P V (a contiguous input above 2^32 elements)": lambda p: (
        "wraps P V (a contiguous input above 2^32 elements)" if p.input_wrap
        else "computes P V (a contiguous input above 2^32 elements) right"),
    "an output above 2^32 elements": lambda p: {
        "strides-ignored": "reads a transposed operand as packed once the output passes 2^32 elements "
                           "(wrong_all)",
        "fp32-wrong": "is wrong in fp32 once the output passes 2^32 elements",
        "correct": "computes outputs above 2^32 elements right"}[p.output_rule],
    "a view operand past 2^31 elements": lambda p: {
        "raise": f"raises on a transposed or sliced operand of 2^31 elements or more ('{p.view_message}')",
        "abort": "aborts the process on a transposed or sliced operand of 2^31 to 2^32 elements",
        "truncate": "truncates (mostly zeros) a transposed or sliced operand of 2^32 elements or more",
        "none": "computes transposed and sliced operands of any size without an error"}[p.view_rule],
    "a slice's offset": lambda p: (
        None if p.view_rule in ("truncate", "none")
        else "counts a slice's storage offset towards the view limit" if p.slice_extent
        else "counts only a slice's own elements towards the view limit"),
}
OPEN = "open"  # a behaviour the settings a sweep left open disagree on


def behaviours(profile: FaultProfile) -> dict[str, str | None]:
    """Each behaviour's phrase for this profile; OPEN where its settings disagree; None where it does not
    apply; all OPEN where bmm is judged conservatively (no setting agreed with the cells)."""
    if profile.judges_conservatively("bmm"):
        return dict.fromkeys(BEHAVIOURS, OPEN)
    found = {}
    for name, phrase in BEHAVIOURS.items():
        phrases = {phrase(setting) for setting in profile.settings()}
        found[name] = phrases.pop() if len(phrases) == 1 else OPEN
    return found


def describe_change(old: FaultProfile, new: FaultProfile) -> tuple[str, bool]:
    """One sentence on how `new` differs from `old`, behaviour by behaviour, and whether anything changed
    (a behaviour one side left open is not a change: the sentence says it cannot tell)."""
    before, after = behaviours(old), behaviours(new)
    changed, still, unknown = [], [], []
    for name in BEHAVIOURS:
        was, now = before[name], after[name]
        if OPEN in (was, now):
            side = "both sweeps" if was == now else "the old sweep" if was == OPEN else "the new sweep"
            unknown.append(f"{name}: {side} left it open")
        elif was != now:
            changed += [f"no longer {was}"] * (was is not None) + [f"now {now}"] * (now is not None)
        elif now is not None:
            still.append(f"still {now}")
    parts = changed + still + ([f"cannot tell ({'; '.join(unknown)})"] if unknown else [])
    header = f"profile {old.release} -> {new.release}: {new.release} " if old.release != new.release else (
        f"profile {new.release}: ")
    return header + "; ".join(parts), bool(changed)
