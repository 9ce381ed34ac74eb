"""Any Hugging Face model built on `meta` from its config alone (an offline hub-cache id, a folder or a
config.json), for any task and attention implementation, and traced at any batch size and length."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from mpsimpact.bounds import MAX_CONFIG_BYTES, NAME_MAX, FileProblemError, name_problem, parse_json, path_problem
from mpsimpact.bounds import json_value_problem, read_file_bytes, shown_path
from mpsimpact.errors import ModelLoadError, UsageError
from mpsimpact.engine.release import FaultProfile
from mpsimpact.modes.call_site import TORCH_AND_OURS, innermost_outside, is_in_packages
from mpsimpact.modes.tracer import trace_module
from mpsimpact.engine.fault_plan import FaultPlan
from mpsimpact.engine.faults import MPS_INDEX_BITS

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
# Bounds on a config, checked on its JSON before transformers reads it or anything is built: no real model
# comes near them, and past them a meta build overflows a storage size or runs until killed.
MAX_CONFIG_SIZE = 2**31 - 1  # any size field (a dimension past INT_MAX is no model)
MAX_CONFIG_LAYERS = 512  # layers of one stack (the deepest published models have about 200; 512 BERT layers trace in 45 s)
MAX_PARAMETERS = 10**13  # parameters, estimated from the sizes (the largest published models have about 2 * 10**12)
LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "num_encoder_layers",
                "encoder_layers", "decoder_layers")
# Counts transformers turns into one Python object per item (a list entry, a module) as it reads the config or builds
# the model: any `..._layers` (MTP, residual, adapter layers), and these. Each is bounded by MAX_CONFIG_LAYERS.
LAYER_COUNTS = ("depth", "first_k_dense_replace")
MAX_LABELS = 1_000_000  # num_labels, id2label, label2id: transformers builds a dict entry per label (a billion: 24 GB)
LABEL_TABLES = ("id2label", "label2id")
SIZE_SUFFIXES = ("_size", "_dim", "_layers", "_heads", "_positions", "_embd", "_embeddings")
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # what a config's dtype may say (or "auto")
# Input variants, tried in order until one traces: transformers' mask code reads mask values (`.all()`), which
# meta tensors lack; which variant avoids that depends on the architecture. The 2-D mask (what a tokenizer
# gives) comes before the 4-D one, which some models would broadcast wrongly (DeBERTa builds its own (B, 1, L, L)
# from a 2-D mask). No variant changes a matmul.
MASKS = ("none", "2-D ones", "4-D ones")
PASS_A_MODEL = "pass a model folder, a config.json or a hub id."  # what every refused model source is told


def _looks_like_path(source: str) -> bool:
    return source.endswith(".json") or source.startswith(("/", ".", "~")) or source.count("/") > 1


def load_model_config(source: str) -> tuple[Any, str]:
    """The transformers config of a hub id (offline cache only), a folder or a config.json file, and
    where it came from ("config file", "local folder" or "Hugging Face cache")."""
    from transformers import AutoConfig

    path = Path(source).expanduser()
    _check_local_source(path, source)
    where = "config file" if path.is_file() else "local folder" if path.is_dir() else "Hugging Face cache"
    model_type = _check_model_type(path if path.exists() else _cached_config_file(source), source)
    named = f" (model type '{model_type}')" if model_type else ""
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
        raise ModelLoadError(f"Cannot load the config of '{source}'{named}: {_one_line(error)}") from None
    except Exception as error:  # a field transformers validates or uses and cannot (any error type)
        raise ModelLoadError(f"Cannot load the config of '{source}'{named}: {type(error).__name__}: "
                             f"{_one_line(error)}") from None


def _check_local_source(path: Path, source: str) -> None:
    """A local model folder or config.json, looked at before anything reads it (Note [Only regular files] in
    bounds): a folder's config.json, or the file itself, a regular file of at most MAX_CONFIG_BYTES; a name
    that looks like a path must exist. A hub id (nothing of that name here) passes."""
    problem = name_problem(path) if _looks_like_path(source) or len(source) > NAME_MAX else None
    if problem is not None:
        raise UsageError(f"Model '{shown_path(source)}' {problem}; {PASS_A_MODEL}")
    if path.is_dir():
        problem = path_problem(path / "config.json", MAX_CONFIG_BYTES, "a config")
        if problem == "does not exist":
            raise ModelLoadError(f"Folder '{source}' has no config.json; {PASS_A_MODEL}")
        if problem is not None:
            raise ModelLoadError(f"Folder '{source}': its config.json {problem}; {PASS_A_MODEL}")
    elif os.path.lexists(path):
        if (problem := path_problem(path, MAX_CONFIG_BYTES, "a config")) is not None:
            raise UsageError(f"Model '{source}' {problem}; {PASS_A_MODEL}")
    elif _looks_like_path(source):
        raise UsageError(f"'{source}' does not exist; {PASS_A_MODEL}")


def _cached_config_file(source: str) -> Path | None:
    """The config.json of a hub id in the local Hugging Face cache (checked like a local one), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, "config.json")
    except Exception:  # a malformed repo id: AutoConfig says so in its own words
        return None
    return Path(found) if isinstance(found, str) else None


