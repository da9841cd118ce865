"""What a sentence-transformers save adds to a Hugging Face checkpoint, read as CrossEncoder reads it.

CrossEncoder reads ``config_sentence_transformers.json`` (activation, prompts) and the Transformer module's
``sentence_bert_config.json`` (max_seq_length, do_lower_case, the tokenizer's and config's keyword arguments, the
text processing arguments) only for a CrossEncoder save: a directory with ``modules.json`` whose ``model_type`` is
"CrossEncoder". Its Transformer module may sit in a subfolder (``path`` in ``modules.json``), where the model's
own files then are. A causal LM's save adds a LogitScore module after it (the vocabulary ids whose logits make the
score). A plain checkpoint, or a save of another model type (which CrossEncoder converts), gets the defaults.
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
# The tasks a CrossEncoder's Transformer module runs that xenc_lab scores: a classification head, or a causal LM read by
# a LogitScore module.
TASKS = ("sequence-classification", "text-generation")
LOGIT_SCORE = "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"
# apply_chat_template's own arguments (sentence-transformers' _APPLY_CHAT_TEMPLATE_TOP_LEVEL_KWARGS): the rest of
# processing_kwargs' chat_template are the template's variables.
CHAT_SIZE_KEYS = frozenset({"padding", "truncation", "max_length", "return_tensors"})


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
    transformer_task: str = "sequence-classification"  # or "text-generation": a causal LM read by LogitScore
    logit_score: tuple[int, int | None] | None = None  # a saved LogitScore's (true_token_id, false_token_id)
    modality_config: dict | None = None  # the Transformer's saved modality_config (its "message" entry: chat input)
    chat_template_kwargs: dict = field(default_factory=dict)  # processing_kwargs' chat_template (chat_processing)


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
    # The chat_template entry applies to chat-template input only (chat_processing reads it).
    others = {key: value for key, value in processing_kwargs.items() if key not in ("text", "chat_template") and value}
    if (others or not isinstance(text, dict) or set(text) - {"max_length", "truncation", "padding"}
            or text.get("truncation", True) not in (True, "longest_first")):
        raise ValueError(f"{where}: xenc_lab takes {{'text': {{'max_length': n}}}} (with truncation True or "
                         f"'longest_first', its only truncation), got {processing_kwargs!r}")
    max_length = text.get("max_length")
    return None if max_length is None else whole_number(f"{where}' text max_length", max_length)


def chat_processing(processing_kwargs, where: str) -> tuple[int | None, dict, bool]:
    """What sentence-transformers' ``processing_kwargs`` say about chat-template input: the max_length (its
    chat_template entry's wins over its text entry's, as sentence-transformers folds one over the other), the
    template's variables (the chat_template entry less apply_chat_template's own arguments and ``restore_suffix``),
    and whether a truncated row gets the template's tail back (``restore_suffix``, default True)."""
    max_length = processing_max_length(processing_kwargs, where)
    chat = (processing_kwargs or {}).get("chat_template") or {}
    if not isinstance(chat, dict):
        raise TypeError(f"{where}' chat_template must be a dict of template variables, got {type(chat).__name__}")
    restore = chat.get("restore_suffix", True)
    if not isinstance(restore, bool):
        raise TypeError(f"{where}' chat_template restore_suffix must be True or False, got {restore!r}")
    sizes = {key: value for key, value in chat.items() if key in CHAT_SIZE_KEYS}
    if sizes:
        max_length = processing_max_length({"text": {k: v for k, v in sizes.items() if k != "return_tensors"}},
                                           f"{where}' chat_template") or max_length
    variables = {key: value for key, value in chat.items() if key not in CHAT_SIZE_KEYS and key != "restore_suffix"}
    return max_length, variables, restore


def _logit_score(path: Path, module: dict, task: str, logits_name: str) -> tuple[int, int | None]:
    """A saved LogitScore module's (true_token_id, false_token_id)."""
    if module.get("type") != LOGIT_SCORE:
        raise ValueError(f"{path}: modules.json names the module class {module.get('type')!r} after the Transformer; "
                         f"xenc_lab runs only sentence-transformers' {LOGIT_SCORE} there (and never a save's own code)")
    folder = (path / module.get("path", "")).resolve()
    if not folder.is_relative_to(path.resolve()) or not (folder / "config.json").is_file():
        raise ValueError(f"{path}: modules.json puts the LogitScore at {module.get('path')!r}, which is not a folder "
                         "inside the save holding its config.json")
    config = json.loads((folder / "config.json").read_text())
    true_id, false_id = config.get("true_token_id"), config.get("false_token_id")
    reads = config.get("module_input_name", "causal_logits")
    if task != "text-generation" or reads != logits_name:
        raise ValueError(f"{path}: a LogitScore reads the logits a 'text-generation' Transformer writes, here a "
                         f"{task!r} Transformer writing {logits_name!r} and a LogitScore reading {reads!r}")
    ids = [true_id] + ([] if false_id is None else [false_id])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: the LogitScore's token ids must be vocabulary ids, got true_token_id={true_id!r} "
                         f"false_token_id={false_id!r}")
    return true_id, false_id


def _module_dir(path: Path, modules: list) -> Path:
    """The folder of a CrossEncoder save's Transformer module (the first), which must be sentence-transformers' own."""
    types = [m.get("type", "") for m in modules]
    if not 1 <= len(modules) <= 2 or types[0].rsplit(".", 1)[-1] != "Transformer":
        raise ValueError(f"{path} is a CrossEncoder save with modules {types}; only a Transformer module (sequence "
                         "classification), or one followed by a LogitScore (a causal LM), is supported")
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
    modules = json.loads(modules_file.read_text())
    module_dir = _module_dir(path, modules)
    name = next((n for n in MODULE_CONFIGS if (module_dir / n).is_file()), MODULE_CONFIGS[0])
    module_config = json.loads((module_dir / name).read_text()) if (module_dir / name).is_file() else {}
    task = module_config.get("transformer_task", "sequence-classification")
    if task not in TASKS:
        raise ValueError(f"{path}: transformer_task {task!r} is not supported, only {' or '.join(map(repr, TASKS))}")
    logits_name = module_config.get("module_output_name") or "causal_logits"
    logit_score = _logit_score(path, modules[1], task, logits_name) if len(modules) == 2 else None
    if task == "text-generation" and logit_score is None:
        raise ValueError(f"{path}: a 'text-generation' Transformer scores through a LogitScore module after it, and "
                         "modules.json lists none")
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
    processing = module_config.get("processing_kwargs")
    text_max_length = processing_max_length(processing, f"{name}'s processing_kwargs")
    chat_processing(processing, f"{name}'s processing_kwargs")  # checked here, applied by chat.ChatPairTokenizer
    modality_config = module_config.get("modality_config")
    if modality_config is not None and not isinstance(modality_config, dict):
        raise TypeError(f"{path}: {name}'s modality_config must be a dict, got {type(modality_config).__name__}")
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
        transformer_task=task,
        logit_score=logit_score,
        modality_config=modality_config,
        chat_template_kwargs=dict((processing or {}).get("chat_template") or {}),
    )
