"""Rollout dumps: save a ``RolloutBatch`` to one file and load it back, exactly, or fail loudly.

Format (version 2): an uncompressed zip holding ``header.json`` and one ``<column>.npy`` per
``RolloutBatch`` column, i.e. a numpy ``.npz`` archive. Why this and not Parquet: the batch is
already columnar numpy, so every column is stored byte-for-byte as in memory (exact round trip,
no list<int> re-encoding of 64k ragged rows) and vime needs no new dependency; yet common tools
read it: ``np.load(path)["tokens"]``, ``np.load(path)["header.json"]`` (raw JSON bytes), any zip
tool, and pandas via ``pd.DataFrame({k: d[k] for k in per_sample_columns})``.

``header.json``: ``{"format": "vime.rollout_batch", "version": 2, "num_samples": n,
"columns": {name: {"dtype": "<i4", "shape": [t]}}, "group_id_values": [...],
"prompt_group_values": [...], "sha256": hex}``. The checksum covers the header (without the
checksum) and every column's name, dtype, shape and bytes. An optional column
(``OPTIONAL_COLUMNS``: ``rollout_log_probs``, ``rollout_routed_experts`` as a 2-D int16
``[t, layers * topk]``, ``teacher_log_probs``, ``opd_reverse_kl``) is absent when the batch has
none, and a dump without it loads it as None. An optional ``"annotations"`` list holds one JSON object per sample
(``label``, ``metadata``: what a person needs to read a reward, ``vime inspect``); an optional
``"tokenizer"`` object, ``{"path": model directory, "sha256": tokenizer_fingerprint}``, names
the tokenizer whose ids the dump holds (``vime train`` records its model's, so ``vime inspect``
decodes with it). Readers that do not know these keys ignore them, so they need no new version.

A dump of parts (``--save-rollout-data`` where engine leaders keep their parts): each holder
writes its part as a batch file of its own, ``<stem>.rank<member><suffix>`` (``part_path``;
its ids numbered over its own chunks, its annotations and tokenizer as above), and trainer
rank 0 writes ``<stem><suffix>``, an index of format ``vime.rollout_parts`` version 1: the
same zip layout, columns ``INDEX_COLUMNS`` (the planned dense group and prompt ids,
advantages, lengths, rewards: metadata only) and in the header the id values and ``parts``,
``[{"file": name, "starts": [first prompt per chunk], "sizes": [samples per chunk]}]``.
``load_rollout_batch`` of the index joins the parts in global prompt order with the index's
ids and advantages: the batch the run trained; a missing part, or one whose samples differ
from the index's (another run's file), raises ``DumpFormatError`` naming it.

Versions: 2 added the per-sample ``weight_version_min`` / ``weight_version_max`` columns
(``vime_pure.data.batch``). A version-1 dump (without them) still loads, every sample on
policy (``ON_POLICY_VERSION``); dumps are always written as version 2.

Guarantees the tests assert: ``load(save(b))`` reproduces every column (dtype and bytes) and
id; writes are atomic (temp file in the same directory, fsync, ``os.replace``), so a crash
leaves the old file or none; a truncated, corrupt, foreign or other-version file, or one that
holds an invalid batch, raises ``DumpFormatError`` and nothing is returned half-loaded.

Example::

    save_rollout_batch("step_0007.npz", batch)
    lengths, group_ids = workload_from_dump("step_0007.npz")  # what `vime schedule` needs
"""

import hashlib
import io
import json
import math
import os
import zipfile
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vime_pure.data.batch import COLUMNS, OPTIONAL_COLUMNS, RolloutBatch
from vime_pure.data.held_parts import PlannedIds, chunk_rows, join_parts
from vime_pure.errors import DumpFormatError, VimeError
from vime_shell.storage.files import FileKindError, atomic_file, require_regular_file
from vime_shell.storage.manifest import tokenizer_fingerprint

FORMAT = "vime.rollout_batch"
VERSION = 2
VERSION_COLUMNS = ("weight_version_min", "weight_version_max")  # added in version 2
# The columns of each readable version; a dump omits the OPTIONAL_COLUMNS the batch lacks.
COLUMNS_OF: dict[int, tuple[str, ...]] = {
    1: tuple(c for c in COLUMNS if c not in (*VERSION_COLUMNS, "rollout_routed_experts",
                                             "teacher_log_probs", "opd_reverse_kl")),
    2: tuple(COLUMNS)}
