"""The decoder family (models/decoder.py) against transformers on tiny random checkpoints built here.

Each spec is a seeded 2-layer, 64-wide model that transformers builds and saves: Qwen3 with grouped-query attention and
head_dim != hidden / heads (tied embeddings), Qwen2 multi-head with nonzero q/k/v biases (untied), Llama with llama3
rope scaling and attention and MLP biases, Qwen3 seq-cls with yarn rope (attention_scaling != 1) and a single KV
head, Llama seq-cls with linear rope and 3 labels. Weights are redrawn at a scale where the scores spread.

Parity: our last-token scores (LogitScore's yes - no for CausalLM, the score head for seq-cls) against transformers'
on the same token ids, one sequence at a time without padding. Float32 to 1e-4; bfloat16 within a small multiple of
transformers' own bfloat16 error (each measured against transformers in float32).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)

from xenc_lab.decoder.chunks import Chunk, pack_chunks
from xenc_lab.decoder.kv_cache import KVCache
from xenc_lab.loader import build_model, load_config, load_model
from xenc_lab.models.decoder import DecoderForCausalLM, head_dim_of

CPU = torch.device("cpu")
VOCAB, YES, NO = 128, 7, 11
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 2,
          "max_position_embeddings": 256}
SPECS = {
    "qwen3-gqa-tied": lambda: Qwen3ForCausalLM(Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    "qwen2-mha-bias": lambda: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-llama3-bias": lambda: LlamaForCausalLM(LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3-cls-yarn": lambda: Qwen3ForSequenceClassification(Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_labels=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 32})),
    "llama-cls-linear": lambda: LlamaForSequenceClassification(LlamaConfig(
        **COMMON, num_attention_heads=8, num_key_value_heads=4, num_labels=3, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})),
}
CAUSAL = {name for name in SPECS if "cls" not in name}
LENGTHS = (1, 5, 17, 33, 40, 64, 90)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights at a scale where scores spread: norms near 1, embeddings unit, linears (and biases) ~ 1/sqrt(fan-in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else noise if "embed" in name else noise / p.shape[-1] ** 0.5)
    return model


def _sequences(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n) for n in LENGTHS]


def _hf_scores(hf, seqs, causal: bool) -> torch.Tensor:
    """transformers' last-token scores, one unpadded sequence at a time, in float32: (N, labels)."""
    rows = []
    with torch.no_grad():
        for ids in seqs:
            logits = hf(torch.from_numpy(ids)[None]).logits
            rows.append(logits[0, -1, YES:YES + 1] - logits[0, -1, NO:NO + 1] if causal else logits[0])
    return torch.stack(rows).float()


@pytest.fixture(scope="module", params=list(SPECS))
def spec(request, tmp_path_factory):
    """(name, checkpoint dir, {dtype: transformers' scores}) of one spec."""
    name = request.param
    torch.manual_seed(0)
    hf = _randomize(SPECS[name]().eval(), seed=len(name))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    seqs = _sequences()
    refs = {torch.float32: _hf_scores(hf, seqs, name in CAUSAL),
            torch.bfloat16: _hf_scores(hf.to(torch.bfloat16), seqs, name in CAUSAL)}
    return name, path, refs


def _load(path, dtype, name):
    model, choices = load_model(path, load_config(path), CPU, dtype)
    if name in CAUSAL:
        model.set_score_tokens(YES, NO)
    return model, choices


def _whole(seqs, first_pair: int = 0) -> list[Chunk]:
    return [Chunk(ids, np.zeros(0, dtype=np.int64), None, first_pair + i) for i, ids in enumerate(seqs)]


def _run(model, choices, chunks, cache=None, page_size: int = 16) -> torch.Tensor:
    batch = pack_chunks(chunks, page_size, cache_slots=cache.slots if cache is not None else 0)
    with torch.no_grad():
        return model(batch, choices, cache)[: len(batch.pairs)].float()


