"""Plugins written against slime's signatures (test data for the slime-script corpus)."""

from vime_shell.rollout.functions import generate


async def async_rm(args, sample):
    """slime's custom reward: ``async def rm(args, sample)``."""
    return float(sample.response == sample.label)


def check_reward_nonzero_std(args, samples):
    """slime's dynamic-sampling filter signature ``(args, samples)``."""
    rewards = [s.reward for s in samples]
    return any(r != rewards[0] for r in rewards)


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """slime's custom rollout log; returning False keeps the default logging."""
    return False


async def retool_generate(args, sample, sampling_params):
    """Stands in for slime's examples/retool/generate_with_retool.generate (same signature;
    the real one imports slime.rollout and a tool sandbox): one turn, no tool calls."""
    return await generate(args, sample, sampling_params)


async def retool_reward_func(args, sample, **kwargs):
    """Stands in for retool's reward_func: a dict, trained on its "score" (--reward-key)."""
    correct = sample.response.strip() == str(sample.label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": sample.response}
