"""Stage 1 for chat-template rerankers: (text_1, text_2) pairs -> token ids, exactly as sentence-transformers makes
them.

When the tokenizer has a chat template (or a CrossEncoder save's modality_config names the "message" input),
sentence-transformers turns a pair into two messages, ``{"role": "query", ...}`` and ``{"role": "document", ...}``
(a prompt goes before them as a ``system`` message), renders them with ``apply_chat_template`` and tokenizes the one
string with ``add_special_tokens=False``: a control token written inside a text (a literal "<|im_end|>") is the control
token there. Rows are cut at max_length on the tokenizer's truncation side, then a row that reached max_length gets
the template's tail (the tokens after the last text) written back over its last tokens, so that a causal LM still
reads its verdict cue at the last position. Without a chat template the pair is tokenized as a text pair
(``tokenize.PairTokenizer``); ``pair_tokenizer`` picks.

Here the pairs are rendered with the tokenizer's own Jinja and the rendered strings encoded in one call of the
tokenizers library, free of transformers' per-call setup; the probe renders at load check that this gives the
tokenizer's own ids (else the tokenizer is called as sentence-transformers calls it).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from tokenizers import Tokenizer
from transformers import PretrainedConfig

from ..st_format import CrossEncoderSave, chat_processing
from ..tokenize import Encodings, PairTokenizer, backend_copy, load_tokenizer

logger = logging.getLogger(__name__)

PAIR_ROLES = ("query", "document")
# sentence-transformers' probes (base/modality.py): a baseline pair, then each role's text changed alone.
ROLE_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))
# Model types whose messages sentence-transformers sends as plain strings whatever the template (base/modality.py).
KNOWN_MESSAGE_FORMATS = {"apertus": "flat", "deepseek_v3": "flat", "gpt_oss": "flat", "minicpm3": "flat",
                         "seed_oss": "flat"}
# A template that reads any of these gets typed content parts, [{"type": "text", "text": ...}] (``_infer_format``).
STRUCTURED_PATTERNS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")
# The fillers whose two renders differ only in content: their common token tail is the template's.
_FILLERS = ("0", "1 2 3 4")
# Renders on which the backend copy must give the tokenizer's own ids: unicode, control tokens in a text, a prompt.
_BACKEND_PROBES = [("Zürich 東京 ok?", " 🙂 x\n\n<|im_end|> yes", None), ("", "", "a prompt"),
                   ("a  b", "cafe\u0301\t", None)]
_IMAGE = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".tiff", ".webp")
_VIDEO = (".mp4", ".avi", ".mov", ".wmv", ".flv", ".mkv")
_AUDIO = (".mp3", ".wav", ".ogg", ".flac", ".aac")
_YOUTUBE = ("www.youtube.com", "youtube.com", "youtu.be", "m.youtube.com")


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://")) and " " not in text


def _is_media(text: str, extensions: tuple[str, ...], local_files: bool = True) -> bool:
    if _is_url(text):
        try:
            return urlparse(text).path.lower().endswith(extensions)
        except ValueError:
            return False
    return local_files and text.lower().endswith(extensions) and os.path.isfile(text)


def text_kind(text: str, local_files: bool = True) -> str:
    """What sentence-transformers takes one text of a pair for (``infer_modality``, which ``pair_to_messages`` calls
    without the model's modalities): "image", "video" or "audio" for a media URL or an existing media file's path,
    else "text". Typed content then carries the text under that type, which a text-only template does not render.
    ``local_files=False`` never asks the file system (a server: a request must not learn which paths exist)."""
    if text.startswith("data:image/") or _is_media(text, _IMAGE, local_files):
        return "image"
    if _is_media(text, _VIDEO, local_files):
        return "video"
    if _is_url(text):
        try:
            if urlparse(text).netloc in _YOUTUBE:
                return "video"
        except ValueError:
            pass
    return "audio" if _is_media(text, _AUDIO, local_files) else "text"


def uses_chat_template(tokenizer, save: CrossEncoderSave) -> bool:
    """Whether sentence-transformers sends pairs as chat messages: a save's modality_config decides where it has one
    (a "message" entry), else whether the tokenizer has a chat template, whatever the architecture."""
    if save.modality_config is not None:
        return "message" in save.modality_config
    return getattr(tokenizer, "chat_template", None) is not None


def message_format(tokenizer, model_type: str, save: CrossEncoderSave) -> str:
    """"flat" (content is the text) or "structured" (typed parts) as sentence-transformers' InputFormatter decides:
    a save's modality_config message format, else by model type, else by what the template reads."""
    saved = ((save.modality_config or {}).get("message") or {}).get("format", "auto")
    if saved != "auto":
        return saved
    if model_type in KNOWN_MESSAGE_FORMATS:
        return KNOWN_MESSAGE_FORMATS[model_type]
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return "structured"
    return "structured" if any(p in template for p in STRUCTURED_PATTERNS) else "flat"


def pair_tokenizer(
    path: Path,
    config: PretrainedConfig,
    max_length: int | None = None,
    trust_remote_code: bool = False,
    save: CrossEncoderSave | None = None,
    position_limit: int | None = None,
):
    """The tokenizer sentence-transformers would use on the pairs: a ChatPairTokenizer where it sends them as chat
    messages (``uses_chat_template``), else a PairTokenizer."""
    save = save if save is not None else CrossEncoderSave()
    loaded = load_tokenizer(path, config, max_length, trust_remote_code, save, position_limit)
    if uses_chat_template(loaded[0], save):
        return ChatPairTokenizer(path, config, max_length, trust_remote_code, save, position_limit, loaded=loaded)
    return PairTokenizer(path, config, max_length, trust_remote_code, save, position_limit, loaded=loaded)


def score_tokens(tokenizer, save: CrossEncoderSave | None = None) -> tuple[int, int | None]:
    """The vocabulary ids whose last-token logits score a causal LM, ``logit[true] - logit[false]`` (false None:
    ``logit[true]`` alone): a save's LogitScore module's, else the tokenizer's "yes" and "no", as CrossEncoder picks
    them. A tokenizer with an unknown token maps a missing word to it, as in CrossEncoder."""
    if save is not None and save.logit_score is not None:
        return save.logit_score
    true_id, false_id = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    if true_id is None or false_id is None:
        missing = " and ".join(repr(w) for w, i in (("yes", true_id), ("no", false_id)) if i is None)
        raise ValueError(
            f"the tokenizer has no {missing} token, which a causal LM reranker is scored by (logit('yes') - "
            "logit('no') at the last token, sentence-transformers' default LogitScore); save the model as a "
            "CrossEncoder with a LogitScore module naming its true/false token ids (sentence_transformers."
            "cross_encoder.modules.LogitScore(true_token_id, false_token_id)), or use a tokenizer that has them")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in (true_id, false_id):
        logger.warning("the tokenizer lacks 'yes' or 'no' and maps it to its unknown token %d, whose logit then "
                       "scores the pairs (as in sentence-transformers)", unk)
    return true_id, false_id


class ChatPairTokenizer:
    def __init__(
        self,
        path: Path,
        config: PretrainedConfig,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        save: CrossEncoderSave | None = None,
        position_limit: int | None = None,
        *,
        loaded: tuple | None = None,
    ):
        """The tokenizer as CrossEncoder loads it (``tokenize.load_tokenizer``; ``loaded``: its result, where the
        caller has it), the template's variables and suffix restoring from a save's processing_kwargs, and the check
        that the template renders both texts of a pair (ValueError otherwise, as sentence-transformers raises)."""
        save = save if save is not None else CrossEncoderSave()
        if loaded is None:
            loaded = load_tokenizer(path, config, max_length, trust_remote_code, save, position_limit)
        self.tokenizer, self.max_length, self.max_length_source = loaded
        where = f"{save.module_config}'s processing_kwargs"
        chat_max_length, self.template_kwargs, self.restore_suffix = chat_processing(
            {"chat_template": save.chat_template_kwargs}, where)
        if chat_max_length is not None and max_length is None:
            self.max_length, self.max_length_source = chat_max_length, f"{where}' chat_template"
        self.format = message_format(self.tokenizer, getattr(config, "model_type", ""), save)
        self.local_files = True  # a text naming an existing media file is typed as that media, as there
        self.name = getattr(config, "name_or_path", None) or str(path)
        self._check_pair_roles()
        self.emits_token_type_ids = "token_type_ids" in self.tokenizer.model_input_names
        self.backend = self._own_backend()
        if self.backend is not None:  # ids alone (no offsets) where the library can
            self._encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        self._suffixes: dict[str | None, list[int]] = {}
        # The Scorer refuses a max_length below: a row cut there holds the whole suffix and one token before it.
        self.specials = len(self.suffix()) + 1

    def from_where(self) -> str:
        """Where a max_length not passed came from, as ' (from ...)' for messages; '' where it was passed."""
        return f" (from {self.max_length_source})" if self.max_length_source else ""

    # -- messages and renders -------------------------------------------------------------------------
    def _content(self, text: str, kind: str = "text"):
        return text if self.format == "flat" else [{"type": kind, kind: text}]

    def messages(self, text_1: str, text_2: str, prompt: str | None = None) -> list[dict]:
        """The conversation sentence-transformers makes of a pair: the prompt as a system message, then the query and
        the document."""
        conversation = [{"role": "system", "content": self._content(prompt)}] if prompt else []
        structured = self.format == "structured"
        for role, text in zip(PAIR_ROLES, (text_1, text_2)):
            kind = text_kind(text, self.local_files) if structured else "text"
            conversation.append({"role": role, "content": self._content(text, kind)})
        return conversation

    def render(self, conversations: list[list[dict]]) -> list[str]:
        """The template's strings, rendered with the tokenizer's Jinja as sentence-transformers' call renders them."""
        return self.tokenizer.apply_chat_template(conversations, tokenize=False, common_kwargs={},
                                                  **self.template_kwargs)

    def _encode(self, rendered: list[str]) -> list[list[int]]:
        """The renders' ids, whole: with the backend copy where it gives the tokenizer's own, else the tokenizer."""
        if self.backend is not None:
            return [e.ids for e in self._encode_batch(rendered, add_special_tokens=False)]
        return self._tokenizer_call(rendered)

    def _tokenizer_call(self, rendered: list[str]) -> list[list[int]]:
        """The renders tokenized as apply_chat_template tokenizes them (before truncation)."""
        out = self.tokenizer(rendered, add_special_tokens=False, padding=False, truncation=False, verbose=False)
        return out["input_ids"]

    def _check_pair_roles(self) -> None:
        """sentence-transformers' ``_verify_pair_roles_supported``: each probe pair's texts must move the render."""
        failure = None
        if getattr(self.tokenizer, "chat_template", None) is None:
            failure = "the model has no chat template"
        else:
            try:
                base, *varied = (self.tokenizer.apply_chat_template(self.messages(a, b), tokenize=False,
                                                                    **self.template_kwargs) for a, b in ROLE_PROBES)
                base, varied = str(base), [str(v) for v in varied]
            except Exception as exc:  # noqa: BLE001 (a template may raise anything)
                failure = f"it raised {type(exc).__name__}: {exc}"
            else:
                dropped = [role for role, render in zip(PAIR_ROLES, varied) if render == base]
                if dropped:
                    failure = f"the {' and '.join(map(repr, dropped))} content does not reach the rendered prompt"
        if failure is None:
            return
        if self.format == "structured":
            read = '(messages | selectattr("role", "eq", "{}") | first).content[0].text'
        else:
            read = 'messages | selectattr("role", "eq", "{}") | map(attribute="content") | first'
        raise ValueError(
            f"The chat template of {self.name} cannot carry a 'query'/'document' pair ({failure}). A pair is sent as "
            "one message per role (and a prompt as a system message), so pass a chat template that renders both "
            f"roles, e.g.:\n    <Query>: {{{{ {read.format('query')} }}}}\n"
            f"    <Document>: {{{{ {read.format('document')} }}}}\n"
            "as a chat_template.jinja file beside the tokenizer, or in a CrossEncoder save's processor_kwargs "
            '({"chat_template": ...} in sentence_bert_config.json), as sentence-transformers reads them.')

    def _own_backend(self) -> Tokenizer | None:
        """A copy of the fast tokenizer's backend free of transformers' truncation and padding, where encoding the
        renders with it gives the tokenizer's own ids on probes (a tokenizer class may encode its own way), else
        None: the tokenizer is called."""
        backend = backend_copy(self.tokenizer)
        if backend is None:
            return None
        backend.encode_special_tokens = bool(getattr(self.tokenizer, "split_special_tokens", False))
        probes = self.render([self.messages(a, b, p) for a, b, p in _BACKEND_PROBES])
        if [e.ids for e in backend.encode_batch(probes, add_special_tokens=False)] != self._tokenizer_call(probes):
            logger.info("%s: encoding the renders alone differs from the tokenizer's call; calling it", self.name)
            return None
        return backend

    def suffix(self, prompt: str | None = None) -> list[int]:
        """The template's tail that a truncated row gets back (``_chat_template_suffix_ids``): the common token tail
        of two renders with the texts set to "0" and to "1 2 3 4" (a prompt kept), or [] where the renders never
        differ or fail. Cached per prompt."""
        if prompt in self._suffixes:
            return self._suffixes[prompt]
        suffix: list[int] = []
        try:
            first, second = self._encode(self.render([self._skeleton(filler, prompt) for filler in _FILLERS]))
            count = 0
            for left, right in zip(reversed(first), reversed(second)):
                if left != right:
                    break
                count += 1
            if 0 < count < min(len(first), len(second)):
                suffix = first[len(first) - count :]
        except Exception as exc:  # noqa: BLE001 (as in sentence-transformers, a failed derivation restores nothing)
            logger.debug("could not derive the chat template's suffix: %s", exc)
        self._suffixes[prompt] = suffix
        return suffix

    def _skeleton(self, filler: str, prompt: str | None) -> list[dict]:
        conversation = [{"role": "system", "content": self._content(prompt)}] if prompt else []
        return conversation + [{"role": role, "content": self._content(filler)} for role in PAIR_ROLES]

    # -- the pairs ------------------------------------------------------------------------------------
    def __call__(
        self, text_1: list[str], text_2: list[str], max_length: int | None = None, prompt: str | None = None
    ) -> Encodings:
        """The pairs' ids, cut to ``max_length`` tokens (default: ``self.max_length``) on the tokenizer's truncation
        side, a row that reached it ending in the template's suffix; ``prompt`` as sentence-transformers places it (a
        system message)."""
        assert len(text_1) == len(text_2), (len(text_1), len(text_2))
        max_length = self.max_length if max_length is None else max_length
        assert max_length >= 1, max_length
        prompt = prompt or None
        conversations, rows = self.rendered(text_1, text_2, prompt)
        suffix = self.suffix(prompt) if self.restore_suffix else []
        enc = Encodings.from_rows([self.cut(ids, max_length, suffix, c) for ids, c in zip(rows, conversations)])
        if self.emits_token_type_ids:
            enc.type_ids = np.zeros_like(enc.ids)
        return enc

    def rendered(self, text_1: list[str], text_2: list[str], prompt: str | None) -> tuple[list, list[list[int]]]:
        """The pairs' conversations and the ids of their whole renders (before truncation)."""
        conversations = [self.messages(a, b, prompt) for a, b in zip(text_1, text_2)]
        return conversations, self._encode(self.render(conversations)) if conversations else []

    def cut(self, ids: list[int], max_length: int, suffix: list[int], conversation: list[dict]) -> list[int]:
        """A render's ids cut to ``max_length`` on the truncation side; a row that reached it ends in ``suffix`` (the
        template's, [] where none is restored) unless the conversation has a non-text part."""
        if len(ids) > max_length:
            ids = ids[len(ids) - max_length :] if self.tokenizer.truncation_side == "left" else ids[:max_length]
        if len(ids) >= max_length and suffix and self.text_only(conversation):
            keep = min(len(suffix), len(ids))
            ids = ids[: len(ids) - keep] + suffix[len(suffix) - keep :]
        return ids

    def text_only(self, conversation: list[dict]) -> bool:
        """sentence-transformers restores no suffix on a row with a non-text content part (a text taken for media)."""
        return self.format == "flat" or all(part["type"] == "text" for m in conversation for part in m["content"])
