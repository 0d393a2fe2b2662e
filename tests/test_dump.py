"""Rollout dumps: exact round trip, atomic writes, and a typed error for every bad file."""

import io
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from vime_pure import (BatchingPolicy, DumpFormatError, ParallelLayout, RolloutBatch, Sample,
                       build_schedule, schedule_for)
from vime_shell.storage.dump import (load_rollout_batch, save_rollout_batch, workload_from_dump,
                             write_dump_columns)
from tests.data_invariants import assert_rolloutbatch_invariants
from tests.property.data_strategies import rollout_outputs


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    for name, col in a.columns().items():
        other = getattr(b, name)
        if col is None:
            assert other is None, name
        else:
            assert other.dtype == col.dtype and other.tobytes() == col.tobytes(), name
    assert a.group_id_values == b.group_id_values
    assert [type(v) for v in a.group_id_values] == [type(v) for v in b.group_id_values]
    assert a.prompt_group_values == b.prompt_group_values


@settings(max_examples=40)
@given(rollout_outputs())
def test_round_trip_is_exact(output):
    batch = RolloutBatch.from_samples(output)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_rollout_batch(Path(tmp) / "batch.npz", batch)
        loaded = load_rollout_batch(path)
        assert sorted(os.listdir(tmp)) == ["batch.npz"]  # no temp files left behind
    assert_same_batch(batch, loaded)
    assert_rolloutbatch_invariants(loaded)


def _batch() -> RolloutBatch:
    out = [[Sample(tokens=[10 + k, 11, 12, 13], response_length=2, reward=float(k % 2),
                   group_id=f"g{k}", rollout_log_probs=[-0.25, -1.5]) for k in range(3)],
           [Sample(tokens=[7, 8, 9], response_length=1, reward=1.0, loss_mask=[0],
                   rollout_log_probs=[-3.0])]]
    return RolloutBatch.from_samples(out)


@pytest.fixture
def dump(tmp_path) -> Path:
    return save_rollout_batch(tmp_path / "rollout.npz", _batch())


def test_common_tools_read_it(dump):
    data = np.load(dump)
    assert data["tokens"].tolist() == _batch().tokens.tolist()
    header = json.loads(data["header.json"])
    assert header["format"] == "vime.rollout_batch" and header["version"] == 2
    assert header["group_id_values"] == ["g0", "g1", "g2", 0]


def test_workload_from_dump_feeds_the_scheduler(dump):
    lengths, group_ids = workload_from_dump(dump)
    assert lengths.tolist() == [4, 4, 4, 3] and group_ids == ["g0", "g1", "g2", 0]
    layout, policy = ParallelLayout(dp=2), BatchingPolicy(global_batch_size=4,
                                                           max_tokens_per_gpu=8)
    assert build_schedule(lengths, group_ids, layout, policy) == schedule_for(_batch(), layout,
                                                                             policy)


def test_truncated_dump(dump):
    data = dump.read_bytes()
    for cut in (0, 10, len(data) // 3, len(data) - 30, len(data) - 1):
        dump.write_bytes(data[:cut])
        with pytest.raises(DumpFormatError, match="truncated, corrupt or not a vime dump"):
            load_rollout_batch(dump)


def test_flipped_bytes_in_data_are_caught(dump):
    data = bytearray(dump.read_bytes())
    with zipfile.ZipFile(dump) as zf:
        info = zf.getinfo("tokens.npy")
    # The member's bytes start after its local header (30 bytes + name + extra).
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + info.file_size - 2] ^= 0x01  # inside the token values
    dump.write_bytes(bytes(data))
    with pytest.raises(DumpFormatError, match="Bad CRC-32|checksum"):
        load_rollout_batch(dump)


