"""`mpsimpact train-head`: the embedded classifier's head retrained reproducibly."""

import typer

from mpsimpact.commands import options


def main(
    out: str | None = options.out("Write sentiment_head.npz/.json",
                                  "the installed package's data folder: overwrites the installed head",
                                  fresh=False),
    limit: int | None = options.option(
        "--limit", "Use only the first N texts of each split (quick checks).", "every text"),
) -> None:
    """Retrain the embedded classifier's head reproducibly (logistic regression on MiniLM embeddings)."""
    from pathlib import Path

    from mpsimpact.errors import UsageError
    from mpsimpact.runs.head import train_head

    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}.")
    metadata = train_head(Path(out) if out else None, limit=limit)
    typer.echo(f"held-out accuracy {metadata['heldout_accuracy']:.4f} on {metadata['heldout_texts']} texts "
               f"(trained on {metadata['train_texts']})")
