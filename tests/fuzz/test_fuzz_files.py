"""Fuzz: the file loaders (rollout dumps, config files) and the ``vime schedule`` command on
truncated, bit-flipped, spliced, foreign and random files.

A loader either returns exactly what was written or raises a ``VimeError``; the command exits
0, or 2 with one line on stderr and no traceback (run in-process, ``main([...])``).
"""

import contextlib
import io
import json
import pickle

import attrs
import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz.harness import REJECTED, REJECTIONS, outcome, tried
from tests.fuzz.strategies import JUNK
from vime_pure import RolloutBatch, Sample
from vime_shell.cli.main import main
from vime_shell.settings.flags import load_config_file
from vime_shell.settings.train_config import TrainConfig
from vime_shell.storage.dump import load_rollout_batch, save_rollout_batch


@pytest.fixture(scope="module")
def dump_bytes(tmp_path_factory) -> tuple[bytes, RolloutBatch]:
    output = [[Sample(tokens=[1, 2, 3, k], response_length=2, reward=float(k % 2),
                      group_id=f"g{k}", rollout_log_probs=[-0.5, -1.0]) for k in range(4)]]
    batch = RolloutBatch.from_samples(output)
    path = save_rollout_batch(tmp_path_factory.mktemp("dump") / "ok.npz", batch)
    return path.read_bytes(), batch


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """``data`` truncated, bit-flipped (1-3 bits), spliced, zeroed in a range, replaced by
    random bytes or by a pickle, or intact."""
    kind = draw(st.sampled_from(["truncate", "flip", "splice", "zero", "random", "pickle",
                                 "intact"]))
    n = len(data)
    if kind == "truncate":
        return data[:draw(st.integers(0, n - 1))]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            out[draw(st.integers(0, n - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "splice":
        at = draw(st.integers(0, n))
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    if kind == "zero":
        a = draw(st.integers(0, n - 1))
        return data[:a] + bytes(min(16, n - a)) + data[a + 16:]
    if kind == "random":
        return draw(st.binary(max_size=64))
    if kind == "pickle":
        return pickle.dumps({"tokens": np.arange(3), "note": "not a dump"})
    return data


def _same(a: RolloutBatch, b: RolloutBatch) -> bool:
    return all(np.array_equal(x, y) if x is not None else y is None
               for x, y in zip(a.columns().values(), b.columns().values())) and (
        a.group_id_values == b.group_id_values)


@given(st.data())
def test_load_rollout_batch(dump_bytes, tmp_path_factory, data):
    original, batch = dump_bytes
    path = tmp_path_factory.mktemp("fuzz") / "rollout.npz"
    path.write_bytes(data.draw(damaged(original)))
    loaded = outcome("load_rollout_batch", load_rollout_batch, path)
    if loaded is not REJECTED:  # an undetected change must be one that changed nothing
        assert _same(loaded, batch)


def _run_cli(entry: str, argv: list[str]) -> tuple[int, str]:
    """``vime ...`` in-process: its exit status and stderr (status 2 counts as a rejection)."""
    tried(entry)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    if rc == 2:
        REJECTIONS[entry] += 1
    return rc, err.getvalue()


def _assert_clean_exit(rc: int, err: str) -> None:
    """Exit 0, or 2 with exactly one line on stderr, naming the command, no traceback."""
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("vime schedule: error:"), err
        assert "Traceback" not in err and "Fix:" in err, err


JSONL = "".join(json.dumps({"length": 100 + 7 * k, "group_id": f"g{k // 2}"}) + "\n"
                for k in range(8))
SCHEDULE = ["--global-batch-size", "2", "--dp", "1", "--max-tokens-per-gpu", "1000"]


@given(st.data(), st.sampled_from(["rollout.npz", "workload.jsonl", "workload"]))
@settings(max_examples=100)  # each example runs the whole command in-process
def test_vime_schedule_on_damaged_inputs(dump_bytes, tmp_path_factory, data, name):
    original = dump_bytes[0] if name.endswith(".npz") else JSONL.encode()
    path = tmp_path_factory.mktemp("cli") / name
    path.write_bytes(data.draw(damaged(original)))
    _assert_clean_exit(*_run_cli("vime schedule --input",
                                 ["schedule", "--input", str(path), *SCHEDULE]))


@given(st.sampled_from(["dir", "missing", "json-dir", "plot-txt", "plot-dir", "jsonl-row"]),
       st.data())
@settings(max_examples=30)
def test_vime_schedule_bad_paths_and_rows(tmp_path_factory, case, data):
    root = tmp_path_factory.mktemp("paths")
    good = root / "w.jsonl"
    good.write_text(JSONL)
    argv = ["schedule", "--input", str(good), *SCHEDULE]
    if case == "dir":
        argv[2] = str(root)
    elif case == "missing":
        argv[2] = str(root / "nope.jsonl")
    elif case == "json-dir":
        argv += ["--json", str(root / "no" / "such" / "dir" / "s.json")]
    elif case == "plot-txt":
        argv += ["--plot", str(root / "out.txt")]
    elif case == "plot-dir":
        argv += ["--plot", str(root)]
    else:
        row = data.draw(st.fixed_dictionaries({"length": JUNK | st.integers(-3, 3),
                                               "group_id": JUNK | st.text(max_size=2)}))
        good.write_text(JSONL + json.dumps(row, default=repr) + "\n")
    rc, err = _run_cli("vime schedule paths/rows", argv)
    _assert_clean_exit(rc, err)
    if case != "jsonl-row":
        assert rc == 2


FIELDS = sorted(f.name for f in attrs.fields(TrainConfig))
SETTING_VALUES = st.one_of(st.integers(-2, 300), st.floats(allow_nan=True), st.booleans(),
                           st.none(), st.text(max_size=6), st.sampled_from(
                               ["3e-4", "1e-3", "none", "ffd", "tokens", "nan", "inf"]),
                           st.lists(st.integers(0, 3), max_size=2))


@st.composite
def config_texts(draw) -> tuple[str, bytes]:
    """A config file: a drawn mapping (setting names in either spelling, sometimes a typo,
    an int or None key) as YAML or JSON, or random text / bytes under any suffix."""
    suffix = draw(st.sampled_from([".yaml", ".yml", ".json", ".toml", ".ini"]))
    if draw(st.booleans()):
        return suffix, draw(st.one_of(st.binary(max_size=40), st.text(max_size=40).map(
            str.encode)))
    keys = st.one_of(st.sampled_from(FIELDS), st.sampled_from(FIELDS).map(
        lambda k: k.replace("_", "-")), st.text("abz_", max_size=8), st.integers(0, 3), st.none())
    mapping = draw(st.dictionaries(keys, SETTING_VALUES, max_size=4))
    if suffix == ".json":
        mapping = {str(k): v for k, v in mapping.items()}
        return suffix, json.dumps(mapping).encode()
    return suffix, yaml.safe_dump(mapping).encode()


@given(config_texts())
def test_config_loader(tmp_path_factory, case):
    suffix, text = case
    path = tmp_path_factory.mktemp("cfg") / f"run{suffix}"
    path.write_bytes(text)
    data = outcome("load_config_file", load_config_file, path)
    if data is not REJECTED:
        cfg = outcome("TrainConfig.from_mapping", TrainConfig.from_mapping, data)
        assert cfg is REJECTED or isinstance(cfg, TrainConfig)
