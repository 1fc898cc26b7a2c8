"""The disk tier: one file per block under DIR/<namespace>/<xx>/<hash>.kvb, shareable by several
processes (servers, data-parallel replicas) pointed at one directory.

A file is a fixed header, then the block's bytes::

    magic "KVSB" | format version u16 | check kind u16 | namespace 32 B | block hash 32 B
    | payload length u64 | check 32 B | payload

The check is a CRC-32 of the payload (kind 0, the default), or with a key (`--kv-offloading-disk-key`)
an HMAC-SHA256 of the header before it and the payload (kind 1).

A file is written under a temporary name in its final directory and renamed into place
(`os.replace` is atomic), so a reader, or a process killed mid-write, never sees a partial
file under a block's name; concurrent writers of one block write identical bytes. A file that
fails any check (short, wrong magic/version/namespace/hash/length/checksum) is a miss with a
warning, and is removed; one that cannot be read now (an I/O error) is a miss and stays. The
size bound is enforced by whichever process crosses it: it scans the directory and removes the
least recently used files (mtime; a hit touches its file) down to 90% of the bound; a reader
whose file vanishes meanwhile just misses. Files are 0600 and directories 0700: they hold
tenants' KV. A write that finds the file system full (ENOSPC, EDQUOT) lowers the bound to 90% of
what the directory holds and evicts down to it, as at the bound, then tries once more; a write
failing otherwise (EROFS, EACCES, any OSError), or still full, stops further writes with one
warning; reads go on.

The directory is a trust boundary: whoever can write it chooses what a prefix hit loads. So the
tier refuses a root owned by another user and makes a group- or world-writable one 0700 (one
warning; ssh's rule for ~/.ssh); it works through file descriptors of its own namespace
directory, opened once without following links, so a directory swapped for a symbolic link later
neither redirects writes nor escapes the size bound; block files are opened with O_NOFOLLOW and
O_NONBLOCK and read only if fstat says they are regular files of the right size (a FIFO or a link
planted in place of a block is a miss, not a hang or a read of another file); and the scan that
enforces the bound counts regular files only (lstat). CRC-32 catches accidents, not a writer who
recomputes it: where someone else may write the directory (shared or network storage), a key
(`load_key`: 32 random bytes in a 0600 file of this user, beside the tier or elsewhere) makes every
block carry an HMAC-SHA256 tag that cannot be forged without it (RFC 2104). It covers the header
too, so a valid file copied under another block's name fails as well. With a key the namespace
directory's name carries a digest of it (`directory_name`): servers with no key or another key
sharing the root write to directories of their own.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch

from kvserve.cache.tiers.block_store import BlockStore

logger = logging.getLogger("kvserve")

MAGIC = b"KVSB"
FORMAT_VERSION = 3  # 1: a blake2b-128 checksum; 2: a CRC-32 field of 4 bytes
HEADER = struct.Struct("<4sHH32s32sQ32s")
CHECKED = HEADER.size - 32  # the header bytes an HMAC tag covers (all but the check itself)
CRC32, HMAC_SHA256 = 0, 1  # check kinds
KEY_BYTES = 32
AUTO_KEY = "auto"  # --kv-offloading-disk-key auto: the key file in the tier's directory
KEY_FILE = ".kvserve-block-key"
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died
EVICT_TO = 0.9  # fraction of the bound the size-limit eviction leaves used


def checksum(payload: bytes | memoryview) -> int:
    """CRC-32 (zlib): it catches the torn, truncated and bit-flipped files a disk or a killed writer
    leaves, and zlib releases the GIL on large buffers, so the engine thread runs meanwhile. The
    files are not a trust boundary (0600 in a 0700 directory; the header names the model and the
    block), so a cryptographic hash buys nothing; blake2b-128 (format version 1) took most of a
    read's time (BENCHMARKS.md, "Disk-tier reads: a CRC-32 per block")."""
    return zlib.crc32(payload)


