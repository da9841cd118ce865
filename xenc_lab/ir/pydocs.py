"""An offline test collection built from the documentation that ships with Python: each documented function of
some standard-library modules is a document (its module as title, its docstring as text), and a query made of its
name's words has that function's docstring as its one relevant document. Its BM25 first stage is ``xenc_lab.bm25``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

MODULES = [
    "array", "base64", "binascii", "bisect", "calendar", "cmath", "codecs", "collections", "colorsys", "copy", "csv",
    "datetime", "decimal", "difflib", "email.utils", "filecmp", "fnmatch", "fractions", "functools", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "inspect", "ipaddress", "itertools", "json", "keyword", "linecache", "locale",
    "math", "mimetypes", "operator", "os", "os.path", "pathlib", "pickle", "platform", "pprint", "quopri", "random",
    "re", "secrets", "shlex", "shutil", "socket", "statistics", "string", "struct", "sysconfig", "tarfile",
    "tempfile", "textwrap", "threading", "time", "tokenize", "unicodedata", "urllib.parse", "uuid", "warnings",
    "zipfile", "zlib",
]


def _documented_functions() -> list[tuple[str, str, list[str], str]]:
    """(module, name, name's words, docstring) of every documented function of MODULES, read in a fresh isolated
    interpreter (``pydocs_extract.py``): the same for a script, pytest and a notebook kernel."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pydocs_extract.py")
    out = subprocess.run([sys.executable, "-I", script, *MODULES], capture_output=True, text=True, check=True)
    return [(module, name, name.split("_"), doc) for module, name, doc in json.loads(out.stdout)]


def python_docs_collection(folder: str | os.PathLike, max_chars: int = 1000, max_queries: int | None = None
                           ) -> dict[str, str]:
    """Writes a BEIR folder (corpus.jsonl, queries.jsonl, qrels/test.tsv) of the standard library's documented
    functions and returns the three paths. A query is a function's name split into words, prefixed by its module
    (``"os path join"``); its relevant document is that function's docstring (cut to ``max_chars``). An alias
    (``bisect.bisect`` of ``bisect_right``) is left out: its text would tie with the original's. ``max_queries``
    keeps the first queries only (the corpus stays whole). The contents follow the running Python's docstrings."""
    os.makedirs(os.path.join(folder, "qrels"), exist_ok=True)
    docs, queries, texts = [], {}, set()
    for module, name, words, doc in _documented_functions():
        docno, text = f"{module}.{name}", re.sub(r"\s+", " ", doc)[:max_chars]
        if (module, text) in texts:
            continue
        texts.add((module, text))
        docs.append({"_id": docno, "title": module, "text": text})
        query = " ".join(module.replace(".", " ").split() + [w for w in words if w])
        queries.setdefault(query, docno)  # one query per distinct text
    paths = {name: os.path.join(folder, file) for name, file in
             (("corpus", "corpus.jsonl"), ("queries", "queries.jsonl"), ("qrels", os.path.join("qrels", "test.tsv")))}
    with open(paths["corpus"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(paths["queries"], "w", encoding="utf-8") as f, open(paths["qrels"], "w", encoding="utf-8") as q:
        q.write("query-id\tcorpus-id\tscore\n")
        for i, (text, docno) in enumerate(list(queries.items())[:max_queries]):
            f.write(json.dumps({"_id": f"q{i}", "text": text}) + "\n")
            q.write(f"q{i}\t{docno}\t1\n")
    return paths


def bm25_run(queries, corpus, k: int = 100, title_sep: str | None = " "):
    """Deprecated name of ``xenc_lab.bm25`` (``xenc_lab.ir.bm25``), kept for old notebooks."""
    warnings.warn("xenc_lab.ir.pydocs.bm25_run is now xenc_lab.bm25", DeprecationWarning, stacklevel=2)
    from .first_stage import bm25

    return bm25(queries, corpus, k=k, title_sep=title_sep)
