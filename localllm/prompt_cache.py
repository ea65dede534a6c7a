"""The prompt cache on disk: `localllm run` reads back the KV of a prompt it has seen before.

A one-shot `cat notes.md | localllm run MODEL "summarize"`, the same system prompt or file
asked about again, a `/load`ed conversation: the prompt's prefill is the slow part, and its K/V
are the same bits every time. After a reply, the KV cache (prompt and reply, when at least
MIN_TOKENS) is written to $LOCALLLM_HOME/prompt-cache; before the next prefill, the file that
holds the longest prefix of the new prompt is read into the cache, and only the rest is run.

A file is a magic line, a JSON header (the model file's identity, the cache's element type and
shape, the token ids) and the K then V rows of those positions, layer by layer, as the cache
holds them. Files are written to a temporary name and renamed, so a full disk or Ctrl-C leaves
no half file; one that does not read back as expected is ignored and removed. The directory is
kept under a size cap (MAX_BYTES, `LOCALLLM_PROMPT_CACHE_BYTES`), least recently used first.
Only CPU caches are kept (a CUDA cache lives on the device).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from localllm.kv_cache import KVCache, reusable_prefix

log = logging.getLogger(__name__)

MAGIC = b"LOCALLLM-KV 1\n"
MIN_TOKENS = 256  # shorter prompts prefill in well under a second: not worth a file
MAX_BYTES = 4 << 30


def cache_dir() -> Path:
    home = os.environ.get("LOCALLLM_HOME") or Path.home() / ".localllm"
    return Path(home).expanduser() / "prompt-cache"


def max_bytes() -> int:
    try:
        return int(os.environ.get("LOCALLLM_PROMPT_CACHE_BYTES", MAX_BYTES))
    except ValueError:
        return MAX_BYTES


class PromptCache:
    """The prompt-cache files of one model file (and cache layout) in `directory`."""

    def __init__(self, model_path: Path, cache: KVCache, directory: Path | None = None) -> None:
        stat = Path(model_path).stat()
        self.directory = cache_dir() if directory is None else directory
        identity = f"{Path(model_path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        k = cache.pool.k
        layout = f"{k.dtype}:{k.shape[0]}:{cache.pool.row_shape}"
        self.model = hashlib.sha256(f"{identity}|{layout}".encode()).hexdigest()[:16]
        # the file the cache was last restored from (or written to), and its tokens
        self._source: tuple[Path, list[int]] | None = None

    @staticmethod
    def usable(cache: KVCache) -> bool:
        return isinstance(cache.pool.k, np.ndarray)

    def _files(self) -> list[Path]:
        return sorted(self.directory.glob(f"{self.model}-*.kv"))

    def restore(self, cache: KVCache, prompt_ids: list[int]) -> int:
        """Fill `cache` from the file holding the longest prefix of prompt_ids, where that
        beats what the cache holds already; the number of positions it now holds for them."""
        have = cache.reusable_prefix(prompt_ids)
        best, best_n = None, have
        for path in self._files():
            found = _read_header(path)
            if found is None:
                continue
            n = reusable_prefix(found[0]["tokens"], prompt_ids)
            if n > best_n:
                best, best_n = (path, *found), n
        if best is None or not self._read_into(*best, cache, best_n):
            return cache.reusable_prefix(prompt_ids)  # (a failed read leaves it empty)
        path, header, _ = best
        self._source = path, header["tokens"]
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used
        return best_n

    def _read_into(self, path: Path, header: dict, offset: int, cache: KVCache, n: int) -> bool:
        """Copy the first n positions of the file (header and data offset read) into cache."""
        pool = cache.pool
        try:
            rows = pool.row_shape
            if header["dtype"] != str(pool.k.dtype) or tuple(header["rows"]) != rows:
                return False
            shape = (2, pool.k.shape[0], len(header["tokens"]), *rows)
            data = np.memmap(path, dtype=pool.k.dtype, mode="r", offset=offset, shape=shape)
            cache.clear()
            cache.prepare(0, n)
            at = cache.positions(n)
            for layer in range(pool.k.shape[0]):
                pool.k[layer][at] = data[0, layer, :n]
                pool.v[layer][at] = data[1, layer, :n]
            del data
        except (OSError, ValueError, KeyError, TypeError) as e:
            _drop(path, e)
            cache.clear()
            return False
        cache.extend(header["tokens"][:n])
        return True

    def store(self, cache: KVCache) -> None:
        """Write the cache's positions to a file (replacing the one it was restored from,
        which it extends); a failure (a full disk) only loses the file."""
        tokens = list(cache.tokens)
        if len(tokens) < MIN_TOKENS or not self.usable(cache):
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:16]
        path = self.directory / f"{self.model}-{digest}.kv"
        if path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)
            return
        n = len(tokens)
        pool, at = cache.pool, cache.positions(n)
        header = {"tokens": tokens, "dtype": str(pool.k.dtype), "rows": list(pool.row_shape)}
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(temporary, "wb") as f:
                blob = json.dumps(header).encode()
                f.write(MAGIC + len(blob).to_bytes(8, "little") + blob)
                for layers in (pool.k, pool.v):
                    for layer in layers:
                        f.write(np.ascontiguousarray(layer[at]).data)
            os.replace(temporary, path)
        except (OSError, KeyboardInterrupt) as e:
            with contextlib.suppress(OSError):
                temporary.unlink()
            if isinstance(e, KeyboardInterrupt):
                raise
            log.debug("prompt cache not written: %s", e)
            return
        source, self._source = self._source, (path, tokens)
        if source is not None and source[0] != path and _extends(tokens, source[1]):
            with contextlib.suppress(OSError):
                source[0].unlink()
        self._evict()

    def _evict(self) -> None:
        """Remove the least recently used files (of any model) while the total is over the cap."""
        entries = []
        for p in self.directory.glob("*.kv"):
            with contextlib.suppress(OSError):
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= max_bytes():
                break
            with contextlib.suppress(OSError):
                p.unlink()
                total -= size


def _header(f) -> dict:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a prompt-cache file")
    size = int.from_bytes(f.read(8), "little")
    if not 0 < size < 1 << 28:
        raise ValueError("bad header size")
    header = json.loads(f.read(size))
    if not isinstance(header, dict) or not isinstance(header.get("tokens"), list):
        raise ValueError("bad header")
    return header


def _read_header(path: Path) -> tuple[dict, int] | None:
    """(header, offset of the K/V data), or None for a file that is not one (removed)."""
    try:
        with open(path, "rb") as f:
            return _header(f), f.tell()
    except (OSError, ValueError) as e:
        _drop(path, e)
        return None


def _drop(path: Path, why: Exception) -> None:
    log.debug("prompt cache %s unreadable (%s): removed", path.name, why)
    with contextlib.suppress(OSError):
        path.unlink()


def _extends(tokens: list[int], older: list[int]) -> bool:
    return len(older) <= len(tokens) and tokens[: len(older)] == older
