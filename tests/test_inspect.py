"""``vime inspect DUMP``: a dump's text columns decode to the prompts and responses the
rollout produced, beside their labels, rewards and metadata."""

import json

from vime_pure import RolloutBatch, Sample
from vime_shell.cli.main import main
from vime_shell.loop.rollouts import sample_annotations
from vime_shell.models.embedded import build_embedded
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.storage.dump import load_rollout_batch, save_rollout_batch


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
