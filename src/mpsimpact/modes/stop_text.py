"""The guard's stop texts: what a call would do on MPS, its numbers, the rule it would hit, the safe chunk
and what to do (the message of OversizedOpError and of guard mode "warn")."""

from __future__ import annotations

from mpsimpact.engine.call import CallRecord, rows_per_sample
from mpsimpact.engine.faults import MPS_INDEX_BITS, Fault, rows_safe_whole
from mpsimpact.engine.release import FaultProfile, profile_for
from mpsimpact.modes.chunking import split_bmm, split_sdpa
from mpsimpact.modes.entrypoint import entry_shape
from mpsimpact.modes.piecewise import Pieces, has_split


# What one of a product's rows is called: (one, many).
ROW_UNITS = {"bmm": ("batch", "batches"), "mm": ("row", "rows"), "sdpa": ("batch-head row", "batch-head rows")}


def whole_rows(record: CallRecord, index_bits: int, profile: FaultProfile) -> int | None:
    """The largest first dimension at which a stopped product runs correctly whole (faults.rows_safe_whole), where
    that is more than the guard's pieces: a smaller batch of the same code. None for SDPA and the other families."""
    if record.family not in ("bmm", "mm"):
        return None
    return rows_safe_whole(record.a, record.b, index_bits=index_bits, profile=profile, op=record.family)


def what_mps_does(record: CallRecord, fault: Fault, chunk: int | Pieces | None, why_not: str | None = None,
                  per: int | None = None, index_bits: int = MPS_INDEX_BITS, whole: int | None = None) -> str:
    """The guard's stop text after its "mpsimpact guard: ": the call, what MPS would do with it and why, the safe
    chunk (or `why_not` none is taken) and what to do. `per`: rows a sample (default: as the call now being
    decided folds them, Note [A call's samples] in modes/entrypoint.py); `index_bits`: the width judged at, said
    where it is not MPS's; `whole`: the rows a smaller batch may hold and run it whole (more than a piece of the
    split may: See `_chunk_advice`)."""
    per = rows_per_sample(record, entry_shape()) if per is None else per
    if record.is_product and chunk is not None:
        advice = _chunk_advice(chunk, per, ROW_UNITS.get(record.family, ROW_UNITS["bmm"]), record.op, whole)
    elif why_not:
        advice = f"The guard does not split it: {why_not}; lower the batch size."
    elif not record.is_product:
        advice = _family_advice(record, chunk)
    else:
        advice = "No split makes it safe (one row of it alone crosses a limit): shorten the sequence."
    return f"{_what_and_why(record, fault, per, index_bits)} {advice}"


def what_mps_does_with(record: CallRecord, index_bits: int, per: int) -> str:
    """`what_mps_does` for a recorded call the guard did not decide (the emulator's, a warned one), with `per`
    rows a sample: its safe chunk worked out from its shapes, as the guard's own split would be (a product's
    along its first dimension; the other families' pieces, which strict mode's guard splits)."""
    what = _what_and_why(record, record.fault, per)
    if record.family in ("bmm", "mm"):
        split = split_bmm(record.a, record.b, index_bits, record.family)
        if split is not None and split.rows is not None:
            return (f"{what} Not one whole batch is safe: guard mode 'chunk' splits each into blocks of {split.rows} "
                    f"rows and {split.cols} column{'s' if split.cols > 1 else ''}; or shorten the sequence.")
        release = record.fault.release
        whole = whole_rows(record, index_bits, profile_for(release)) if release else None
        return what_mps_does(record, record.fault, split.batches if split is not None else None, per=per,
                             whole=whole)
    if record.family == "sdpa":
        split = split_sdpa(record.a.shape, record.b.shape, record.a.shape[-1], index_bits)
        return f"{what} " + (
            f"Guard mode 'chunk' splits it into pieces of {split.rows} batch-head rows"
            + (f" over blocks of {split.block} query rows" if split.block < record.a.shape[-2] else "")
            + "; or lower the batch size." if split is not None else
            "No split makes it safe (one key or value head alone crosses a limit): shorten the sequence.")
    if not record.is_product and has_split(record.op, record.family, record.a, record.b, index_bits):
        return (f"{what} Guard mode 'chunk' with strict=True splits it into "
                "pieces below the limits; or lower the batch size.")
    return what_mps_does(record, record.fault, None, per=per)


