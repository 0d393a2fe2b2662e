"""``vime inspect DUMP``: a dump's text columns decode to the prompts and responses the
rollout produced, beside their labels, rewards and metadata."""

import json
import shutil

from vime_pure import RolloutBatch, Sample
from vime_shell.cli.main import main
from vime_shell.models.embedded import build_embedded
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.sources.replay import DumpWriter
from vime_shell.sources.rollouts import sample_annotations
from vime_shell.storage.dump import (load_rollout_batch, read_dump_header, save_rollout_batch,
                                     tokenizer_record)


def test_dump_text_columns_decode_to_the_prompts_and_responses(tmp_path, capsys):
    model = build_embedded(tmp_path / "embedded")
    tok = load_tokenizer(model)
    rows = [("47>", "74", "74", 1.0), ("12>", "11", "21", 0.0)]
    output = []
    for p, (prompt, response, label, reward) in enumerate(rows):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        out = tok(response, add_special_tokens=False)["input_ids"]
        output.append([Sample(tokens=ids + out, response_length=len(out), reward=reward,
                              group_id=p, metadata={"prompt": prompt, "response": response,
                                                    "label": label, "turn": 0,
                                                    "source": "unit"})])
    path = save_rollout_batch(tmp_path / "d.npz", RolloutBatch.from_samples(output),
                              sample_annotations(output))
    assert load_rollout_batch(path).num_samples == 2  # the annotated dump is a valid dump
    assert main(["inspect", str(path), "--hf-checkpoint", str(model), "--json"]) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["response"], r["label"], r["reward"]) for r in printed] == rows
    assert printed[0]["metadata"] == {"turn": 0, "source": "unit"}
    assert main(["inspect", str(path), "--hf-checkpoint", str(model)]) == 0
    text = capsys.readouterr().out
    assert "response: '74'" in text and "label:    '21'" in text and "2 samples" in text


def _own_model(tmp_path):
    """A copy of the embedded model whose tokenizer numbers the digits backwards: the user's
    own model, whose ids the embedded tokenizer decodes to the wrong text."""
    model = shutil.copytree(build_embedded(tmp_path / "embedded"), tmp_path / "mine")
    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    digits = [str(d) for d in range(10)]
    ids = [vocab[d] for d in digits]
    vocab.update(zip(digits, reversed(ids)))
    (model / "tokenizer.json").write_text(json.dumps(spec))
    return model


def _dump_of(tmp_path, model, text="47>", response="74"):
    tok = load_tokenizer(model)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = tok(response, add_special_tokens=False)["input_ids"]
    batch = RolloutBatch.from_samples([[Sample(tokens=ids + out, response_length=len(out),
                                               reward=1.0, group_id=0)]])
    return _written(tmp_path / "d.npz", batch, model)


def _written(path, batch, model):
    writer = DumpWriter(str(path), model)  # what vime train uses: records the model
    writer.submit(0, batch)
    writer.close()
    return path


def test_inspect_decodes_with_the_tokenizer_the_dump_records(tmp_path, capsys):
    model = _own_model(tmp_path)
    path = _dump_of(tmp_path, model)
    assert read_dump_header(path)["tokenizer"] == tokenizer_record(model)
    assert main(["inspect", str(path), "--json"]) == 0
    out = capsys.readouterr()
    (row,) = [json.loads(x) for x in out.out.splitlines()]
    assert (row["prompt"], row["response"]) == ("47>", "74") and out.err == ""
    # The embedded model's tokenizer reads the same ids as other digits: the old default.
    embedded = build_embedded(tmp_path / "embedded")
    assert main(["inspect", str(path), "--json", "--hf-checkpoint", str(embedded)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["response"] != "74"
    assert out.err.strip() == (f"note: --hf-checkpoint {embedded}'s tokenizer is not the one "
                               f"that wrote this dump ({model.resolve()})")


def test_inspect_says_when_the_dumps_tokenizer_changed_or_is_gone(tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setenv("VIME_CACHE_DIR", str(tmp_path / "embedded"))  # never the user's cache
    model = _own_model(tmp_path)
    path = _dump_of(tmp_path, model)
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "edited": true}', 1))
    assert main(["inspect", str(path), "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: the tokenizer of {model.resolve()} "
                                               "changed since it wrote")
    assert "pass --hf-checkpoint" in err[0]
    shutil.rmtree(model)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"tokenizer of {model.resolve()}, which is gone" in err[0]
    assert "Fix: pass --hf-checkpoint" in err[0]


def test_inspect_notes_that_an_old_dump_is_decoded_with_the_embedded_tokenizer(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VIME_CACHE_DIR", str(tmp_path / "embedded"))  # never the user's cache
    model = build_embedded(tmp_path / "embedded")
    tok = load_tokenizer(model)
    ids = tok("12>21", add_special_tokens=False)["input_ids"]
    batch = RolloutBatch.from_samples([[Sample(tokens=ids, response_length=2, reward=0.0,
                                               group_id=0)]])
    path = save_rollout_batch(tmp_path / "old.npz", batch)  # no tokenizer record
    assert "tokenizer" not in read_dump_header(path)
    assert main(["inspect", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["response"] == "21"
    assert out.err.startswith(f"note: {path} does not record its tokenizer")
    assert "decoding with the embedded model's" in out.err and "--hf-checkpoint" in out.err