def tag(key: bytes, header: bytes, payload: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of a block file's header (less its check field) and payload. hashlib releases the
    GIL over large buffers, as zlib does; SHA-256 is hardware-accelerated on current x86 and Arm."""
    mac = hmac.new(key, header[:CHECKED], hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def key_path(root: str | os.PathLike, setting: str) -> Path:
    """Where the key for `--kv-offloading-disk-key setting` lives."""
    return Path(root).expanduser() / KEY_FILE if setting == AUTO_KEY else Path(setting).expanduser()


def load_key(path: str | os.PathLike) -> bytes:
    """The key in `path`, created (32 random bytes, 0600) if absent. ValueError with one line if it is
    not a regular file of this user that only this user can read, or is shorter than 16 bytes."""
    path = Path(path)
    try:
        try:
            fd = os.open(path, _CREATE_FLAGS, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
        except FileExistsError:
            pass
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
                       else f"belongs to uid {st.st_uid}, not to this user" if hasattr(os, "geteuid") and st.st_uid != os.geteuid()
                       else f"can be read or written by other users (mode {stat.S_IMODE(st.st_mode):o}; make it 0600)"
                       if st.st_mode & 0o077 else None)
            key = f.read(4096) if problem is None else b""
    except OSError as exc:
        raise ValueError(f"--kv-offloading-disk-key: cannot use {str(path)!r}: {exc.strerror or exc}") from None
    if problem is None and len(key) < 16:
        problem = f"holds {len(key)} bytes; a key is at least 16"
    if problem is not None:
        raise ValueError(f"--kv-offloading-disk-key: {str(path)!r} {problem}")
    return key


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# A block file: never through a link, and never waiting on a FIFO or device planted in its place.
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC


def _secure(directory: Path) -> None:
    """Refuse a directory another user owns; make a group- or world-writable one of ours 0700."""
    st = directory.stat()
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise ValueError(f"--kv-offloading-disk-path: {str(directory)!r} belongs to uid {st.st_uid}, not to this "
                         f"user (uid {os.geteuid()}): whoever controls it chooses what a prefix hit loads")
    if st.st_mode & 0o022:
        os.chmod(directory, 0o700)
        logger.warning("KV disk tier: %s was writable by other users (mode %o); made 0700", directory,
                       stat.S_IMODE(st.st_mode))


def check_directory(root: str | os.PathLike) -> None:
    """Create the tier's directory (0700) if needed, secure it (`_secure`) and check that a file can
    be written in it; ValueError with one line otherwise. Runs at start-up, before the weights load."""
    root = Path(root).expanduser()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _secure(root)
        fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX, dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"--kv-offloading-disk-path {str(root)!r} is not a usable directory: "
                         f"{exc.strerror or exc}") from None


def directory_name(namespace: bytes, key: bytes | None) -> str:
    """The namespace's directory: its hex, and with a key a digest of the key too, so servers
    sharing a root with no key or another key keep apart instead of refusing (and removing) each
    other's files. The digest says nothing of the key."""
    if key is None:
        return namespace.hex()
    key_id = hashlib.sha256(b"kvserve disk tier key id\0" + key).digest()
    return hashlib.sha256(namespace + key_id).hexdigest()


class DiskTier(BlockStore):
    name = "disk"

    def __init__(self, root: str | os.PathLike, namespace: bytes, capacity_bytes: int, block_nbytes: int,
                 key: bytes | None = None):
        """`key`: authenticate blocks with HMAC-SHA256 under it (None: CRC-32). Raises ValueError (one
        line) if the directory cannot be created or written."""
        if len(namespace) != 32:
            raise ValueError("the disk tier's namespace is a 32-byte digest")
        self.key = key
        self.root = Path(root).expanduser()
        self.namespace = namespace
        self.dir = self.root / directory_name(namespace, key)
        self.max_bytes = capacity_bytes
        self.block_nbytes = block_nbytes
        self.file_nbytes = HEADER.size + block_nbytes
        self.disabled: str | None = None  # why writes stopped
        self.num_writes = 0
        self.num_bad_files = 0
        self.num_evicted_files = 0
        self._lock = threading.Lock()
        check_directory(self.root)
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            # every read and write goes through this descriptor: a link put in the directory's
            # place later is never followed
            self._dir_fd = os.open(self.dir, _DIR_FLAGS)
            _secure(self.dir)
        except OSError as exc:
            why = "is a symbolic link" if self.dir.is_symlink() else (exc.strerror or exc)
            raise ValueError(f"--kv-offloading-disk-path {str(root)!r}: {self.dir} {why}") from None
        self._used = self._scan()[1]

    # ------------------------------------------------------------------ paths and scanning
    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        """(mtime, size, path) of every block file under the root (all namespaces: the bound is the
        directory's), and their total size; removes stale temporary files on the way."""
        files, total, now = [], 0, time.time()
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue  # removed meanwhile by another process
                if not stat.S_ISREG(st.st_mode):
                    continue  # a link or a FIFO is not a block this tier wrote
                if name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        _unlink(path)
                    else:
                        total += st.st_size
                elif name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, path))
                    total += st.st_size
        return files, total

    def _enforce_bound(self) -> None:
        files, total = self._scan()
        if total > self.max_bytes:
            target = self.max_bytes * EVICT_TO
            for _, size, path in sorted(files):
                if total <= target:
                    break
                if _unlink(path):
                    self.num_evicted_files += 1
                    if os.path.dirname(os.path.dirname(path)) == str(self.dir):  # ours, not another namespace's
                        self._removed(bytes.fromhex(os.path.basename(path)[:-len(SUFFIX)]))
                total -= size
        self._used = total

    # ------------------------------------------------------------------ BlockStore
    def contains(self, block_hash: bytes) -> bool:
        return self.path(block_hash).exists()

    def _open_block(self, block_hash: bytes) -> int | str | None:
        """The block file's descriptor, opened through our directory descriptor without following
        links; None when absent; why, when something that is no block file sits there (it is
        removed). Raises OSError when it cannot be opened now (EIO, EMFILE, ESTALE, ...): a miss
        that keeps the file."""
        name = block_hash.hex()
        try:
            sub = os.open(name[:2], _DIR_FLAGS, dir_fd=self._dir_fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                return f"sits in {name[:2]}, which is not a directory"
            raise
        try:
            fd = os.open(name + SUFFIX, _READ_FLAGS, dir_fd=sub)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                return "is a symbolic link or not a regular file"
            raise
        finally:
            os.close(sub)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.file_nbytes:
            os.close(fd)
            return "is not a regular file" if not stat.S_ISREG(st.st_mode) else "has the wrong length"
        return fd

    def get(self, block_hash: bytes, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The block's bytes, read into `out` (a 1-D uint8 CPU tensor of block_nbytes) when given.
        None for a miss: absent, bad (removed), or unreadable now (an I/O error: the file stays)."""
        path = self.path(block_hash)
        if out is None:
            out = torch.empty(self.block_nbytes, dtype=torch.uint8)
        payload = memoryview(out.numpy())
        header, got, extra = b"", 0, 0
        try:
            opened = self._open_block(block_hash)
            if isinstance(opened, int):
                with os.fdopen(opened, "rb") as f:
                    header = f.read(HEADER.size)
                    got = f.readinto(payload) if len(header) == HEADER.size else 0
                    extra = len(f.read(1))
                    try:
                        os.utime(f.fileno())  # least recently used goes first
                    except OSError:
                        pass  # (a read-only mount) the block is still good
        except OSError as exc:
            logger.debug("KV disk tier: cannot read %s now (%s); a miss", path, exc.strerror or exc)
            return None
        if opened is None:
            self._removed(block_hash)  # absent (perhaps removed by another process sharing the directory)
            return None
        problem = opened if isinstance(opened, str) else self._check(header, got, extra, payload, block_hash)
        if problem is not None:
            self.num_bad_files += 1
            logger.warning("KV disk tier: %s %s; treated as a miss and removed", path, problem)
            self._unlink_block(block_hash)
            self._removed(block_hash)
            return None
        return out

    def _unlink_block(self, block_hash: bytes) -> None:
        """Remove whatever sits at the block's name (a link itself, never its target)."""
        name = block_hash.hex()
        try:
            sub = os.open(name[:2], _DIR_FLAGS, dir_fd=self._dir_fd)
        except OSError:
            return
        try:
            os.unlink(name + SUFFIX, dir_fd=sub)
        except OSError:
            pass
        finally:
            os.close(sub)

    def _check(self, header: bytes, got: int, extra: int, payload: memoryview, block_hash: bytes) -> str | None:
        if len(header) < HEADER.size:
            return "is truncated"
        magic, version, kind, namespace, stored_hash, length, check = HEADER.unpack(header)
        if magic != MAGIC:
            return "is not a kvserve block file"
        if version != FORMAT_VERSION:
            return f"has format version {version}, not {FORMAT_VERSION}"
        if namespace != self.namespace or stored_hash != block_hash:
            return "belongs to another model, KV layout or block"
        if length != self.block_nbytes or got != length or extra:
            return "is truncated or has the wrong length"
        if self.key is not None:
            if kind != HMAC_SHA256:
                return "carries no authentication tag (written without --kv-offloading-disk-key)"
            if not hmac.compare_digest(tag(self.key, header, payload), check):
                return "fails its authentication tag (forged, or written under another key)"
            return None
        if kind != CRC32:
            return "carries an authentication tag this server has no key for (--kv-offloading-disk-key)"
        if checksum(payload) != int.from_bytes(check[:4], "little"):
            return "fails its checksum"
        return None

    def _header(self, block_hash: bytes, payload: memoryview) -> bytes:
        if self.key is None:
            return HEADER.pack(MAGIC, FORMAT_VERSION, CRC32, self.namespace, block_hash, len(payload),
                               checksum(payload).to_bytes(4, "little"))
        unchecked = HEADER.pack(MAGIC, FORMAT_VERSION, HMAC_SHA256, self.namespace, block_hash, len(payload), b"")
        return unchecked[:CHECKED] + tag(self.key, unchecked, payload)

    def put(self, block_hash: bytes, data: torch.Tensor) -> bool:
        """Write one block (a CPU uint8 tensor); called by the background writer. False when not
        written (writes stopped)."""
        if self.disabled is not None:
            return False
        if data.numel() != self.block_nbytes:
            raise ValueError(f"a block is {self.block_nbytes} bytes, got {data.numel()}")
        payload = memoryview(data.contiguous().numpy())
        header = self._header(block_hash, payload)
        try:
            try:
                self._write_file(block_hash.hex(), header, payload)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._make_room():
                    raise
                self._write_file(block_hash.hex(), header, payload)  # once more, with room made
        except OSError as exc:
            self.disable(f"{exc.strerror or exc} ({self.path(block_hash).parent})")
            return False
        self.num_writes += 1
        self._stored(block_hash)
        with self._lock:
            self._used += self.file_nbytes
            if self._used > self.max_bytes:
                self._enforce_bound()
        return True

    def _write_file(self, name: str, header: bytes, payload: memoryview) -> None:
        """The block file `name`, written under a temporary name and renamed into place; OSError
        (with the temporary file removed) when it cannot be."""
        tmp, sub = None, None
        try:
            try:
                os.mkdir(name[:2], 0o700, dir_fd=self._dir_fd)
            except FileExistsError:
                pass
            sub = os.open(name[:2], _DIR_FLAGS, dir_fd=self._dir_fd)
            tmp = f"{TMP_PREFIX}{secrets.token_hex(8)}"
            fd = _create_file(tmp, sub)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, name + SUFFIX, src_dir_fd=sub, dst_dir_fd=sub)
            tmp = None
        finally:
            if tmp is not None and sub is not None:
                try:
                    os.unlink(tmp, dir_fd=sub)
                except OSError:
                    pass
            if sub is not None:
                os.close(sub)

    def _make_room(self) -> bool:
        """The file system is full before the bound is: the bound comes down to 90% of what the
        directory holds now (what fits, as far as anyone can tell), and the least recently used
        files go down to 90% of that, as at the bound. False when there is nothing to remove."""
        with self._lock:
            files, total = self._scan()
            if not files:
                return False
            lowered = max(self.file_nbytes, int(total * EVICT_TO))
            logger.warning("KV disk tier: the file system is full at %.2f GiB of blocks: the tier's bound "
                           "lowered from %.2f to %.2f GiB", total / 2 ** 30, self.max_bytes / 2 ** 30,
                           lowered / 2 ** 30)
            self.max_bytes = lowered
            self._enforce_bound()
            return self._used < total

    def held_hashes(self) -> list[bytes]:
        """The blocks of this namespace on disk now (written by any process sharing the directory)."""
        out = []
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            for entry in sub.iterdir() if sub.is_dir() else ():
                name = entry.name
                if name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX):
                    try:
                        out.append(bytes.fromhex(name[:64]))
                    except ValueError:
                        continue
        return out

    def close(self) -> None:
        """Let go of the namespace directory's descriptor."""
        if getattr(self, "_dir_fd", None) is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def disable(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            logger.warning("KV disk tier: writes stopped: %s; serving goes on (blocks already on disk "
                           "are still read)", reason)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self.max_bytes


def _create_file(name: str, dir_fd: int) -> int:
    """A new 0600 file `name` in the directory `dir_fd`, never through a link."""
    return os.open(name, _CREATE_FLAGS, 0o600, dir_fd=dir_fd)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