@pytest.mark.slow
def test_checkpoint_names_and_shapes_are_the_modules(spec):
    name, path, _ = spec
    with safe_open(path / "model.safetensors", framework="pt") as f:
        names = f.keys()  # safe_open is not iterable
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    module = {k: tuple(v.shape) for k, v in build_model(load_config(path)).state_dict().items()}
    assert saved == module
    assert ("lm_head.weight" in saved) == (name in ("qwen2-mha-bias", "llama-llama3-bias"))  # untied CausalLMs only


def test_float32_matches_transformers(spec):
    name, path, refs = spec
    model, choices = _load(path, torch.float32, name)
    ours, ref = _run(model, choices, _whole(_sequences())), refs[torch.float32]
    delta = (ours - ref).abs()
    print(f"{name} float32: max |delta| {delta.max():.2e}, mean {delta.mean():.2e}, score std {ref.std():.3f}")
    assert ours.shape == ref.shape
    assert ref.std() > 1000 * 1e-4, "the scores do not spread past the tolerance: a constant model would pass"
    assert delta.max() < 1e-4


def test_bfloat16_is_within_transformers_own_bfloat16_error(spec):
    name, path, refs = spec
    model, choices = _load(path, torch.bfloat16, name)
    ours = _run(model, choices, _whole(_sequences()))
    exact, theirs = refs[torch.float32], refs[torch.bfloat16]
    ours_err, their_err = (ours - exact).abs().max(), (theirs - exact).abs().max()
    ulp = 2.0 ** (torch.frexp(exact.abs().max()).exponent.item() - 8)  # bf16's step at the largest score
    print(f"{name} bfloat16: max |ours - tf bf16| {(ours - theirs).abs().max():.2e}; vs tf float32: "
          f"ours {ours_err:.2e}, tf bf16 {their_err:.2e}")
    assert ours_err <= 4 * their_err + ulp
    assert (ours - exact).abs().max() < 0.05 * exact.std()