# A dump of parts (``--save-rollout-data`` where engine leaders keep their parts): every
# holder writes its part as a batch file beside the index, which trainer rank 0 writes.
PARTS_FORMAT = "vime.rollout_parts"
PARTS_VERSIONS = (1,)
# What the index holds per sample: the planned ids and advantages, which the parts' own
# (numbered over one holder) are not, and the lengths and rewards each part must match.
INDEX_COLUMNS: dict[str, np.dtype] = {
    "group_ids": np.dtype(np.int32), "prompt_groups": np.dtype(np.int32),
    "advantages": np.dtype(np.float64), "lengths": np.dtype(np.int32),
    "rewards": np.dtype(np.float64)}
HEADER = "header.json"
MAX_HEADER_BYTES = 64 << 20  # header.json: column specs and group ids, far below this
MAX_NPY_HEADER_BYTES = 1 << 16  # numpy's .npy header is under 4 KiB in practice


def save_rollout_batch(path: str | os.PathLike, batch: RolloutBatch,
                       annotations: Sequence[Mapping[str, Any]] | None = None,
                       tokenizer: Mapping[str, Any] | None = None) -> Path:
    """Write ``batch`` to ``path`` atomically; returns the path. ``annotations``: one mapping
    per sample (label, metadata), stored as JSON in the header (values JSON cannot hold are
    written as their ``repr``); ``tokenizer``: :func:`tokenizer_record` of the model whose
    tokenizer produced the ids."""
    if not isinstance(batch, RolloutBatch):
        raise DumpFormatError(f"batch is a {type(batch).__name__}. Fix: pass a RolloutBatch.")
    if annotations is not None and len(annotations) != batch.num_samples:
        raise DumpFormatError(f"annotations has {len(annotations)} entries for "
                              f"{batch.num_samples} samples. Fix: pass one per sample.")
    columns = {k: v for k, v in batch.columns().items() if v is not None}
    return write_dump_columns(path, columns, batch.group_id_values, batch.prompt_group_values,
                              annotations=annotations, tokenizer=tokenizer)


def tokenizer_record(model_dir: str | os.PathLike) -> dict[str, str | None]:
    """What a dump records of the tokenizer that wrote its ids: the model directory (absolute)
    and its :func:`tokenizer_fingerprint`. Example: ``{"path": "/models/qwen3-4b", "sha256":
    "9f2c..."}``."""
    return {"path": str(Path(model_dir).expanduser().resolve()),
            "sha256": tokenizer_fingerprint(model_dir)}


def read_dump_header(path: str | os.PathLike) -> dict[str, Any]:
    """A dump's ``header.json`` (its optional ``annotations`` and ``tokenizer`` included),
    after the dump is validated; a dump of parts gives its index's header with the parts'
    annotations in the batch's order."""
    return load_dump(path)[1]


def read_dump_annotations(path: str | os.PathLike) -> list[dict[str, Any]] | None:
    """The per-sample annotations of a dump (None when it was written without them)."""
    return read_dump_header(path).get("annotations")


def write_dump_columns(path: str | os.PathLike, columns: Mapping[str, np.ndarray],
                       group_id_values: tuple[Hashable, ...],
                       prompt_group_values: tuple[Hashable, ...],
                       annotations: Sequence[Mapping[str, Any]] | None = None,
                       tokenizer: Mapping[str, Any] | None = None) -> Path:
    """Write raw columns in the dump format, unvalidated (``load_rollout_batch`` validates).

    For tools that produce dumps from other sources; ``save_rollout_batch`` is the usual entry.
    """
    extra: dict[str, Any] = {}
    if annotations is not None:  # plain JSON (a round trip turns tuples and numpy into lists)
        extra["annotations"] = json.loads(json.dumps(list(annotations), default=repr))
    return _write_archive(Path(path), FORMAT, VERSION, columns, group_id_values,
                          prompt_group_values, extra, tokenizer)


