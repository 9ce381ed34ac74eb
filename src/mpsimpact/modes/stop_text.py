"""The guard's stop texts: what a call would do on MPS, its numbers, the rule it would hit, the safe chunk
and what to do (the message of OversizedOpError and of guard mode "warn")."""

from __future__ import annotations

from mpsimpact.engine.call import CallRecord
from mpsimpact.engine.faults import Fault
from mpsimpact.modes.piecewise import Pieces


def describe_stop(record: CallRecord, fault: Fault, chunk: int | Pieces | None, why_not: str | None = None) -> str:
    """The error text: what, the numbers, the rule it would hit, the safe chunk (or `why_not` none is
    taken), what to do."""
    what = {
        "wrong_all": "return wrong values in every batch",
        "wrong_tail": f"return wrong values from batch {fault.first_bad_batch} onward",
        "truncated": "return a truncated result (mostly zeros)",
        "wrong_other": "return wrong values (pattern not characterised)",
        "error": f"raise '{fault.message}'",
        "abort": "abort the process",
    }[fault.kind]
    if fault.rule == "reduction-wrap":
        what = f"return the result of only its first numel mod {fault.wrap_elements} elements"
    elif fault.is_unmeasured:
        what = "run where nobody measured MPS (judged conservatively: possibly wrong values)"
    release = f"MPS (torch {fault.release})" if fault.release else "MPS"
    why = f"rule {fault.rule}" + ("; inferred" if fault.inferred else "")
    why += f"; {fault.message}" if fault.kind in ("wrong_other", "wrong_all") and fault.message else ""
    if not record.is_product:
        sizes = f"input {record.a.numel} elements, output {record.b.numel}"
        return (f"mpsimpact guard: {record.describe()} in {record.phase} ({sizes}) would {what} on {release} "
                f"({why}). " + (f"The guard does not split it: {why_not}; lower the batch size." if why_not
                                else _family_advice(record, chunk)))
    unit = {"mm": "rows", "sdpa": "batch-head rows"}.get(record.family, "batches")
    advice = (f"The largest safe chunk for this op is {chunk} {unit}: lower the batch size, or use guard mode "
              "'chunk'." if chunk is not None else
              f"The guard does not split it: {why_not}; lower the batch size." if why_not else
              "No split makes it safe (one row of it alone crosses a limit): shorten the sequence.")
    return (
        f"mpsimpact guard: {record.describe()} in {record.phase} (output {record.out_numel} elements, "
        f"a {record.a.numel}, b {record.b.numel}) would {what} on {release} ({why}). {advice}"
    )


def _family_advice(record: CallRecord, chunk: int | Pieces | None) -> str:
    if record.family == "cat":
        return "Guard mode 'chunk' builds it by copying each input into place, in pieces below the limits."
    if isinstance(chunk, Pieces):
        return f"Guard mode 'chunk' splits it into {chunk.describe()}; or lower the batch size."
    return (f"No split is known for {record.op} ({record.family}): lower the batch size until no tensor of "
            "it passes the limit; on attention scores, attn_implementation='mps_safe_eager' (name = "
            "mpsimpact.attention.register()) never makes the whole score tensor.")
