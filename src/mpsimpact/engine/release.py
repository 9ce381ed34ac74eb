"""The measured torch releases: one fault profile per release group, the failure texts each prints, the
first-pass suite's outcome for every op family on every release, the aten op -> family table, and
picking the profile of a version string. The rules that read these tables live in faults.py.

See docs/fault-model.md, "Per-release differences" (the study's results/summary/studio/versions.md) and
"Op families past INT_MAX".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Literal

from mpsimpact.bounds import Release, kind_problem, name_problem, path_problem, read_release, shown_path
from mpsimpact.engine.profile_file import ProfileFileError, profile_fields, read_profile_fields
from mpsimpact.errors import EnvironmentVariableError, UsageError

# What every console line, report and figure says when no Apple GPU was used.
MEASURED_RELEASES = ("2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0",
                     "2.14.0")
CONSERVATIVE = "conservative"
CACHE_VARIABLE = "MPSIMPACT_CACHE"  # the cache folder (`cache_root`)
STUDY = "study"  # the source of the profiles encoded here; a profile read from a file names that file

INT_MAX_MESSAGE = "MPSGraph does not support tensor dims larger than INT_MAX"
INT_MAX_MESSAGE_TYPO = "MPSGaph does not support tensor dims larger than INT_MAX"  # sic, 2.9.1 .. 2.12.1
NDARRAY_ABORT_MESSAGE = (
    "failed assertion '[MPSNDArray initWithDevice:descriptor:isTextureBacked:] Error: NDArray dimension "
    "length > INT_MAX' (the process aborts, exit 134)"
)
_SRC_NDARRAY_LINE = {"2.5.1": 480, "2.6.0": 486, "2.7.1": 516, "2.8.0": 517}
ENCODE_FAILED_MESSAGE = "is too large for kernel. Encode failed."
# The first-pass suite's texts (docs/fault-model.md, "Op families past INT_MAX").
FAMILY_ABORT_MESSAGE = "SIGABRT from MPSGraph/MPSNDArray (the process aborts; its text was not recorded)"
CAT_ABORT_MESSAGE = "MPSNDArray.mm:831: fail (SIGABRT: the process aborts)"
SIGSEGV_MESSAGE = "SIGSEGV (signal 11): the process dies with no error message"
# 2.14.0's NotImplementedError for a sum past INT_MAX
SUM_64_BIT_MESSAGE = "MPS sum_reduction: tensors requiring 64-bit indexing are not supported (numel={numel})"
MASKED_FILL_MESSAGE = "masked_fill not supported for tensors of more than 2**{bits} elements"  # 2**32 on MPS

# The study's first-pass suite as data (docs/fault-model.md, "Op families past INT_MAX"), read by Note [Op
# families past INT_MAX] in faults.py. One column per MEASURED_RELEASES entry: 2.4.1, 2.5.1, 2.6.0, 2.7.1,
# 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.0. Codes: "ok"; "abort"; "error" (the INT_MAX text, spelt
# as that release spells it); "wrong" (values not characterised); "wrap" (the result of the first numel mod
# 2**bits elements); "unmeasured" (conservative); the families' own checks "sum-64-bit" and
# "masked-fill-numel"; on 2.13.0 "int32-kernel" and "int32-offsets". A family missing from a table is
# unmeasured there.
_A, _E, _W, _O, _U = "abort", "error", "wrong", "ok", "unmeasured"

# A tensor with one dimension past INT_MAX: the suite's 1-D tests, N = 2**32 + 2**20 elements.
ONE_DIMENSION_ROWS: dict[str, tuple[str, ...]] = {
    # fp16 ones(N) * 2 + 1
    "elementwise": (_A, _A, _A, _A, _W, _E, _E, _E, _O, _O, _O),
    # uint8 ones(N).sum(): 2.13.0 returns N mod 2**32; 2.14.0 raises its own NotImplementedError
    "reduction": (_A, _A, _A, _A, _A, _E, _E, _E, _E, "wrap", "sum-64-bit"),
    # int64 arange(N) % 1000, then x[[0, 2**32 + 5, N - 1]]: one test, so arange shares the indexing row
    "indexing": (_A, _A, _A, _A, _W, _E, _E, _E, _E, _E, _W),
    # uint8 zeros(2**32 + 16).masked_fill_(mask, 7): from 2.7.1 masked_fill's own element-count check
    "masked_fill": (_A, _A, _A) + ("masked-fill-numel",) * 8,
    # cat of two fp16 halves of 2**31 + 2**19 elements each (output N)
    "cat": (_A,) * 5 + (_E,) * 3 + (_O,) * 3,
    # ones/zeros: values shown right from 2.12.1 (ones(N) * 2 + 1 is ok there); before, every test that
    # made one crashed, raised in a later op or was wrong, so its values were never seen
    "creation": (_U,) * 8 + (_O,) * 3,
}

# A multi-dimensional tensor of more than INT_MAX elements with no dimension past INT_MAX.
MULTI_DIMENSION_ROWS: dict[str, tuple[str, ...]] = {
    # the scale and softmax of eager attention's (5712, 12, 256, 256) scores: clean where the test did not
    # crash (results/workload saw S and P right); 2.13.0 died with SIGSEGV
    "elementwise": (_O,) * 9 + ("int32-kernel", _O),
    "softmax": (_O,) * 9 + ("int32-kernel", _O),
    # (65552, 256, 256) fp16 .transpose(1, 2).contiguous(): ok on every release
    "copy": (_O,) * 11,
    # every multi-dimensional test's inputs reached MPS intact (inferred: how they were made is not recorded)
    "creation": (_O,) * 11,
    "random": (_O,) * 11,
    # 2.14.0's text names 64-bit indexing, which a multi-dimensional tensor needs as much (inferred)
    "reduction": (_U,) * 10 + ("sum-64-bit",),
    # masked_fill's text names an element count, whatever the shape (inferred)
    "masked_fill": (_U,) * 3 + ("masked-fill-numel",) * 8,
    # pytorch#189960: 2.13.0's cat kernel takes int32 offsets unless a dimension is past INT_MAX; 2.14.0 has
    # the fix (inferred)
    "cat": (_U,) * 9 + ("int32-offsets", _O),
}


def _ops(family: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), family)


# aten op name (overload and in-place "_" dropped) -> family. "view": no kernel runs (nothing to fault).
# Ops not listed are family "other": nobody measured them past a limit, so they are judged conservatively.
OP_FAMILIES: dict[str, str] = {
    **_ops("bmm", "bmm baddbmm"),
    **_ops("mm", "mm addmm linear"),
    **_ops("sdpa", "sdpa scaled_dot_product_attention _scaled_dot_product_attention_math_for_mps"),
    **_ops("elementwise", """
        add sub rsub mul div remainder fmod pow neg abs exp exp2 expm1 log log2 log10 log1p sqrt rsqrt
        reciprocal sigmoid tanh sin cos erf erfinv gelu silu relu mish elu leaky_relu hardtanh softplus
        hardswish hardsigmoid where clamp clamp_min clamp_max maximum minimum eq ne lt le gt ge logical_and
        logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not sign floor ceil
        round trunc frac addcmul addcdiv lerp square floor_divide atan2 hypot threshold nan_to_num
        gelu_backward silu_backward sigmoid_backward tanh_backward threshold_backward"""),
    **_ops("softmax", """
        softmax _softmax log_softmax _log_softmax _safe_softmax _softmax_backward_data
        _log_softmax_backward_data"""),
    **_ops("reduction", """
        sum nansum mean prod amax amin max min argmax argmin var std var_mean std_mean norm
        linalg_vector_norm all any logsumexp count_nonzero"""),
    **_ops("indexing", """
        index index_put _index_put_impl index_select gather scatter scatter_add scatter_reduce take put
        embedding embedding_dense_backward masked_select masked_scatter nonzero index_add index_copy
        index_fill arange"""),
    **_ops("masked_fill", "masked_fill"),
    **_ops("cat", "cat concat concatenate stack"),
    **_ops("creation", """
        ones zeros full fill zero ones_like zeros_like full_like new_ones new_zeros new_full
        scalar_tensor"""),
    **_ops("random", """
        normal uniform bernoulli randn rand randint randperm exponential random native_dropout multinomial
        randn_like rand_like randint_like"""),
    **_ops("copy", "clone copy _to_copy _copy_from _copy_from_and_resize contiguous"),
    **_ops("view", """
        view _unsafe_view reshape _reshape_alias expand transpose permute t slice select unsqueeze squeeze
        as_strided alias detach empty empty_like empty_strided new_empty new_empty_strided unbind split
        split_with_sizes chunk narrow unfold lift_fresh view_as_real view_as_complex diagonal movedim
        flatten unflatten"""),
}
FAMILIES = frozenset(OP_FAMILIES.values()) | {"other"}
# The "view" ops that allocate a buffer (without a kernel): where a Mac's largest buffer refuses one.
ALLOCATING = frozenset("empty empty_like empty_strided new_empty new_empty_strided empty_permuted".split())


def allocates(op: object) -> bool:
    """Whether an op (name or overload) allocates a new buffer without running a kernel (`ALLOCATING`)."""
    return op_base_name(op) in ALLOCATING


# The op each first-pass row ran; a family's other ops follow that row, inferred.
MEASURED_OPS: dict[str, frozenset[str]] = {
    family: frozenset(names.split()) for family, names in {
        "elementwise": "mul add", "reduction": "sum", "indexing": "arange index", "cat": "cat",
        "masked_fill": "masked_fill", "creation": "ones zeros", "copy": "clone copy",
        "softmax": "softmax _softmax",
    }.items()
}


@functools.lru_cache(maxsize=4096)
def op_base_name(op: object) -> str:
    """"add" for "add", "add_", "aten::add_.Tensor" or the op overload aten.add_.Tensor (its __name__); cached:
    plan and check ask it of every traced call, for every release and geometry they decide."""
    name = op if isinstance(op, str) else getattr(op, "__name__", str(op))
    name = name.removeprefix("aten::").split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name  # in-place: same kernel


@functools.lru_cache(maxsize=4096)
def family_of(op: object) -> str:
    """The family of an aten op (a name or an op overload, see `op_base_name`); a family name stands for
    itself; an op not in OP_FAMILIES is "other"."""
    name = op_base_name(op)
    return name if name in FAMILIES else OP_FAMILIES.get(name, "other")


@dataclasses.dataclass(frozen=True)
class FaultProfile:
    """How one torch release's MPS backend treats large matrix products.

    Attributes:
        release: the release string ("2.12.1"), or the version asked for when unmeasured.
        group: the release group of the study's table ("2.10.0-2.12.1"), or "unmeasured"; a profile
            read from a file is its own group (its release).
        measured: whether this exact release was measured (on a Mac, for a file); an unmeasured release
            inside a group's range is taken as its group; one outside every range is `conservative`.
        conservative: a call is unsafe if any measured release faults on it.
        output_rule: above 2**32 output elements: "strides-ignored" (a transposed operand is read as
            packed, 2.5.1 on), "fp32-wrong" (2.4.1: wrong in fp32, pattern not characterised; fp16 ok)
            or "correct" (a release that fixed it; still terminal: rules 2 and 3 are skipped).
        view_rule: a view operand at 2**31 elements or more: "raise" (RuntimeError), "abort" (2.5.1 ..
            2.8.0: abort below 2**32 of storage extent, RuntimeError at exactly 2**32, wrap above),
            "truncate" (2.4.1: from 2**32 elements the result is truncated, mostly zeros) or "none".
        slice_extent: the view limit counts a slice's storage offset too (2.5.1 .. 2.9.1).
        input_wrap: a contiguous operand above 2**32 elements wraps (rule 3; every measured release).
        view_message: the text of the view RuntimeError.
        limit_message: the RuntimeError of a view of exactly 2**32 elements under view_rule "abort";
            "" for the study's text of this release (`view_equal_limit_message`).
        mm_aborts: a 2-D mm/addmm/Linear whose input has more than 2**32 elements aborts the process (2.8.0
            on, measured), and so does one whose output has 2**32 or more (measured on 2.14.0); before 2.8.0
            such an input is right and such an output unmeasured.
        sdpa_fused: MPS has an SDPA op of its own for calls that need no gradient (2.5.1 on).
        sdpa_fused_wrong: that op is wrong above 2**32 score elements (2.5.1 .. 2.12.1).
        families: (family, code with a dimension past INT_MAX, code for a multi-dimensional tensor past
            INT_MAX elements) from ONE_DIMENSION_ROWS and MULTI_DIMENSION_ROWS, this release's column.
        notes: model-level observations that the op-level rules do not explain.
        unmeasured: the profile_file.ASPECTS its measurement did not cover ("mm", "sdpa", "families";
            "bmm" when no setting of the bmm fields agrees with its cells): judged per call as the
            conservative profile judges them (faults.conservative).
        alternatives: when several settings of the profile_file.BMM_FIELDS agree with every measured
            cell, each one as (field, value) pairs: a call is judged by the worst of them where they
            differ (faults.undecided), exactly where they agree. Empty: the fields above are decided.
        source: "study" (the tables here), or the absolute path of the profile.json it was read from.
        measured_on: for a file, what it was measured on ("torch 2.15.0, macOS 15.1 arm64 (Apple M2
            Ultra), mps, 2026-11-20"); "" for the study.
    """

    release: str
    group: str
    measured: bool
    conservative: bool = False
    output_rule: Literal["strides-ignored", "fp32-wrong", "correct"] = "strides-ignored"
    view_rule: Literal["raise", "abort", "truncate", "none"] = "raise"
    slice_extent: bool = False
    view_message: str = INT_MAX_MESSAGE
    mm_aborts: bool = True
    sdpa_fused: bool = True
    sdpa_fused_wrong: bool = False
    families: tuple[tuple[str, str, str], ...] = ()
    notes: tuple[str, ...] = ()
    input_wrap: bool = True
    limit_message: str = ""
    unmeasured: tuple[str, ...] = ()
    alternatives: tuple[tuple[tuple[str, Any], ...], ...] = ()
    source: str = STUDY
    measured_on: str = ""

    @property
    def label(self) -> str:
        """E.g. "2.12.1", "2.12.0 (taken as 2.10.0-2.12.1)", "2.15.0 (unmeasured release: conservative)",
        "2.14.0rc1 (unmeasured pre-release: conservative)" or "2.15.0 (from /path/profile.json)"."""
        if self.conservative:
            return f"{self.release} (unmeasured {'pre-release' if _is_prerelease(self.release) else 'release'}: " \
                   "conservative)"
        if self.source != STUDY:
            return f"{self.release} (from {self.source})"
        return self.release if self.measured else f"{self.release} (taken as {self.group})"

    @property
    def ref(self) -> str:
        """What `resolve_profile` takes back to this profile: the file's path, else the release (or
        "conservative"). Plans and run geometries keep this string."""
        return self.release if self.source == STUDY else self.source

    def judges_conservatively(self, aspect: str) -> bool:
        """Whether calls of this aspect ("bmm", "mm", "sdpa", "families") are judged as the conservative
        profile judges them."""
        return self.conservative or aspect in self.unmeasured

    def settings(self) -> tuple[FaultProfile, ...]:
        """One profile per setting of the bmm fields its measurement left open; itself when decided."""
        if not self.alternatives:
            return (self,)
        return tuple(dataclasses.replace(self, alternatives=(), **dict(alt)) for alt in self.alternatives)

    def family_codes(self, family: str) -> tuple[str, str]:
        """(code with a dimension past INT_MAX, code multi-dimensional past INT_MAX elements) of a family."""
        return next(((one, multi) for name, one, multi in self.families if name == family), (_U, _U))

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self) | {"label": self.label}


def _is_prerelease(name: str) -> bool:
    """Whether a release's name is a pre-release or a development build's ("2.14.0rc1", "2.15.0.dev2026")."""
    try:
        return not read_release(name).is_final
    except ValueError:
        return False


_EAGER_2_4_1 = ("In the study's tests of whole ops (one shape each), eager attention (5712, 12, 256, 256) came "
                "back correct on 2.4.1, although the op-level rules predict its weighted sum of the values wrong "
                "(unexplained).")
_EAGER_2_13_0 = ("In the study's tests of whole ops (one shape each), eager attention (5712, 12, 256, 256) crashed "
                 "the process (signal 11) on 2.13.0; the rules put the crash at the scaling or softmax of its more "
                 "than 2^32 scores (inferred).")


def _group(version: tuple[int, int, int]) -> tuple[str, dict[str, object]] | None:
    """The release group of a version inside the measured range, and how it differs from 2.14.0."""
    typo = {"view_message": INT_MAX_MESSAGE_TYPO, "sdpa_fused_wrong": True}
    if version == (2, 4, 1):
        return "2.4.1", {"output_rule": "fp32-wrong", "view_rule": "truncate", "mm_aborts": False, "sdpa_fused": False,
                         "notes": (_EAGER_2_4_1,)}
    if (2, 5, 0) <= version <= (2, 8, 99):
        return "2.5.1-2.8.0", {"view_rule": "abort", "slice_extent": True, "mm_aborts": version >= (2, 8, 0),
                               "sdpa_fused_wrong": True}
    if (2, 9, 0) <= version <= (2, 9, 99):
        return "2.9.1", typo | {"slice_extent": True}
    if (2, 10, 0) <= version <= (2, 12, 99):
        return "2.10.0-2.12.1", typo
    if (2, 13, 0) <= version <= (2, 13, 99):
        return "2.13.0", {"notes": (_EAGER_2_13_0,)}
    if version == (2, 14, 0):
        return "2.14.0", {}
    return None


@functools.lru_cache(maxsize=256)
def parse_version(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a package's own version ("2.13.0+cpu", "2.12.1", "2.15.0.dev20261101"), read
    leniently (its first numbers, digits 0-9 only); None if unreadable. A release asked for is read whole:
    `parse_release`."""
    if not (match := re.match(r"^([0-9]+)\.([0-9]+)(?:\.([0-9]+))?", version)):
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def release_name(version: str) -> str | None:
    """The release a package's own version names: "2.13.0" for "2.13.0+cpu" (a build of it), "2.15.0.dev20261101"
    and "2.14.0rc1" as they are (never their final release's); where it is not PEP 440's form, its first
    numbers (`parse_version`); None if unreadable."""
    try:
        return str(read_release(version))
    except ValueError:
        parsed = parse_version(version)
        return ".".join(map(str, parsed)) if parsed else None


