"""A fault plan: every call one run makes on MPS under a torch release, in order, each with its fault
(matrix products, SDPA, and the other ops whose tensors pass the per-dimension limit); built by the
tracer, replayed by the emulator, read by plan, check and run."""

from __future__ import annotations

import dataclasses
from typing import Any

from mpsimpact.engine.call import CallRecord, classify_record
from mpsimpact.engine.faults import MPS_INDEX_BITS, Fault, Profile, sdpa_path
from mpsimpact.engine.mac_memory import MacMemory, buffer_fault, call_bytes
from mpsimpact.engine.release import FaultProfile, takes_release


def runs_on_mps(trace: Any, profile: FaultProfile) -> list[Any]:
    """The traced calls MPS runs under `profile`: of an SDPA call, the fused op or its math path's calls
    (two ways of one call), as the release runs it. `trace` holds CallRecords, or anything with a `call`
    CallRecord (the fitted calls of safe_size), kept as they are."""
    records = [getattr(item, "call", item) for item in trace]
    parents = {c.index: c for c in records if c.family == "sdpa"}
    kept = []
    for item, call in zip(trace, records):
        sdpa = parents.get(call.within) if call.within is not None else call if call.family == "sdpa" else None
        if sdpa is None or (sdpa_path(sdpa.needs_grad, profile) == "math") == (call.family != "sdpa"):
            kept.append(item)
    return kept


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """Every bmm/mm/SDPA call one run makes on MPS under a torch release, in order, with its fault, and
    every other op whose largest tensor has more than DIM_MAX elements (the tracer's prefilter: below
    it no family rule applies), decided by its family (Note [Op families past INT_MAX]).

    `trace` keeps every call the tracer saw, SDPA's math-path calls included, so the same trace
    can be re-decided for another release (`under`): whether an SDPA call is one fused op or its
    math path's calls (bmm, the scale, softmax) depends on the release.
    """

    calls: tuple[CallRecord, ...]
    index_bits: int = MPS_INDEX_BITS
    trace: tuple[CallRecord, ...] = ()
    profile: FaultProfile | None = dataclasses.field(default=None, repr=False)  # the release deciding
    mac: MacMemory | None = None  # the Mac whose largest buffer also decides (None: the index rules alone)

    @classmethod
    @takes_release
    def from_trace(cls, trace: tuple[CallRecord, ...], index_bits: int, profile: Profile = None,
                   mac: MacMemory | None = None) -> FaultPlan:
        """The calls MPS makes under `profile`, each re-decided by that release's rules; on `mac`, a call whose
        tensor reaches its largest buffer is refused first (Note [The Mac's largest buffer])."""
        kept = (call.evolve(index=index, fault=decide(call, index_bits, profile, mac))
                for index, call in enumerate(runs_on_mps(trace, profile)))
        return cls(tuple(kept), index_bits, tuple(trace), profile, mac)

    def under(self, profile: Profile) -> FaultPlan:
        """The same trace, decided for another torch release (on the same Mac)."""
        return FaultPlan.from_trace(self.trace or self.calls, self.index_bits, profile, self.mac)

    def on_mac(self, mac: MacMemory | None) -> FaultPlan:
        """The same trace and release, decided on `mac` (None: by the index rules alone)."""
        if mac == self.mac:
            return self
        return FaultPlan.from_trace(self.trace or self.calls, self.index_bits, self.profile, mac)

    def out_of_memory(self, needed: int) -> FaultPlan:
        """The plan on a Mac whose high watermark a run needing `needed` bytes in all passes (its estimated peak):
        MPS stops it with "MPS backend out of memory" where the run makes its largest tensor (the first forward call
        that allocates it: where the peak is reached), unless that call stops already (the Mac's buffer refuses that
        tensor first) or no Mac is declared, or the run is judged at a narrowed index (its weights do not shrink
        with its limits: Note [The Mac's largest buffer])."""
        mac = self.mac
        if mac is None or mac.holds(needed) or self.index_bits != MPS_INDEX_BITS or not self.calls:
            return self
        at = max([c for c in self.calls if c.phase == "forward"] or self.calls, key=call_bytes)  # the first largest
        if at.fault.is_stop:
            return self
        fault = mac.out_of_memory(needed, self.profile.release if self.profile else "")
        return dataclasses.replace(self, calls=tuple(c.evolve(fault=fault) if c is at else c for c in self.calls))

    @property
    def faults(self) -> list[CallRecord]:
        """The calls that do not simply compute correctly."""
        return [call for call in self.calls if not call.fault.is_ok]

    @property
    def products(self) -> list[CallRecord]:
        """The bmm/mm/SDPA calls, in order: what the emulator's plan replay counts."""
        return [call for call in self.calls if call.is_product]

    @property
    def first_stop(self) -> CallRecord | None:
        """The first call that raises or aborts: on MPS the run ends there."""
        return next((c for c in self.calls if c.fault.is_stop), None)

    def to_json(self) -> dict[str, Any]:
        return {"index_bits": self.index_bits, "profile": self.profile.ref if self.profile else "",
                "calls": len(self.calls), "faults": [call.to_json() for call in self.faults],
                **({"mac": self.mac.to_json()} if self.mac is not None else {})}


def decide(call: CallRecord, index_bits: int, profile: FaultProfile, mac: MacMemory | None = None) -> Fault:
    """One call's fault: the Mac's refusal of a tensor past its largest buffer first, else the release's rules."""
    refused = buffer_fault(call, mac, index_bits, profile.release) if mac is not None else None
    return refused or classify_record(call, index_bits, profile)
