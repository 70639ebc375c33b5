"""Hashing model files for the conversion cache: a file's sha256, remembered by size and mtime.

`agentkv.models` keys converted GGUF checkpoints by the file's hash; this module
owns computing it and the memo file that saves rehashing a multi-GB file per load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

__all__ = ["memo_get", "memo_put", "sha256_of"]

logger = logging.getLogger("agentkv.models")

_HASH_CHUNK_BYTES = 8 << 20


def sha256_of(path: Path) -> str:
    """The sha256 hex digest of the file at `path`, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def memo_get(memo_file: Path, path: Path) -> str | None:
    """The remembered sha256 of `path`, if its size and mtime are unchanged since it was hashed.

    Hashing a multi-GB GGUF on every load would cost seconds; the cache key only
    has to change when the file does.
    """
    try:
        stat = path.stat()
        record = json.loads(memo_file.read_text()).get(str(path))
    except (OSError, ValueError, AttributeError):
        return None
    if (
        isinstance(record, dict)
        and record.get("size") == stat.st_size
        and record.get("mtime_ns") == stat.st_mtime_ns
        and isinstance(record.get("sha256"), str)
    ):
        return str(record["sha256"])
    return None


def memo_put(memo_file: Path, path: Path, digest: str) -> None:
    """Remember a hash; best effort (a failure only costs a rehash next time)."""
    try:
        stat = path.stat()
        try:
            records = json.loads(memo_file.read_text())
            if not isinstance(records, dict):
                records = {}
        except (OSError, ValueError):
            records = {}
        records[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=memo_file.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(records, f, indent=2)
            os.replace(tmp, memo_file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        logger.debug("could not record the hash of %s in %s: %s", path, memo_file, e)