def parse_release(text: str) -> Release:
    """A release asked for (--torch-profile, `profile=`), read whole by the one rule for what a person types
    (bounds.read_release): its pre-release, post-release and development parts kept, never dropped.

    Raises:
        UnknownReleaseError (a ValueError): `text` is no release ("2.12.1.1", "２.14.0", " 2.14.0").
    """
    try:
        return read_release(text)
    except ValueError:
        raise UnknownReleaseError(f"'{text}' is not a torch release (expected e.g. 2.12.1)", release=text) from None


@functools.lru_cache(maxsize=64)
def profile_for(version: str) -> FaultProfile:
    """The fault profile of a torch release string such as "2.13.0+cpu" or "2.5.1", named as the release it is
    (a build's "+cpu" aside). A release measured is itself; another final one inside a group's range (2.12.0, a
    post-release 2.14.0.post1) is taken as its group, said in its label; a pre-release or a development build
    (2.14.0rc1, 2.15.0.dev20261101), which nobody measured and which may lack what its final release fixed, and
    a release outside every range, are judged conservatively, named as they are.

    Raises:
        UnknownReleaseError (a ValueError): the string is not a version.
    """
    if version == CONSERVATIVE:
        return FaultProfile(CONSERVATIVE, "unmeasured", False, conservative=True)
    parsed = parse_release(version)
    release = str(parsed)
    found = _group(parsed.number) if parsed.is_final else None
    if found is None:
        return FaultProfile(release, "unmeasured", False, conservative=True)
    group, fields = found
    return FaultProfile(release, group, release in MEASURED_RELEASES, families=_family_column(parsed.number),
                        **fields)  # type: ignore[arg-type]


