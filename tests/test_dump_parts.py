"""Dumps of parts (``--save-rollout-data`` where engine leaders keep their parts): every holder
writes its part, trainer rank 0 the index (planned ids, advantages, lengths, rewards: metadata
only), and ``load_rollout_batch(index)`` joins them into the batch the run trained, bit for bit,
whichever holder claimed which chunk; a missing, foreign or stale part is a ``DumpFormatError``
naming the file."""

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.property.data_strategies import rollout_outputs
from tests.test_dump import assert_same_batch
from vime_pure import BatchingPolicy, DumpFormatError, ParallelLayout, RolloutBatch, Sample
from vime_pure.data.held_parts import claimed_part
from vime_pure.data.shares import merge_meta, plan_shares
from vime_shell.storage.dump import (_digest, load_dump, load_rollout_batch, part_path,
                                     save_parts_index, save_rollout_batch)


@st.composite
def held_chunks(draw):
    """A rollout output cut into work-queue chunks (consecutive prompts) dealt to 1-3 holders,
    each holder's chunks in a claim order of its own."""
    output = list(draw(rollout_outputs(depth=draw(st.integers(1, 2)))))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(output) - 1)), max_size=3)))
    bounds = [0, *[c for c in cuts if c < len(output)], len(output)]
    chunks = [(a, output[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    holders = draw(st.integers(1, 3))
    owner = [draw(st.integers(0, holders - 1)) for _ in chunks]
    held = [draw(st.permutations([c for c, o in zip(chunks, owner) if o == h]))
            for h in range(holders)]
    return output, [h for h in held if h]


def write_parts(index: Path, held) -> RolloutBatch:
    """What the run does: each holder's part, then rank 0's index; returns the reference."""
    parts = [claimed_part(chunks) for chunks in held]
    meta, _ = plan_shares(merge_meta([m for _, ms in parts for m in ms]), ParallelLayout(dp=1),
                          BatchingPolicy(global_batch_size=1, max_tokens_per_gpu=10**6,
                                         allow_partial_step=True))
    for member, (part, _) in enumerate(parts):
        notes = [{"label": f"{start}:{i}"} for start, out in sorted(held[member], key=_first)
                 for i in range(RolloutBatch.from_samples(out).num_samples)]
        save_rollout_batch(part_path(index, member), part, notes)
    save_parts_index(index, meta, [(member, [int(s) for m in ms for s in m.part_starts],
                                    [int(n) for m in ms for n in m.part_sizes])
                                   for member, (_, ms) in enumerate(parts)])
    return meta


def _first(chunk: tuple) -> int:
    return chunk[0]


@settings(max_examples=40, deadline=None)
@given(held_chunks())
def test_the_parts_join_into_the_batch_whoever_held_which_chunk(tmp_path_factory, case):
    output, held = case
    index = tmp_path_factory.mktemp("dump") / "rollout_3.npz"
    write_parts(index, held)
    batch, header = load_dump(index)
    assert_same_batch(batch, RolloutBatch.from_samples(output))
    # the annotations follow their samples into prompt order
    firsts = sorted(start for chunks in held for start, _ in chunks)
    want = [f"{start}:{i}" for start in firsts
            for start2, out in (c for chunks in held for c in chunks) if start2 == start
            for i in range(RolloutBatch.from_samples(out).num_samples)]
    assert [a["label"] for a in header["annotations"]] == want


def _two_holders(tmp_path: Path, name: str = "r0.npz", reward: float = 1.0) -> Path:
    def prompt(p: int) -> list:
        return [Sample(tokens=[1, 2, p + 3], response_length=1, reward=reward * p,
                       group_id=f"g{p}") for _ in range(2)]

    index = tmp_path / name
    write_parts(index, [[(0, [prompt(0)]), (2, [prompt(2)])], [(1, [prompt(1)])]])
    return index


def test_a_missing_part_is_named(tmp_path):
    index = _two_holders(tmp_path)
    part_path(index, 1).unlink()
    with pytest.raises(DumpFormatError, match=r"r0\.rank1\.npz is missing"):
        load_rollout_batch(index)


def test_a_part_of_another_run_is_named(tmp_path):
    index = _two_holders(tmp_path)
    (tmp_path / "other").mkdir()
    other = _two_holders(tmp_path / "other", reward=2.0)
    part_path(other, 0).replace(part_path(index, 0))  # same chunks, other rewards
    with pytest.raises(DumpFormatError, match="another run"):
        load_rollout_batch(index)


def test_an_index_naming_a_file_elsewhere_is_refused(tmp_path):
    index = _two_holders(tmp_path)
    with zipfile.ZipFile(index) as zf:
        header = json.loads(zf.read("header.json"))
    header["parts"][0]["file"] = "../r0.rank0.npz"
    columns = {}
    with zipfile.ZipFile(index) as zf:
        for name in header["columns"]:
            with zf.open(f"{name}.npy") as f:
                columns[name] = np.lib.format.read_array(f)
    header["sha256"] = _digest(header, columns)  # re-signed: only the name is wrong
    with zipfile.ZipFile(index, "w") as zf:
        zf.writestr("header.json", json.dumps(header))
        for name, arr in columns.items():
            with zf.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, arr)
    with pytest.raises(DumpFormatError, match="beside the index"):
        load_rollout_batch(index)


def test_a_part_is_a_batch_dump_of_its_own(tmp_path):
    """Each part file loads alone (its holder's samples); only the index joins them."""
    index = _two_holders(tmp_path)
    assert load_rollout_batch(part_path(index, 0)).num_samples == 4
    assert load_rollout_batch(part_path(index, 1)).num_samples == 2
    assert load_rollout_batch(index).num_samples == 6
