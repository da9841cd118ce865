"""The public face of xenc_lab: ``Scorer``, a drop-in for sentence-transformers' ``CrossEncoder``."""
from __future__ import annotations

import functools
import itertools
import numbers
import operator
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence, Sized

import numpy as np
import torch
from tqdm.auto import tqdm

from . import settings
from .config import (ScorerConfig, check_call_device, check_max_length, resolve_device, share_prefix_of,
                     whole_number)
from .cpu.info import HALF_UNITS, cpu_info, native_half_units
from .decoder.chat import ChatPairTokenizer, pair_tokenizer, score_tokens
from .engine import INPUT_BLOCK, Budget, CallOptions, Engine, gathered
from .engines import engine_for
from .loader import architecture_of, family_of, load_config, load_model, resolve
from .long_documents import call_mode, check_supported, pair_scores, windowed_pairs
from .runner import ModelRunner
from .score_cache import open_cache
from .scores import default_activation, to_scores
from .st_args import (check_flags, check_ordered, is_single_pair, new_model_card_data, predict_names, rank_names,
                      resolve_prompt, split_pairs, vllm_pairs)
from .st_format import processing_max_length, read_cross_encoder_save

STREAM_BLOCK = 16 * INPUT_BLOCK  # pairs of an iterator taken at a time