def _write_archive(target: Path, fmt: str, version: int, columns: Mapping[str, np.ndarray],
                   group_id_values: Sequence[Hashable], prompt_group_values: Sequence[Hashable],
                   extra: Mapping[str, Any], tokenizer: Mapping[str, Any] | None) -> Path:
    """One dump archive (a batch or an index of parts): the header, checksummed, then one
    ``.npy`` per column, written atomically."""
    arrays = {name: np.ascontiguousarray(col) for name, col in columns.items()}
    header: dict[str, Any] = {
        "format": fmt, "version": version,
        "num_samples": int(len(arrays["lengths"])) if "lengths" in arrays else 0,
        "columns": {k: {"dtype": a.dtype.str, "shape": list(a.shape)} for k, a in arrays.items()},
        "group_id_values": list(group_id_values),
        "prompt_group_values": list(prompt_group_values), **extra}
    if tokenizer is not None:
        header["tokenizer"] = {"path": str(tokenizer["path"]), "sha256": tokenizer["sha256"]}
    header["sha256"] = _digest(header, arrays)
    with atomic_file(target) as fh:
        with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED) as zf:
            zf.writestr(HEADER, json.dumps(header, indent=1).encode())
            for name, arr in arrays.items():
                with zf.open(f"{name}.npy", "w", force_zip64=arr.nbytes > 1 << 30) as member:
                    np.lib.format.write_array(member, arr, allow_pickle=False)
    return target


def load_rollout_batch(path: str | os.PathLike) -> RolloutBatch:
    """Read a dump written by ``save_rollout_batch`` (or a dump of parts, joined); a
    ``DumpFormatError`` for anything wrong (missing, truncated, bit-flipped, foreign, pickled:
    ``allow_pickle=False`` everywhere)."""
    return load_dump(path)[0]


def load_dump(path: str | os.PathLike) -> tuple[RolloutBatch, dict[str, Any]]:
    """``(batch, header)`` of a dump: one batch file, or the index of a dump of parts with its
    part files joined in prompt order (:func:`join_dump_parts`)."""
    where = Path(path)
    header, arrays = read_archive(where, (FORMAT, PARTS_FORMAT))
    if header["format"] == PARTS_FORMAT:
        return join_dump_parts(where, header, arrays)
    return batch_of_archive(where, header, arrays), header


