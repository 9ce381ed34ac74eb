"""`mpsimpact check`: is a Hugging Face model affected? Traces any architecture on `meta` (one forward
pass or training step) and says which calls fault, which samples go wrong, the largest safe batch, the
longest safe length, the memory a real run needs and which guard makes it safe."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mpsimpact.errors import ModelLoadError, UsageError
from mpsimpact.prediction.meta_model import (
    MetaModel, build_meta_model, explain_build_error, heads_of, length_limit, load_model_config, pad_for_the_head,
    resolve_task,
)
from mpsimpact.config import LENGTH_CEILING, CheckConfig, batch_ceiling
from mpsimpact.output.record import ABSENT, Record
from mpsimpact.prediction.outcome import CallRow, PredictionBlock, PredictionSection, ReleaseBlock, Subject
from mpsimpact.prediction.memory import batch_fits, length_fits
from mpsimpact.prediction.safe_size import (
    TRACE_TEXTS, BoundarySearch, bisect_clean, calls_at, cut_to_fit, fit_lengths, is_clean, largest_safe_batch,
    longest_safe_length, per_text, plan_at, plan_signature, scalable,
)
from mpsimpact.engine.release import ASKED, ON_THIS_MAC, JudgedRelease, judge_release
from mpsimpact.engine.fault_plan import FaultPlan


def geometry(config: Any, cfg: CheckConfig) -> tuple[int, int]:
    """(sequence length, the longest length searched) after checking --seq-len against the model."""
    hard, nominal = length_limit(config)
    length = cfg.seq_len or nominal
    if length is None:
        raise UsageError("The config states no maximum length; pass --seq-len.")
    if hard is not None and length > hard:
        raise UsageError(f"--seq-len {length} exceeds the model's {hard} positions.")
    return length, hard or max(LENGTH_CEILING, length)


def profile_info(judged: JudgedRelease) -> dict[str, Any]:
    """Which release's rules decide, why, and whether that release was measured."""
    profile = judged.profile
    source = {ASKED: "--torch-profile", ON_THIS_MAC: f"the installed torch {judged.installed.label}"}.get(
        judged.reason, f"a release measured on Macs where the bug is silent ({judged.reason})")
    return {"release": profile.release, "label": profile.label, "group": profile.group,
            "measured": profile.measured, "conservative": profile.conservative, "source": source,
            "notes": list(profile.notes)}


def prepare(cfg: CheckConfig) -> tuple[MetaModel, dict[str, Any]]:
    """Judges the release (once, first: the value travels down), loads the config, builds the model on meta,
    and says what was built and why."""
    import transformers

    judged = judge_release(cfg.torch_profile)
    config, where = load_model_config(cfg.model)
    if cfg.target_len is not None and not getattr(config, "is_encoder_decoder", False):
        raise UsageError(f"--target-len is the decoder's length of an encoder-decoder, and '{cfg.model}' (model type "
                         f"'{config.model_type}') is none: its one length is --seq-len; drop --target-len.",
                         option="--target-len")
    model_class, task, task_basis = resolve_task(config, cfg.task)
    config, padding = pad_for_the_head(config, model_class)
    try:
        module = build_meta_model(model_class, config, cfg.attention)
    except Exception as error:  # a config transformers accepted, but no model can be built from (any error type)
        raise explain_build_error(error, model_class, config, cfg.attention) from None
    basis = "--attention" if cfg.attention != "default" else (f"transformers {transformers.__version__}'s default "
                                                              "for this model (model.config._attn_implementation)")
    model = MetaModel(module, config, cfg.model, cfg.workload == "training", cfg.index_bits, judged.profile,
                      cfg.target_len, cfg.cache, mac=cfg.mac)
    info = {
        "judged": judged,
        "source": cfg.model, "found_in": where, "model_type": config.model_type, "class": type(module).__name__,
        "task": task, "task_basis": task_basis, "attention": module.config._attn_implementation,
        "attention_basis": basis, "heads": heads_of(config), "layers": getattr(config, "num_hidden_layers", None),
        "dtype": str(module.dtype).removeprefix("torch."), "parameters": sum(p.numel() for p in module.parameters()),
        "encoder_decoder": bool(getattr(config, "is_encoder_decoder", False)),
        "supports_attention_interface": bool(getattr(module, "_supports_attention_backend", False)),
        "padding": padding,
    }
    return model, info


