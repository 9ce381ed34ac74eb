"""`mpsimpact plan`: the shape-only prediction for a scenario's model at a geometry, as a report
(JSON-ready dict) and as rich tables; plus the batch-size sweep for talks."""

from __future__ import annotations

import dataclasses
from typing import Any

from mpsimpact.errors import UsageError
from mpsimpact.option import BATCH_SIZE, INDEX_BITS, MAX_LENGTH, TORCH_PROFILE, option, validate
from mpsimpact.planner import estimate_peak_bytes, largest_safe_batch, per_text_calls, plan_at, predict

SAFE_TABLE_LENGTHS = (128, 256, 384, 512)
SWEEP_BATCHES = (256, 512, 1024, 1365, 1366, 2048, 3072, 4096, 5461, 5462, 8192, 16384, 21845, 21846, 32768)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What `mpsimpact plan` was asked; embedded in its JSON."""

    scenario: str
    batch_size: int | None = option(None, BATCH_SIZE)
    max_length: int | None = option(None, MAX_LENGTH)
    model: str | None = None
    backward: bool = False
    index_bits: int = option(32, INDEX_BITS)
    sweep: bool = False
    figure: str | None = None
    torch_profile: str | None = option(None, TORCH_PROFILE)
    versions: bool = False
    out: str | None = None
    memory: str | None = None  # "32GB" (a Mac's unified memory) or "auto": the demo that fits

    def validate(self) -> None:
        """Raises UsageError on any bad value, before anything is loaded."""
        validate(self)


def _call_row(call, heads: int, batch: int) -> dict[str, Any]:
    first = call.fault.first_bad_batch
    text_head = divmod(first, heads) if first is not None and call.family == "bmm" and call.a.shape[0] == batch * heads else None
    return {
        "index": call.index, "phase": call.phase, "where": call.module, "op": call.op,
        "a": list(call.a.shape), "b": list(call.b.shape), "a_numel": call.a.numel, "b_numel": call.b.numel,
        "out_numel": call.out_numel, "kind": call.fault.kind, "rule": call.fault.rule, "first_bad_batch": first,
        "first_bad_text": text_head[0] if text_head else None, "first_bad_head": text_head[1] if text_head else None,
    }


def build_plan_report(config: PlanConfig) -> dict[str, Any]:
    """Traces the scenario's model on meta (config only) and predicts everything `plan` prints."""
    from mpsimpact.classifier import usable_positions
    from mpsimpact.release import resolve_profile
    from mpsimpact.scenario import get_scenario

    config.validate()
    scenario_cls = get_scenario(config.scenario)
    batch = config.batch_size or scenario_cls.default_batch_size
    length = config.max_length or scenario_cls.default_max_length
    scenario = scenario_cls(model=config.model)
    model_config = scenario.load_config()
    positions = usable_positions(model_config)
    if length > positions:
        raise UsageError(f"--max-length {length} exceeds the model's {positions} positions.")
    meta = scenario.meta_module(model_config)
    heads = model_config.num_attention_heads
    profile = resolve_profile(config.torch_profile)
    traced = {L: per_text_calls(meta, L, backward=config.backward) for L in {*SAFE_TABLE_LENGTHS, length} if L <= positions}
    calls = traced[length]
    plan = plan_at(calls, batch, config.index_bits, profile)
    forward = predict(plan, batch, heads, "forward")
    safe = {L: largest_safe_batch(c, heads, config.index_bits, profile=profile) for L, c in traced.items()}
    report = {
        "config": dataclasses.asdict(config) | {"batch_size": batch, "max_length": length},
        "profile": profile.to_json(),
        "model": config.model or "embedded:all-MiniLM-L6-v2", "heads": heads, "layers": model_config.num_hidden_layers,
        "calls_traced": len(plan.calls),
        "faulting_calls": [_call_row(c, heads, batch) for c in plan.faults],
        "prediction": forward.to_json(),
        "largest_safe_batch": safe[length],
        "largest_safe_batch_by_length": dict(sorted(safe.items())),
        "estimated_peak_gib": round(estimate_peak_bytes(model_config, batch, length) / 2**30, 1),
        "guard_advice": guard_advice(plan),
    }
    if config.backward:
        report["backward_faulting_calls"] = sum(1 for c in plan.faults if c.phase == "backward")
    if config.memory:
        report["memory"] = memory_section(config, scenario_cls.name, traced, model_config, heads, safe, forward)
    if config.versions:
        from mpsimpact.versions import version_table

        report["versions"] = version_table(lambda attention: scenario.meta_module(model_config, attention), batch, length, heads, config.index_bits)
    if config.sweep:
        report["sweep"] = sweep(traced, heads, config.index_bits, profile)
        if config.figure:
            write_sweep_figure(report["sweep"], config.figure, report["model"])
    return report


