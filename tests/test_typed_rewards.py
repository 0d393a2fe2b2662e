"""slime's per-row and per-eval-set reward: a built-in reward defers to the ``rm_type`` a
sample's metadata names; an ``--eval-config`` set's ``rm_type`` stamps its rows."""

import json

import pytest

from vime_pure import Sample
from vime_shell.rollout.data import DataKeys, load_prompt_rows
from vime_shell.rollout.rewards import Rewarder, RewardFunctionError
from vime_shell.run.launch_checks import eval_config_sets
from vime_shell.settings.train_config import ConfigError


def _s(response, label, **meta) -> Sample:
    return Sample(tokens=[1, 2], response_length=1,
                  metadata={"prompt": "q", "response": response, "label": label, **meta})


def test_a_samples_rm_type_picks_its_reward():
    """'\\boxed{8}' is wrong for exact match and right for boxed_exact: each sample gets its own."""
    samples = [_s("\\boxed{8}", "8"), _s("\\boxed{8}", "8", rm_type="boxed_exact")]
    assert Rewarder.build(rm_type="exact").score(samples) == [0.0, 1.0]
    assert Rewarder.build(rm_type="exact").score_groups([samples, samples[:1]],
                                                        where=str) == [[0.0, 1.0], [0.0]]
    with pytest.raises(RewardFunctionError, match="rm_type"):
        Rewarder.build(rm_type="exact").score([_s("8", "8", rm_type="nope")])


def test_eval_config_rm_type_reaches_every_row_and_is_checked(tmp_path):
    (tmp_path / "aime.jsonl").write_text(json.dumps({"q": "1+1", "a": "2"}) + "\n")
    cfg = tmp_path / "evals.json"
    entry = {"name": "aime", "path": "aime.jsonl", "input_key": "q", "label_key": "a",
             "rm_type": "math"}
    cfg.write_text(json.dumps({"datasets": [entry]}))
    [(name, path, keys)] = eval_config_sets(str(cfg), DataKeys())
    assert load_prompt_rows(path, keys)[0].metadata == {"rm_type": "math"}
    cfg.write_text(json.dumps({"datasets": [{**entry, "rm_type": "ifbench"}]}))
    with pytest.raises(ConfigError, match="rm_type='ifbench': is not a built-in reward"):
        eval_config_sets(str(cfg), DataKeys())
