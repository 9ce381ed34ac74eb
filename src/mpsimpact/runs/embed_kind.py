"""The embed kind: a corpus embedded in one forward pass per attention implementation and guard
condition, judged as a search index against the reference index (ranking.summarize_embeddings);
its columns, figures, samples and console lines."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from mpsimpact.runs.classify_kind import npz_bytes, select_reference
from mpsimpact.runs.device import full_precision_reductions
from mpsimpact.runs.ranking import COSINE_THRESHOLD, summarize_embeddings, twin_ids
from mpsimpact.output.page import EMULATED_LABEL, Footnotes
from mpsimpact.runs.kind import PASS_COLUMNS, RunKind, pass_cells
from mpsimpact.runs.device_pass import Geometry, build_batch, run_conditions, tokenize


class EmbedKind(RunKind):
    """Embedding a corpus for search: corrupted vectors, self-retrieval, query results, hubs."""

    name = "embedding"
    dtypes = ("float32",)
    reads = frozenset({"reference_device"})
    not_read = {"steps": "it trains nothing", "lr": "it trains nothing",
                "threshold": f"it judges each vector by its cosine to the reference vector (wrong below "
                             f"{COSINE_THRESHOLD}), not by a relative error",
                "dataset": "it embeds the embedded tweet corpus and queries it with texts of its own"}
    columns = (*PASS_COLUMNS, ("self_retrieval_failures", "self-retrieval failures"),
               ("recall_at_10", "recall@10"), ("top1_changed", "top-1 changed"), ("wall_s", "wall s"))
    files = ("report.json", "report.md", "report.html", "samples.jsonl", "embeddings.npz", "figures")
    position_files = ("samples.jsonl",)
    console_formats = RunKind.console_formats | {"recall_at_10": "{:.3f}"}
    console_header = ("guard", "status", "wrong", "first wrong (pred.)", "lost own match", "recall@10",
                      "top-1 changed", "wall")

    @full_precision_reductions()
    def run(self, config, scenario, model, geometry: Geometry, sections: dict,
            progress) -> tuple[dict[str, Any], dict[str, Any]]:
        from mpsimpact.runs.reference import run_chunked

        texts, _, repeats = build_batch(scenario.data.texts, scenario.data.labels, geometry.batch_size)
        inputs, token_stats = tokenize(model.tokenizer, texts, geometry)
        # Queries on the CPU, so only the index can be corrupted.
        queries = run_chunked(model.module.to("cpu"), model.tokenizer, list(scenario.queries),
                              geometry.run_length)
        first = sections[geometry.attentions[0]].prediction
        ref, info = select_reference(config, model, texts, geometry, first.first_corrupted_text, progress)
        info.update(threshold=COSINE_THRESHOLD, measure="cosine to the reference vector",
                    queries=len(queries), query_device="cpu")
        module = model.module.to(geometry.device)
        inputs = {k: v.to(geometry.device) for k, v in inputs.items()}
        twins = twin_ids(ref)
        conditions = []
        arrays: dict[str, Any] = {"reference": ref, "queries": queries, "texts": texts, "embeddings": {},
                                  "per_text": {}}
        for key, result in run_conditions(config, module, inputs, geometry, sections, model.heads, progress):
            embeddings = result.pop("logits", None)
            if embeddings is not None:
                summary, arrays["per_text"][key] = summarize_embeddings(embeddings, ref, queries, twins)
                result.update(summary)
                arrays["embeddings"][key] = embeddings
            conditions.append(result)
        model.module.to("cpu")
        return {"repeated_texts": repeats, "tokens": token_stats, "reference": info,
                "conditions": conditions}, arrays

    def figures(self, report: dict, arrays: dict) -> dict[str, bytes]:
        from mpsimpact.runs.figures import render_retrieval

        return render_retrieval(report, arrays["per_text"], self.figure_line(report))

    def extra_files(self, report: dict, arrays: dict) -> dict[str, bytes]:
        npz = npz_bytes({"reference": arrays["reference"], "queries": arrays["queries"]}, arrays["embeddings"])
        return {"samples.jsonl": samples_jsonl(arrays).encode("utf-8"), "embeddings.npz": npz}

    def markdown_lines(self, report: dict) -> list[str]:
        return [f"- {line}" for line in retrieval_lines(report)]

    def damage(self, report: dict, off: dict) -> tuple[str, str]:
        s = off["self_retrieval"]
        return (f"{off['corrupted_count']} of {report['geometry']['batch_size']} embeddings came back wrong",
                f"{s['failures']} documents no longer find themselves as their own nearest neighbour")

    def console_title(self, report: dict, title: str) -> str:
        return f"{EMULATED_LABEL}, {title}" if report["geometry"]["emulated"] else title

    def console_row(self, condition: dict, footnotes: Footnotes, verbose: bool) -> list[str]:
        c = condition
        return [*pass_cells(c, footnotes, verbose), *(
            [str(c["self_retrieval_failures"]), f"{c['recall_at_10']:.3f}", str(c["top1_changed"])]
            if c["status"] == "completed" else ["-"] * 3), f"{c['wall_s']:.1f}s"]

    def console_lines(self, report: dict, verbose: bool = False) -> list[str]:
        return [self.console_title(report, line) for line in retrieval_lines(report)]  # led by the label too


def retrieval_lines(report: dict) -> list[str]:
    """Self-retrieval, query results, hubs and direction of each completed condition with corrupted
    vectors."""
    lines = []
    for c in report["conditions"]:
        if c["status"] != "completed":
            continue
        eager = c.get("attention", "eager") == "eager"
        who = f"guard {c['guard']}" if eager else f"{c['attention']}, guard {c['guard']}"
        s, q, h, d = c["self_retrieval"], c["query_results"], c["hubs"], c["direction"]
        lines.append(f"{who}: {_corrupted_words(c)}; self-retrieval: {_self_retrieval_words(s)}; queries: mean "
                     f"recall@10 {q['recall_at_10']:.4f}, top-1 changed for {q['top1_changed']} of {q['queries']}.")
        if c["corrupted_count"]:
            lines.append(
                f"{who}: hubs: corrupted documents fill {h['corrupted_top10_appearances']} top-10 slots "
                f"(reference {h['reference_top10_appearances']}, uniform expectation "
                f"{h['expected_if_uniform']:.1f}); mean pairwise cosine of corrupted vectors "
                f"{_fmt(d['corrupted_mean_pairwise_cosine'])} vs clean "
                f"{_fmt(d['clean_mean_pairwise_cosine'])} (the same documents in the reference: "
                f"{_fmt(d['corrupted_reference_mean_pairwise_cosine'])}).")
    return lines


def _corrupted_words(c: dict) -> str:
    """'6 corrupted vectors (first 10, predicted 10)', or 'no corrupted vector (none predicted)': no None said."""
    predicted = c.get("predicted_first_corrupted_index")
    said = "none predicted" if predicted is None else f"predicted {predicted}"
    if not c["corrupted_count"]:
        return f"no corrupted vector ({said})"
    return f"{c['corrupted_count']} corrupted vectors (first {c['first_corrupted_index']}, {said})"


def _self_retrieval_words(s: dict) -> str:
    if not s["failures"]:
        return "every document is still its own nearest neighbour"
    return (f"{s['failures']} documents are no longer their own nearest neighbour (median rank "
            f"{s['median_failed_rank']}, max {s['max_rank']})")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def samples_jsonl(arrays: dict) -> str:
    """One line per document and completed condition."""
    lines = []
    for key, per in arrays["per_text"].items():
        for i, text in enumerate(arrays["texts"]):
            cos = float(per["cosine"][i])
            lines.append(json.dumps({
                "guard": key, "position": i, "text": text, "cosine": cos if np.isfinite(cos) else None,
                "corrupted": not cos >= COSINE_THRESHOLD, "self_rank": int(per["rank"][i]),
                "top10_appearances": int(per["appearances"][i]),
            }))
    return "\n".join(lines) + "\n"