def memory_section(config: PlanConfig, scenario: str, traced: dict, model_config: Any, heads: int, safe: dict, forward) -> dict[str, Any]:
    """--memory: per dtype and length the smallest clearly-visible demo, whether it fits, the command."""
    from mpsimpact.sizing import demo_options, mac_table, recommend, usable_bytes

    budget, basis = usable_bytes(config.memory)
    options = demo_options(traced, model_config, heads, safe, config.index_bits)
    first = safe.get(512, 0) + 1
    return {"budget_gib": round(budget / 2**30, 1), "basis": basis, "options": options,
            "recommendation": recommend(options, budget, scenario), "mac_table": mac_table(model_config, first)}


def guard_advice(plan) -> str:
    if not plan.faults:
        return "Nothing crosses a limit: no guard needed."
    stop = plan.first_stop
    first = plan.faults[0]
    stops = f"guard 'raise' stops before call {first.index} ({first.op} in {first.module or first.phase})"
    extra = f"; unguarded, MPS would {'abort' if stop.fault.kind == 'abort' else 'raise'} at call {stop.index}" if stop else ""
    return f"guard 'chunk' makes all {len(plan.faults)} faulting calls safe; {stops}{extra}."


def sweep(traced: dict, heads: int, index_bits: int, profile=None) -> dict[str, list[dict[str, Any]]]:
    """Predicted corrupted fraction (or stop) over SWEEP_BATCHES, for each table length."""
    table = {}
    for length in (L for L in SAFE_TABLE_LENGTHS if L in traced):
        calls = traced[length]
        rows = []
        for batch in SWEEP_BATCHES:
            p = predict(plan_at(calls, batch, index_bits, profile), batch, heads)
            rows.append({"batch": batch, "corrupted_fraction": p.corrupted_count / batch, "stops": p.stop.fault.kind if p.stop else None})
        table[str(length)] = rows
    return table


def write_sweep_figure(table: dict, path: str, model: str) -> None:
    from mpsimpact.figures import sweep_figure
    from mpsimpact.report import atomic_write_bytes

    atomic_write_bytes(path, sweep_figure(table, f"{model}: predicted corrupted fraction (MPS, eager attention)"))


