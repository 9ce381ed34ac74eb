"""`mpsimpact check`: is a Hugging Face model affected? Built on meta from its config alone."""

import typer

from mpsimpact.commands import options
from mpsimpact.config import CheckConfig
from mpsimpact.commands.options import option, shared


CONFIG = CheckConfig  # the options' dataclass: --help shows its defaults


def main(
    model: str = typer.Argument(
        ..., help="A hub id (offline Hugging Face cache only), a local model folder or a config.json."),
    batch_size: str | None = shared("--batch-size"),
    seq_len: str | None = options.number("--seq-len", "Tokens per sample (the prompt, for causal LMs).",
                                 "the model's maximum"),
    target_len: str | None = options.number("--target-len", "Encoder-decoders: decoder tokens.", "--seq-len"),
    task: str | None = option("--task", "auto (from the config's architectures), base, "
                              "sequence-classification, token-classification, causal-lm or seq2seq."),
    attention: str | None = option("--attention", "eager, sdpa, or default (what this transformers picks for "
                                                  "the model)."),
    workload: str | None = option("--workload", "inference (one forward pass) or training (one step: forward "
                                                "and backward)."),
    phase: str | None = typer.Option(None, "--phase", hidden=True),  # --workload's former name, kept working
    torch_profile: str | None = shared("--torch-profile"),
    index_bits: str | None = shared("--index-bits"),
    cache: bool | None = option("--cache/--no-cache", "Trace with the KV cache on (use_cache=True), as the "
                                "default forward model(ids) and generate() run; --no-cache as scoring and "
                                "training with use_cache=False do."),
    as_json: bool = options.as_json(),
    verbose: bool = options.verbose(),
    out: str | None = options.out("Also write check.json and check.md"),
    memory: str | None = shared("--memory"),
) -> None:
    """Is my model affected? Any Hugging Face architecture, from its config alone (meta, no weights)."""
    from mpsimpact.output.files import claimed_out_dir

    options.check_output(as_json, verbose)
    check_config = options.config_from(  # validated before anything heavy is imported
        CheckConfig, model=model, batch_size=batch_size, seq_len=seq_len, target_len=target_len, task=task,
        attention=attention, workload=workload or phase, torch_profile=torch_profile, index_bits=index_bits,
        cache=cache, out=out, memory=memory,
    )
    from mpsimpact.prediction.check import build_check_report
    from mpsimpact.reports.check import print_check, write_check_folder

    with claimed_out_dir(out, "check", default=False) as folder:
        report = build_check_report(check_config)
        options.print_result(report, as_json, lambda: print_check(report, verbose))
        if folder is not None:
            write_check_folder(folder, report)
            typer.echo(f"Written to {folder}/ (check.json, check.md)", err=as_json)