def test_every_single_byte_flip_errors_or_loads_identically(dump):
    # Flips in zip bookkeeping that changes nothing may load; a changed batch never does.
    original = _batch()
    data = dump.read_bytes()
    for pos in range(0, len(data), 7):
        bad = bytearray(data)
        bad[pos] ^= 0xFF
        dump.write_bytes(bytes(bad))
        try:
            loaded = load_rollout_batch(dump)
        except DumpFormatError:
            continue
        assert_same_batch(original, loaded)


def _rewrite(dump: Path, header_edit=None, columns_edit=None) -> None:
    """Rewrite a dump with a changed header and/or columns (keeping a valid zip)."""
    with zipfile.ZipFile(dump) as zf:
        header = json.loads(zf.read("header.json"))
        cols = {n[:-4]: np.lib.format.read_array(io.BytesIO(zf.read(n)))
                for n in zf.namelist() if n.endswith(".npy")}
    if columns_edit:
        columns_edit(cols)
        values = (tuple(header["group_id_values"]), tuple(header["prompt_group_values"]))
        write_dump_columns(dump, cols, *values)  # a valid checksum over bad content
        return
    header_edit(header)
    with zipfile.ZipFile(dump, "w") as zf:
        zf.writestr("header.json", json.dumps(header))
        for name, arr in cols.items():
            with zf.open(f"{name}.npy", "w") as fh:
                np.lib.format.write_array(fh, arr)


def test_wrong_version(dump):
    _rewrite(dump, header_edit=lambda h: h.update(version=3))
    with pytest.raises(DumpFormatError, match=r"format version 3, but this vime reads versions "
                                              r"\[1, 2\]"):
        load_rollout_batch(dump)


V1_DUMP = Path(__file__).parent / "data" / "rollout_dump_v1.npz"  # written by vime before v2


def test_version_1_dump_loads_on_policy():
    """A dump without weight-version columns (format 1) is every sample on policy."""
    with zipfile.ZipFile(V1_DUMP) as zf:
        assert json.loads(zf.read("header.json"))["version"] == 1
    loaded = load_rollout_batch(V1_DUMP)
    stored = np.load(V1_DUMP)
    for name in stored.files:
        if name != "header.json":  # every stored column is loaded as written
            assert getattr(loaded, name).tobytes() == stored[name].tobytes(), name
    assert loaded.weight_version_min.tolist() == [-1] * 4 == loaded.weight_version_max.tolist()


def test_weight_versions_survive_a_dump(tmp_path):
    out = [[Sample(tokens=[1, 2, 3], response_length=2, weight_versions=[3, 5], reward=1.0,
                   group_id="a"),
            Sample(tokens=[1, 2, 4], response_length=2, weight_versions=[], reward=1.0,
                   group_id="a")]]
    loaded = load_rollout_batch(save_rollout_batch(tmp_path / "v.npz",
                                                   RolloutBatch.from_samples(out)))
    assert loaded.weight_version_min.tolist() == [3, -1]
    assert loaded.weight_version_max.tolist() == [5, -1]


def test_routed_experts_survive_a_dump(tmp_path):
    routes = [[[0, 3], [1, 2]], [[2, 3], [0, 1]]]  # 2 tokens routed (the last one is not)
    batch = RolloutBatch.from_samples([[Sample(tokens=[1, 2, 3], response_length=1, reward=1.0,
                                               rollout_routed_experts=routes)]])
    loaded = load_rollout_batch(save_rollout_batch(tmp_path / "r.npz", batch))
    assert_same_batch(batch, loaded)
    assert loaded.rollout_routed_experts.tolist() == [[0, 3, 1, 2], [2, 3, 0, 1], [2, 3, 0, 1]]