def _check_model_type(path: Path | None, source: str) -> str | None:
    """A local (or cached) config's model_type must be one this transformers knows (checked before AutoConfig,
    whose message runs over several lines), and its fields within bounds (`check_config_fields`); returns the
    model type (None without a file to read)."""
    if path is None:
        return None
    from transformers import CONFIG_MAPPING, __version__

    file = path / "config.json" if path.is_dir() else path
    try:
        data = read_file_bytes(file, MAX_CONFIG_BYTES, "a config")
    except FileProblemError as error:
        raise ModelLoadError(f"Config '{file}' {error}; {PASS_A_MODEL}") from None
    try:
        fields = parse_json(data, allow_nan=True)  # Mamba-2 configs hold Infinity
    except ValueError as error:
        raise ModelLoadError(f"Cannot read '{file}' as JSON: {_first_line(error)}") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type is None:
        raise ModelLoadError(f"'{file}' has no model_type field; it is not a transformers config.")
    check_config_fields(fields, file)  # its types too (a list as model_type), before anything looks them up
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"'{source}' has model_type '{str(model_type)[:60]}', an architecture transformers {__version__} does not "
            "know; upgrade transformers or check the config."
        )
    check_config_values(fields, CONFIG_MAPPING[model_type], file)
    return model_type


def check_config_values(fields: dict[str, Any], config_class: Any, file: Path, prefix: str = "") -> None:
    """A config holds what JSON allows, as a dataset must (bounds.json_value_problem): no lone surrogate and no NaN
    anywhere, and no infinity (1e400 is one) in a field `config_class` does not declare, which the model never
    reads (a declared one may hold Infinity, as Mamba-2's time_step_limit does, written by transformers); a
    sub-config (text_config, vision_config) is held to its own class's fields.

    Raises:
        ModelLoadError: one line naming the file and the field.
    """
    from transformers import CONFIG_MAPPING

    declared, subs = _declared_fields(config_class), getattr(config_class, "sub_configs", None) or {}
    for name, value in fields.items():
        sub = subs.get(name) if isinstance(value, dict) else None
        if sub is not None and sub.__name__ == "AutoConfig":  # the sub-config's own model_type says its class
            model_type = value.get("model_type")  # a lazy mapping: `in`, then [], as transformers reads it
            sub = CONFIG_MAPPING[model_type] if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
        if sub is not None:
            check_config_values(value, sub, file, f"{prefix}{name}.")
            continue
        found = json_value_problem({name: value}, prefix.rstrip("."), infinity=name in declared)
        if found is not None:
            raise ModelLoadError(f"'{file}': {found[0].lstrip('.')} {found[1]}; remove it or correct it.")


