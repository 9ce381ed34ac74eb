"""Any Hugging Face model built on `meta` from its config alone (an offline hub-cache id, a folder or a
config.json), for any task and attention implementation, and traced at any batch size and length."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import torch

from mpsimpact.errors import ModelLoadError, UsageError
from mpsimpact.engine.release import FaultProfile
from mpsimpact.modes.tracer import trace_module
from mpsimpact.engine.fault_plan import FaultPlan

# --task (config.CHECK_TASKS, in this order) -> the transformers auto class, and the name of its MODEL_..._MAPPING_NAMES table.
TASKS = {
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
    "sequence-classification": (
        "AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token-classification": ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
}
# Sizes a config may state; each must be a whole number >= 1 (transformers would fail deep inside, or build
# a model with no layers).
SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "num_key_value_heads",
               "vocab_size", "max_position_embeddings", "head_dim", "d_model", "d_kv", "d_ff", "num_heads",
               "num_layers", "num_decoder_layers", "n_head", "n_layer", "n_embd", "n_positions")
# Input variants, tried in order: transformers' mask code reads mask values (`.all()`), which meta
# tensors lack; which variant avoids that depends on the architecture. No variant changes a matmul.
MASKS = ("none", "4-D ones", "2-D ones")


def _looks_like_path(source: str) -> bool:
    return source.endswith(".json") or source.startswith(("/", ".", "~")) or source.count("/") > 1


def load_model_config(source: str) -> tuple[Any, str]:
    """The transformers config of a hub id (offline cache only), a folder or a config.json file, and
    where it came from ("config file", "local folder" or "Hugging Face cache")."""
    from transformers import AutoConfig

    path = Path(source).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"Folder '{source}' has no config.json; pass a model folder, a config.json or a hub id.")
    if not path.exists() and _looks_like_path(source):
        raise UsageError(f"'{source}' does not exist; pass a model folder, a config.json or a hub id.")
    where = "config file" if path.is_file() else "local folder" if path.is_dir() else "Hugging Face cache"
    _check_model_type(path if path.exists() else None, source)
    try:
        return AutoConfig.from_pretrained(str(path) if path.exists() else source, local_files_only=True), where
    except OSError:
        if path.exists():
            raise ModelLoadError(f"Cannot read a config from '{source}'.") from None
        raise ModelLoadError(
            f"'{source}' is not in the Hugging Face cache (offline); download it once with "
            f"`hf download {source}` or pass a local folder or config.json."
        ) from None
    except ValueError as error:
        raise ModelLoadError(f"Cannot load the config of '{source}': {_first_line(error)}") from None


def _check_model_type(path: Path | None, source: str) -> None:
    """A local config's model_type must be one this transformers knows (checked before AutoConfig,
    whose message runs over several lines)."""
    if path is None:
        return
    from transformers import CONFIG_MAPPING, __version__

    file = path / "config.json" if path.is_dir() else path
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"Cannot read '{file}' as JSON: {_first_line(error)}") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type is None:
        raise ModelLoadError(f"'{file}' has no model_type field; it is not a transformers config.")
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"'{source}' has model_type '{model_type}', an architecture transformers {__version__} does not know; "
            "upgrade transformers or check the config."
        )
    for name in SIZE_FIELDS:
        value = fields.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise ModelLoadError(f"'{file}': {name} must be a whole number of at least 1, got {json.dumps(value)}; "
                                 "check the config.")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def resolve_task(config: Any, task: str) -> tuple[Any, str, str]:
    """(model class, task, basis): `auto` reads the config's `architectures`."""
    import transformers
    from transformers.models.auto import modeling_auto

    if task != "auto":
        auto_name, _ = TASKS[task]
        auto = getattr(transformers, auto_name)
        if type(config) not in auto._model_mapping:
            offered = [t for t, (name, _) in TASKS.items()
                       if type(config) in getattr(transformers, name)._model_mapping]
            raise UsageError(f"--task {task}: transformers has no {auto_name} class for model type "
                             f"'{config.model_type}'; this model offers: "
                             f"{', '.join(offered) or 'none of the named tasks'} (or --task auto).")
        return auto, task, f"--task {task} ({auto_name})"
    architecture = (getattr(config, "architectures", None) or [None])[0]
    for name, (auto_name, table) in TASKS.items():
        if architecture and architecture in _class_names(getattr(modeling_auto, table).get(config.model_type)):
            return getattr(transformers, auto_name), name, f"the config's architectures: {architecture} ({auto_name})"
    if architecture and hasattr(transformers, architecture):
        basis = f"the config's architectures: {architecture} (built as is)"
        return getattr(transformers, architecture), "architecture", basis
    return transformers.AutoModel, "base", "no known architecture in the config: the base model (AutoModel)"


