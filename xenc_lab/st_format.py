"""What a sentence-transformers save adds to a Hugging Face checkpoint, read as CrossEncoder reads it.

CrossEncoder reads ``config_sentence_transformers.json`` (activation, prompts) and the Transformer module's
``sentence_bert_config.json`` (max_seq_length, do_lower_case, the tokenizer's and config's keyword arguments, the
text processing arguments) only for a CrossEncoder save: a directory with ``modules.json`` whose ``model_type`` is
"CrossEncoder". Its one Transformer module may sit in a subfolder (``path`` in ``modules.json``), where the model's
own files then are. A plain checkpoint, or a save of another model type (which CrossEncoder converts), gets the
defaults.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .config import whole_number

logger = logging.getLogger(__name__)

# The Transformer module's config file, under the names sentence-transformers has written it (it tries them in order).
MODULE_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                  "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                  "sentence_xlnet_config.json")
# Keys of the tokenizer's and config's keyword arguments that say where to load from: the save's own place decides.
_HUB_KEYS = ("subfolder", "token", "cache_dir", "revision", "local_files_only", "trust_remote_code")


@dataclass(frozen=True)
class CrossEncoderSave:
    activation_fn: str | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    model_dir: Path | None = None  # where the model's own files are: the save's root or its Transformer's subfolder
    tokenizer_kwargs: dict = field(default_factory=dict)  # to AutoTokenizer.from_pretrained (processor_kwargs)
    config_kwargs: dict = field(default_factory=dict)  # to AutoConfig.from_pretrained
    text_max_length: int | None = None  # processing_kwargs' text max_length: every call's, unless the call says
    module_config: str = "sentence_bert_config.json"  # the file these came from, for messages


def processing_max_length(processing_kwargs, where: str) -> int | None:
    """The max_length of sentence-transformers' ``processing_kwargs`` ({"text": {"max_length": n}}), which the
    tokenizer is called with, or None. Truncation stays longest_first (True); padding changes no score; anything
    else is refused, as xenc_lab cannot honour it. ``where`` names the source for messages."""
    if processing_kwargs is None:
        return None
    if not isinstance(processing_kwargs, dict):
        raise TypeError(f"{where} must be a dict such as {{'text': {{'max_length': 256}}}}, "
                        f"got {type(processing_kwargs).__name__}")
    text = processing_kwargs.get("text") or {}
    others = {key: value for key, value in processing_kwargs.items() if key != "text" and value}
    if (others or not isinstance(text, dict) or set(text) - {"max_length", "truncation", "padding"}
            or text.get("truncation", True) not in (True, "longest_first")):
        raise ValueError(f"{where}: xenc_lab takes {{'text': {{'max_length': n}}}} (with truncation True or "
                         f"'longest_first', its only truncation), got {processing_kwargs!r}")
    max_length = text.get("max_length")
    return None if max_length is None else whole_number(f"{where}' text max_length", max_length)


def _module_dir(path: Path, modules: list) -> Path:
    """The folder of a CrossEncoder save's one Transformer module, which must be sentence-transformers' own."""
    types = [m.get("type", "") for m in modules]
    if len(modules) != 1 or types[0].rsplit(".", 1)[-1] != "Transformer":
        raise ValueError(f"{path} is a CrossEncoder save with modules {types}; only a single Transformer module "
                         "(sequence classification) is supported")
    if not types[0].startswith("sentence_transformers."):
        raise ValueError(f"{path}: modules.json names the module class {types[0]!r}, which is not sentence-transformers' "
                         "Transformer; xenc_lab runs only that one (and never a save's own code)")
    module_dir = (path / modules[0].get("path", "")).resolve()
    if not module_dir.is_relative_to(path.resolve()) or not module_dir.is_dir():
        raise ValueError(f"{path}: modules.json puts the Transformer at {modules[0].get('path')!r}, which is not a "
                         "folder inside the save")
    return module_dir


def read_cross_encoder_save(path: Path) -> CrossEncoderSave:
    modules_file, st_file = path / "modules.json", path / "config_sentence_transformers.json"
    if not modules_file.is_file() or not st_file.is_file():
        return CrossEncoderSave(model_dir=path)
    st_config = json.loads(st_file.read_text())
    if st_config.get("model_type") != "CrossEncoder":
        return CrossEncoderSave(model_dir=path)
    module_dir = _module_dir(path, json.loads(modules_file.read_text()))
    name = next((n for n in MODULE_CONFIGS if (module_dir / n).is_file()), MODULE_CONFIGS[0])
    module_config = json.loads((module_dir / name).read_text()) if (module_dir / name).is_file() else {}
    task = module_config.get("transformer_task", "sequence-classification")
    if task != "sequence-classification":
        raise ValueError(f"{path}: transformer_task {task!r} is not supported, only 'sequence-classification'")
    prompts = dict(st_config.get("prompts") or {})
    default_prompt_name = st_config.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise ValueError(f"{path}: config_sentence_transformers.json's default_prompt_name {default_prompt_name!r} "
                         f"is not one of its prompts {sorted(prompts)}")
    kwargs = {}
    for new, old in (("processor_kwargs", "tokenizer_args"), ("config_kwargs", "config_args"), ("model_kwargs", "model_args")):
        given = module_config.get(new, module_config.get(old)) or {}
        kwargs[new] = {key: value for key, value in given.items() if key not in _HUB_KEYS}
    if kwargs["model_kwargs"]:
        logger.warning("%s: the save's model_kwargs %s are not applied; the Scorer's own arguments (dtype, device) "
                       "decide", path / name, kwargs["model_kwargs"])
    text_max_length = processing_max_length(module_config.get("processing_kwargs"), f"{name}'s processing_kwargs")
    return CrossEncoderSave(
        activation_fn=st_config.get("activation_fn"),
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        max_seq_length=module_config.get("max_seq_length"),
        do_lower_case=bool(module_config.get("do_lower_case", False)),
        model_dir=module_dir,
        tokenizer_kwargs=kwargs["processor_kwargs"],
        config_kwargs=kwargs["config_kwargs"],
        text_max_length=text_max_length,
        module_config=name,
    )
