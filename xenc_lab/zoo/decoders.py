"""Deterministic builders of tiny random decoder-LLM rerankers (Qwen3, Qwen2, Llama, Gemma; causal LM and seq-cls
heads).

Each build is a Hugging Face directory (config.json, model.safetensors, tokenizer files, chat_template.jinja) that
``sentence_transformers.CrossEncoder(path, device="cpu")`` loads offline: a ``*ForCausalLM`` is scored by
logit("yes") - logit("no") at the last token (ST's LogitScore), a ``*ForSequenceClassification`` by its one-label
head. The tokenizer is a byte-level BPE trained with ``tokenizers`` on the zoo's corpus (corpus.py) behind Qwen2's
split regex (so pieces merge across the query/document boundary as in real Qwen tokenizers), wrapped in the class
the real checkpoints use, with ChatML control tokens and "yes"/"no" as single vocabulary strings.

    path = build_decoder("qwen3-reranker", tmp_path)                 # -> tmp_path / "qwen3-reranker-s0"
    path = build_decoder("llama-bare", tmp_path, seed=1, max_position_embeddings=64)

``workload_reranker`` builds the benchmark's unperturbed Qwen3 rerankers (xenc_lab.bench.decoder), their BPE trained on
the benchmark's own texts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import shutil

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from . import save_seeded
from .corpus import cached_build, corpus, spread_check  # noqa: F401 (spread_check: re-exported)

# transformers' Qwen2Tokenizer pre-tokenizer regex (models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
THINK = ["<think>", "</think>"]  # added tokens that are not special, as in Qwen3's tokenizer
WORKLOAD_ARCHITECTURE = "Qwen3ForCausalLM"  # the benchmark's rerankers (workload_reranker)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
JUDGE = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
          'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n')


def _role(role: str) -> str:
    return f'messages | selectattr("role", "eq", "{role}") | map(attribute="content") | first'


# Qwen3-Reranker's template as sentence-transformers' tests set it: the instruction is the system message (a prompt)
# or the default; three trailing newlines, of which transformers' Jinja keeps two.
QWEN3_RERANKER_TEMPLATE = (
    f'{{%- set instruction = {_role("system")} | default("{DEFAULT_INSTRUCTION}") -%}}\n'
    f'{{%- set query_text = {_role("query")} -%}}\n'
    f'{{%- set document_text = {_role("document")} -%}}\n'
    f"{JUDGE}<|im_start|>user\n<Instruct>: {{{{ instruction }}}}\n<Query>: {{{{ query_text }}}}\n"
    "<Document>: {{ document_text }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\n"
)
# The instruction after the document, taken from a template variable ``instruction`` (processing_kwargs'
# chat_template), else the system message, else a default: the template's tail depends on the prompt.
QWEN2_DOC_INSTRUCTION_TEMPLATE = (
    f'{{%- set system = {_role("system")} -%}}\n'
    '{%- set instruction = instruction if instruction is defined else system | default("Does the passage answer the '
    'question?") -%}\n'
    "<|im_start|>system\nYou judge relevance. Answer yes or no.<|im_end|>\n<|im_start|>user\n"
    f'<Query>: {{{{ {_role("query")} }}}}\n<Document>: {{{{ {_role("document")} }}}}\n'
    "<Instruct>: {{ instruction }}<|im_end|>\n<|im_start|>assistant\n\n"
)
# No turns at all: the bos token, an optional prompt line, the pair, and a cue.
LLAMA_BARE_TEMPLATE = (
    f'{{%- set system = {_role("system")} -%}}\n'
    "{{ bos_token }}{% if system is defined %}{{ system }}\n{% endif %}"
    f'Query: {{{{ {_role("query")} }}}}\nDocument: {{{{ {_role("document")} }}}}\nRelevant:'
)
# Typed content (``content[0].text``, which sentence-transformers detects and then sends), read in a loop.
QWEN3_SEQ_CLS_TEMPLATE = (
    f'{{%- set ns = namespace(instruction="{DEFAULT_INSTRUCTION}", query="", document="") -%}}\n'
    "{%- for message in messages -%}\n"
    '{%- if message.role == "system" -%}{%- set ns.instruction = message.content[0].text -%}\n'
    '{%- elif message.role == "query" -%}{%- set ns.query = message.content[0].text -%}\n'
    '{%- elif message.role == "document" -%}{%- set ns.document = message.content[0].text -%}\n'
    "{%- endif -%}\n{%- endfor -%}\n"
    f"{JUDGE}<|im_start|>user\n<Instruct>: {{{{ ns.instruction }}}}\n<Query>: {{{{ ns.query }}}}\n"
    "<Document>: {{ ns.document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\n"
)
# A general chat template (system/user/assistant only): a pair renders to an empty prompt, which
# sentence-transformers refuses. Not a spec; the tests load a spec's tokenizer with it.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message.role in ['system', 'user', 'assistant'] -%}\n"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endif -%}\n{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}\n"
)


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    name: str
    architecture: str  # transformers class name, also written to config.architectures
    notes: str
    template: str | None  # the tokenizer's chat template; None: none (plain pair tokenization)
    tokenizer: str = "qwen2"  # "qwen2": Qwen2Tokenizer (Qwen2/3); "llama": PreTrainedTokenizerFast as Llama 3's;
    # "gemma": GemmaTokenizer (BPE with byte fallback, spaces as "▁")
    config: tuple = ()  # config values as (key, value) pairs (frozen-friendly)
    logit_score: tuple = ()  # (true token, false token or None): saved as a CrossEncoder with that LogitScore;
    # () : no modules.json (sentence-transformers' default, "yes" less "no")


def _spec(name, arch, notes, template, tokenizer="qwen2", logit_score=(), **config):
    return DecoderSpec(name, arch, notes, template, tokenizer, tuple(sorted(config.items())), logit_score)


_QWEN3 = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "intermediate_size": 128, "max_position_embeddings": 256, "initializer_range": 0.4, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "model_max_length": 1024,
}
_LLAMA = {
    "hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
    "intermediate_size": 160, "max_position_embeddings": 256, "initializer_range": 0.25, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    # llama3 scaling over head_dim 16: frequencies of wavelength under 16 kept, over 64 divided by 8, blended between.
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
}

# BAAI/bge-reranker-v2-gemma's input: "A: {query}\nB: {passage}\n{prompt}" after the bos, the prompt a system message
# (sentence-transformers' prompt) or this default.
GEMMA_PROMPT = ("Given a query A and a passage B, determine whether the passage contains an answer to the query by "
                "providing a prediction of either 'Yes' or 'No'.")
GEMMA_RERANKER_TEMPLATE = (
    f'{{%- set prompt = {_role("system")} | default("{GEMMA_PROMPT}") -%}}\n'
    f'{{{{ bos_token }}}}A: {{{{ {_role("query")} }}}}\nB: {{{{ {_role("document")} }}}}\n{{{{ prompt }}}}'
)
_GEMMA = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
    "intermediate_size": 128, "max_position_embeddings": 256, "initializer_range": 0.3, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "hidden_act": "gelu_pytorch_tanh", "model_max_length": 1024,
}

DECODER_SPECS: dict[str, DecoderSpec] = {s.name: s for s in [
    _spec("qwen3-reranker", "Qwen3ForCausalLM",
          "GQA 4/2 heads, head_dim 24 != 64/4, q/k norm, tied embeddings, Qwen3-Reranker template; tokenizer "
          "model_max_length 1024 > 256 positions (cap)", QWEN3_RERANKER_TEMPLATE, tie_word_embeddings=True, **_QWEN3),
    _spec("qwen2-doc-instruction", "Qwen2ForCausalLM",
          "4/4 heads, random q/k/v biases, untied lm_head, instruction after the document",
          QWEN2_DOC_INSTRUCTION_TEMPLATE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=4, intermediate_size=128, max_position_embeddings=256, initializer_range=0.25,
          rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, model_max_length=1024),
    _spec("llama-bare", "LlamaForCausalLM",
          "GQA 6/2 heads, 3 layers, llama3 rope scaling, bare template with bos; tokenizer model_max_length 160 < "
          "256 positions, truncation_side left", LLAMA_BARE_TEMPLATE, tokenizer="llama", tie_word_embeddings=False,
          model_max_length=160, truncation_side="left", **_LLAMA),
    _spec("qwen3-seq-cls", "Qwen3ForSequenceClassification",
          "as qwen3-reranker with a one-label score head, typed-content template", QWEN3_SEQ_CLS_TEMPLATE,
          tie_word_embeddings=True, **_QWEN3),
    _spec("llama-seq-cls-plain", "LlamaForSequenceClassification",
          "one-label score head, no chat template: pairs tokenized as text pairs (bos $A bos $B)", None,
          tokenizer="llama", tie_word_embeddings=False, model_max_length=1024, **_LLAMA),
    _spec("gemma-reranker", "GemmaForCausalLM",
          "bge-reranker-v2-gemma's shape: multi-query attention (4 heads, 1 KV head), head_dim 32 != 64/4, embeddings "
          "times sqrt(hidden), RMSNorm times 1 + weight, GELU-tanh MLP, tied; A:/B:/prompt template; a CrossEncoder "
          "save scored on the 'Yes' logit alone (LogitScore false_token_id None)", GEMMA_RERANKER_TEMPLATE,
          tokenizer="gemma", logit_score=("Yes", None), tie_word_embeddings=True, **_GEMMA),
    _spec("gemma-yes-no", "GemmaForCausalLM",
          "Gemma with 4/2 heads, 3 layers, untied lm_head, the A:/B:/prompt template, scored by sentence-transformers' "
          "default yes/no LogitScore", GEMMA_RERANKER_TEMPLATE, tokenizer="gemma", tie_word_embeddings=False,
          **{**_GEMMA, "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16}),
]}


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE behind Qwen2's split regex, trained on zoo's corpus
# ---------------------------------------------------------------------------------------------
def _template_lines() -> list[str]:
    """Text the templates write, and "yes"/"no" at the start of a line (where they stay single pieces without the
    space that otherwise joins them), so the trained vocabulary has them whole."""
    lines = [JUDGE, "<Instruct>: " + DEFAULT_INSTRUCTION, "<Query>: what is it?\n<Document>: it is.",
             "Query: what\nDocument: that\nRelevant:", "You judge relevance. Answer yes or no."]
    return lines * 20 + ["yes\nno\nyes", "no\nyes", "yes", "no"] * 100


def _pre_tokenizer():
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_bpe(texts: list[str], vocab_size: int, special: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (vocabulary, merges) behind Qwen2's split regex, trained on ``texts`` with ``special`` first;
    "yes" and "no" must come out whole."""
    tok = Tokenizer(models.BPE())
    tok.normalizer, tok.pre_tokenizer = normalizers.NFC(), _pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    for word in ("yes", "no"):
        assert word in model["vocab"], f"the trained vocabulary lacks {word!r}"
    return model["vocab"], merges