@functools.lru_cache(maxsize=64)
def _declared_fields(config_class: Any) -> frozenset[str]:
    """The fields a transformers config class declares: its constructor's parameters and its defaults' keys."""
    names = set(inspect.signature(config_class.__init__).parameters)
    try:
        names |= set(config_class().to_dict())
    except Exception:  # a class that needs arguments: its parameters alone
        pass
    return frozenset(names)


def check_config_fields(fields: dict[str, Any], file: Path | str) -> None:
    """A config's sizes, counts, types and dtypes, bounded before transformers reads it or anything is built (in
    sub-configs too: a multimodal model's text_config): each size a whole number from 1 to MAX_CONFIG_SIZE, each
    stack (and any other count of layers, LAYER_COUNTS) at most MAX_CONFIG_LAYERS, at most MAX_LABELS labels, the
    parameters the sizes imply at most MAX_PARAMETERS, model_type a string, architectures a list of class names,
    each dtype a float dtype (FLOAT_DTYPES) or "auto".

    Raises:
        ModelLoadError: one line naming the file, the field, its value and the bound.
    """
    for prefix, part in _config_parts(fields):
        for name, value in part.items():
            problem = _field_problem(name, value)
            if problem is not None:
                raise ModelLoadError(f"'{file}': {prefix}{name} {problem}; check the config.")
        parameters = _parameters_implied(part)
        if parameters > MAX_PARAMETERS:
            raise ModelLoadError(f"'{file}': {prefix or 'its sizes'} imply about {parameters:.2g} parameters, more "
                                 f"than any model ({MAX_PARAMETERS:.0e}); check the config.")


def _field_problem(name: str, value: Any) -> str | None:
    """What is wrong with one field of a config, in words that follow its name, or None."""
    is_int = type(value) is int
    if name in SIZE_FIELDS and value is not None and (not is_int or value < 1):
        return f"must be a whole number of at least 1, got {_shown(value)}"
    if is_int and (name in SIZE_FIELDS or name.endswith(SIZE_SUFFIXES)) and value > MAX_CONFIG_SIZE:
        return f"is {value:,}, more than any size a model has ({MAX_CONFIG_SIZE:,})"
    if is_int and (name in LAYER_FIELDS + LAYER_COUNTS or name.endswith("_layers")) and value > MAX_CONFIG_LAYERS:
        return f"is {value:,} layers, more than the {MAX_CONFIG_LAYERS:,} mpsimpact builds"
    if name == "num_labels" and value is not None and (not is_int or not 0 <= value <= MAX_LABELS):
        return f"must be a whole number from 0 to {MAX_LABELS:,} (labels; transformers lists each), got {_shown(value)}"
    if name in LABEL_TABLES and value is not None and not isinstance(value, dict):
        return f"must be an object (label id to name, or name to id), got {_shown(value)}"
    if name in LABEL_TABLES and value is not None and len(value) > MAX_LABELS:
        return f"has {len(value):,} labels, more than the {MAX_LABELS:,} mpsimpact reads"
    if name == "model_type" and value is not None and not isinstance(value, str):
        return f"must be a string (a model type such as \"bert\"), got {_shown(value)}"
    if name == "architectures" and value is not None and (
            not isinstance(value, list) or not all(isinstance(item, str) for item in value)):
        return f"must be a list of class names (such as [\"BertForMaskedLM\"]), got {_shown(value)}"
    if name in ("dtype", "torch_dtype") and value is not None and value not in (*FLOAT_DTYPES, "auto"):
        return f"is {_shown(value)}, not a dtype models are built in here ({', '.join(FLOAT_DTYPES)} or auto)"
    return None


def _shown(value: Any) -> str:
    """A field's value as its JSON (cut to 40 characters); an empty list or object in words."""
    empty = {"[]": "an empty list", "{}": "an empty object"}
    return empty.get(text := json.dumps(value)[:40], text)