def safe_batch(model: MetaModel, batch: int, length: int, subject: Subject) -> BoundarySearch:
    """The largest batch B such that every batch up to B is clean at this length and fits the Mac declared (Note
    [What fits a Mac] in prediction/memory.py): traces at 2 and 4 samples scaled by arithmetic
    (safe_size.largest_safe_batch, as `plan` does), checked against the trace at the asked batch. One sample is
    traced as itself where it decides (a 4-D matmul at one sample hands bmm strided views): when asked, or when the
    scaled answer is below 2."""
    def trace_at(n: int) -> FaultPlan:
        return model.trace(n, length)

    ceiling = batch_ceiling(batch)
    two, four = trace_at(TRACE_TEXTS), trace_at(2 * TRACE_TEXTS)
    if not scalable(two, four):
        found = bisect_clean(trace_at, ceiling, "the calls change with the batch size")
        fits = batch_fits(lambda n: trace_at(n).calls, subject, length, model.mac, model.profile, model.index_bits)
        return cut_to_fit(dataclasses.replace(found, ceiling=True), fits, "batch")
    calls = per_text(two, four)
    basis = f"arithmetic on calls traced at {TRACE_TEXTS} and {2 * TRACE_TEXTS} samples (as `plan`)"
    if batch not in (1, TRACE_TEXTS, 2 * TRACE_TEXTS):
        scaled = plan_at(calls, batch, model.index_bits, model.profile, model.mac)
        if plan_signature(scaled) != plan_signature(trace_at(batch)):
            why = f"the scaled calls differ from the trace at batch {batch}"
            return dataclasses.replace(bisect_clean(trace_at, ceiling, why), ceiling=True)
        basis += f"; the scaling agrees with the trace at batch {batch}"
    found = largest_safe_batch(calls, heads_of(model.config), model.index_bits, model.profile, ceiling, model.mac)
    if batch == 1 or found < 2:
        found = max(found, 1) if is_clean(trace_at(1)) else 0
        basis += "; batch 1 traced as itself"
    fits = batch_fits(lambda n: calls_at(calls, n), subject, length, model.mac, model.profile, model.index_bits)
    return cut_to_fit(BoundarySearch(found, ceiling, basis, ceiling=True), fits, "batch")


# The most ops one trace of the length search may hold: a model that runs ops per token (a state-space or
# recurrent scan: Mamba) is searched only as far as a trace of it stays this small (about a second).
MAX_TRACE_OPS = 20_000


def affordable_length(model: MetaModel, batch: int, high: int) -> tuple[int, str]:
    """(the longest length the search may trace, and a note where that cuts `high`): the ops of the search's
    first two traces (safe_size.fit_lengths: made here, reused by the search), extrapolated linearly;
    transformers' ops do not grow with the length, a token-by-token scan's do."""
    short, longer = fit_lengths(high)[:2]
    if longer <= short:
        return high, ""
    first, second = model.trace(batch, short), model.trace(batch, longer)
    per_token = (len(second.calls) - len(first.calls)) / (longer - short)
    if per_token <= 0:
        return high, ""
    cap = max(longer, int(longer + (MAX_TRACE_OPS - len(second.calls)) / per_token))
    if cap >= high:
        return high, ""
    return cap, (f"searched up to {cap} tokens only: a trace grows by {per_token:.3g} ops per token (the model "
                 f"runs ops token by token), and a longer one would hold more than {MAX_TRACE_OPS:,}")


def safe_length(model: MetaModel, cfg: CheckConfig, batch: int, length: int, high: int,
                subject: Subject) -> BoundarySearch:
    """The longest safe length at this batch (free of faults, and fitting the Mac declared), searched in 1..high
    (cut where a trace would grow too large: `affordable_length`); an answer at a bound of the search's own (not
    the model's positions) is "at least"."""
    high, cost_note = affordable_length(model, batch, high)
    fits = length_fits(subject, batch, model.mac, model.profile, cfg.index_bits)
    by_length = longest_safe_length(lambda n: model.trace(batch, n), high, cfg.index_bits, model.profile,
                                    known=length, mac=model.mac, fits=fits)
    return dataclasses.replace(by_length, ceiling=bool(cost_note) or length_limit(model.config)[0] is None,
                               basis=f"{by_length.basis}; {cost_note}" if cost_note else by_length.basis)


def searched(high: int, search: Callable[[], BoundarySearch]) -> BoundarySearch:
    """`search()` (the longest safe length, the largest safe batch); where one of its own traces fails (BigBird
    at 64 tokens: a sparse attention that becomes full below its blocks), the asked geometry keeps its answer
    and this part alone says it could not be searched, and why."""
    try:
        return search()
    except ModelLoadError as error:
        return BoundarySearch(None, high, f"not searched: a trace the search needs failed ({error.message})")


