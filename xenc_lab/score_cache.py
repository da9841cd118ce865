"""A persistent score cache: each pair's raw fp32 logits in an SQLite file, keyed by the model's weights and every
option that changes them, so a rerun of an experiment reads its scores instead of computing them.

The key of a pair is a SHA-256 of: the weights' fingerprint (a SHA-256 of every file of the model folder, memoized by
path, size and modification time), the architecture, dtype, device type, ``compile``, prefix sharing, the effective
``max_length``, the prompt, whether text_2 is scored in windows and their stride, and the exact texts. Raw logits
are stored, so the activation, ``apply_softmax`` and the aggregation of a long document's windows are applied after
reading, as without a cache. SQLite in WAL mode with a busy timeout lets several processes read and write one file.
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from pathlib import Path

import numpy as np

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS scores (key BLOB PRIMARY KEY, logits BLOB NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS files (path TEXT, size INTEGER, mtime_ns INTEGER, digest TEXT NOT NULL, "
    "PRIMARY KEY (path, size, mtime_ns))",
)
_CHUNK = 500  # keys per SELECT (SQLite's bound-parameter limit is far above)
_SKIPPED = {"README.md", ".gitattributes"}  # a model card edit does not change a score


class ScoreCache:
    """Pair scores (raw logits) in the SQLite file ``path`` (created on first use). ``size()`` and ``clear()`` show and
    empty it; ``xenc-lab cache info|clear PATH`` does the same from a shell."""

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"cache must be a path (str or os.PathLike) or a ScoreCache, got {type(path).__name__}")
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise ValueError(f"cache must be a file path, got the directory {str(self.path)!r}")
        self._lock = threading.Lock()
        self._conn, self._pid = None, None
        self._digests: dict = {}
        self.hits = self.misses = 0  # pairs read and computed since this object was made

    def __repr__(self) -> str:
        return f"ScoreCache({str(self.path)!r})"

    def _db(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():  # a forked child opens its own connection
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=120, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            for statement in _SCHEMA:
                conn.execute(statement)
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    # -- storage ---------------------------------------------------------------------------------------------
    def get(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """The stored logits blobs of those of ``keys`` the cache holds."""
        found = {}
        with self._lock:
            db = self._db()
            for i in range(0, len(keys), _CHUNK):
                chunk = keys[i: i + _CHUNK]
                query = f"SELECT key, logits FROM scores WHERE key IN ({','.join('?' * len(chunk))})"
                found.update(db.execute(query, chunk).fetchall())
        return found

    def put(self, items: dict[bytes, bytes]) -> None:
        """Stores key -> logits blob, in one transaction; a key another process stored meanwhile is kept as it is."""
        if not items:
            return
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("INSERT OR IGNORE INTO scores (key, logits) VALUES (?, ?)", items.items())
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def size(self) -> dict:
        """``{"pairs": stored pairs, "bytes": the file's size on disk (with its write-ahead log)}``."""
        with self._lock:
            pairs = self._db().execute("SELECT COUNT(*) FROM scores").fetchone()[0]
        files = [self.path, Path(f"{self.path}-wal")]
        return {"pairs": int(pairs), "bytes": sum(f.stat().st_size for f in files if f.exists())}

    def clear(self) -> None:
        """Removes every stored score and gives the space back."""
        with self._lock:
            db = self._db()
            db.execute("DELETE FROM scores")
            db.execute("DELETE FROM files")
            db.execute("VACUUM")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    # -- keys ------------------------------------------------------------------------------------------------
    def file_digest(self, path: Path) -> str:
        """SHA-256 of a file's bytes, computed once per (path, size, mtime) and remembered in the cache file."""
        st = path.stat()
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if memo in self._digests:
            return self._digests[memo]
        with self._lock:
            row = self._db().execute("SELECT digest FROM files WHERE path=? AND size=? AND mtime_ns=?", memo).fetchone()
        if row is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            row = (h.hexdigest(),)
            with self._lock:
                self._db().execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)", (*memo, row[0]))
        self._digests[memo] = row[0]
        return row[0]

    def fingerprint(self, folder: str | os.PathLike) -> str:
        """SHA-256 over a model folder's files (names and contents): weights, config, tokenizer."""
        root = Path(folder)
        files = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            files += [Path(dirpath) / n for n in filenames if n not in _SKIPPED and not n.startswith(".")]
        h = hashlib.sha256()
        for path in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
            h.update(f"{path.relative_to(root).as_posix()}\0{self.file_digest(path)}\0".encode())
        return h.hexdigest()

    # -- the Scorer's hook ------------------------------------------------------------------------------------
    def run(self, scorer, compute, text_1, text_2, batch_size, show, prompt, max_length, windows, stride):
        """``Scorer._run`` through the cache: the pairs' logits rows (each pair's windows together, first window first)
        and their owners, computing with ``compute`` (the engine) only the pairs not stored."""
        import torch

        options = {
            "weights": self.fingerprint(scorer.path), "architecture": scorer.architecture,
            "dtype": scorer.config.dtype, "quantization": scorer.config.quantization,
            "device": torch.device(scorer.device).type, "compile": scorer.config.compile,
            "share_prefix": bool(scorer.share_prefix), "num_labels": scorer.num_labels,
            "max_length": scorer.max_length if max_length is None else int(max_length),
            "prompt": prompt or None, "windows": bool(windows), "stride": stride,
        }
        prefix = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).digest()
        keys = [hashlib.sha256(prefix + json.dumps([a, b], ensure_ascii=False).encode()).digest()
                for a, b in zip(text_1, text_2)]
        found = self.get(list(dict.fromkeys(keys)))
        todo = {}  # key -> its first pair's index
        for i, key in enumerate(keys):
            if key not in found:
                todo.setdefault(key, i)
        self.hits += len(keys) - sum(1 for k in keys if k in todo)
        self.misses += sum(1 for k in keys if k in todo)
        if todo:
            index = list(todo.values())
            logits, owner = compute([text_1[i] for i in index], [text_2[i] for i in index], batch_size, show, prompt,
                                    max_length, windows, stride)
            rows = logits.float().cpu().numpy()
            owner = np.arange(len(index)) if owner is None else np.asarray(owner)
            order = np.argsort(owner, kind="stable")  # each pair's rows together, in their order
            bounds = np.searchsorted(owner[order], np.arange(len(index) + 1))
            fresh = {key: np.ascontiguousarray(rows[order[bounds[j]: bounds[j + 1]]], dtype=np.float32).tobytes()
                     for j, key in enumerate(todo)}
            self.put(fresh)
            found.update(fresh)
        labels = scorer.num_labels
        parts = [np.frombuffer(found[k], dtype=np.float32).reshape(-1, labels) for k in keys]
        counts = np.array([len(p) for p in parts], dtype=np.int64)
        logits = torch.from_numpy(np.concatenate(parts) if parts else np.zeros((0, labels), np.float32))
        return logits, (np.repeat(np.arange(len(keys)), counts) if windows else None)


def open_cache(cache) -> ScoreCache | None:
    """A ScoreCache for a path (a ScoreCache is returned as it is; None: no cache)."""
    return cache if cache is None or isinstance(cache, ScoreCache) else ScoreCache(cache)



def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="show or empty a score cache file (Scorer(..., cache=PATH))")
    p.add_argument("action", choices=["info", "clear"])
    p.add_argument("path", metavar="PATH", help="the cache's SQLite file")
    p.set_defaults(func=_command)


def _command(args) -> int:
    if not Path(args.path).is_file():
        raise FileNotFoundError(f"no score cache at {args.path}")
    cache = ScoreCache(args.path)
    if args.action == "clear":
        before = cache.size()
        cache.clear()
        print(f"cleared {args.path}: {before['pairs']} pairs, {before['bytes'] / 1e6:.2f} MB before")
    else:
        size = cache.size()
        print(f"{args.path}: {size['pairs']} pairs, {size['bytes'] / 1e6:.2f} MB")
    return 0