def test_a_batch_of_sequences_scores_each_as_it_does_alone(spec):
    name, path, _ = spec
    model, choices = _load(path, torch.float32, name)
    seqs = _sequences(seed=1)
    together = _run(model, choices, _whole(seqs))
    alone = torch.cat([_run(model, choices, _whole([ids])) for ids in seqs])
    print(f"{name}: batch vs alone max |delta| {(together - alone).abs().max():.2e}")
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_a_prefix_in_the_kv_cache_gives_the_whole_sequences_scores(spec):
    """Two sequences share a cached 21-token prefix (positions 0..20); their own chunks start at position 21."""
    name, path, _refs = spec
    model, choices = _load(path, torch.float32, name)
    config, page = load_config(path), 16
    cache = KVCache(config.num_hidden_layers, config.num_key_value_heads, head_dim_of(config), page, torch.float32, CPU)
    prefix, tails = _sequences(seed=2)[4][:21], [_sequences(seed=3)[i] for i in (2, 5)]
    cache.reserve(2)
    slots = cache.slots_of(cache.allocator.allocate(2), len(prefix))
    _run(model, choices, [Chunk(prefix, np.zeros(0, dtype=np.int64), slots)], cache, page)
    ours = _run(model, choices, [Chunk(tail, slots, None, i) for i, tail in enumerate(tails)], cache, page)
    whole = _run(model, choices, _whole([np.concatenate([prefix, tail]) for tail in tails]))
    print(f"{name}: cached prefix vs whole max |delta| {(ours - whole).abs().max():.2e}")
    assert whole.std() > 0
    torch.testing.assert_close(ours, whole, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("false_id", [NO, None])
def test_logit_score_is_true_minus_false_logit_in_the_model_dtype(tmp_path, false_id):
    torch.manual_seed(0)
    hf = _randomize(SPECS["qwen2-mha-bias"]().eval(), seed=3)
    hf.save_pretrained(tmp_path)
    seqs = _sequences()[:4]
    for dtype in (torch.float32, torch.bfloat16):
        model, choices = load_model(tmp_path, load_config(tmp_path), CPU, dtype)
        assert hasattr(model, "lm_head")
        model.set_score_tokens(YES, false_id)
        assert not hasattr(model, "lm_head")  # the untied output embedding is freed: two rows are kept
        assert tuple(model.score_rows.shape) == (1 if false_id is None else 2, 64)
        batch = pack_chunks(_whole(seqs), 16)
        with torch.no_grad():
            ours = model(batch, choices)[: len(seqs)]
            logits = torch.stack([hf.to(dtype)(torch.from_numpy(ids)[None]).logits[0, -1] for ids in seqs])
        expected = logits[:, YES:YES + 1] if false_id is None else logits[:, YES:YES + 1] - logits[:, NO:NO + 1]
        assert ours.dtype == dtype and ours.shape == (len(seqs), 1)
        assert (ours.float() - expected.float()).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("spec", sorted(CAUSAL), indirect=True)
def test_score_tokens_are_checked_and_required(spec):
    _name, path, _ = spec
    model, choices = load_model(path, load_config(path), CPU, torch.float32)
    assert isinstance(model, DecoderForCausalLM)
    with pytest.raises(RuntimeError, match="set_score_tokens"):
        model(pack_chunks(_whole(_sequences()[:1]), 16), choices)
    with pytest.raises(ValueError, match="vocab_size 128"):
        model.set_score_tokens(VOCAB, NO)
    with pytest.raises(TypeError, match="false_id"):
        model.set_score_tokens(YES, 1.0)
    model.set_score_tokens(YES, NO)
    model.set_score_tokens(YES, NO)  # repeating the same ids is harmless, tied or not
    if model.tied:  # the embedding matrix stays: other ids may be read
        model.set_score_tokens(NO, YES)
    else:
        with pytest.raises(RuntimeError, match="freed"):
            model.set_score_tokens(NO, YES)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 12, "long_factor": [2.0] * 12,
         "original_max_position_embeddings": 32},
    {"rope_type": "made-up", "rope_theta": 10000.0},
])
def test_rope_types_that_depend_on_the_batch_or_are_unknown_are_refused(rope):
    config = Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         architectures=["Qwen3ForCausalLM"])
    config.rope_parameters = rope
    with pytest.raises(ValueError, match=rf"rope_type '{rope['rope_type']}'.*supported rope types: default, linear"):
        build_model(config)


def test_sliding_window_that_can_bind_is_refused():
    config = Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True,
                         sliding_window=32, max_window_layers=1, architectures=["Qwen2ForCausalLM"])
    assert config.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=32, on layers \[1\]\)"):
        build_model(config)
    config.sliding_window = COMMON["max_position_embeddings"]  # no sequence can reach past it: full attention
    build_model(config)


def test_other_families_are_refused():
    config = Qwen3Config(**COMMON, num_attention_heads=4, architectures=["Qwen3ForCausalLM"])
    config.model_type = "mistral"
    with pytest.raises(ValueError, match="model_type 'mistral' is not a decoder family"):
        build_model(config)


def test_a_tied_checkpoint_that_stores_its_lm_head_scores_with_it_as_transformers_does(tmp_path):
    """transformers reads a stored lm_head.weight that differs from the embedding (and does not tie them)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = _randomize(SPECS["qwen3-gqa-tied"]().eval(), seed=3)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn(VOCAB, COMMON["hidden_size"], generator=torch.Generator().manual_seed(9))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    seqs = _sequences(1)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(reloaded.lm_head.weight, tensors["lm_head.weight"])  # transformers kept the stored head
    ref = _hf_scores(reloaded, seqs, causal=True)
    model, choices = _load(tmp_path, torch.float32, "qwen3-gqa-tied")
    torch.testing.assert_close(_run(model, choices, _whole(seqs)), ref, rtol=0, atol=1e-4)
    assert (ref - _hf_scores(hf, seqs, causal=True)).abs().max() > 1e-2  # the stored head changed the scores