def _config_parts(fields: dict[str, Any], prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    """The config and every sub-config in it (a dict value, not a label table), each with its dotted prefix."""
    parts = [(prefix, fields)]
    for name, value in fields.items():
        if isinstance(value, dict) and name not in LABEL_TABLES:
            parts += _config_parts(value, f"{prefix}{name}.")
    return parts


def _parameters_implied(fields: dict[str, Any]) -> int:
    """A rough parameter count from a config's sizes: layers x (4 h^2 + 3 h i x experts) + 2 x vocabulary x h."""
    def first(*names: str, default: int = 0) -> int:
        return next((v for n in names if type(v := fields.get(n)) is int and v > 0), default)

    hidden = first("hidden_size", "d_model", "n_embd", "dim")
    inner = first("intermediate_size", "d_ff", "n_inner", "ffn_dim", "hidden_dim", default=4 * hidden)
    layers = sum(v for n in LAYER_FIELDS if type(v := fields.get(n)) is int and v > 0) or 1
    experts = first("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", default=1)
    return layers * (4 * hidden * hidden + 3 * hidden * inner * experts) + 2 * first("vocab_size") * hidden


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _one_line(error: BaseException, most: int = 240) -> str:
    """An error's whole text on one line (messages that put the reason on a second line keep it)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= most else text[:most - 3] + "..."


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


def pad_for_the_head(config: Any, model_class: Any) -> tuple[Any, str]:
    """A sequence-classification head pools each sample's last token before padding, and refuses batches of
    more than one without a pad token: a config with none is traced with one (the last id, which the zero token
    ids of a trace never meet, so every token counts). Returns the config to build from (a copy where a pad id
    was added: the caller's is left as it was) and what was done, in words ("" when nothing). `check` and every
    scenario's classifier (models.classifier.meta_classifier, which `plan` and `run` trace) share it."""
    if (getattr(config, "pad_token_id", 0) is not None or not getattr(config, "vocab_size", None)
            or "ForSequenceClassification" not in getattr(model_class, "__name__", "")):
        return config, ""
    config = copy.deepcopy(config)
    config.pad_token_id = config.vocab_size - 1
    return config, (f"pad_token_id unset in the config, traced as {config.pad_token_id} (the head pools the last "
                    "token)")


def build_meta_model(model_class: Any, config: Any, attention: str | None = None) -> torch.nn.Module:
    """The model on `meta` (no weights, nothing allocated), in eval mode; `attention` None (or "default")
    leaves the implementation to transformers (read it back from `model.config._attn_implementation`).
    Raises what transformers raises (`explain_build_error` words it for the CLI)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    kwargs = {} if attention in (None, "default") else {"attn_implementation": attention}
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    with torch.device("meta"):
        return build(config, **kwargs).eval()


def explain_build_error(error: Exception, model_class: Any, config: Any, attention: str) -> Exception:
    """A failed `build_meta_model` in one line: the --attention the model lacks, or where it failed."""
    name, model_type = model_class.__name__, config.model_type
    if attention != "default" and "attn_implementation" in str(error):
        return UsageError(f"--attention {attention}: {name} does not support it for model type "
                          f"'{model_type}' ({_first_line(error)[:160]}).")
    return ModelLoadError(f"Cannot build {name} (model type '{model_type}') from the config, "
                          f"in {failing_call(error)}: {type(error).__name__}: {_one_line(error)}")


def trace_meta(module: torch.nn.Module, batch: int, length: int, *, mask: str = "none", backward: bool = False,
               index_bits: int = MPS_INDEX_BITS, profile: FaultProfile | None = None, every_op: bool = False,
               allocations: bool = False, **forward: Any) -> FaultPlan:
    """Traces `module` (built on meta) on `batch` samples of `length` zero token ids, with the attention
    mask variant `mask` (one of MASKS) and any other `forward` arguments; `profile` None: the installed
    torch's rules."""
    inputs: dict[str, Any] = {"input_ids": torch.zeros(batch, length, dtype=torch.long, device="meta")}
    if mask == "4-D ones":
        inputs["attention_mask"] = torch.ones(batch, 1, length, length, dtype=torch.bool, device="meta")
    elif mask == "2-D ones":
        inputs["attention_mask"] = torch.ones(batch, length, dtype=torch.long, device="meta")
    return trace_module(module, inputs | forward, backward=backward, index_bits=index_bits, profile=profile,
                        every_op=every_op, allocations=allocations)


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
    mac: Any = None  # a MacMemory: its largest buffer decides too (Note [The Mac's largest buffer])

    def forward_args(self, batch: int, length: int) -> dict[str, Any]:
        """Decoder ids for encoder-decoders (zeros on meta, `target_len` long) and use_cache as `cache` says
        (the default forward passes K and V through the cache, which changes the layouts bmm sees)."""
        args: dict[str, Any] = {}
        if getattr(self.config, "is_encoder_decoder", False):
            args["decoder_input_ids"] = torch.zeros(batch, self.target_len or length, dtype=torch.long,
                                                    device="meta")
        if "use_cache" in inspect.signature(self.module.forward).parameters:
            args["use_cache"] = self.cache
        return args

    def trace(self, batch: int, length: int) -> FaultPlan:
        """Traces one forward pass (or training step) at this geometry, once: every op but views (so that
        traces at other sizes rescale call by call, and the memory estimate sees each op's dtype)."""
        if (batch, length) not in self.plans:
            self.plans[batch, length] = self._trace(batch, length)
        return self.plans[batch, length]

    def _trace(self, batch: int, length: int) -> FaultPlan:
        """The first input variant that traces (once one has, that one); every variant failing is one line that
        names the model type, the variants tried, and the call that failed last."""
        failures = []
        for variant in (self.mask,) if self.mask else MASKS:
            self.traces += 1
            try:
                plan = trace_meta(self.module, batch, length, mask=variant, backward=self.backward,
                                  index_bits=self.index_bits, profile=self.profile, every_op=True,
                                  allocations=self.mac is not None,
                                  **self.forward_args(batch, length))
            except Exception as error:  # the model's own code on meta tensors can fail in any way: try the next
                failures.append((variant, error))
                continue
            self.mask = variant
            return plan.on_mac(self.mac)
        # The most telling failure: the first that is not a mask value read on meta (the natural input's, 2-D).
        variant, error = next(((v, e) for v, e in failures if "meta tensors" not in str(e)), failures[-1])
        raise ModelLoadError(
            f"Cannot trace {type(self.module).__name__} (model type '{getattr(self.config, 'model_type', '?')}') of "
            f"{self.name} on meta at batch {batch}, length {length} with any input variant "
            f"({', '.join(v for v, _ in failures)}); with {variant} it failed in {failing_call(error)}: "
            f"{type(error).__name__}: {_one_line(error)}", model_type=getattr(self.config, "model_type", None),
            call=failing_call(error)) from None


# The model's own code: transformers', and remote code (trust_remote_code) imported as transformers_modules.
MODEL_CODE = ("transformers", "transformers_modules")


def failing_call(error: BaseException) -> str:
    """Where `error` was raised, as `file.py:line in function`: the innermost frame in the model's own code
    (transformers, or a model's remote code), else the innermost frame outside torch."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if is_in_packages(f.filename, MODEL_CODE)]
    frame = ours[-1] if ours else innermost_outside(TORCH_AND_OURS, frames) or (frames[-1] if frames else None)
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}" if frame else "an unknown call"


def heads_of(config: Any) -> int:
    """Attention heads per layer (1 when the config does not say)."""
    return int(getattr(config, "num_attention_heads", None) or 1)


def usable_positions(config: Any) -> int:
    """Max sequence length: RoBERTa reserves padding_idx + 1 positions."""
    positions = config.max_position_embeddings
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        positions -= config.pad_token_id + 1
    return positions


def length_limit(config: Any) -> tuple[int | None, int | None]:
    """(hard limit, nominal length): the learned positions (RoBERTa's reserved ones excluded) bound
    the length; a relative-position model may only state a nominal one (T5's n_positions)."""
    if getattr(config, "max_position_embeddings", None):
        positions = usable_positions(config)
        return positions, positions
    names = ("n_positions", "max_seq_len", "seq_length")
    return None, next((getattr(config, name) for name in names if getattr(config, name, None)), None)