def _class_names(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def build_meta_model(model_class: Any, config: Any, attention: str) -> torch.nn.Module:
    """The model on `meta` (no weights, nothing allocated), in eval mode; `default` leaves the attention
    implementation to transformers (read it back from `model.config._attn_implementation`)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    kwargs = {} if attention == "default" else {"attn_implementation": attention}
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    try:
        with torch.device("meta"):
            model = build(config, **kwargs)
    except (ValueError, ImportError) as error:
        if attention != "default" and "attn_implementation" in str(error):
            raise UsageError(f"--attention {attention}: {model_class.__name__} does not support it for model type "
                             f"'{config.model_type}' ({_first_line(error)[:160]}).") from None
        raise ModelLoadError(f"Cannot build {model_class.__name__} from the config: {_first_line(error)}") from None
    return model.eval()


@dataclasses.dataclass
class MetaModel:
    """A model built on meta, and how to trace it at any batch size and length."""

    module: torch.nn.Module
    config: Any
    name: str
    backward: bool
    index_bits: int
    profile: FaultProfile
    target_len: int | None = None
    cache: bool = True  # use_cache as the default forward (model(ids), generate()) runs it
    mask: str | None = None  # the input variant that traces (found by the first trace)
    traces: int = 0  # traces made (a geometry traced once is answered from `plans`)
    plans: dict[tuple[int, int], FaultPlan] = dataclasses.field(default_factory=dict)

    def inputs(self, batch: int, length: int, mask: str) -> dict[str, Any]:
        """Zero token ids (and decoder ids for encoder-decoders) on meta; use_cache as `cache` says (the
        default forward passes K and V through the cache, which changes the layouts bmm sees)."""
        def ids(n: int) -> torch.Tensor:
            return torch.zeros(batch, n, dtype=torch.long, device="meta")

        inputs: dict[str, Any] = {"input_ids": ids(length)}
        if getattr(self.config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids(self.target_len or length)
        if mask == "4-D ones":
            inputs["attention_mask"] = torch.ones(batch, 1, length, length, dtype=torch.bool, device="meta")
        elif mask == "2-D ones":
            inputs["attention_mask"] = torch.ones(batch, length, dtype=torch.long, device="meta")
        if "use_cache" in inspect.signature(self.module.forward).parameters:
            inputs["use_cache"] = self.cache
        return inputs

    def trace(self, batch: int, length: int) -> FaultPlan:
        """Traces one forward pass (or training step) at this geometry, once: every op but views (so that
        traces at other sizes rescale call by call, and the memory estimate sees each op's dtype)."""
        if (batch, length) not in self.plans:
            self.plans[batch, length] = self._trace(batch, length)
        return self.plans[batch, length]

    def _trace(self, batch: int, length: int) -> FaultPlan:
        variants = (self.mask,) if self.mask else MASKS
        for variant in variants[:-1]:
            if (plan := self._attempt(batch, length, variant, last=False)) is not None:
                return plan
        return self._attempt(batch, length, variants[-1], last=True)

    def _attempt(self, batch: int, length: int, mask: str, last: bool) -> FaultPlan | None:
        """A trace with this input variant; None if the model read a mask value and others remain."""
        self.traces += 1
        try:
            plan = trace_module(self.module, self.inputs(batch, length, mask), backward=self.backward,
                                index_bits=self.index_bits, profile=self.profile, every_op=True)
        except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as error:
            if "meta tensors" in str(error) and not last:
                return None
            raise ModelLoadError(f"Tracing {self.name} on meta failed at batch {batch}, length {length}: "
                                 f"{_first_line(error)}") from None
        self.mask = mask
        return plan


def heads_of(config: Any) -> int:
    """Attention heads per layer (1 when the config does not say)."""
    return int(getattr(config, "num_attention_heads", None) or 1)


def length_limit(config: Any) -> tuple[int | None, int | None]:
    """(hard limit, nominal length): the learned positions (RoBERTa's reserved ones excluded) bound
    the length; a relative-position model may only state a nominal one (T5's n_positions)."""
    from mpsimpact.models.classifier import usable_positions

    if getattr(config, "max_position_embeddings", None):
        positions = usable_positions(config)
        return positions, positions
    names = ("n_positions", "max_seq_len", "seq_length")
    return None, next((getattr(config, name) for name in names if getattr(config, name, None)), None)
