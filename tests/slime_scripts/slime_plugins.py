"""Plugins written against slime's signatures (test data for the slime-script corpus)."""


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
