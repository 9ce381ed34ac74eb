"""`mpsimpact train-head`: the embedded classifier's head retrained reproducibly, into a folder of its own;
replacing the installed head takes --install."""

import typer

from mpsimpact.commands import options
from mpsimpact.config import TrainHeadConfig


CONFIG = TrainHeadConfig  # the options' dataclass: --help shows its defaults


def main(
    out: str | None = options.out("Write sentiment_head.npz/.json", "outputs/train-head-<time>/"),
    limit: str | None = options.number(
        "--limit", "Use only the first N texts of each split (quick checks).", "every text"),
    install: bool = typer.Option(False, "--install", help="Replace the installed package's head with the new one "
                                 "(its data folder) instead of writing a folder. Off unless given."),
) -> None:
    """Retrain the embedded classifier's head reproducibly (logistic regression on MiniLM embeddings)."""
    head_config = options.config_from(TrainHeadConfig, out=out, limit=limit, install=install)
    from mpsimpact.output.files import claimed_out_dir, folder_written_atomically
    from mpsimpact.output.progress import progress_steps
    from mpsimpact.errors import paragraph
    from mpsimpact.runs.head import installed_head_folder, train_head

    if install:
        with progress_steps() as steps:
            metadata = train_head(None, limit=head_config.limit, steps=steps)
        where = f"Replaced the installed head in {installed_head_folder()}/"
    else:
        with claimed_out_dir(head_config.out, "train-head") as folder:
            with folder_written_atomically(folder) as partial, progress_steps() as steps:
                metadata = train_head(partial, limit=head_config.limit, steps=steps)
        where = (f"Written to {folder}/ (sentiment_head.npz, sentiment_head.json); the installed head is "
                 "unchanged (--install replaces it)")
    typer.echo(f"held-out accuracy {metadata['heldout_accuracy']:.4f} on {metadata['heldout_texts']} texts "
               f"(trained on {metadata['train_texts']})")
    typer.echo(paragraph(where))
