"""The measured torch releases: one fault profile per release group, the failure texts each prints, and
picking the profile of a version string. The rules that read these profiles live in faults.py.

See docs/fault-model.md, "Per-release differences" (the study's results/summary/studio/versions.md).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Literal

# What every console line, report and figure says when no Apple GPU was used.
MEASURED_RELEASES = ("2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.0")
CONSERVATIVE = "conservative"

INT_MAX_MESSAGE = "MPSGraph does not support tensor dims larger than INT_MAX"
INT_MAX_MESSAGE_TYPO = "MPSGaph does not support tensor dims larger than INT_MAX"  # sic, 2.9.1 .. 2.12.1
NDARRAY_ABORT_MESSAGE = (
    "failed assertion '[MPSNDArray initWithDevice:descriptor:isTextureBacked:] Error: NDArray dimension "
    "length > INT_MAX' (the process aborts, exit 134)"
)
_SRC_NDARRAY_LINE = {"2.5.1": 480, "2.6.0": 486, "2.7.1": 516, "2.8.0": 517}
ENCODE_FAILED_MESSAGE = "is too large for kernel. Encode failed."


@dataclasses.dataclass(frozen=True)
class FaultProfile:
    """How one torch release's MPS backend treats large matrix products.

    Attributes:
        release: the release string ("2.12.1"), or the version asked for when unmeasured.
        group: the release group of the study's table ("2.10.0-2.12.1"), or "unmeasured".
        measured: whether this exact release was measured; an unmeasured release inside a group's
            range is taken as its group; one outside every range is `conservative`.
        conservative: a call is unsafe if any measured release faults on it.
        output_rule: above 2**32 output elements: "strides-ignored" (a transposed operand is read as
            packed, 2.5.1 on) or "fp32-wrong" (2.4.1: wrong in fp32, pattern not characterised; fp16 ok).
        view_rule: a view operand at 2**31 elements or more: "raise" (RuntimeError), "abort" (2.5.1 ..
            2.8.0: abort below 2**32 of storage extent, RuntimeError at exactly 2**32, wrap above) or
            "truncate" (2.4.1: from 2**32 elements the result is truncated, mostly zeros).
        slice_extent: the view limit counts a slice's storage offset too (2.5.1 .. 2.9.1).
        view_message: the text of the view RuntimeError.
        mm_aborts: a 2-D mm/addmm output of 2**32 elements aborts the process (2.8.0 on).
        sdpa_fused: MPS has an SDPA op of its own for calls that need no gradient (2.5.1 on).
        sdpa_fused_wrong: that op is wrong above 2**32 score elements (2.5.1 .. 2.12.1).
        cat_rule: torch.cat above the limit: "abort" (2.4.1 .. 2.8.0, above 2**32), "error" (2.9.1 ..
            2.11.0, above 2**32), "wrong" (2.13.0, above 2**31, silently), or "ok".
        notes: model-level observations that the op-level rules do not explain.
    """

    release: str
    group: str
    measured: bool
    conservative: bool = False
    output_rule: Literal["strides-ignored", "fp32-wrong"] = "strides-ignored"
    view_rule: Literal["raise", "abort", "truncate"] = "raise"
    slice_extent: bool = False
    view_message: str = INT_MAX_MESSAGE
    mm_aborts: bool = True
    sdpa_fused: bool = True
    sdpa_fused_wrong: bool = False
    cat_rule: Literal["abort", "error", "wrong", "ok"] = "ok"
    notes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """E.g. "2.12.1", "2.12.0 (taken as 2.10.0-2.12.1)" or "2.15.0 (unmeasured release: conservative)"."""
        if self.conservative:
            return f"{self.release} (unmeasured release: conservative)"
        return self.release if self.measured else f"{self.release} (taken as {self.group})"

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self) | {"label": self.label}


_EAGER_2_4_1 = ("Model level, the first-pass suite saw eager attention (5712, 12, 256, 256) correct on 2.4.1, "
                "although the op-level rules predict its P V wrong (unexplained).")
_EAGER_2_13_0 = "Model level, eager attention (5712, 12, 256, 256) crashed (signal 11) on 2.13.0 in the first-pass suite."


def _group(version: tuple[int, int, int]) -> tuple[str, dict[str, object]] | None:
    """The release group of a version inside the measured range, and how it differs from 2.14.0."""
    typo = {"view_message": INT_MAX_MESSAGE_TYPO, "sdpa_fused_wrong": True}
    if version == (2, 4, 1):
        return "2.4.1", {"output_rule": "fp32-wrong", "view_rule": "truncate", "mm_aborts": False, "sdpa_fused": False,
                         "cat_rule": "abort", "notes": (_EAGER_2_4_1,)}
    if (2, 5, 0) <= version <= (2, 8, 99):
        return "2.5.1-2.8.0", {"view_rule": "abort", "slice_extent": True, "mm_aborts": version >= (2, 8, 0),
                               "sdpa_fused_wrong": True, "cat_rule": "abort"}
    if (2, 9, 0) <= version <= (2, 9, 99):
        return "2.9.1", typo | {"slice_extent": True, "cat_rule": "error"}
    if (2, 10, 0) <= version <= (2, 12, 99):
        return "2.10.0-2.12.1", typo | {"cat_rule": "error" if version < (2, 12, 0) else "ok"}
    if (2, 13, 0) <= version <= (2, 13, 99):
        return "2.13.0", {"cat_rule": "wrong", "notes": (_EAGER_2_13_0,)}
    if version == (2, 14, 0):
        return "2.14.0", {}
    return None


def parse_version(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of "2.13.0+cpu", "2.12.1", "2.15.0.dev20261101"; None if unreadable."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not match:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


@functools.lru_cache(maxsize=64)
def profile_for(version: str) -> FaultProfile:
    """The fault profile of a torch release string such as "2.13.0+cpu" or "2.5.1".

    Raises:
        ValueError: the string is not a version.
    """
    if version == CONSERVATIVE:
        return FaultProfile(CONSERVATIVE, "unmeasured", False, conservative=True)
    parsed = parse_version(version)
    if parsed is None:
        raise ValueError(f"'{version}' is not a torch release (expected e.g. 2.12.1)")
    release = ".".join(map(str, parsed))
    found = _group(parsed)
    if found is None:
        return FaultProfile(release, "unmeasured", False, conservative=True)
    group, fields = found
    return FaultProfile(release, group, release in MEASURED_RELEASES, **fields)  # type: ignore[arg-type]


def installed_profile() -> FaultProfile:
    """The profile of the torch installed here."""
    import torch

    return profile_for(torch.__version__)


def resolve_profile(profile: str | FaultProfile | None) -> FaultProfile:
    """None: the installed torch's release; a string: that release; a profile: itself."""
    if profile is None:
        return installed_profile()
    return profile if isinstance(profile, FaultProfile) else profile_for(profile)


def measured_profiles() -> tuple[FaultProfile, ...]:
    """One profile per measured release, oldest first."""
    return tuple(profile_for(release) for release in MEASURED_RELEASES)


def group_representatives() -> tuple[FaultProfile, ...]:
    """One measured release per release group (the last of each), oldest first: the version table's rows."""
    chosen: dict[str, FaultProfile] = {}
    for profile in measured_profiles():
        chosen[profile.group] = profile
    return tuple(chosen.values())


def view_equal_limit_message(profile: FaultProfile) -> str:
    """2.5.1 .. 2.8.0's RuntimeError for a view of exactly 2**32 elements of storage."""
    line = _SRC_NDARRAY_LINE.get(profile.release, 480)
    return (f'srcNDArray INTERNAL ASSERT FAILED at ".../OperationUtils.mm":{line}, please report a bug to PyTorch.')