class Scorer:
    """Scores (text_1, text_2) pairs with a cross-encoder, as ``CrossEncoder.predict`` would, on our packed engine.

    >>> scorer = Scorer("cross-encoder/ms-marco-MiniLM-L6-v2")
    >>> scorer.predict([("how tall is everest", "Everest is 8,849 m high."), ("q", "d")])
    """

    def __init__(
        self,
        model_name_or_path: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        dtype: str = "float32",
        max_length: int | None = None,
        page_size: int = 16,
        max_batch_tokens: int = 4096,
        compile: bool = False,
        activation_fn: Callable | None = None,
        trust_remote_code: bool = False,
        share_prefix: bool | None = None,
        long_documents: str = "truncate",
        window_stride: int | None = None,
        cache: str | os.PathLike | None = None,
        quantization: str | None = None,
    ):
        device = resolve_device(device)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if activation_fn is not None and not callable(activation_fn):
            raise TypeError(f"activation_fn must be callable, got {type(activation_fn).__name__}")
        self.cache = open_cache(cache)  # a persistent score cache (score_cache.py), opt-in; checked before loading
        self.config = ScorerConfig(
            model=str(model_name_or_path),
            device=str(device),
            dtype=dtype,
            max_length=max_length,
            page_size=page_size,
            max_batch_tokens=max_batch_tokens,
            compile=compile,
            trust_remote_code=trust_remote_code,
            long_documents=long_documents,
            window_stride=window_stride,
            quantization=quantization,
        )
        cfg = self.config
        settings.check_all()
        path = resolve(model_name_or_path)
        self.path = path
        self.save = read_cross_encoder_save(path)
        model_dir = self.save.model_dir  # the save's root, or its Transformer module's folder
        self.hf_config = load_config(model_dir, trust_remote_code, **self.save.config_kwargs)
        self.architecture = architecture_of(self.hf_config)
        self.family = family_of(self.hf_config)  # the model class: its contract (encoder or decoder) and its reading
        self.decoder = self.family.causal
        share_prefix = share_prefix_of(share_prefix, self.decoder, self.architecture)
        self.tokenizer = pair_tokenizer(model_dir, self.hf_config, cfg.max_length, trust_remote_code, self.save,
                                        self.family.position_limit(self.hf_config))
        self._check_max_length(self.tokenizer.max_length, "pass", self.tokenizer.from_where())
        check_supported(self.tokenizer, self.num_labels, cfg.long_documents)
        # A causal LM's true/false token ids, checked before any weights are read.
        by_logits = getattr(self.family, "scores_by_logits", False)
        score_ids = score_tokens(self.tokenizer.tokenizer, self.save) if by_logits else None
        self.device = device
        if device.type == "cpu" and cfg.dtype in HALF_UNITS and native_half_units(cfg.dtype) is False:
            warnings.warn(
                f"dtype={cfg.dtype!r} on a CPU without {' or '.join(HALF_UNITS[cfg.dtype])} ({cpu_info().model}): "
                f"its linear layers run as float32 GEMMs on the {cfg.dtype} values, no faster than dtype='float32', "
                "and less exact",
                stacklevel=2,
            )
        model, self.choices = load_model(model_dir, self.hf_config, self.device, cfg.torch_dtype, cfg.compile,
                                         cfg.quantization)
        if by_logits:
            model.set_score_tokens(*score_ids)
        self.activation_fn = activation_fn if activation_fn is not None else default_activation(
            self.hf_config, self.save, trust_remote_code, self.num_labels)
        self.pad_token_id = self.tokenizer.tokenizer.pad_token_id or 0
        # The model family's engine, built once: every call's pairs run through it.
        budget = Budget(self.num_labels, cfg.page_size, cfg.pages_per_batch, self.pad_token_id)
        self.engine: Engine = engine_for(
            ModelRunner(model, self.choices), budget, share_prefix=share_prefix,
            pooled_past=self.family.pooled_past(self.hf_config) if self.decoder else None)
        # One call at a time: a fast tokenizer shared by threads raises "Already borrowed", and a decoder's KV cache
        # is the Scorer's own. The model uses every core already, so threads lose nothing by taking turns.
        self._lock = threading.RLock()

    # -- properties a notebook reaches for --------------------------------------------------------
    @property
    def num_labels(self) -> int:
        return self.family.num_labels_of(self.hf_config)

    @property
    def runner(self) -> ModelRunner:
        """The engine's stage 4: the model, compiled or not, with the load's choices."""
        return self.engine.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self.engine.runner = runner

    @property
    def share_prefix(self) -> bool:
        """Whether a decoder computes the prefix its pairs share once (False for encoders)."""
        return getattr(self.engine, "share_prefix", False)

    @share_prefix.setter
    def share_prefix(self, share_prefix: bool | None) -> None:
        """Turn a decoder's prefix sharing on or off for the next calls (read per call; True on an encoder is
        refused)."""
        share_prefix = share_prefix_of(share_prefix, self.decoder, self.architecture)
        if self.decoder:
            self.engine.share_prefix = share_prefix

    @property
    def kv_cache(self):
        """A decoder's paged KV cache (``decoder.kv_cache.KVCache``); None for encoders."""
        return getattr(self.engine, "cache", None)

    @property
    def token_counts(self):
        """The last call's tokens scored and computed (``engine.TokenCounts``; decoders)."""
        return self.engine.counts

    @property
    def labels(self) -> list[str]:
        """Label names in logit order (from ``config.id2label``)."""
        id2label = self.hf_config.id2label or {}
        return [str(id2label.get(i, f"LABEL_{i}")) for i in range(self.num_labels)]

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @functools.cached_property
    def model_card_data(self):
        """Where sentence-transformers' evaluators record their metrics (``set_evaluation_metrics``): its own
        ``CrossEncoderModelCardData`` when it is installed, else an ``EvalResults``; made on first use."""
        return new_model_card_data()

    def __repr__(self) -> str:
        c = self.config
        activation = type(self.activation_fn).__name__ if isinstance(self.activation_fn, torch.nn.Module) else repr(self.activation_fn)
        gemm = self.choices.bf16_gemm  # how a bf16 model's GEMMs multiply on this CPU
        dtype = f"{c.dtype} (GEMMs: {gemm})" if gemm else c.dtype
        if c.quantization:
            dtype += f", quantization={c.quantization!r}"
        return (
            f"Scorer(model={c.model!r}, architecture={self.architecture}, device={c.device!r}, dtype={dtype}, "
            f"page_size={c.page_size}, max_batch_tokens={c.max_batch_tokens}, max_length={self.max_length}, "
            f"num_labels={self.num_labels}, activation={activation}, compile={c.compile})"
        )

    # -- the engine ---------------------------------------------------------------------------------
    def _check_max_length(self, max_length: int, remedy: str, source: str = "") -> None:
        check_max_length(self.config, max_length, self.tokenizer.specials, self.family.position_limit(self.hf_config),
                         self.architecture, self.decoder, remedy, source)

    def _call_max_length(self, max_length, processing_kwargs) -> int | None:
        """A per-call max_length, as CrossEncoder.predict takes it: ``max_length=n`` or
        ``processing_kwargs={"text": {"max_length": n}}`` (which wins, as there). None: the Scorer's own."""
        from_kwargs = processing_max_length(processing_kwargs, "processing_kwargs")
        max_length = from_kwargs if from_kwargs is not None else max_length
        if max_length is None:
            return None
        max_length = whole_number("max_length", max_length)
        self._check_max_length(max_length, "use")
        return max_length

    def logits(self, pairs: Sequence, batch_size: int | None = None, show_progress_bar: bool | None = None,
               prompt: str | None = None, max_length: int | None = None) -> torch.Tensor:
        """(N, num_labels) fp32 logits on the CPU, in the caller's order. ``prompt`` is prepended to each text_1 (a
        decoder's chat template places it, as a system message); ``max_length`` (checked by the caller) truncates
        the pairs instead of the Scorer's own."""
        return self._rows(list(pairs), batch_size, show_progress_bar, prompt, max_length)[0]

    def _rows(self, pairs: list, batch_size, show_progress_bar, prompt, max_length, windows=False, stride=None):
        """``logits``, or with ``windows`` those of every pair's windows of text_2 (``stride`` tokens apart), and the
        pair of each row (``long_documents.windowed_pairs``; None where every row is its pair)."""
        text_1, text_2 = split_pairs(pairs)
        show = len(text_1) >= 2048 if show_progress_bar is None else show_progress_bar
        with self._lock:
            self.engine.new_call()
            return self._run(text_1, text_2, batch_size, show, prompt, max_length, windows, stride)

    def _streamed_logits(self, pairs: Iterable, batch_size, show_progress_bar, prompt, max_length, windows=False,
                         stride=None) -> tuple[torch.Tensor, np.ndarray | None]:
        """``_rows`` of an iterator of pairs, taken in blocks of STREAM_BLOCK: memory holds one block's texts, not
        the input's. A bad pair is reported by its place in the whole input."""
        it, parts, owners, done = iter(pairs), [], [], 0
        show = {"disable": False, "delay": 1.0} if show_progress_bar is None else {"disable": not show_progress_bar}
        with self._lock, tqdm(total=operator.length_hint(pairs) or None, desc="Scoring pairs", unit="pair",
                              **show) as bar:
            self.engine.new_call()
            while block := list(itertools.islice(it, STREAM_BLOCK)):
                text_1, text_2 = split_pairs(block, start=done)
                logits, owner = self._run(text_1, text_2, batch_size, False, prompt, max_length, windows, stride)
                parts.append(logits)
                owners.append(None if owner is None else owner + done)
                done += len(block)
                bar.update(len(block))
        return gathered(parts, owners, self.num_labels)

    def _run(self, *args):
        if self.cache is not None:  # stored pairs are read, the others computed and stored
            return self.cache.run(self, self._engine_run, *args)
        return self._engine_run(*args)

    def _engine_run(self, text_1, text_2, batch_size, show, prompt, max_length, windows, stride):
        tokenize = self.tokenizer
        if windows:
            tokenize = functools.partial(windowed_pairs, tokenize, stride=stride)
        if isinstance(self.tokenizer, ChatPairTokenizer):
            tokenize = functools.partial(tokenize, prompt=prompt or None)
        elif prompt:
            text_1 = [prompt + t for t in text_1]
        return self.engine.run(tokenize, text_1, text_2, CallOptions(batch_size, max_length, show))

    def predict(self, pairs=None, *, batch_size: int | None = None, show_progress_bar: bool | None = None,
                activation_fn: Callable | None = None, apply_softmax: bool = False, convert_to_numpy: bool = True,
                convert_to_tensor: bool = False, prompt_name: str | None = None, prompt: str | None = None,
                max_length: int | None = None, processing_kwargs: dict | None = None,
                device: str | torch.device | None = None, long_documents: str | None = None,
                window_stride: int | None = None, **other_names):
        """Scores of (text_1, text_2) pairs: float32 array of shape (N,) for one label, (N, num_labels) else.

        Same input forms and outputs as ``CrossEncoder.predict``: a single pair gives a scalar (or a
        (num_labels,) array); ``convert_to_tensor`` a tensor on the model's device; ``convert_to_numpy=False``
        a list of tensors. ``batch_size`` caps the pairs per batch; the token budget caps it anyway.
        ``prompt`` / ``prompt_name`` (or a save's default prompt) is prepended to every text_1, as there.
        ``max_length`` (or ``processing_kwargs={"text": {"max_length": n}}``) truncates this call's pairs to n
        tokens instead of the Scorer's max_length; ``device`` may name the Scorer's own device only.
        ``long_documents`` and ``window_stride`` (None: the Scorer's) score a text_2 that overflows in windows, the
        max or mean of their scores (docs/sentence-transformers.md#long-documents).
        sentence-transformers v6's name for the pairs, ``inputs``, works too; its names from before v5,
        ``sentences`` and ``activation_fct`` (and ``num_workers``, ignored), work with a warning. Options are
        keyword-only: sentence-transformers v6 takes ``prompt_name`` second, earlier versions ``batch_size``.
        """
        pairs, activation_fn = predict_names(pairs, activation_fn, other_names)
        if batch_size is not None:
            batch_size = whole_number("batch_size", batch_size, optional=True)
        check_flags(show_progress_bar=show_progress_bar, apply_softmax=apply_softmax,
                     convert_to_numpy=convert_to_numpy, convert_to_tensor=convert_to_tensor)
        if activation_fn is not None and not callable(activation_fn):
            raise TypeError(f"activation_fn must be callable, got {type(activation_fn).__name__}")
        check_call_device(self.device, device)
        max_length = self._call_max_length(max_length, processing_kwargs)
        long_documents, stride = call_mode(self.config, self.tokenizer, self.num_labels, long_documents, window_stride)
        windows = long_documents in ("max", "mean")  # "first": the first window is the truncated pair
        prompt = resolve_prompt(self.save, prompt, prompt_name)  # before an iterator of pairs is consumed
        check_ordered("pairs", pairs, "a (text_1, text_2) pair or a list of them")
        if isinstance(pairs, np.ndarray) and pairs.ndim == 0:
            raise TypeError(f"pairs must be a (text_1, text_2) pair or a list of them, got a 0-d array {pairs!r}")
        single = is_single_pair(pairs)
        if single:
            split_pairs([pairs], single=True)  # a bad pair passed alone is named "pairs"
            logits, owner = self._rows([pairs], batch_size, show_progress_bar, prompt, max_length, windows, stride)
        elif isinstance(pairs, Sized):
            logits, owner = self._rows(list(pairs), batch_size, show_progress_bar, prompt, max_length, windows, stride)
        else:  # an iterator or generator: consumed block by block
            logits, owner = self._streamed_logits(pairs, batch_size, show_progress_bar, prompt, max_length, windows,
                                                  stride)
        score = functools.partial(to_scores, activation=self.activation_fn if activation_fn is None else activation_fn,
                                  apply_softmax=apply_softmax)
        # each pair's windows' scores aggregated (a one-label model's), or the pairs' scores
        scores = score(logits) if owner is None else pair_scores(logits, owner, long_documents, score)
        if single:
            scores = scores[0]
        if convert_to_tensor:
            return scores.to(self.device)
        if not convert_to_numpy:
            scores = scores.to(self.device)
            return scores if single else list(scores)
        # float32 whatever the activation returns, as there
        return scores.float().numpy() if scores.ndim else np.float32(scores.item())

    __call__ = predict

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], **kwargs):
        """vLLM's pairing: str/str -> float; str/list or [str]/list -> 1:N; equal-length lists -> N:N."""
        if self.num_labels != 1:
            raise ValueError(f"score() needs a one-label model; this one has {self.num_labels} labels: use predict()")
        if isinstance(text_1, str) and isinstance(text_2, str):
            return float(self.predict((text_1, text_2), **kwargs))
        return self.predict(vllm_pairs(text_1, text_2), **kwargs)

    def rank(
        self,
        query: str,
        documents: Sequence[str],
        top_k: int | None = None,
        return_documents: bool = False,
        *,
        batch_size: int | None = None,
        show_progress_bar: bool | None = None,
        activation_fn: Callable | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        device: str | torch.device | None = None,
        long_documents: str | None = None,
        window_stride: int | None = None,
        **old_names,
    ) -> list[dict]:
        """sentence-transformers' rank: [{corpus_id, score(, text)}] sorted by score, ties in corpus order.

        ``apply_softmax``, ``convert_to_numpy``, ``convert_to_tensor`` and ``num_workers``, which
        sentence-transformers v6 still takes and ignores, are ignored here too, with a warning; its old name
        ``activation_fct`` works with a warning. ``device`` may name the Scorer's own device only; ``long_documents``
        and ``window_stride`` as in ``predict``."""
        activation_fn = rank_names(activation_fn, old_names)
        if self.num_labels != 1:
            raise ValueError(f"rank() needs a one-label model; this one has {self.num_labels} labels")
        if not isinstance(query, str):
            raise TypeError(f"query must be str, got {type(query).__name__}")
        check_ordered("documents", documents, "a list of str")
        if top_k is not None:
            if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
                raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
            if top_k < 1:
                raise ValueError(f"top_k must be a positive int or None (all documents), got {top_k}")
            top_k = int(top_k)
        check_flags(return_documents=return_documents)
        check_call_device(self.device, device)
        prompt = resolve_prompt(self.save, prompt, prompt_name)  # before an iterator of documents is consumed
        documents = list(documents)
        scores = self.predict(
            [[query, doc] for doc in documents],
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
            activation_fn=activation_fn,
            convert_to_tensor=True,
            prompt="" if prompt is None else prompt,
            long_documents=long_documents,
            window_stride=window_stride,
        ).tolist()
        results = [{"corpus_id": i, "score": s} for i, s in enumerate(scores)]
        if return_documents:
            for r in results:
                r["text"] = documents[r["corpus_id"]]
        return sorted(results, key=lambda r: r["score"], reverse=True)[:top_k]

    def score_frame(self, df, text_1="query", text_2="passage", column: str = "score", *, overwrite: bool = False,
                    **predict_kwargs):
        """A copy of the pandas DataFrame ``df`` with the scores of its (``text_1``, ``text_2``) rows added: one float32
        column ``column``, or for a multi-label model one per label, ``f"{column}_{label}"``. The index and row order
        are kept and ``df`` is not modified; ``predict_kwargs`` go to ``predict``."""
        from .ir.frames import score_frame

        return score_frame(self, df, text_1, text_2, column, overwrite=overwrite, **predict_kwargs)

    def as_pyterrier(self, text_field: str = "text", **predict_kwargs):
        """This Scorer as a PyTerrier reranking transformer (needs python-terrier: ``pip install
        'xenc-lab[pyterrier]'``): it scores a results frame's (query, ``text_field``) rows (``ir/pyterrier.py``)."""
        from .ir.pyterrier import as_pyterrier

        return as_pyterrier(self, text_field, **predict_kwargs)
