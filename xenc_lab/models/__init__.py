"""One dict from a checkpoint's architecture to our packed module. Each module's forward takes a
PackedBatch and returns (B, num_labels) logits."""
from __future__ import annotations

from .bert import BertForSequenceClassification, ElectraForSequenceClassification, RobertaForSequenceClassification

ARCHITECTURES = {
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "ElectraForSequenceClassification": ElectraForSequenceClassification,
}
