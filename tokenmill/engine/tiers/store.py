"""FileStore: KV blocks as files in one directory, shared by every process that opens the same directory.

The host tier is a FileStore on /dev/shm (tmpfs: shared memory, every tokenmill worker on the host reads
what any of them wrote); the disk tier is a FileStore on a local (or shared) filesystem.

One file per block, named by its key (hex). Layout (little-endian):
    header  magic b"TMKV" | version u16 | reserved u16 | key 16B | n_tokens u32 | payload_len u64 | checksum u32
    tokens  n_tokens x int64 (the block's token ids)
    payload payload_len bytes (the block's KV bytes, as ModelRunner.read_blocks returns them)
checksum = CRC-32 of key | tokens | payload (4 GB/s here vs 0.8 for blake2b: it guards against damage, not
an adversary; the key and tokens are compared exactly besides). A read verifies the exact size, magic, version, the full key
against the one asked for, the tokens against the request's, and the checksum: anything else is a miss
(counted as corrupt), never data.

Writes: temp file in the same directory -> (fsync if `fsync`) -> rename into place. A reader therefore sees
no file or a complete one; a crash leaves at most a temp file (removed at the next start-up) or, without
fsync, a renamed file whose data did not reach the disk, which the checksum turns into a miss.
fsync policy: off for the host tier (tmpfs has nothing to flush), on for the disk tier by default
(`kv_disk_fsync`), because without it a power loss can leave many zero-filled entries that each cost a
failed read before they are evicted.

Capacity: every put runs under an exclusive flock on `<dir>/.lock`, which also guards `<dir>/.usage` (the
bytes of all entries, shared by all processes). Before a file is written, room is made: when usage + size
would pass the cap, the directory is scanned (true usage) and the least recently used entries (mtime; a
read hit touches it) are deleted down to the low watermark. So the cap holds across processes and
restarts (start-up rescans). Deleting a file that another process already deleted is not an error.
Any OSError (ENOSPC, EACCES, EROFS, ...) in a put is counted and the put dropped; in a get it is a miss.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
import zlib
from array import array
from dataclasses import dataclass

from tokenmill.engine.tiers.keys import KEY_BYTES

MAGIC = b"TMKV"
VERSION = 1
HEADER = struct.Struct("<4sHH16sIQI")
SUFFIX = ".kv"


def _checksum(key: bytes, tokens: bytes, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(key)))


def encode_entry(key: bytes, token_ids, payload) -> bytes:
    toks = array("q", token_ids).tobytes()
    payload = memoryview(payload).cast("B")
    head = HEADER.pack(MAGIC, VERSION, 0, key, len(token_ids), len(payload), _checksum(key, toks, payload))
    return head + toks + payload


def decode_entry(data: bytes, key: bytes, token_ids, payload_len: int) -> bytes | None:
    """The payload if data is a complete, intact entry for exactly this key and tokens, else None."""
    n = len(token_ids)
    if len(data) != HEADER.size + 8 * n + payload_len:
        return None
    magic, version, _, k, nt, pl, csum = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or k != key or nt != n or pl != payload_len:
        return None
    toks = data[HEADER.size:HEADER.size + 8 * n]
    if toks != array("q", token_ids).tobytes():
        return None
    payload = data[HEADER.size + 8 * n:]
    if _checksum(key, toks, payload) != csum:
        return None
    return payload


@dataclass
class StoreStats:
    hits: int = 0  # blocks read back intact
    misses: int = 0  # lookups that found no (usable) entry
    corrupt: int = 0  # entries found but rejected (size, key, tokens, checksum)
    errors: int = 0  # I/O errors (read or write), each a miss or a dropped put
    stores: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0


class FileStore:
    def __init__(self, name: str, path: str, capacity_bytes: int, fsync: bool = False, low_watermark: float = 0.9):
        if capacity_bytes <= 0:
            raise ValueError(f"{name} tier: capacity must be > 0 bytes")
        self.name, self.path, self.capacity = name, os.path.abspath(path), int(capacity_bytes)
        self.fsync, self.low_watermark = fsync, low_watermark
        self.stats = StoreStats()
        self._tlock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._lock_fd: int | None = None
        os.makedirs(self.path, exist_ok=True)
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            try:
                self._lock_fd = os.open(os.path.join(self.path, ".lock"), flags, 0o666)
                break
            except OSError:
                continue
        try:
            with self._locked():
                self._cleanup_temp()
                self._write_usage(self._scan()[0])
        except OSError:
            self.count(errors=1)

    # -- paths and the shared usage counter ----------------------------------------------------
    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + SUFFIX)

    def _locked(self):
        store = self

        class _L:
            def __enter__(self):
                store._tlock.acquire()
                if store._lock_fd is None:
                    store._tlock.release()
                    raise PermissionError(errno.EACCES, f"{store.name} tier: no lock file in {store.path}")
                fcntl.flock(store._lock_fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.flock(store._lock_fd, fcntl.LOCK_UN)
                store._tlock.release()

        return _L()

    def _scan(self) -> tuple[int, list[tuple[float, int, str]]]:
        """(bytes of all entries, [(mtime, size, path)]) from the directory itself."""
        total, entries = 0, []
        with os.scandir(self.path) as it:
            for e in it:
                if not e.name.endswith(SUFFIX):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:  # deleted by another process meanwhile
                    continue
                total += st.st_size
                entries.append((st.st_mtime, st.st_size, e.path))
        return total, entries

    def _cleanup_temp(self) -> None:
        """Temp files are only written under the lock: one found while holding it is a crashed writer's."""
        with os.scandir(self.path) as it:
            for e in it:
                if e.name.startswith(".tmp-"):
                    _unlink(e.path)

    def _read_usage(self) -> int:
        try:
            with open(os.path.join(self.path, ".usage"), "rb") as f:
                return int(f.read() or b"0")
        except (OSError, ValueError):
            return self._scan()[0]

    def _write_usage(self, n: int) -> None:
        tmp = os.path.join(self.path, f".tmp-usage-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(str(max(0, n)).encode())
        os.replace(tmp, os.path.join(self.path, ".usage"))

    def usage(self) -> int:
        return self._scan()[0]

    def count(self, **deltas) -> None:
        """Add to the stats (the engine thread and the tier I/O threads all count here)."""
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    # -- the interface --------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return os.path.exists(self._file(key))

    def get(self, key: bytes, token_ids, payload_len: int) -> bytes | None:
        """The block's payload, or None (missing, corrupt, foreign, unreadable) — never wrong data."""
        t0 = time.perf_counter()
        path = self._file(key)
        try:
            with open(path, "rb") as f:  # an unlink by an evicting process after open leaves this read intact
                data = f.read(HEADER.size + 8 * len(token_ids) + payload_len + 1)
        except FileNotFoundError:
            self.count(misses=1)
            return None
        except OSError:
            self.count(errors=1, misses=1)
            return None
        payload = decode_entry(data, key, token_ids, payload_len)
        dt = time.perf_counter() - t0
        if payload is None:
            self.count(corrupt=1, misses=1)
            self._drop(path)
            return None
        try:
            _touch(path)  # LRU: a hit is a use
        except OSError:
            pass
        self.count(hits=1, bytes_read=len(data), load_seconds=dt)
        return payload

    def put(self, key: bytes, token_ids, payload) -> bool:
        """Store a block; False if it was not stored (already there, larger than the tier, I/O error)."""
        t0 = time.perf_counter()
        data = encode_entry(key, token_ids, payload)
        if len(data) > self.capacity:
            return False
        path = self._file(key)
        tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{threading.get_ident()}-{key.hex()}")
        try:
            with self._locked():
                if os.path.exists(path):
                    return False
                usage = self._read_usage()
                if usage + len(data) > self.capacity:
                    usage = self._evict(len(data))
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        if self.fsync:
                            f.flush()
                            os.fsync(f.fileno())
                    _touch(tmp)
                    os.rename(tmp, path)
                except BaseException:
                    _unlink(tmp)
                    raise
                self._write_usage(usage + len(data))
        except OSError:
            self.count(errors=1)
            return False
        self.count(stores=1, bytes_written=len(data), store_seconds=time.perf_counter() - t0)
        return True

    def _evict(self, incoming: int) -> int:
        """Under the lock: delete least recently used entries until usage + incoming <= low watermark."""
        total, entries = self._scan()
        target = min(self.capacity * self.low_watermark, self.capacity - incoming)
        entries.sort()
        for _, size, p in entries:
            if total + incoming <= target:
                break
            if _unlink(p):
                self.count(evictions=1)
            total -= size
        return total

    def _drop(self, path: str) -> None:
        """Remove a rejected entry (so it is not read again), keeping the usage counter honest."""
        try:
            with self._locked():
                try:
                    size = os.stat(path).st_size
                except FileNotFoundError:
                    return
                if _unlink(path):
                    self._write_usage(self._read_usage() - size)
        except OSError:
            pass

    def clear(self) -> None:
        with self._locked():
            for _, _, p in self._scan()[1]:
                _unlink(p)
            self._write_usage(0)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _touch(path: str) -> None:
    """mtime = now at ns resolution (the kernel's own stamps are tick-coarse: many entries would tie)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:  # already evicted by another process
        return False
    except OSError:
        return False
