"""A response's usage: the tokens of its pairs as the Scorer makes them (truncated, with the special tokens or the chat
template, the save's default prompt included), counted on a copy of the Scorer's tokenizer in a thread of its own: a
tokenizer is not to be shared between threads, and the count runs while the request waits for the engine."""
from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor

from ..decoder.chat import ChatPairTokenizer
from .truncation import truncating_from


class TokenCounter:
    def __init__(self, scorer):
        self.tokenizer = copy.deepcopy(scorer.tokenizer)
        save = scorer.save  # predict's prompt when given none: the save's default prompt (CrossEncoder's rule)
        self._prompt = (save.prompts.get(save.default_prompt_name) if save.default_prompt_name else None) or None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xenc-count")

    def count(self, pairs: list[tuple[str, str]], max_length: int | None, truncation_side: str | None = None) -> int:
        """Tokens of the pairs at ``max_length`` (None: the Scorer's), as ``Scorer.predict`` tokenizes them."""
        text_1, text_2 = [a for a, _ in pairs], [b for _, b in pairs]
        with truncating_from(self, truncation_side):
            if isinstance(self.tokenizer, ChatPairTokenizer):
                enc = self.tokenizer(text_1, text_2, max_length, prompt=self._prompt)
            else:
                if self._prompt:
                    text_1 = [self._prompt + t for t in text_1]
                enc = self.tokenizer(text_1, text_2, max_length)
        return int(enc.lengths.sum())

    def _count(self, pairs: list[tuple[str, str]], max_length: int | None, truncation_side: str | None) -> int:
        try:
            return self.count(pairs, max_length, truncation_side)
        except (Exception, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # a Rust panic in the tokenizer: an error the server can answer
            raise RuntimeError(f"the tokenizer failed: {err!r}") from None

    def submit(self, pairs: list[tuple[str, str]], max_length: int | None,
               truncation_side: str | None = None) -> Future:
        return self._pool.submit(self._count, pairs, max_length, truncation_side)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
