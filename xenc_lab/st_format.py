"""What a sentence-transformers save adds to a Hugging Face checkpoint, read as CrossEncoder reads it.

CrossEncoder reads ``config_sentence_transformers.json`` (activation, prompts) and the Transformer
module's ``sentence_bert_config.json`` (max_seq_length, do_lower_case) only for a CrossEncoder save: a
directory with ``modules.json`` whose ``model_type`` is "CrossEncoder". A plain checkpoint, or a save of
another model type (which CrossEncoder converts), gets the defaults.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CrossEncoderSave:
    activation_fn: str | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False


def read_cross_encoder_save(path: Path) -> CrossEncoderSave:
    modules_file, st_file = path / "modules.json", path / "config_sentence_transformers.json"
    if not modules_file.is_file() or not st_file.is_file():
        return CrossEncoderSave()
    st_config = json.loads(st_file.read_text())
    if st_config.get("model_type") != "CrossEncoder":
        return CrossEncoderSave()
    modules = json.loads(modules_file.read_text())
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if kinds != ["Transformer"] or modules[0].get("path", "") not in ("", "."):
        raise ValueError(
            f"{path} is a CrossEncoder save with modules {kinds}; only a single Transformer module at the "
            "root (sequence classification) is supported"
        )
    module_file = path / "sentence_bert_config.json"
    module_config = json.loads(module_file.read_text()) if module_file.is_file() else {}
    task = module_config.get("transformer_task", "sequence-classification")
    if task != "sequence-classification":
        raise ValueError(f"{path}: transformer_task {task!r} is not supported, only 'sequence-classification'")
    return CrossEncoderSave(
        activation_fn=st_config.get("activation_fn"),
        prompts=dict(st_config.get("prompts") or {}),
        default_prompt_name=st_config.get("default_prompt_name"),
        max_seq_length=module_config.get("max_seq_length"),
        do_lower_case=bool(module_config.get("do_lower_case", False)),
    )