def _family_column(version: tuple[int, int, int]) -> tuple[tuple[str, str, str], ...]:
    """The first-pass codes of the measured release of this minor version (2.12.0 is taken as 2.12.1)."""
    minor = f"{version[0]}.{version[1]}."
    column = next(i for i, release in enumerate(MEASURED_RELEASES) if release.startswith(minor))
    unmeasured = (_U,) * len(MEASURED_RELEASES)
    one, multi = ONE_DIMENSION_ROWS, MULTI_DIMENSION_ROWS
    return tuple((f, one.get(f, unmeasured)[column], multi.get(f, unmeasured)[column])
                 for f in sorted(one.keys() | multi.keys()))


def cache_root() -> Path:
    """The mpsimpact cache folder: $MPSIMPACT_CACHE, else $XDG_CACHE_HOME/mpsimpact (an absolute path: the XDG
    specification says a relative one is ignored), else ~/.cache/mpsimpact. Everything kept between runs lives
    under it: profiles in its `profiles/`, references in its `reference/`, transformers environments in its
    `envs/`, datasets in its `datasets/`. What is found there is checked by whoever reads it. Nothing is made
    outside it: the folder it goes under (XDG_CACHE_HOME, or HOME) must be an existing folder.

    Raises:
        EnvironmentVariableError: the variable that names it gives a name this system cannot take, or a HOME
            (or XDG_CACHE_HOME) that is empty, relative, missing, not a folder or holds a control character:
            one line naming MPSIMPACT_CACHE, the way to say where the cache goes.
    """
    environ = os.environ
    return _cache_root(environ.get(CACHE_VARIABLE), environ.get("XDG_CACHE_HOME"), environ.get("HOME"))