def print_plan(report: dict[str, Any]) -> None:
    """The plan as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg, pred = report["config"], report["prediction"]
    console.print(f"[bold]{report['model']}[/] ({report['heads']} heads, {report['layers']} layers): batch {cfg['batch_size']}, max length {cfg['max_length']}, {report['calls_traced']} bmm/mm/SDPA calls traced on meta (shapes only), decided for MPS on torch {report['profile']['label']}.")
    table = Table(title="calls that hit a rule")
    for title in ("#", "where", "op: a @ b", "out", "outcome (rule)", "first bad row (text, head)"):
        table.add_column(title)
    for row in report["faulting_calls"]:
        first = f"{row['first_bad_batch']} ({row['first_bad_text']}, {row['first_bad_head']})" if row["first_bad_text"] is not None else str(row["first_bad_batch"] if row["first_bad_batch"] is not None else "-")
        where = row["where"].replace("encoder.encoder.", "").replace("model.roberta.encoder.", "") + (" (bwd)" if row["phase"] == "backward" else "")
        shapes = f"{row['op']}: {'x'.join(map(str, row['a']))} @ {'x'.join(map(str, row['b']))}"
        table.add_row(str(row["index"]), where, shapes, _count(row["out_numel"]), f"{row['kind']} ({row['rule']})", first)
    console.print(table if report["faulting_calls"] else "No call crosses a limit.")
    if pred["stops"]:
        console.print(f"MPS would [bold red]{'abort the process' if pred['stops']['kind'] == 'abort' else 'raise'}[/] at call {pred['stops']['call']['index']}: {pred['stops']['message']}")
    else:
        console.print(f"Predicted: first corrupted text {pred['first_corrupted_text']} (head {pred['first_corrupted_head']}); {pred['corrupted_count']} of {cfg['batch_size']} texts ({pred['corrupted_fraction']:.2%}) silently wrong.")
    safe = Table(title="largest safe batch")
    safe.add_column("max length")
    safe.add_column("texts")
    for length, value in report["largest_safe_batch_by_length"].items():
        safe.add_row(str(length), str(value))
    console.print(safe)
    console.print(f"Estimated peak memory of a real run: {report['estimated_peak_gib']} GiB. {report['guard_advice']}")
    if "sweep" in report:
        _print_sweep(console, report["sweep"])
    if "versions" in report:
        _print_versions(console, report["versions"], cfg)
    if "memory" in report:
        _print_memory(console, report["memory"])


def _print_memory(console, memory: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"the smallest clear demo per dtype and length, against {memory['basis']}")
    for title in ("dtype", "max length", "batch", "predicted", "estimated peak", "fits"):
        table.add_column(title)
    for o in memory["options"]:
        table.add_row(o["dtype"], str(o["max_length"]), str(o["batch_size"]), o["outcome"], f"{o['estimated_peak_gib']} GiB", "yes" if o["fits"] else "no")
    console.print(table)
    rec = memory["recommendation"]
    console.print(f"Run: [bold]{rec['command']}[/]  ({rec['why']})" if rec["command"] else f"[bold red]{rec['why']}[/]", soft_wrap=True)


def _print_versions(console, rows: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    from rich.table import Table

    from mpsimpact.versions import ATTENTIONS, PHASES

    table = Table(title=f"on MPS, by torch release: batch {cfg['batch_size']} x {cfg['max_length']} tokens (from shapes alone)", show_lines=True)
    table.add_column("torch")
    columns = [(a, p) for a in ATTENTIONS for p in PHASES]
    for attention, phase in columns:
        table.add_column(f"{attention}, {phase}")
    for release in dict.fromkeys(r["release"] for r in rows):
        cells = {(r["attention"], r["phase"]): r["message"] for r in rows if r["release"] == release}
        table.add_row(release, *[cells[c] for c in columns])
    console.print(table)
    for note in sorted({r["note"] for r in rows if r["note"]}):
        console.print(f"note: {note}", soft_wrap=True)


def write_plan_folder(report: dict[str, Any], folder: Any) -> Any:
    """plan.json, and with --versions versions.md and versions.png, atomically into `folder` (from
    report.fresh_out_dir, checked before any work)."""
    import json

    from mpsimpact.report import atomic_write_bytes, atomic_write_text, folder_written_atomically

    with folder_written_atomically(folder) as partial:
        atomic_write_text(partial / "plan.json", json.dumps(report, indent=2, default=str) + "\n")
        if "versions" in report:
            from mpsimpact.versions import heatmap, to_markdown

            cfg = report["config"]
            atomic_write_text(partial / "versions.md", to_markdown(report["versions"]))
            title = f"{report['model']}: {cfg['batch_size']} x {cfg['max_length']} on MPS by torch release (predicted from shapes)"
            atomic_write_bytes(partial / "versions.png", heatmap(report["versions"], title))
    return folder


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}G" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def _print_sweep(console, table: dict) -> None:
    from rich.table import Table

    out = Table(title="predicted corrupted fraction by batch size")
    out.add_column("batch")
    for length in table:
        out.add_column(f"L={length}", justify="right")
    for i, row in enumerate(next(iter(table.values()))):
        cells = [table[length][i] for length in table]
        out.add_row(str(row["batch"]), *[c["stops"] or f"{c['corrupted_fraction']:.1%}" for c in cells])
    console.print(out)