@functools.cache
def _bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    return train_bpe(corpus() + _template_lines(), vocab_size, SPECIAL + THINK)


@functools.cache
def _gemma_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A BPE as Gemma's tokenizer runs it (spaces as "▁", no pre-tokenizer split), trained on the corpus and the
    template's text; then the byte-fallback tokens <0x00>..<0xFF> and the verdict words, whole, at the end."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
                                  show_progress=False, max_token_length=16)
    tok.train_from_iterator(corpus() + [GEMMA_PROMPT, "A: what is it?\nB: it is."] * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for piece in [f"<0x{b:02X}>" for b in range(256)] + ["Yes", "No", "yes", "no"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return vocab, merges


def gemma_tokenizer(max_len: int, template: str | None, vocab_size: int = 1500):
    """A GemmaTokenizer over ``_gemma_bpe``: bos <bos>, eos <eos>, pad <pad>, unk <unk>; ``template`` its chat
    template."""
    import transformers as tf

    vocab, merges = _gemma_bpe(vocab_size)
    tokenizer = tf.GemmaTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=max_len)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def qwen2_tokenizer(vocab: dict[str, int], merges: list, max_len: int, template: str | None):
    """A Qwen2Tokenizer over a trained BPE as Qwen2/3's: eos <|im_end|>, pad <|endoftext|>, no bos, no unk, the
    <think> tags added (not special), ``template`` as its chat template."""
    import transformers as tf

    tokenizer = tf.Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), unk_token=None, bos_token=None,
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=max_len,
                                  extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def build_tokenizer(kind: str, max_len: int, template: str | None, vocab_size: int = 1500):
    """The spec's tokenizer: ``kind`` "qwen2" (Qwen2Tokenizer: eos <|im_end|>, pad <|endoftext|>, no bos, no unk) or
    "llama" (PreTrainedTokenizerFast with Llama 3's bos post-processor: bos <|begin_of_text|>, eos and pad
    <|endoftext|>), with ``template`` as its chat template."""
    import transformers as tf

    if kind == "gemma":
        return gemma_tokenizer(max_len, template, vocab_size)
    vocab, merges = _bpe(vocab_size)
    if kind == "qwen2":
        tokenizer = qwen2_tokenizer(vocab, merges, max_len, template)
    elif kind == "llama":
        tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), ignore_merges=True))
        tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizers.NFC(), _pre_tokenizer(), decoders.ByteLevel()
        bos = "<|begin_of_text|>"
        tok.add_special_tokens(SPECIAL)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
        tokenizer = tf.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=bos, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
            model_max_length=max_len, model_input_names=["input_ids", "attention_mask"])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
        if template is not None:
            tokenizer.chat_template = template
    else:
        raise ValueError(kind)
    for word in ("yes", "no"):
        assert tokenizer.convert_tokens_to_ids(word) is not None
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def _perturb_(model, torch) -> None:
    """HF init leaves RMSNorm weights at 1 and biases at 0; randomize them so that parity tests cover the norm scales
    (q/k norms included) and Qwen2's q/k/v biases."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)


def _build_into(spec: DecoderSpec, out: pathlib.Path, seed: int, overrides: dict) -> None:
    import torch
    import transformers as tf

    cfg = dict(spec.config, **overrides)
    max_len = cfg.pop("model_max_length", cfg["max_position_embeddings"])
    truncation_side = cfg.pop("truncation_side", "right")
    tokenizer = build_tokenizer(spec.tokenizer, max_len, spec.template, cfg.pop("vocab_size", 1500))
    tokenizer.truncation_side = truncation_side
    cfg.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id)
    if spec.architecture.endswith("ForSequenceClassification"):
        cfg.setdefault("num_labels", 1)
    model_type = {"Qwen3": "qwen3", "Qwen2": "qwen2", "Llama": "llama", "Gemma": "gemma"}[
        spec.architecture.split("For")[0]]
    config = tf.AutoConfig.for_model(model_type, **cfg)
    config.architectures = [spec.architecture]
    save_seeded(config, tokenizer, out, seed, prepare=lambda m: _perturb_(m, torch))
    if spec.logit_score:
        _save_logit_score(out, tokenizer, *spec.logit_score)


def _save_logit_score(out: pathlib.Path, tokenizer, true_token: str, false_token: str | None) -> None:
    """Save the checkpoint at ``out`` again as sentence-transformers' CrossEncoder with a LogitScore of these tokens
    (a Transformer and a LogitScore module: modules.json), as a reranker such as bge-reranker-v2-gemma is saved."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder.modules import LogitScore, Transformer

    ids = [tokenizer.convert_tokens_to_ids(t) if t is not None else None for t in (true_token, false_token)]
    modules = [Transformer(str(out), transformer_task="text-generation"), LogitScore(*ids)]
    CrossEncoder(modules=modules, device="cpu").save(str(out))