def read_archive(where: Path, formats: tuple[str, ...] = (FORMAT,)
                 ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The validated header and columns of a dump archive of one of ``formats``."""
    if not where.exists():
        raise DumpFormatError(f"{where}: no such rollout dump. Fix: check the path, or write "
                              "it with --save-rollout-data / save_rollout_batch.")
    try:
        require_regular_file(where, "rollout dump")  # a FIFO would block the reader forever
    except FileKindError as exc:
        raise DumpFormatError(str(exc)) from None
    try:
        with zipfile.ZipFile(where) as zf:
            header = _read_header(zf, where, formats)
            arrays = {name: _read_column(zf, name, spec, where)
                      for name, spec in header["columns"].items()}
        digest = _digest(header, arrays)
    except DumpFormatError:
        raise
    except Exception as exc:  # zip, npy and JSON parsers fail in many ways on corrupt bytes
        raise DumpFormatError(
            f"{where}: cannot read the rollout dump ({type(exc).__name__}: {exc}); it is "
            "truncated, corrupt or not a vime dump. Fix: re-save it with save_rollout_batch, "
            "or restore it from a copy.") from None
    if digest != header.get("sha256"):
        raise DumpFormatError(f"{where}: checksum mismatch: the file's contents changed after "
                              "it was written. Fix: restore the dump from a copy.")
    return header, arrays


def batch_of_archive(where: Path, header: dict[str, Any], arrays: dict[str, np.ndarray]
                     ) -> RolloutBatch:
    """The ``RolloutBatch`` of a validated batch archive (``read_archive``)."""
    expected = set(COLUMNS_OF[header["version"]])
    if not set(arrays) <= expected or not expected - set(OPTIONAL_COLUMNS) <= set(arrays):
        raise DumpFormatError(f"{where}: columns {sorted(arrays)} do not match the version "
                              f"{header['version']} set {sorted(expected)}. Fix: write it "
                              "with save_rollout_batch.")
    # A column an older version lacks takes the batch's default (versions: on policy). Any:
    # keyword arguments of RolloutBatch, arrays and None for an optional column not recorded.
    columns: dict[str, Any] = {name: arrays[name] for name in COLUMNS if name in arrays}
    for name in OPTIONAL_COLUMNS:
        columns.setdefault(name, None)
    ids = tuple(header["group_id_values"]), tuple(header["prompt_group_values"])
    try:
        return RolloutBatch(**columns, group_id_values=ids[0], prompt_group_values=ids[1])
    except VimeError as exc:
        raise DumpFormatError(f"{where}: the file is intact but holds an invalid batch: {exc}"
                              ) from exc


def part_path(index: str | os.PathLike, member: int) -> Path:
    """The part file exchange member ``member`` writes beside the ``index`` of a dump of
    parts. Example: ``part_path("d/rollout_3.npz", 1) == Path("d/rollout_3.rank1.npz")``."""
    where = Path(index)
    return where.with_name(f"{where.stem}.rank{member}{where.suffix}")


def save_parts_index(path: str | os.PathLike, meta: Any,
                     holders: Sequence[tuple[int, Sequence[int], Sequence[int]]],
                     tokenizer: Mapping[str, Any] | None = None) -> Path:
    """Write the index of a dump of parts atomically: the planned ``meta`` (a ``BatchMeta``
    after ``plan_shares``: ids, advantages, lengths, rewards) and, per holder ``(exchange
    member, its chunks' first prompts, their samples)`` in its part's order, the part file it
    writes (:func:`part_path`). Metadata only: no token passes through the writer."""
    target = Path(path)
    columns = {name: np.asarray(getattr(meta, name)).astype(dtype)
               for name, dtype in INDEX_COLUMNS.items()}
    parts = [{"file": part_path(target, member).name, "starts": [int(x) for x in starts],
              "sizes": [int(x) for x in sizes]} for member, starts, sizes in holders]
    return _write_archive(target, PARTS_FORMAT, PARTS_VERSIONS[-1], columns,
                          meta.group_id_values, meta.prompt_group_values, {"parts": parts},
                          tokenizer)


def join_dump_parts(where: Path, header: dict[str, Any], arrays: dict[str, np.ndarray]
                    ) -> tuple[RolloutBatch, dict[str, Any]]:
    """The batch of a dump of parts: every part file the index names, joined in global
    prompt order with the index's ids and advantages, and checked against its lengths and
    rewards (a part left by another run, or not yet written, is named); the header carries
    the parts' annotations in the batch's order when every part has them."""
    if set(arrays) != set(INDEX_COLUMNS) or not isinstance(header.get("parts"), list):
        raise DumpFormatError(f"{where}: an index of parts needs the columns "
                              f"{sorted(INDEX_COLUMNS)} and a parts list. Fix: restore it "
                              "from a copy.")
    parts, notes, chunks = [], [], []
    for entry in header["parts"]:
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or Path(name).name != name:
            raise DumpFormatError(f"{where}: part entry {entry!r} does not name a file beside "
                                  "the index. Fix: restore the index from a copy.")
        file = where.with_name(name)
        if not file.exists():
            raise DumpFormatError(f"{where}: its part {file} is missing (the holder that writes "
                                  "it failed or has not finished). Fix: copy the index with "
                                  f"every {where.stem}.rank*{where.suffix} beside it.")
        part_header, part_arrays = read_archive(file)
        part = batch_of_archive(file, part_header, part_arrays)
        pairs = list(zip(entry["starts"], entry["sizes"]))
        if part.num_samples != sum(n for _, n in pairs):
            raise _stale(where, file, f"{part.num_samples} samples, the index "
                                      f"{sum(n for _, n in pairs)}")
        parts.append(part)
        notes.append(part_header.get("annotations"))
        chunks.append(pairs)
    rows = chunk_rows(chunks)
    ids = PlannedIds(group_ids=arrays["group_ids"], group_id_values=tuple(
        header["group_id_values"]), prompt_groups=arrays["prompt_groups"],
        prompt_group_values=tuple(header["prompt_group_values"]),
        advantages=arrays["advantages"])
    try:
        batch = join_parts(parts, ids, rows=rows)
    except VimeError as exc:
        raise DumpFormatError(f"{where}: its parts do not join into a batch: {exc}") from exc
    for name in ("lengths", "rewards"):
        if not np.array_equal(getattr(batch, name), arrays[name]):
            raise _stale(where, None, f"different {name} from the index's")
    joined = dict(header)
    if notes and all(n is not None for n in notes):
        flat = [a for n in notes for a in (n or ())]
        joined["annotations"] = [flat[i] for i in rows.tolist()]
    return batch, joined


def _stale(where: Path, file: Path | None, what: str) -> DumpFormatError:
    return DumpFormatError(f"{where}: {'a part' if file is None else file} has {what}: a part "
                           "written by another run (or another layout) sits beside this "
                           "index. Fix: dump into a fresh directory, or restore the parts "
                           "that belong to this index.")


def workload_from_dump(path: str | os.PathLike) -> tuple[np.ndarray, list[Hashable]]:
    """``(lengths, group_ids)`` of a dump: the scheduler's input (``vime schedule --input``).

    Example: a dump of 3 samples of 4, 6 and 2 tokens in groups "a", "a", 7 gives
    ``(array([4, 6, 2]), ["a", "a", 7])``.
    """
    batch = load_rollout_batch(path)
    return batch.lengths, batch.original_group_ids()


def _read_header(zf: zipfile.ZipFile, where: Path, formats: tuple[str, ...]
                 ) -> dict[str, Any]:
    names = zf.namelist()
    if HEADER not in names:
        raise DumpFormatError(f"{where}: no {HEADER}; this zip is not a vime rollout dump. "
                              "Fix: pass a file written by save_rollout_batch.")
    header = json.loads(_read_member(zf, HEADER, MAX_HEADER_BYTES, where).decode())
    if not isinstance(header, dict) or header.get("format") not in formats:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        want = " or ".join(repr(f) for f in formats)
        raise DumpFormatError(f"{where}: format={got!r}, expected {want}. Fix: pass a "
                              "file written by save_rollout_batch.")
    versions = COLUMNS_OF if header["format"] == FORMAT else PARTS_VERSIONS
    if type(header.get("version")) is not int or header["version"] not in versions:
        raise DumpFormatError(f"{where}: format version {header.get('version')!r}, but this "
                              f"vime reads versions {sorted(versions)}. Fix: load it "
                              "with the vime release that wrote it, or re-save it with this one.")
    if not isinstance(header.get("columns"), dict) or set(names) != {HEADER} | {
            f"{k}.npy" for k in header["columns"]}:
        raise DumpFormatError(f"{where}: members {sorted(names)} do not match the header's "
                              "columns. Fix: re-save the dump with save_rollout_batch.")
    return header


def _read_column(zf: zipfile.ZipFile, name: str, spec: dict, where: Path) -> np.ndarray:
    # The member may hold no more than its header-declared array plus the .npy header: a
    # small compressed member that inflates to gigabytes (a zip bomb) stops at that limit.
    limit = np.dtype(spec["dtype"]).itemsize * math.prod(spec["shape"]) + MAX_NPY_HEADER_BYTES
    raw = _read_member(zf, f"{name}.npy", limit, where)
    arr = np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
    if arr.dtype.str != spec["dtype"] or list(arr.shape) != spec["shape"]:
        raise DumpFormatError(f"{where}: column {name} is {arr.dtype.str}{list(arr.shape)} but "
                              f"the header says {spec['dtype']}{spec['shape']}. Fix: restore "
                              "the dump from a copy.")
    return arr


def _read_member(zf: zipfile.ZipFile, name: str, limit: int, where: Path) -> bytes:
    """A stored (uncompressed) member's bytes, never more than ``limit`` (declared or
    actual), so a member inflates to at most the file's own size. Reading to the member's end
    makes zipfile verify its CRC-32."""
    info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:  # vime writes stored members only
        raise DumpFormatError(f"{where}: member {name} is compressed; vime dumps are stored "
                              "uncompressed, so its inflated size cannot be bounded before "
                              "reading (a zip bomb would exhaust memory). Fix: re-save the dump "
                              "with save_rollout_batch.")
    declared = info.file_size
    if declared > limit:
        raise DumpFormatError(f"{where}: member {name} declares {declared} bytes, more than the "
                              f"{limit} its header allows (a damaged file or a zip bomb). Fix: "
                              "re-save the dump with save_rollout_batch.")
    with zf.open(name) as member:
        raw = member.read(limit + 1)
    if len(raw) > limit:
        raise DumpFormatError(f"{where}: member {name} inflates past {limit} bytes (a zip "
                              "bomb). Fix: re-save the dump with save_rollout_batch.")
    return raw


def _digest(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in header.items() if k != "sha256"},
                        sort_keys=True).encode())
    for name in sorted(arrays):
        arr = arrays[name]
        h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).data.cast("B"))
    return h.hexdigest()