@functools.lru_cache(maxsize=16)
def _cache_root(root: str | None, xdg: str | None, home: str | None) -> Path:
    if root and root.strip():
        variable, value, folder, base = CACHE_VARIABLE, root, Path(root), None
    elif xdg and os.path.isabs(xdg):
        variable, value, folder, base = "XDG_CACHE_HOME", xdg, Path(xdg) / "mpsimpact", xdg
    else:  # HOME, or where it is unset the user's home in the password database
        base = home if home is not None else os.path.expanduser("~")
        variable, value, folder = "HOME", base, Path(base) / ".cache" / "mpsimpact"
    unset = " (HOME is unset: this is the password database's home)" if variable == "HOME" and home is None else ""
    if (problem := _control_problem(value) or (base is not None and _base_problem(base))):
        raise EnvironmentVariableError(
            variable, value, f"{problem}{unset}, so mpsimpact has no place for its cache folder "
                             f"({shown_path(folder, 80)})",
            f"set {CACHE_VARIABLE} to the folder mpsimpact may keep its cache in (it makes nothing outside it)",
            unset=variable != "HOME")
    if (problem := name_problem(folder)) is not None:
        raise EnvironmentVariableError(variable, value, f"makes a cache folder that {problem}{unset}",
                                       "point it at a shorter path", unset=variable != "HOME")
    return folder


