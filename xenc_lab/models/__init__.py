"""The family registry: one dict from a checkpoint's architecture to our packed module. What each declares is
``base.EncoderModel``'s or ``base.DecoderModel``'s contract; no architecture name is read outside ``models/`` and the
loader."""
from __future__ import annotations

from .base import DecoderModel, EncoderModel, PackedModel
from .bert import BertForSequenceClassification, ElectraForSequenceClassification, RobertaForSequenceClassification
from .deberta_v2 import DebertaV2ForSequenceClassification
from .decoder import DecoderForCausalLM, DecoderForSequenceClassification
from .distilbert import DistilBertForSequenceClassification
from .gemma import GemmaForCausalLM
from .modernbert import ModernBertForSequenceClassification

ARCHITECTURES = {
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "ElectraForSequenceClassification": ElectraForSequenceClassification,
    "DistilBertForSequenceClassification": DistilBertForSequenceClassification,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
    "DebertaV2ForSequenceClassification": DebertaV2ForSequenceClassification,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "LlamaForCausalLM": DecoderForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Qwen3ForSequenceClassification": DecoderForSequenceClassification,
    "Qwen2ForSequenceClassification": DecoderForSequenceClassification,
    "LlamaForSequenceClassification": DecoderForSequenceClassification,
}

__all__ = ["ARCHITECTURES", "DecoderModel", "EncoderModel", "PackedModel"]
