"""Scores of a DataFrame's (text_1, text_2) columns, added as new columns."""
from __future__ import annotations

from ..st_args import check_flags


def score_frame(scorer, df, text_1="query", text_2="passage", column: str = "score", *, overwrite: bool = False,
                **predict_kwargs):
    """``Scorer.score_frame`` for any model with ``CrossEncoder.predict``'s signature: a copy of the DataFrame ``df``
    with the scores of its (``text_1``, ``text_2``) rows added, one float32 column ``column`` or, for a multi-label
    model, one per label (``f"{column}_{label}"``). The index and row order are kept; ``df`` is not modified."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    if not isinstance(column, str):
        raise TypeError(f"column must be a str, got {type(column).__name__}")
    check_flags(overwrite=overwrite)
    for name in ("convert_to_tensor", "convert_to_numpy"):
        if name in predict_kwargs:
            raise ValueError(f"score_frame writes float32 columns: {name} cannot be passed, got {name}="
                             f"{predict_kwargs[name]!r}")
    texts = []
    for role, name in (("text_1", text_1), ("text_2", text_2)):
        if name not in df.columns:
            raise ValueError(f"{role}={name!r} is not a column of df; its columns are {list(df.columns)}")
        held = list(df.columns).count(name)
        if held > 1:
            raise ValueError(f"{role}={name!r} names {held} columns of df; it must name one")
        values = df[name]
        missing = values.isna()
        if missing.any():
            raise ValueError(f"column {name!r} must hold str values, got NaN/None in rows "
                             f"{list(values.index[missing][:5])}")
        not_str = ~values.map(lambda v: isinstance(v, str)).astype(bool)
        if not_str.any():
            first = values[not_str].iloc[0]
            raise TypeError(f"column {name!r} must hold str values, got {type(first).__name__} (e.g. {first!r}) "
                            f"in rows {list(values.index[not_str][:5])}")
        texts.append(values.tolist())
    names = [column] if scorer.num_labels == 1 else [f"{column}_{label}" for label in scorer.labels]
    taken = [n for n in names if n in df.columns]
    if taken and not overwrite:
        raise ValueError(f"df already has the column(s) {taken}; pass overwrite=True to replace them")
    scores = scorer.predict(list(zip(*texts)), **predict_kwargs).reshape(len(df), len(names))  # (rows, labels)
    out = df.copy()
    for j, name in enumerate(names):
        out[name] = scores[:, j]
    return out