def _control_problem(value: str) -> str:
    """"holds a control character (\\n)" where `value` holds one (a newline, a tab, ...); "" where none."""
    found = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    return "" if found is None else f"holds a control character ({repr(found)[1:-1]})"


def _base_problem(base: str) -> str:
    """What keeps the folder the cache goes under (HOME, XDG_CACHE_HOME) from taking it, or "": empty, relative
    (the cache would follow the folder each command runs in), missing (its whole tree would be made), or
    anything but a folder."""
    if not base:
        return "is empty"
    if not os.path.isabs(base):
        return "is a relative path (the cache would follow the folder each command runs in)"
    if name_problem(base) is None and not os.path.isdir(base):
        return "is not a folder" if os.path.lexists(base) else "does not exist (its whole tree would be made)"
    return ""


def cached_profile_path(release: str) -> Path:
    """Where a profile.json of `release` ("2.15.0") is found for the installed torch of that release."""
    return cache_root() / "profiles" / f"{release}.json"


def installed_profile() -> FaultProfile:
    """The profile of the torch installed here: the profile.json of its release in the cache
    (`cached_profile_path`) where there is one, its label naming that file (read again only when it changed:
    `load_profile`); else the study's."""
    import torch

    name = release_name(torch.__version__)
    cached = cached_profile_path(name) if name else None
    if cached is None or not os.path.lexists(cached):  # no exception raised for the usual case: no file
        return profile_for(torch.__version__)
    return load_profile(cached)  # a dangling link, a FIFO, a malformed file: said in one line


