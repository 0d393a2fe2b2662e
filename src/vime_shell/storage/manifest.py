"""Checksums of a checkpoint's files, a dataset's fingerprint and a tokenizer's (torch-free,
stdlib only).

``write_manifest(dir)`` records the size and BLAKE2b-256 digest of every file under ``dir`` in
``dir/manifest.json``, written last (atomically), so a complete manifest means every file it
names was complete when it was written. ``verify_manifest(dir)`` re-reads every file and
raises ``ManifestError`` naming the first one that is missing, of another size, or of other
bytes (a flipped bit anywhere in a shard is found; the cost is one full read of the
checkpoint at BLAKE2b's single-core speed, once per node at launch).

``fingerprint(path)`` is a dataset's identity for resuming: its size, its mtime and the digest
of its first and last MiB (the whole file when it is under 2 MiB). ``dataset_changed(old,
new)`` says how a dataset changed: a different size or digest is a change; a different mtime
alone is one only when the file was not hashed whole (so a ``cp`` or ``touch`` of a small file
is not a change, and an edit in the middle of a large one is).

``tokenizer_fingerprint(model_dir)`` is a tokenizer's identity for reading a dump back: the
SHA-256 of the names and bytes of the model directory's tokenizer files (``TOKENIZER_FILES``),
so an edit of any of them, or another model's tokenizer at the same path, changes it.

Example: after ``write_manifest(ck)``, flipping one byte of ``ck/__0_0.distcp`` makes
``verify_manifest(ck)`` raise ``ManifestError: ck/__0_0.distcp: its BLAKE2b checksum differs
from the manifest's ...``.
"""

import hashlib
import json
import os
from pathlib import Path

from vime_pure.errors import VimeError
from vime_shell.storage.files import write_atomic

MANIFEST = "manifest.json"
_FORMAT = "vime.manifest"
_CHUNK = 1 << 20
_EDGE = 1 << 20  # the fingerprint hashes the first and the last MiB
# What transformers' tokenizers load from a model directory (fast, BPE, WordPiece, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model")


class ManifestError(VimeError):
    """A checkpoint file that is missing, truncated or changed since its manifest was written."""


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    """Every regular file under ``root``, relative, sorted; the manifest itself excluded."""
    out = []
    for folder, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), root)
            if rel != MANIFEST and os.path.isfile(os.path.join(root, rel)):
                out.append(rel)
    return sorted(out)


def write_manifest(root: str | os.PathLike) -> Path:
    """Hash every file under ``root`` into ``root/manifest.json`` (written last, atomically)."""
    root = Path(root)
    files = {rel: {"size": os.path.getsize(root / rel), "blake2b": file_digest(root / rel)}
             for rel in _files(root)}
    write_atomic(root / MANIFEST, json.dumps({"format": _FORMAT, "version": 1,
                                              "algorithm": "blake2b-256", "files": files},
                                             indent=1) + "\n")
    return root / MANIFEST


def read_manifest(root: str | os.PathLike) -> dict[str, dict] | None:
    """The manifest's ``{file: {"size", "blake2b"}}``; None when there is no manifest."""
    path = Path(root) / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        files = data["files"] if data.get("format") == _FORMAT else None
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int)
                and isinstance(v.get("blake2b"), str) for v in files.values()):
            raise ValueError("no {file: {size, blake2b}} table")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, KeyError,
            TypeError, RecursionError) as exc:
        raise ManifestError(f"{path}: is not a readable checkpoint manifest "
                            f"({type(exc).__name__}: {str(exc)[:80]}). Fix: restore the "
                            "checkpoint from a copy, or resume from an earlier one.") from None
    return files


def verify_manifest(root: str | os.PathLike) -> bool:
    """Check every file the manifest names; False when there is no manifest (a checkpoint
    written before manifests existed), ``ManifestError`` naming the first bad file."""
    root = Path(root)
    files = read_manifest(root)
    if files is None:
        return False
    for rel, want in sorted(files.items()):
        path = root / rel
        fix = "Fix: restore the checkpoint from a copy, or resume from an earlier one."
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ManifestError(f"{root / MANIFEST}: names {rel!r}, outside the checkpoint. {fix}")
        if not path.is_file():
            raise ManifestError(f"{path}: is missing from the checkpoint (its manifest lists "
                                f"it). {fix}")
        size = path.stat().st_size
        if size != want["size"]:
            raise ManifestError(f"{path}: holds {size} bytes, its manifest says "
                                f"{want['size']} (truncated or rewritten). {fix}")
        if file_digest(path) != want["blake2b"]:
            raise ManifestError(f"{path}: its BLAKE2b checksum differs from the manifest's: the "
                                f"file changed after it was written (bit rot, a partial copy, "
                                f"an edit). {fix}")
    return True


def fingerprint(path: str | os.PathLike) -> dict:
    """``{"size", "mtime_ns", "edges_blake2b", "whole"}`` of a dataset file (module docs)."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        h.update(fh.read(_EDGE))
        if st.st_size > 2 * _EDGE:
            fh.seek(st.st_size - _EDGE)
        h.update(fh.read(_EDGE))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edges_blake2b": h.hexdigest(),
            "whole": st.st_size <= 2 * _EDGE}


def dataset_changed(old: dict, new: dict) -> str | None:
    """How the dataset changed between two fingerprints, or None when it did not."""
    if old.get("size") != new["size"]:
        return f"its size changed from {old.get('size')} to {new['size']} bytes"
    if old.get("edges_blake2b") != new["edges_blake2b"]:
        return "its first or last MiB changed"
    if old.get("mtime_ns") != new["mtime_ns"] and not new["whole"]:
        return ("it was modified since (same size, same first and last MiB: the middle may "
                "differ)")
    return None


def tokenizer_fingerprint(model_dir: str | os.PathLike) -> str | None:
    """SHA-256 over the ``TOKENIZER_FILES`` present in ``model_dir`` (name, size, bytes, in
    that order); None when it holds none of them (or is gone)."""
    root = Path(model_dir)
    present = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    if not present:
        return None
    h = hashlib.sha256()
    for name in present:
        h.update(f"{name}|{(root / name).stat().st_size}|".encode())
        with open(root / name, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
