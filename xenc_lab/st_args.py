"""sentence-transformers' argument forms at the public boundary: what a pair is, its old argument names, and the
checks of flags and ordered inputs, so that ``Scorer`` reads like the engine it fronts."""
from __future__ import annotations

import reprlib
import warnings

import numpy as np


def is_single_pair(inputs) -> bool:
    # sentence-transformers' rule: a list/tuple whose first element is not a list/tuple is one pair.
    if isinstance(inputs, np.ndarray):
        return inputs.ndim == 1 and inputs.size > 0
    return isinstance(inputs, (list, tuple)) and len(inputs) > 0 and not isinstance(inputs[0], (list, tuple, np.ndarray))


def _shown(value) -> str:
    return f"{type(value).__name__} ({reprlib.repr(value)})"


def split_pairs(pairs: list, single: bool = False, start: int = 0) -> tuple[list[str], list[str]]:
    """The two text lists of a list of pairs, or a ValueError/TypeError naming the first bad element by its place
    (``pairs[17][1]``; ``start``: the place of ``pairs[0]`` in the caller's input; ``single``: the pairs are one pair
    the caller passed alone, named ``pairs``)."""
    text_1, text_2 = [], []
    for i, pair in enumerate(pairs, start):
        where = "pairs" if single else f"pairs[{i}]"
        sized = isinstance(pair, (list, tuple)) or (isinstance(pair, np.ndarray) and pair.ndim > 0)
        if not sized or len(pair) != 2:
            got = f"a {type(pair).__name__} of length {len(pair)}" if sized else _shown(pair)
            raise ValueError(f"{where} is {got}; expected a (text_1, text_2) pair of two str")
        a, b = pair
        for side, text in ((0, a), (1, b)):
            if not isinstance(text, str):
                raise TypeError(f"{where}[{side}] is {_shown(text)}; expected str (text_{side + 1})")
        text_1.append(a)
        text_2.append(b)
    return text_1, text_2


def check_flags(**flags) -> None:
    for name, value in flags.items():
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _unexpected(method: str, names) -> TypeError:
    return TypeError(f"{method}() got unexpected keyword argument(s) {sorted(names)}")


def predict_names(pairs, activation_fn, other: dict):
    """sentence-transformers' other names for predict's arguments: v6's ``inputs`` for the pairs, and from before
    v5 ``sentences``, ``activation_fct`` and ``num_workers`` (ignored), the old ones with a warning."""
    unknown = set(other) - {"inputs", "sentences", "activation_fct", "num_workers"}
    if unknown:
        raise _unexpected("predict", unknown)
    old = [name for name in other if name != "inputs"]
    if old:
        hints = {"sentences": "use pairs=", "activation_fct": "use activation_fn=", "num_workers": "ignored"}
        warnings.warn("predict() took old sentence-transformers names: "
                      + ", ".join(f"{name} ({hints[name]})" for name in old), FutureWarning, stacklevel=3)
    given = [name for name in ("inputs", "sentences") if name in other] + (["pairs"] if pairs is not None else [])
    if len(given) > 1:
        raise TypeError(f"predict() got the pairs under several names ({', '.join(sorted(given))}); pass pairs alone")
    if given and given[0] != "pairs":
        pairs = other[given[0]]
    if "activation_fct" in other:
        if activation_fn is not None:
            raise TypeError("predict() got both activation_fn and activation_fct; pass activation_fn alone")
        activation_fn = other["activation_fct"]
    if pairs is None:
        raise TypeError("predict() needs pairs: a (text_1, text_2) pair or a list of them")
    return pairs, activation_fn


def rank_names(activation_fn, old: dict):
    """rank's arguments sentence-transformers v6 still takes and ignores (``apply_softmax``, ``convert_to_numpy``,
    ``convert_to_tensor``, ``num_workers``), and the old name ``activation_fct``: each with a warning."""
    unknown = set(old) - {"apply_softmax", "convert_to_numpy", "convert_to_tensor", "num_workers", "activation_fct"}
    if unknown:
        raise _unexpected("rank", unknown)
    ignored = sorted(set(old) - {"activation_fct"})
    if ignored:
        warnings.warn(f"rank() ignores {ignored}, as sentence-transformers v6 does", FutureWarning, stacklevel=3)
    if "activation_fct" in old:
        if activation_fn is not None:
            raise TypeError("rank() got both activation_fn and activation_fct; pass activation_fn alone")
        warnings.warn("rank() took the old sentence-transformers name activation_fct: use activation_fn=",
                      FutureWarning, stacklevel=3)
        activation_fn = old["activation_fct"]
    return activation_fn


def resolve_prompt(save, prompt: str | None, prompt_name: str | None) -> str | None:
    """CrossEncoder's rule: an explicit prompt, else one of the save's prompts by name, else the save's default."""
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be str, got {type(prompt).__name__}")
        if prompt_name is not None:
            warnings.warn(f"got both prompt and prompt_name={prompt_name!r}: using prompt, as sentence-transformers "
                          "does; pass one of them", stacklevel=3)
        return prompt
    if prompt_name is not None:
        if prompt_name not in save.prompts:
            raise ValueError(f"prompt_name {prompt_name!r} is not one of the model's prompts {sorted(save.prompts)}")
        return save.prompts[prompt_name]
    return save.prompts.get(save.default_prompt_name) if save.default_prompt_name else None


def vllm_pairs(text_1, text_2) -> list[tuple[str, str]]:
    """vLLM's pairing of ``score``'s two sides (not two strings): str or [str] with a list is 1:N, equal-length lists
    N:N; other shapes and empty lists raise."""
    for name, value in (("text_1", text_1), ("text_2", text_2)):
        if not isinstance(value, (str, list, tuple)):
            raise TypeError(f"{name} must be a str or a list of str, got {type(value).__name__}")
    list_1 = [text_1] if isinstance(text_1, str) else list(text_1)
    list_2 = [text_2] if isinstance(text_2, str) else list(text_2)
    if not list_1 or not list_2:
        raise ValueError(f"text_1 and text_2 must not be empty (got lengths {len(list_1)} and {len(list_2)})")
    if len(list_1) == 1:
        list_1 = list_1 * len(list_2)
    elif len(list_1) != len(list_2):
        raise ValueError(f"text_1 and text_2 must pair 1:1, 1:N or N:N; got lengths {len(list_1)} and {len(list_2)}")
    return list(zip(list_1, list_2))


def check_ordered(name: str, value, expected: str) -> None:
    """``value`` must be an ordered iterable (not a str, a set or a dict): scores come back in its order."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if isinstance(value, (set, frozenset, dict)):
        raise TypeError(f"{name} must be {expected}, in an order the scores can follow; got a {type(value).__name__}")


class EvalResults:
    """Evaluator -> its last metrics, as ``CrossEncoderModelCardData`` keeps them, for a Scorer without
    sentence-transformers installed."""

    def __init__(self):
        self.eval_results_dict: dict = {}

    def set_evaluation_metrics(self, evaluator, metrics: dict, epoch: int = 0, step: int = 0) -> None:
        self.eval_results_dict[evaluator] = dict(metrics)


def new_model_card_data():
    """Where sentence-transformers' evaluators record metrics: its ``CrossEncoderModelCardData`` where installed (not
    registered with a model: registration reads a torch model's children and prompts), else an ``EvalResults``."""
    try:
        from sentence_transformers.cross_encoder.model_card import CrossEncoderModelCardData
    except ImportError:
        return EvalResults()
    return CrossEncoderModelCardData(local_files_only=True)