def test_opd_reverse_kl_survives_a_dump_and_dumps_without_it_load_none(dump, tmp_path):
    """Top-k distillation's per-token reverse-KL estimates (negative ones too) are one more
    optional column: written when the batch has them, None from a dump without them (this
    vime's, or a version-1 dump)."""
    batch = RolloutBatch.from_samples([[
        Sample(tokens=[1, 2, 3], response_length=2, reward=1.0, opd_reverse_kl=[0.5, -2.25]),
        Sample(tokens=[4, 5], response_length=1, reward=0.0, opd_reverse_kl=[1e-3])]])
    path = save_rollout_batch(tmp_path / "kl.npz", batch)
    assert "opd_reverse_kl" in np.load(path).files
    loaded = load_rollout_batch(path)
    assert_same_batch(batch, loaded)
    assert loaded.opd_reverse_kl.dtype == np.float32
    assert loaded.opd_reverse_kl.tolist() == [0.5, -2.25, np.float32(1e-3)]
    assert "opd_reverse_kl" not in np.load(dump).files
    assert load_rollout_batch(dump).opd_reverse_kl is None
    assert load_rollout_batch(V1_DUMP).opd_reverse_kl is None


def test_foreign_files(dump, tmp_path):
    _rewrite(dump, header_edit=lambda h: h.update(format="something.else"))
    with pytest.raises(DumpFormatError, match="format='something.else'"):
        load_rollout_batch(dump)
    np.savez(tmp_path / "plain.npz", tokens=np.arange(3))
    with pytest.raises(DumpFormatError, match="no header.json"):
        load_rollout_batch(tmp_path / "plain.npz")
    with pytest.raises(DumpFormatError, match="no such rollout dump"):
        load_rollout_batch(tmp_path / "missing.npz")


def test_header_edit_breaks_the_checksum(dump):
    _rewrite(dump, header_edit=lambda h: h.update(group_id_values=["g0", "g1", "g9", 0]))
    with pytest.raises(DumpFormatError, match="checksum mismatch"):
        load_rollout_batch(dump)


def _set(name, value):
    return lambda cols: cols.__setitem__(name, value(cols))


@pytest.mark.parametrize("edit, match", [
    (_set("loss_masks", lambda c: c["loss_masks"][:-1]),
     r"RolloutBatch.loss_masks has shape \(6,\)"),
    (lambda c: [c.__setitem__(k, c[k][:-1]) for k in ("loss_masks", "rollout_log_probs")],
     r"loss_masks has 6 entries but response_offsets run from 0 to 7"),
    (_set("tokens", lambda c: c["tokens"].astype(np.float64)),
     r"tokens is float64\[15\]; expected a 1-D int32"),
    (_set("lengths", lambda c: np.r_[-4, c["lengths"][1:]]),
     r"lengths\[0\]=-4 breaks the rule: every sample needs at least one token"),
    (_set("response_lengths", lambda c: np.r_[c["response_lengths"][:-1], -1]),
     r"response_lengths\[3\]=-1 breaks the rule"),
    (_set("loss_masks", lambda c: np.r_[c["loss_masks"][:-1], 3].astype(np.uint8)),
     r"loss_masks\[6\]=3 breaks the rule: masks are 0/1"),
    (lambda c: c.pop("advantages"), r"columns .* do not match"),
    (lambda c: c.pop("weight_version_max"), r"columns .* do not match the version 2 set"),
    (_set("weight_version_max", lambda c: c["weight_version_max"] * 0 + 2),
     r"weight_version_max\[0\]=2 breaks the rule: the newest version is >= the oldest"),
])
def test_intact_file_with_an_invalid_batch(dump, edit, match):
    _rewrite(dump, columns_edit=edit)
    with pytest.raises(DumpFormatError, match="holds an invalid batch|do not match") as e:
        load_rollout_batch(dump)
    assert e.match(match)


def test_failed_write_keeps_the_old_file(dump, monkeypatch):
    before = dump.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np.lib.format, "write_array", boom)
    with pytest.raises(OSError, match="disk full"):
        save_rollout_batch(dump, _batch())
    assert dump.read_bytes() == before
    assert sorted(p.name for p in dump.parent.iterdir()) == [dump.name]