def build_decoder(name: str, root: pathlib.Path, *, seed: int = 0, **config_overrides) -> pathlib.Path:
    """Build (or reuse) the checkpoint ``name`` under ``root`` and return its directory. ``config_overrides`` go to
    the config, except ``model_max_length``, ``truncation_side`` and ``vocab_size``, which shape the tokenizer."""
    spec = DECODER_SPECS[name]
    return cached_build(root, name, seed, config_overrides, lambda out: _build_into(spec, out, seed, config_overrides))


def without_yes_no(name: str, root: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A copy of the checkpoint ``name`` at ``out`` whose tokenizer (bytes and the chat tokens only, no unknown
    token) has no "yes" or "no": a causal LM that neither engine can score."""
    import transformers

    shutil.copytree(build_decoder(name, root), out)
    alphabet = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = transformers.Qwen2Tokenizer(vocab={t: i for i, t in enumerate(alphabet)}, merges=[], unk_token=None,
                                            eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = DECODER_SPECS[name].template
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (out / file).unlink()
    tokenizer.save_pretrained(out)
    return out


def workload_reranker(name: str, root: pathlib.Path, config: dict, texts: list[str], *, seed: int = 0,
                      vocab_size: int = 8192, max_len: int = 8192) -> pathlib.Path:
    """Build (or reuse) under ``root`` a random-weight Qwen3 causal-LM reranker of ``config`` (Qwen3Config values),
    HF's init left as it is, with Qwen3-Reranker's template and a BPE of at most ``vocab_size`` pieces trained on
    ``texts`` (the chat tokens special): the benchmark's models, whose words are single tokens as in a real
    vocabulary."""
    import transformers as tf

    digest = hashlib.sha1("\x00".join(texts).encode()).hexdigest()[:16]
    key = {"config": config, "vocab_size": vocab_size, "max_len": max_len, "texts": digest}

    def build(out):
        tokenizer = qwen2_tokenizer(*train_bpe(texts, vocab_size, SPECIAL[:3]), max_len, QWEN3_RERANKER_TEMPLATE)
        cfg = tf.AutoConfig.for_model("qwen3", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **config)
        cfg.architectures = [WORKLOAD_ARCHITECTURE]
        save_seeded(cfg, tokenizer, out, seed)

    return cached_build(root, name, seed, key, build)
