"""Scenario `finetune`: the sentiment classifier in training mode (dropout off, so deterministic)
takes K optimiser steps on one oversized batch; what the faults do to gradients and the model."""

from __future__ import annotations

from mpsimpact.scenarios.sentiment import SentimentScenario

from mpsimpact.runs.scenario import register
from mpsimpact.runs.train_kind import TrainKind

EVAL_TEXTS = 512


@register
class FinetuneScenario(SentimentScenario):
    """Same model and data as `sentiment`: training texts from the embedded corpus's training split
    (or the given dataset), evaluation on a fixed slice of held-out texts."""

    name = "finetune"
    description = "One oversized training step of the sentiment classifier: gradients, update, predictions after."
    default_batch_size = 2048
    default_max_length = 512
    kind = TrainKind()

    def load(self) -> None:
        from mpsimpact.models.dataset import LabelledTexts, load_embedded

        super().load()
        held = self.data
        if self.dataset_name is None:
            self.data = load_embedded("train")
        self.eval_data = LabelledTexts(held.texts[-EVAL_TEXTS:], held.labels[-EVAL_TEXTS:], held.label_names,
                                       f"{held.source}, last {EVAL_TEXTS}")