# The release of the study's published demo (docs/fault-model.md, "The published downstream demo"): measured,
# and the bug is silent there. Without an Apple GPU, commands judge it unless --torch-profile says otherwise.
PUBLISHED_DEMO_RELEASE = "2.14.0"
# Why a command judges the release it judges.
ASKED, ON_THIS_MAC, NO_APPLE_GPU = "--torch-profile", "installed on this Mac", "no Apple GPU here"


@dataclasses.dataclass(frozen=True)
class JudgedRelease:
    """The torch release whose MPS faults a command emulates, guards against and plans, and why: the one
    --torch-profile names; else on a Mac the installed torch (its GPU runs that release); else, where the
    installed torch says nothing about a Mac, the published demo's release (`PUBLISHED_DEMO_RELEASE`)."""

    profile: FaultProfile
    reason: str  # ASKED, ON_THIS_MAC or NO_APPLE_GPU
    installed: FaultProfile

    @property
    def is_installed(self) -> bool:
        """Whether the judged release is the installed one (so nothing else to say about a Mac)."""
        return self.profile.ref == self.installed.ref

    def sentence(self, flag: str = "--torch-profile") -> str:
        """Which release, and why, in one sentence; `flag`: the option that asks for one (the pytest plugin's
        --mps-profile)."""
        judged = f"torch {self.profile.label}"
        if self.reason == ASKED:
            return f"Judged as {judged}, as {flag} asked (torch {self.installed.label} is installed)."
        if self.reason == ON_THIS_MAC:
            return f"Judged as {judged}, the release installed on this Mac."
        return (f"Judged as {judged}, a release measured on Macs where the bug is silent: there is no Apple "
                f"GPU here to run the installed torch {self.installed.label} on.")

    def to_json(self) -> dict[str, object]:
        return {"judged": self.profile.ref, "release": self.profile.release, "label": self.profile.label,
                "measured": not self.profile.conservative, "why": self.reason,
                "installed": self.installed.release, "sentence": self.sentence()}


