"""The difference between two measured release profiles in plain words ("2.15.0 no longer aborts on a view
operand of 2^31 to 2^32 elements; now raises on it; P V still wraps"), behaviour by behaviour of the bmm
rules, then the Linear, fused SDPA and each op family's rows, saying where a sweep left a behaviour open
instead of guessing it."""

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

# The other aspects' behaviours; each reads after "still", "no longer" and "now" as well.
OTHER_BEHAVIOURS: dict[str, tuple[str, Callable[[FaultProfile], str]]] = {
    "a Linear whose input passes 2^32 elements": ("mm", lambda p: (
        "aborts the process on a Linear whose input passes 2^32 elements" if p.mm_aborts
        else "computes a Linear whose input passes 2^32 elements right")),
    "fused SDPA above 2^32 score elements": ("sdpa", lambda p: (
        "runs SDPA without gradients on the math path (the bmm rules decide)" if not p.sdpa_fused
        else "computes fused SDPA above 2^32 score elements wrong" if p.sdpa_fused_wrong
        else "computes fused SDPA above 2^32 score elements right")),
}
# A family code's phrase, filled with what it is about ("elementwise ops with a dimension past INT_MAX").
CODE_PHRASES = {
    "ok": "computes {what} right", "abort": "aborts the process on {what}", "error": "raises on {what}",
    "wrong": "computes {what} wrong", "wrap": "reduces only the first numel mod 2^32 elements of {what}",
    "sum-64-bit": "raises its 64-bit indexing error on {what}",
    "masked-fill-numel": "raises its element-count error on {what}",
    "int32-kernel": "dies (SIGSEGV) above 2^32 elements on {what}",
    "int32-offsets": "computes {what} wrong above 2^31 elements (int32 offsets)",
}
_DIMENSIONS = ("with a dimension past INT_MAX", "of more than INT_MAX elements (no dimension past it)")
FAMILY_ROW = " ops "  # in the name of every family row's behaviour, and in no other


def family_behaviours(profile: FaultProfile) -> dict[str, str | None]:
    """Each family row's phrase ("elementwise ops with a dimension past INT_MAX": "raises on ..."), OPEN
    where it is unmeasured; one OPEN "the op families" where the whole aspect is judged conservatively."""
    if profile.judges_conservatively("families"):
        return {"the op families": OPEN}
    found: dict[str, str | None] = {}
    for name, one, multi in sorted(profile.families):
        for dimension, code in zip(_DIMENSIONS, (one, multi)):
            what = f"{name} ops {dimension}"
            found[what] = OPEN if code == "unmeasured" else CODE_PHRASES[code].format(what=what)
    return found


def other_behaviours(profile: FaultProfile) -> dict[str, str | None]:
    """The mm and SDPA behaviours and every family row's (OPEN where not measured)."""
    return {name: OPEN if profile.judges_conservatively(aspect) else phrase(profile)
            for name, (aspect, phrase) in OTHER_BEHAVIOURS.items()} | family_behaviours(profile)


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
    before_others, after_others = other_behaviours(old), other_behaviours(new)
    changed, still, unknown, unchanged = [], [], [], 0
    if "the op families" in before_others or "the op families" in after_others:  # one side measured none
        before_others, after_others = ({k: v for k, v in side.items() if FAMILY_ROW not in k}
                                       | {"the op families": side.get("the op families", "measured")}
                                       for side in (before_others, after_others))
    others = [name for name in before_others | after_others
              if (before_others.get(name, OPEN), after_others.get(name, OPEN)) != (OPEN, OPEN)]
    before, after = before | before_others, after | after_others
    for name in [*BEHAVIOURS, *others]:  # a family row neither profile measured is left out
        was, now = before.get(name, OPEN), after.get(name, OPEN)
        if OPEN in (was, now):
            side = "both sweeps" if was == now else "the old sweep" if was == OPEN else "the new sweep"
            unknown.append(f"{name}: {side} left it open")
        elif was != now:
            changed += [f"no longer {was}"] * (was is not None) + [f"now {now}"] * (now is not None)
        elif FAMILY_ROW in name:
            unchanged += 1
        elif now is not None:
            still.append(f"still {now}")
    still += [f"{unchanged} op-family rows as before"] if unchanged else []
    parts = changed + still + ([f"cannot tell ({'; '.join(unknown)})"] if unknown else [])
    header = f"profile {old.release} -> {new.release}: {new.release} " if old.release != new.release else (
        f"profile {new.release}: ")
    return header + "; ".join(parts), bool(changed)
