"""The sweep's op-family cells: the study's first-pass tests (Linear, the 1-D ops past the per-dimension
limit, the multi-dimensional ops past DIM_MAX elements, fused SDPA), scaled to the sweep's index width,
each run once and judged against the CPU. See Note [Op families past INT_MAX] in engine/families.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from mpsimpact.engine.faults import OK, SILENT_KINDS, STOP_KINDS, Fault, limits
from mpsimpact.engine.mac_memory import tensor_bytes
from mpsimpact.runs.cell import (
    CHUNK_ELEMENTS, NOT_RUN, SPEEDS, finite_or_none, is_allocation_failure, is_error_value, random_tensor,
    worker_main,
)

WRONG_ABOVE = 1e-2  # the first-pass suite's criterion: relative error above 1e-2 against the CPU is WRONG
RANDOM_SCALE = 1e-2  # random draws: a mean or a standard deviation off by more than this is WRONG
NO_VALUES = {"max_rel_error": None}
# What a family cell can be observed as, and the fields of its row that say so (see runs.row_check).
FAMILY_OBSERVED = frozenset({"ok", "wrong", "wrap", "wrong_other", "crash", NOT_RUN}) | STOP_KINDS
FAMILY_SEEN_FIELDS = ("observed", "max_rel_error", "message", "rule")
_DT = {"fp32": torch.float32, "fp16": torch.float16, "uint8": torch.uint8, "int64": torch.int64,
       "bool": torch.bool}
# An input: (name, shape, dtype, fill); fill is "randn", "ones", "zeros", "twos", "true" or "arange%1000".
Input = tuple[str, tuple[int, ...], str, str]


def long_length(index_bits: int) -> int:
    """N of the 1-D tests: 2**32 + 2**20 at 32 bits, LIMIT + LIMIT / 4096 (at least 16 more) below."""
    limit = limits(index_bits)[0]
    return limit + max(16, limit >> 12)


def multi_shape(index_bits: int) -> tuple[int, int, int]:
    """(G, 16, 256): more than LIMIT elements (LIMIT * 17 / 16 and a row), no dimension past DIM_MAX;
    like the (5712, 12, 256, 256) scores of eager attention (4.49e9 elements) at 32 bits."""
    limit = limits(index_bits)[0]
    return (limit // 4096 + max(1, limit >> 16) + 1, 16, 256)


@dataclasses.dataclass(frozen=True)
class FamilyTest:
    """One first-pass test: what it runs on the device, on which inputs (made on the device, as the study
    made them), and which rule it decides: `aspect` "families" (the `family`'s row for a dimension past
    INT_MAX when `one_d`, else its multi-dimensional row), "mm" or "sdpa"."""

    name: str
    aspect: str
    family: str
    one_d: bool
    text: str
    inputs: Callable[[int], tuple[Input, ...]]
    run: Callable[[dict[str, torch.Tensor], str, int], torch.Tensor]
    wraps: bool = False  # a reduction whose wrap (the first numel mod LIMIT elements) is characterised
    random: bool = False  # judged by its moments, not against the CPU's draws
    # The inputs whose slices along dim 0 give the output's slices (the op acts on each alone): judged a block
    # of rows at a time, with no whole copy on the CPU, so a cell needs about half the memory.
    rows_of: tuple[str, ...] = ()

    @property
    def slot(self) -> str:
        """'elementwise, 1-D', 'softmax, multi-dim' (more than DIM_MAX elements, no dimension past it), 'mm'
        or 'sdpa'."""
        if self.aspect != "families":
            return self.aspect
        return f"{self.family}, {'1-D' if self.one_d else 'multi-dim'}"


def _long(dtype: str, fill: str) -> Callable[[int], tuple[Input, ...]]:
    return lambda bits: (("x", (long_length(bits),), dtype, fill),)


def _multi(dtype: str, fill: str) -> Callable[[int], tuple[Input, ...]]:
    return lambda bits: (("x", multi_shape(bits), dtype, fill),)


def _halves(shape: Callable[[int], tuple[int, ...]]) -> Callable[[int], tuple[Input, ...]]:
    """Two fp16 inputs, ones then twos, whose cat along dim 0 has the shape's elements or a row more."""
    def inputs(bits: int) -> tuple[Input, ...]:
        whole = shape(bits)
        half = (-(-whole[0] // 2), *whole[1:])
        return (("a", half, "fp16", "ones"), ("b", half, "fp16", "twos"))
    return inputs


def _linear_inputs(bits: int) -> tuple[Input, ...]:
    # (67125249, 64) at 32 bits: 2**26 + 2**14 + 1 rows, an input of 2**32 + 2**20 + 64 elements
    limit = limits(bits)[0]
    rows = limit // 64 + max(1, limit >> 18) + 1
    return (("x", (rows, 64), "fp32", "randn"), ("w", (32, 64), "fp32", "randn"), ("bias", (32,), "fp32", "randn"))


def _sdpa_inputs(bits: int) -> tuple[Input, ...]:
    # (69632, 1, 256, 64) at 32 bits: 2**32 + 2**28 score elements (the study: 5712 x 12 heads, 4.49e9)
    limit = limits(bits)[0]
    shape = (limit // 65536 + max(1, limit >> 20), 1, 256, 64)
    return tuple((name, shape, "fp32", "randn") for name in "qkv")


TESTS: tuple[FamilyTest, ...] = (
    FamilyTest("linear", "mm", "mm", False, "Linear 64->32 on x (LIMIT/64 + ..., 64): input past LIMIT",
               _linear_inputs, lambda x, d, b: torch.nn.functional.linear(x["x"], x["w"], x["bias"]),
               rows_of=("x",)),
    FamilyTest("elementwise-1d", "families", "elementwise", True, "fp16 ones(N) * 2 + 1",
               _long("fp16", "ones"), lambda x, d, b: x["x"] * 2 + 1, rows_of=("x",)),
    FamilyTest("reduction-1d", "families", "reduction", True, "uint8 ones(N).sum()",
               _long("uint8", "ones"), lambda x, d, b: x["x"].sum(), wraps=True),
    FamilyTest("cat-1d", "families", "cat", True, "1-D cat of two fp16 halves (N/2 each)",
               _halves(lambda bits: (long_length(bits),)), lambda x, d, b: torch.cat([x["a"], x["b"]])),
    FamilyTest("indexing-1d", "families", "indexing", True, "int64 arange(N) % 1000, then x[[0, LIMIT+5, N-1]]",
               _long("int64", "arange%1000"),
               lambda x, d, b: x["x"][torch.tensor([0, limits(b)[0] + 5, x["x"].shape[0] - 1], device=d)]),
    FamilyTest("masked_fill-1d", "families", "masked_fill", True, "uint8 zeros(LIMIT + 16).masked_fill(mask, 7)",
               lambda bits: (("x", (limits(bits)[0] + 16,), "uint8", "zeros"),
                             ("mask", (limits(bits)[0] + 16,), "bool", "true")),
               lambda x, d, b: x["x"].masked_fill(x["mask"], 7), rows_of=("x", "mask")),
    FamilyTest("creation-1d", "families", "creation", True, "fp16 ones(N)",
               lambda bits: (), lambda x, d, b: torch.ones(long_length(b), dtype=torch.float16, device=d)),
    FamilyTest("scale", "families", "elementwise", False, "eager attention's scale: fp32 scores * 0.125",
               _multi("fp32", "randn"), lambda x, d, b: x["x"] * 0.125, rows_of=("x",)),
    FamilyTest("softmax", "families", "softmax", False, "eager attention's softmax(scores, -1), fp32",
               _multi("fp32", "randn"), lambda x, d, b: torch.softmax(x["x"], -1), rows_of=("x",)),
    FamilyTest("copy", "families", "copy", False, "fp16 x.transpose(1, 2).contiguous()",
               _multi("fp16", "randn"), lambda x, d, b: x["x"].transpose(1, 2).contiguous(), rows_of=("x",)),
    FamilyTest("creation", "families", "creation", False, "fp16 ones((G, 16, 256))",
               lambda bits: (), lambda x, d, b: torch.ones(multi_shape(b), dtype=torch.float16, device=d)),
    FamilyTest("random", "families", "random", False, "fp32 randn((G, 16, 256)): mean 0, std 1, no repeat",
               lambda bits: (), lambda x, d, b: torch.randn(multi_shape(b), device=d), random=True),
    FamilyTest("reduction", "families", "reduction", False, "uint8 ones((G, 16, 256)).sum()",
               _multi("uint8", "ones"), lambda x, d, b: x["x"].sum(), wraps=True),
    FamilyTest("masked_fill", "families", "masked_fill", False, "uint8 zeros((G, 16, 256)).masked_fill(mask, 7)",
               lambda bits: (("x", multi_shape(bits), "uint8", "zeros"), ("mask", multi_shape(bits), "bool", "true")),
               lambda x, d, b: x["x"].masked_fill(x["mask"], 7), rows_of=("x", "mask")),
    FamilyTest("cat", "families", "cat", False, "cat of two fp16 (G/2, 16, 256) along dim 0",
               _halves(multi_shape), lambda x, d, b: torch.cat([x["a"], x["b"]])),
    FamilyTest("sdpa", "sdpa", "sdpa", False, "fused SDPA, q k v (B, 1, 256, 64) fp32, scores past LIMIT",
               _sdpa_inputs, lambda x, d, b: torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"]),
               rows_of=("q", "k", "v")),
)
TESTS_BY_NAME = {test.name: test for test in TESTS}


@dataclasses.dataclass(frozen=True)
class FamilyCell:
    """One first-pass test at the sweep's index width (a runs.cell.SweepCell; its own width decides, not the
    sweep's `index_bits` the protocol passes)."""

    test: str
    index_bits: int
    no_values: ClassVar[dict[str, Any]] = NO_VALUES
    seen_fields: ClassVar[tuple[str, ...]] = FAMILY_SEEN_FIELDS
    control: ClassVar[dict[str, Any]] = {"kind": "ok", "rule": "none", "message": ""}
    row_defaults: ClassVar[dict[str, Any]] = {"rule": None}

    def predict(self, index_bits: int = 0, profile: Any = None) -> Fault:
        """What the fault model says of the cell's computation, traced on meta tensors: its first call that
        ends it (a stop, or values nobody characterised), else its first silently wrong call, else ok."""
        from mpsimpact.modes.tracer import trace_faults

        made = make_inputs(self, "meta")
        plan = trace_faults(lambda: self.spec.run(made, "meta", self.index_bits), index_bits=self.index_bits,
                            profile=profile)
        faults = [call.fault for call in plan.calls if not call.fault.is_ok]
        return next((f for f in faults if f.is_stop or f.kind == "wrong_other"), faults[0] if faults else OK)

    def run(self, device: str, emulated: bool, index_bits: int, profile: Any) -> dict[str, Any]:
        """Runs the test once at the cell's own width and judges it against the CPU (see runs.cell.observe);
        an allocation the device refuses (inputs or output) is raised for `observe`, never an "error"."""
        from mpsimpact.errors import EmulatedMpsError, NotEmulatedError
        from mpsimpact.modes.emulator import emulate

        torch.manual_seed(0)
        inputs = make_inputs(self, device, torch.Generator(device=device).manual_seed(0))
        try:
            with emulate(index_bits=self.index_bits, profile=profile) if emulated else contextlib.nullcontext():
                out = self.spec.run(inputs, device, self.index_bits)
            if device == "mps":
                torch.mps.synchronize()
        except (EmulatedMpsError, NotEmulatedError) as error:
            fault = error.fields["fault"]
            kind = fault.kind if isinstance(error, EmulatedMpsError) else "wrong_other"
            return {"observed": kind, "message": error.message, "rule": fault.rule, **NO_VALUES}
        except Exception as error:  # an exception on the device is the cell's outcome: error, with its text
            if is_allocation_failure(error):
                raise  # the output did not fit: not the op's fault (runs.cell.observe says not run)
            text = str(error).strip().splitlines()
            return {"observed": "error", "message": f"{type(error).__name__}: {text[0] if text else ''}", **NO_VALUES}
        observed, rel = _judge(self, inputs, out)
        return {"observed": observed, "max_rel_error": finite_or_none(rel), "message": None}

    @staticmethod
    def judge(row: dict[str, Any]) -> bool:
        """Whether an observed family cell matches what is expected of it (the fault model's prediction on
        MPS or under emulation; ok on a control device), by the bmm cells' criteria (runs.sweep.Cell.judge)."""
        pred, seen = row["expected"], row["observed"]
        if pred["kind"] == "abort":
            return seen in ("abort", "crash")
        if pred["kind"] == "error":
            return seen == "error" and pred["message"].split(" (")[0][:40] in (row.get("message") or "")
        if pred["rule"] == "reduction-wrap":
            return seen == "wrap"
        if pred["kind"] == "wrong_other":  # values nobody characterised: emulated, refused; on MPS, any wrong
            return seen in ("wrong", "wrap") if row.get("device") == "mps" else seen == "wrong_other"
        if pred["kind"] in SILENT_KINDS:  # a bmm of SDPA's math path, emulated with its wrong values
            return seen in ("wrong", "wrap")
        return seen == "ok"

    def predicted_seen(self, index_bits: int, profile: Any) -> dict[str, Any]:
        fault = self.predict(profile=profile)
        computed = SILENT_KINDS - {"wrong_other"}  # wrong values the emulator computes (a bmm wrap)
        observed = "wrap" if fault.rule == "reduction-wrap" else "wrong" if fault.kind in computed else fault.kind
        return {"observed": observed, "message": fault.message or None, "rule": fault.rule, **NO_VALUES}

    def row_fields(self, index_bits: int, emulated: bool, profile: Any) -> tuple[dict, dict]:
        """(its name and slot; after the observation, the path SDPA took)."""
        tail = {"sdpa_path": sdpa_route(emulated, profile)} if self.spec.aspect == "sdpa" else {}
        return {"name": self.name, "slot": self.spec.slot}, tail

    @property
    def name(self) -> str:
        """'softmax (softmax, multi-dim)': the cell as people say it."""
        return f"{self.test} ({self.spec.slot})"

    def observation_problem(self, seen: dict[str, Any]) -> str | None:
        """What makes a read-back observation of this cell impossible, in words, or None (as
        runs.sweep.Cell.observation_problem)."""
        observed, rel = seen.get("observed"), seen.get("max_rel_error")
        if observed not in FAMILY_OBSERVED:
            return f"observed {str(observed)[:30]!r} is not an outcome of a family cell"
        if not is_error_value(rel):
            return f"max_rel_error {str(rel)[:30]} is not a finite number >= 0"
        if not all(isinstance(seen.get(key), (str, type(None))) for key in ("message", "rule")):
            return "its message or rule is not text"
        bound = max(WRONG_ABOVE, RANDOM_SCALE)
        if observed == "ok" and (rel is None or rel > bound):
            return f"it says ok, with an error {rel} that is not within {bound}"
        if observed in ("wrong", "wrap") and rel is not None and rel <= bound:
            return f"it says {observed}, with an error {rel} within {bound}"
        if observed in STOP_KINDS | {"crash", NOT_RUN, "wrong_other"} and (rel is not None or not seen.get("message")):
            return f"it says {observed}, but holds an error judged, or no message"
        return None

    @property
    def spec(self) -> FamilyTest:
        return TESTS_BY_NAME[self.test]

    def on_meta(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The cell's inputs and output on meta: their shapes and dtypes, nothing allocated."""
        made = make_inputs(self, "meta")
        return made, self.spec.run(made, "meta", self.index_bits)

    def largest_tensor_bytes(self) -> int:
        """Bytes of the largest input or output the cell allocates on the device (what a Mac's largest buffer
        must hold; the op's own intermediates, e.g. the scores of SDPA's math path, are not counted: a device
        that refuses them is caught as it runs, runs.cell.observe)."""
        made, out = self.on_meta()
        return max(tensor_bytes(x) for x in (*made.values(), out))

    def bytes_needed(self) -> int:
        """Bytes the cell holds at once: inputs and output on the device; the same again on the CPU for
        the reference, or, for an op judged by blocks of rows (`rows_of`), one block of them (a block holds
        at most CHUNK_ELEMENTS of the output and of each input); the fp32 draws and the two float64 chunks
        compared (a chunk at a time); and the scores of SDPA's math path (of one block)."""
        made, out = self.on_meta()
        device = sum(x.numel() * x.element_size() for x in (*made.values(), out))
        share = min(1.0, self.block_rows(made, out) / out.shape[0]) if self.spec.rows_of else 1.0
        on_cpu = sum(math.ceil(x.numel() * share) * x.element_size() if name in self.spec.rows_of or x is out
                     else x.numel() * x.element_size() for name, x in (*made.items(), ("", out)))
        largest = max((x.numel() for x in made.values()), default=out.numel())
        chunks = min(CHUNK_ELEMENTS, largest) * 4 + 2 * min(CHUNK_ELEMENTS, out.numel()) * 8
        scores = math.ceil(math.prod(made["q"].shape[:-1]) * share) * made["k"].shape[-2] * 4 if "q" in made else 0
        return device + on_cpu + chunks + scores

    def block_rows(self, inputs: dict[str, torch.Tensor], out: torch.Tensor) -> int:
        """Rows (along dim 0) per block of a judgement by rows: CHUNK_ELEMENTS of the widest row, at least 1."""
        row = max([out[0].numel(), *(inputs[name][0].numel() for name in self.spec.rows_of)])
        return max(1, CHUNK_ELEMENTS // max(1, row))

    def estimated_seconds(self, device: str) -> float:
        """A rough time before anything ran: every element drawn, computed and compared a few times."""
        made, out = self.on_meta()
        return 4 * (sum(x.numel() for x in made.values()) + out.numel()) / SPEEDS.get(device, SPEEDS["cpu"])[1]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def family_grid(index_bits: int) -> list[FamilyCell]:
    """Every first-pass test at this width (the same in --quick and --full: a few seconds at 20 bits)."""
    return [FamilyCell(test.name, index_bits) for test in TESTS]


def make_inputs(cell: FamilyCell, device: str, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The cell's inputs on `device` (meta: shapes only)."""
    made = {}
    for name, shape, dtype, fill in cell.spec.inputs(cell.index_bits):
        dt = _DT[dtype]
        if device == "meta":
            made[name] = torch.empty(shape, dtype=dt, device="meta")
        elif fill == "randn":
            made[name] = random_tensor(shape, dt, device, generator)
        elif fill == "arange%1000":
            made[name] = torch.arange(shape[0], dtype=dt, device=device) % 1000
        else:
            value = {"ones": 1, "zeros": 0, "twos": 2, "true": True}[fill]
            made[name] = torch.full(shape, value, dtype=dt, device=device)
    return made


def sdpa_route(emulated: bool, profile: Any) -> str:
    """"fused" or "math": where emulated, the path the profile gives a call without gradients; on a device,
    whether this torch has MPS's own SDPA op (2.5 on)."""
    from mpsimpact.engine.faults import sdpa_path

    if emulated:
        return sdpa_path(False, profile)
    return "fused" if hasattr(torch.ops.aten, "_scaled_dot_product_attention_math_for_mps") else "math"


def _judge(cell: FamilyCell, inputs: dict[str, torch.Tensor], out: torch.Tensor) -> tuple[str, float]:
    """(ok / wrong / wrap, the relative error against the CPU's result of the same inputs)."""
    if cell.spec.rows_of:
        rel = _rows_error(cell, inputs, out)
        return ("ok" if not rel > WRONG_ABOVE else "wrong"), rel
    got = out.cpu()
    if cell.spec.random:
        return _judge_random(got, limits(cell.index_bits)[0])
    here = {name: x.cpu() for name, x in inputs.items()}
    want = cell.spec.run(here, "cpu", cell.index_bits)
    rel = relative_error(got, want)
    if not rel > WRONG_ABOVE:
        return "ok", rel
    if cell.spec.wraps:  # the reduction of the first numel mod LIMIT elements (2.13.0's sum)
        flat = here["x"].reshape(-1)
        wrapped = cell.spec.run({"x": flat[: flat.numel() % limits(cell.index_bits)[0]]}, "cpu", cell.index_bits)
        if relative_error(got, wrapped) <= WRONG_ABOVE:
            return "wrap", rel
    return "wrong", rel


def _rows_error(cell: FamilyCell, inputs: dict[str, torch.Tensor], out: torch.Tensor) -> float:
    """relative_error of the whole output, computed a block of rows at a time: each block of the device's
    output against the CPU's result of the same rows of the inputs (the others copied whole; they are small)."""
    if out.shape[0] != next(iter(inputs[name] for name in cell.spec.rows_of)).shape[0]:
        return math.inf
    whole = {name: x.cpu() for name, x in inputs.items() if name not in cell.spec.rows_of}
    step, diff, scale = cell.block_rows(inputs, out), 0.0, 0.0
    for start in range(0, out.shape[0], step):
        rows = {name: inputs[name][start:start + step].cpu() for name in cell.spec.rows_of}
        want = cell.spec.run(whole | rows, "cpu", cell.index_bits)
        gap, top = _gap_and_scale(out[start:start + step].cpu(), want)
        diff, scale = max(diff, gap), max(scale, top)
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 a chunk at a time; inf for another shape or a NaN."""
    diff, scale = _gap_and_scale(got, want)
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _gap_and_scale(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |want|), in float64 a chunk at a time; the gap is inf for another shape or a NaN."""
    if got.shape != want.shape:
        return math.inf, 0.0
    g, w = got.reshape(-1), want.reshape(-1)
    diff = scale = 0.0
    for start in range(0, g.numel(), CHUNK_ELEMENTS):
        a, b = g[start:start + CHUNK_ELEMENTS].double(), w[start:start + CHUNK_ELEMENTS].double()
        gap = (a - b).abs().max().item() if a.numel() else 0.0
        diff = math.inf if gap != gap else max(diff, gap)  # a NaN compares unequal to itself
        scale = max(scale, b.abs().max().item() if b.numel() else 0.0)
    return diff, scale


def _judge_random(got: torch.Tensor, limit: int) -> tuple[str, float]:
    """Draws of a standard normal: mean and standard deviation within RANDOM_SCALE, and the elements from
    LIMIT on not a repeat of the first ones (a wrapped generator offset)."""
    flat, total, squares = got.reshape(-1), 0.0, 0.0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = flat[start:start + CHUNK_ELEMENTS].double()
        total, squares = total + part.sum().item(), squares + part.square().sum().item()
    mean = total / flat.numel()
    off = max(abs(mean), abs(math.sqrt(max(squares / flat.numel() - mean * mean, 0.0)) - 1.0))
    tail = flat[limit:limit + 4096]
    repeats = tail.numel() > 0 and torch.equal(tail, flat[:tail.numel()])
    return ("wrong" if repeats or not off <= RANDOM_SCALE else "ok"), (math.inf if repeats else off)


if __name__ == "__main__":
    worker_main(FamilyCell)