def _what_and_why(record: CallRecord, fault: Fault, per: int, index_bits: int = MPS_INDEX_BITS) -> str:
    """The first sentence: the call in its phase, its sizes, what it would do on which release, and why."""
    one, unit = ROW_UNITS.get(record.family, ROW_UNITS["bmm"])
    first = fault.first_bad_batch
    what = {
        "wrong_all": "return wrong values in every batch",
        "wrong_tail": f"return wrong values from sample {first // per} of the first dimension onward ({record.op} "
                      f"{one} {first}, {per} {unit} a sample)" if per > 1 and first is not None else
                      f"return wrong values from batch {first} onward",
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
    if index_bits != MPS_INDEX_BITS:  # the numbers are a narrowed index's, standing for MPS's
        why += f"; at a {index_bits}-bit index, every limit divided by 2^{MPS_INDEX_BITS - index_bits}"
    sizes = (f"input {record.a.numel} elements, output {record.b.numel}" if not record.is_product else
             f"scores {record.out_numel} elements, query {record.a.numel} and key {record.b.numel}"
             if record.family == "sdpa" else
             f"output {record.out_numel} elements, operands a {record.a.numel} and b {record.b.numel}")
    return f"{record.describe()} in {record.phase} ({sizes}) would {what} on {release} ({why})."


def _chunk_advice(chunk: int, per: int, units: tuple[str, str], op: str, whole: int | None = None) -> str:
    """The largest safe chunk, in the caller's samples where they are known (Note [A call's samples]); and where a
    smaller batch runs the op whole with more (`whole` rows: a whole operand may reach the index limit, a piece of
    the split is a slice, a view, held to half of it), that batch, which is what lowering the batch size gives."""
    if whole is not None and whole // per > chunk // per:
        if per == 1:
            return (f"It runs correctly on at most {whole} {units[1]} at once: lower the batch size so that it gets "
                    f"no more, or use guard mode 'chunk' (its pieces, slices of the batch, hold at most {chunk}).")
        samples = whole // per
        pieces = f"at most {chunk // per}" if chunk >= per else f"part of one ({chunk} {op} {units[chunk > 1]})"
        return (f"It runs correctly on a batch of at most {samples} sample{'s' if samples > 1 else ''} of the first "
                f"dimension ({samples * per} {op} {units[1]}): lower the batch size to {samples}, or use guard mode 'chunk' "
                f"(its pieces, slices of the batch, hold {pieces}).")
    unit = units[0] if per == 1 and chunk == 1 else units[1]
    if per == 1:
        return f"The largest safe chunk for this op is {chunk} {unit}: lower the batch size, or use guard mode 'chunk'."
    if chunk < per:
        return (f"Not one whole sample is safe ({per} {unit} a sample, at most {chunk} safe): shorten the "
                "sequence, or use guard mode 'chunk'.")
    samples = f"{chunk // per} sample{'s' if chunk // per > 1 else ''}"
    return (f"The largest safe chunk for this op is {samples} of the first dimension ({chunk} {op} "
            f"{unit}): lower the batch size to {chunk // per}, or use guard mode 'chunk'.")


def _family_advice(record: CallRecord, chunk: int | Pieces | None) -> str:
    if record.family == "cat":
        return "Guard mode 'chunk' builds it by copying each input into place, in pieces below the limits."
    if isinstance(chunk, Pieces):
        return f"Guard mode 'chunk' splits it into {chunk.describe()}; or lower the batch size."
    return (f"No split is known for {record.op} ({record.family}): lower the batch size until no tensor of "
            "it passes the limit; on attention scores, attn_implementation='mps_safe_eager' (name = "
            "mpsimpact.attention.register()) never makes the whole score tensor.")