def judge_release(asked: str | None, apple_gpu: bool | None = None) -> JudgedRelease:
    """The release a command judges (see JudgedRelease); `apple_gpu` None: whether torch sees MPS here.

    Raises:
        ValueError, ProfileFileError: as `resolve_profile` for a bad --torch-profile.
    """
    installed = installed_profile()
    if asked is None and apple_gpu is None:
        import torch

        apple_gpu = torch.backends.mps.is_available()
    if asked is None and apple_gpu:
        return JudgedRelease(installed, ON_THIS_MAC, installed)
    reason = ASKED if asked is not None else NO_APPLE_GPU
    return JudgedRelease(resolve_profile(PUBLISHED_DEMO_RELEASE if asked is None else asked), reason, installed)


def load_profile(path: str | Path) -> FaultProfile:
    """The profile in a profile.json (written by `mpsimpact sweep`; format: engine.profile_file), read
    once per version of the file; its `source` is the file's absolute path.

    Raises:
        ProfileFileError: the file is missing, unreadable or malformed; one line naming the file and field.
    """
    path = Path(path).expanduser().absolute()
    problem = name_problem(path)
    try:
        stat = None if problem else path.stat()
    except OSError as error:
        problem = path_problem(path) if path.is_symlink() else None  # dangling, or looping
        if problem is None:
            raise ProfileFileError(f"Cannot read the profile '{path}': {error.strerror}; pass a profile.json "
                                   "written by `mpsimpact sweep`.", path) from None
    problem = problem or kind_problem(stat.st_mode)  # a FIFO is never opened: see Note [Only regular files]
    if problem is not None:
        raise ProfileFileError(f"Profile '{shown_path(path)}' {problem}; pass a profile.json written by "
                               "`mpsimpact sweep`.", path)
    return _load_profile(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _load_profile(path: Path, mtime_ns: int, size: int) -> FaultProfile:
    return FaultProfile(**read_profile_fields(path, FAMILIES))


def profile_from_json(data: Any, origin: str | Path) -> FaultProfile:
    """The profile of profile.json's parsed content (e.g. derived from a sweep's rows in memory); `origin`
    names it in errors and is its `source`.

    Raises:
        ProfileFileError: a field is wrong (the message names `origin` and the field).
    """
    return FaultProfile(**profile_fields(data, Path(origin), FAMILIES))


def is_profile_path(text: str) -> bool:
    """Whether a --torch-profile value names a profile file rather than a release: a .json name, a path, or
    anything but a folder of that name here (a FIFO named 'p' is refused as one, not taken for a release)."""
    return (text.endswith(".json") or "/" in text or os.sep in text
            or (os.path.lexists(text) and not os.path.isdir(text)))


def resolve_profile(profile: str | FaultProfile | None) -> FaultProfile:
    """None: the installed torch's (see `installed_profile`); a release ("2.12.1") or "conservative":
    that profile; a path to a profile.json (`is_profile_path`): that file's; a profile: itself.

    Raises:
        ValueError: a string that is neither a release nor a path; a ProfileFileError (one) when the
            profile file is missing or malformed (the message names the file and field).
    """
    if profile is None:
        return installed_profile()
    if isinstance(profile, FaultProfile):
        return profile
    return load_profile(profile) if is_profile_path(profile) else profile_for(profile)


class UnknownReleaseError(UsageError, ValueError):
    """A release asked for (--torch-profile, `profile=`) that is not a torch version; a ValueError too."""


def takes_release(function: Any) -> Any:
    """Lets a public function or mode take its `profile` (by keyword or position) as a release ("2.12.1"),
    "conservative", a profile.json's path, a FaultProfile or None (the installed torch's): resolved here,
    where the call comes in; a FaultProfile (how a release travels inside) is passed on as it is.

    Raises:
        ValueError, ProfileFileError: as `resolve_profile`, for a release that cannot be resolved.
    """
    parameters = inspect.signature(function).parameters
    keyword_only = parameters["profile"].kind is inspect.Parameter.KEYWORD_ONLY  # after *args (trace_faults)
    where = 1 << 30 if keyword_only else list(parameters).index("profile")

    @functools.wraps(function)
    def resolved(*args: Any, **kwargs: Any) -> Any:
        positional = len(args) > where
        profile = args[where] if positional else kwargs.get("profile")
        if isinstance(profile, FaultProfile):
            return function(*args, **kwargs)
        profile = resolve_profile(profile)
        if positional:
            return function(*args[:where], profile, *args[where + 1:], **kwargs)
        return function(*args, **kwargs | {"profile": profile})

    return resolved


def measured_profiles() -> tuple[FaultProfile, ...]:
    """One profile per measured release, oldest first."""
    return tuple(profile_for(release) for release in MEASURED_RELEASES)


def group_representatives() -> tuple[FaultProfile, ...]:
    """One measured release per release group (the last of each), oldest first: the version table's rows."""
    return tuple({profile.group: profile for profile in measured_profiles()}.values())


def view_equal_limit_message(profile: FaultProfile) -> str:
    """2.5.1 .. 2.8.0's RuntimeError for a view of exactly 2**32 elements of storage."""
    if profile.limit_message:
        return profile.limit_message
    line = _SRC_NDARRAY_LINE.get(profile.release, 480)
    return (f'srcNDArray INTERNAL ASSERT FAILED at ".../OperationUtils.mm":{line}, please report a bug to PyTorch.')


def bmm_failure_texts() -> tuple[str, ...]:
    """Every text the study recorded for a bmm that raises or aborts, in each release's spelling."""
    at_limit = (view_equal_limit_message(profile_for(release)) for release in _SRC_NDARRAY_LINE)
    return (INT_MAX_MESSAGE, INT_MAX_MESSAGE_TYPO, NDARRAY_ABORT_MESSAGE, *at_limit)


def torch_words(text: str | None) -> str:
    """torch's own error text, quoted as torch's ("in torch's own words: '...'"); torch's own misspelling
    (2.9.1 .. 2.12.1's "MPSGaph") said to be torch's, so that no reader takes it for ours."""
    typo = text is not None and INT_MAX_MESSAGE_TYPO.split()[0] in text
    return f"in torch's own words{', misspelling and all' if typo else ''}: '{text}'"
