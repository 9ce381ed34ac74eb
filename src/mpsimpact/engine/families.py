"""The op families past the per-dimension limit and the per-tensor 32-bit offsets (elementwise,
reduction, indexing, masked_fill, cat, creation; Linear on every operand): `classify_op`, one entry
for any aten op, and `classify_cat`. Pure functions of specs, per release (engine.release's tables).
See Note [Op families past INT_MAX]."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from mpsimpact.engine.faults import (
    MPS_INDEX_BITS, OK, Fault, Profile, TensorSpec, classify_bmm, classify_mm, classify_sdpa, conservative,
    dim_max, limits, spec_of, unmeasured,
)
from mpsimpact.engine.release import (
    CAT_ABORT_MESSAGE, FAMILY_ABORT_MESSAGE, MASKED_FILL_MESSAGE, MEASURED_OPS, SIGSEGV_MESSAGE,
    SUM_64_BIT_MESSAGE, FaultProfile, family_of, op_base_name, takes_release,
)

# Note [Op families past INT_MAX]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Besides bmm, the study's first-pass suite ran one test per op family on every release; see
# docs/fault-model.md, "Op families past INT_MAX". release.ONE_DIMENSION_ROWS and MULTI_DIMENSION_ROWS
# hold its outcomes. With DIM_MAX = VIEW_LIMIT - 1 (INT_MAX at 32 bits), a call's tensors (inputs and
# output) decide:
#   * a dimension past DIM_MAX: the family's 1-D row. From 2.9.1 MPSGraph checks each *dimension*
#     ("... does not support tensor dims larger than INT_MAX"); earlier releases abort in MPSNDArray.
#     The rows were measured at 2**32 + 2**20 elements; at LIMIT elements or fewer the same outcome is
#     inferred (the checks are per dimension), but a characterised wrap is then unmeasured.
#   * no dimension past DIM_MAX and a tensor of more than DIM_MAX elements: the per-dimension check
#     passes, and the family's multi-dimensional row decides. 2.13.0 picks its kernels by that same
#     per-dimension test, so a multi-dimensional tensor gets 32-bit offsets: cat above VIEW_LIMIT output
#     elements is wrong (pytorch#189960), and eager attention died (SIGSEGV) where its scale and softmax
#     run on 4.49e9-element scores. So on 2.13.0 those two families abort above LIMIT (inferred: nothing
#     narrower was measured) and are unmeasured between VIEW_LIMIT and LIMIT; elsewhere the study saw
#     them clean.
#   * otherwise nothing is past a limit: ok.
# A row was measured on one test (release.MEASURED_OPS); the family's other ops follow it, inferred.
# 2.13.0's reduction wrap returns the result of the first numel mod LIMIT elements: for the measured uint8
# ones(N).sum() that is N mod 2**32 (a 32-bit accumulator would agree there; other data: inferred).
# What nobody measured past a limit (a family without a row, or a code "unmeasured") is conservative:
# kind wrong_other, rule "unmeasured:<family>", inferred. The guard stops it, the emulator refuses to
# invent its values, plans say "unmeasured".


@takes_release
def classify_cat(inputs: Iterable[Any], *, dim: int = 0, index_bits: int = MPS_INDEX_BITS,
                 profile: Profile = None) -> Fault:
    """Decides `torch.cat` of `inputs` along `dim`: tensors or specs, whose shapes decide (Note [Op
    families past INT_MAX]), or bare element counts: shapes unknown, so a 1-D and a multi-dimensional
    reading are both possible and the worse decides (a measured fault before an inferred one, a stop
    before a silent one)."""
    items = list(inputs)
    if items and all(isinstance(n, int) for n in items):
        return _cat_of_counts(items, index_bits, profile)
    specs = [spec_of(x) for x in items]
    ref = next((s for s in specs if s.numel), specs[0]) if specs else TensorSpec.contiguous((0,))
    shape = list(ref.shape)
    if shape:
        axis = dim % len(shape)
        shape[axis] = sum(s.shape[axis] for s in specs if len(s.shape) == len(shape))  # cat skips 1-D empties
    out = TensorSpec.contiguous(tuple(shape), ref.dtype)
    return classify_op("cat", specs, out, index_bits=index_bits, profile=profile)


def _cat_of_counts(numels: list[int], index_bits: int, profile: FaultProfile) -> Fault:
    if profile.judges_conservatively("families"):
        return conservative(lambda p: _cat_of_counts(numels, index_bits, p), profile)
    total = sum(numels)
    if total <= dim_max(index_bits):
        return OK
    readings = (_sized_fault("cat", "cat", total, one_d, index_bits, profile) for one_d in (True, False))
    return min((f for f in readings if not f.is_ok), key=lambda f: (f.inferred, not f.is_stop), default=OK)


@takes_release
def classify_op(op: Any, inputs: Iterable[Any] = (), out: Any = None, *, index_bits: int = MPS_INDEX_BITS,
                profile: Profile = None) -> Fault:
    """Decides one aten op call on MPS from its tensors' metadata: the one entry for every op.

    Args:
        op: an aten op name ("add", "masked_fill_", "aten::index.Tensor"), an op overload, or a family
            name (judged as the op its family's row measured); `family_of` maps it.
        inputs: the call's arguments in aten order; tensors (real, meta, fake) and `TensorSpec`s count,
            lists of them (cat) are opened, anything else (scalars, None) is skipped.
        out: the output tensor(s) or spec(s), if known (a broadcast output can outgrow every input).
        index_bits: the index width; every limit scales with it (DIM_MAX = 2**(index_bits - 1) - 1).
        profile: a torch release, a `FaultProfile`, or None for the installed torch's.

    Returns:
        The `Fault`. bmm/baddbmm, mm/addmm/linear and sdpa (the fused op; `sdpa_path` says whether a
        call takes it) go to their own rules; the other families: Note [Op families past INT_MAX].
    """
    family, tensors = family_of(op), _tensors(inputs)
    if family in ("bmm", "mm", "sdpa"):
        return _classify_product(op_base_name(op), family, tensors, index_bits, profile)
    if family == "view":
        return OK  # no kernel runs
    if profile.judges_conservatively("families"):
        return conservative(lambda p: classify_op(op, tensors, out, index_bits=index_bits, profile=p), profile)
    specs, most = [spec_of(x) for x in (*tensors, *_tensors([out]))], dim_max(index_bits)
    numel = max((s.numel for s in specs), default=0)
    if numel <= most:
        return OK
    long_dim = any(size > most for s in specs for size in s.shape)
    return _sized_fault(op_base_name(op), family, numel, long_dim, index_bits, profile)


def _tensors(items: Iterable[Any]) -> list[Any]:
    """The tensors and specs among `items`, lists (cat's inputs) opened."""
    found: list[Any] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            found += _tensors(item)
        elif isinstance(item, TensorSpec) or callable(getattr(item, "stride", None)):
            found.append(item)
    return found


# Where a product op keeps its operands in aten order: (a, b, added input); others (bmm, mm) (0, 1, 2).
_PRODUCT_ARGS = {"baddbmm": (1, 2, None), "addmm": (1, 2, 0), "linear": (0, 1, 2)}


def _classify_product(name: str, family: str, tensors: list[Any], index_bits: int, profile: Profile) -> Fault:
    """bmm/mm/sdpa calls that `classify_op` hands over, their operands picked out of aten's order."""
    if family == "sdpa":
        return classify_sdpa(tensors[0], tensors[1], index_bits=index_bits, profile=profile)
    ia, ib, ic = _PRODUCT_ARGS.get(name, (0, 1, 2))
    if family == "bmm":
        return classify_bmm(tensors[ia], tensors[ib], index_bits=index_bits, profile=profile)
    a, b = spec_of(tensors[ia]), spec_of(tensors[ib])
    bias = tensors[ic] if ic is not None and ic < len(tensors) else None
    if name == "linear":  # x (..., K) @ w (N, K)^T: matmul folds x's leading dims; w.t() is a transposed view
        if len(a.shape) != 2:
            rows = TensorSpec.contiguous((a.numel // max(a.shape[-1], 1), a.shape[-1]), a.dtype)
            a = dataclasses.replace(rows, storage_offset=a.storage_offset)
        b = b.transpose()
    return classify_mm(a, b, bias=bias, index_bits=index_bits, profile=profile)


def _sized_fault(name: str, family: str, numel: int, long_dim: bool, index_bits: int,
                 profile: FaultProfile) -> Fault:
    """What this release's first-pass code for `family` says of a call whose largest tensor has `numel`
    (> DIM_MAX) elements, with or without a dimension past DIM_MAX. See Note [Op families past INT_MAX]."""
    limit, view_limit = limits(index_bits)
    code = profile.family_codes(family)[0 if long_dim else 1]
    band = numel <= limit  # every row was measured above LIMIT
    measured_op = name == family or name in MEASURED_OPS.get(family, ())
    inferred, release = band or not long_dim or not measured_op, profile.release
    if code in ("abort", "error", "wrong"):
        return _dimension_fault(family, code, inferred, profile)
    if code == "wrap" and not band:
        message = (f"returns the result of the first numel mod 2**{index_bits} elements "
                   f"(ones(N).sum() returns N mod 2**{index_bits})")
        return Fault("wrong_all", None, 0, message, "reduction-wrap", limit, release, inferred=inferred)
    if code == "sum-64-bit":  # a NotImplementedError on MPS
        message = SUM_64_BIT_MESSAGE.format(numel=numel)
        return Fault("error", None, None, message, "sum-64-bit", release=release, inferred=inferred)
    if code == "masked-fill-numel" and not band:
        message = MASKED_FILL_MESSAGE.format(bits=index_bits)
        return Fault("error", None, None, message, "masked-fill-numel", release=release, inferred=inferred)
    if code == "int32-kernel" and not band:
        return Fault("abort", None, None, SIGSEGV_MESSAGE, "int32-kernel", release=release, inferred=True)
    if code == "int32-offsets":
        if numel <= view_limit:
            return OK
        message = (f"torch.cat output of {numel} elements, every dimension below INT_MAX: its int32 offsets "
                   "wrap (pytorch#189960)")
        return Fault("wrong_other", None, None, message, "cat-int32-offsets", release=release)
    if code == "ok":
        return OK
    return unmeasured(family, profile, "a dimension past INT_MAX" if long_dim else f"{numel} elements")


def _dimension_fault(family: str, code: str, inferred: bool, profile: FaultProfile) -> Fault:
    """A dimension past INT_MAX: the abort, the INT_MAX error in the release's spelling, or wrong values."""
    rule = f"dim-int-max:{family}"
    if code == "abort":
        message = CAT_ABORT_MESSAGE if family == "cat" else FAMILY_ABORT_MESSAGE
        return Fault("abort", None, None, message, rule, release=profile.release, inferred=inferred)
    if code == "error":
        return Fault("error", None, None, profile.view_message, rule, release=profile.release, inferred=inferred)
    message = f"{family} with a dimension past INT_MAX: wrong on MPS {profile.release}; values not characterised"
    return Fault("wrong_other", None, None, message, rule, release=profile.release, inferred=inferred)