@dataclasses.dataclass(frozen=True, eq=False)
class CheckGeometry(Record):
    batch_size: int
    seq_len: int
    target_len: int | None = ABSENT
    workload: str = ABSENT
    phase: str = ABSENT  # reports before "workload"
    index_bits: int = ABSENT


@dataclasses.dataclass(frozen=True, eq=False)
class CheckReport(Record):
    """What `check` concludes (check.json, and its --json): the model as built, the release judged, the geometry,
    the calls traced and those that fault, the prediction, the largest safe batch and longest safe length as
    searched, the peak memory of a real run, the guard advice. Made by `build_check_report`, written by
    reports.check."""

    config: dict[str, Any]
    model: dict[str, Any]
    release: ReleaseBlock
    geometry: CheckGeometry
    prediction: PredictionBlock
    mac: dict[str, Any] = ABSENT
    torch_profile: dict[str, Any] = ABSENT
    calls_traced: int = ABSENT
    ops_traced: int = ABSENT
    faulting_calls: list[CallRow] = ABSENT
    largest_safe_batch: int | None = ABSENT
    largest_safe_batch_search: dict[str, Any] = ABSENT
    longest_safe_length: int | None = ABSENT
    longest_safe_length_search: dict[str, Any] = ABSENT
    estimated_peak_gib: float = ABSENT
    estimated_peak_basis: str = ABSENT
    guard_advice: list[str] = ABSENT
    generation: str = ABSENT
    traces: int = ABSENT

    def problem(self) -> str | None:
        said = self.prediction.disagreement(self.geometry.batch_size)
        return f"prediction.{said}" if said else None


def build_check_report(cfg: CheckConfig) -> CheckReport:
    """Everything `mpsimpact check` prints and writes, as one typed value."""
    cfg.validate()
    model, info = prepare(cfg)
    judged = info.pop("judged")
    length, high = geometry(model.config, cfg)
    batch, heads = cfg.batch_size, info["heads"]
    plan = model.trace(batch, length)  # the asked geometry: where it cannot be traced, that is the answer
    subject = Subject(heads, info["class"], info["supports_attention_interface"], info["parameters"],
                      int(getattr(model.config, "hidden_size", 0) or 0), model.module.dtype, model.backward)
    by_length = searched(high, lambda: safe_length(model, cfg, batch, length, high, subject))
    by_batch = searched(batch_ceiling(batch), lambda: safe_batch(model, batch, length, subject))
    section = PredictionSection(judged, plan, batch, length, subject)
    target = (cfg.target_len or length) if info["encoder_decoder"] else None
    return CheckReport.of({
        "config": dataclasses.asdict(cfg),
        "model": info | {"max_length": length_limit(model.config)[0],
                         "inputs": f"token ids of zeros; attention mask: {model.mask}; "
                                   f"use_cache={cfg.cache}" + ("" if cfg.cache else " (--no-cache)")
                                   + (f"; {info['padding']}" if info["padding"] else "")},
        "release": section.release_json(),
        **({"mac": model.mac.to_json()} if model.mac is not None else {}),
        "torch_profile": profile_info(judged),
        "geometry": {"batch_size": batch, "seq_len": length, "target_len": target, "workload": cfg.workload,
                     "index_bits": cfg.index_bits},
        **section.to_json({"largest_safe_batch": by_batch.largest_safe,
                           "largest_safe_batch_search": by_batch.to_json(),
                           "longest_safe_length": by_length.largest_safe,
                           "longest_safe_length_search": by_length.to_json()}),
        "generation": generation_note(plan, info["task"], batch, length),
        "traces": model.traces,
    })


def generation_note(plan: FaultPlan, task: str, batch: int, length: int) -> str:
    """For causal LMs: what generate() runs differs from this full-logit forward in the lm_head."""
    if task != "causal-lm":
        return ""
    head = [c for c in plan.faults if c.module.split(".")[-1] == "lm_head"]
    rest = [c for c in plan.faults if c not in head]
    note = (f"generate() keeps one logit row per sample (logits_to_keep=1): its lm_head makes {batch} x 1 x "
            f"vocab logits, not the {batch} x {length} x vocab of this full-logit forward (scoring, "
            "perplexity, training).")
    if head:
        fault = f"the lm_head's {head[0].fault.kind} (call {head[0].index}, rule {head[0].fault.rule})"
        note += (f" So {fault} happens in full-logit forwards, not in generation" + (
            "; the other faulting calls happen in generate()'s prefill too." if rest else
            ": generate() at this geometry makes no faulting call."))
    return note
