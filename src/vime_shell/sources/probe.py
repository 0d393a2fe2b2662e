"""The weight-sync probe of separate engine ranks: one fixed prompt, answered by the weights
just synced and scored by the trainer on the same weights (see
:mod:`vime_shell.sources.remote`). Its gap is the colocated loop's gap check, on data that
is on policy by construction, when the batches themselves are not.

The probe asks the engine directly, for at most ``PROBE_TOKENS`` tokens per sample: not the
rollout function, whose tools, rewards or waits have nothing to say about the weights and
would hold the sync (and, in the fully-async pools, the pool's command loop) for as long as
one of its groups takes.

Example: reverse2 with ``--n-samples-per-prompt 8``: after every sync the engine answers one
fixed prompt 8 times (same seeds every time, up to 8 tokens each) and the trainer checks the
mean |engine - trainer| log-prob of those tokens against ``--logprob-gap-tolerance``.
"""

from typing import Any

import attrs

from vime_pure.data.sample import Sample
from vime_shell.rollout.functions import encode_prompt, rollout_sampling_seed
from vime_shell.sources.rollouts import RolloutProducer

_PROBE_ROLLOUT = 0x9B0BE  # the probe's own seed base: a rollout id no run reaches
PROBE_TOKENS = 8  # per sample: a missed sync moves every token's log-prob, the first ones too


def generate_probe(producer: RolloutProducer, engine: Any = None, *,
                   first_group_id: int = 0) -> list:
    """One probe group on ``engine`` (this rank's by default; its batched call), seeded the
    same every time; ``first_group_id`` keeps the groups of several engine ranks' probes
    apart. Returns a rollout output of one prompt group."""
    cfg = producer.cfg
    engine = engine or producer.engines.engine
    sampling = producer.sampling(cfg.max_response_len,
                                 rollout_sampling_seed(producer.seed, _PROBE_ROLLOUT))
    sampling = attrs.evolve(sampling, max_new_tokens=min(sampling.max_new_tokens, PROBE_TOKENS))
    # The fixed prompt of every probe: the dataset's first row, or a task's fixed draw.
    prompt = producer.source.fixed_prompt(_PROBE_ROLLOUT)
    ids = encode_prompt(producer.tokenizer, prompt, cfg.apply_chat_template)
    batched = getattr(engine, "generate_batch", None) or engine.generate  # a per-request
    gens = batched([ids] * cfg.n_samples_per_prompt, sampling)  # engine's batched call
    return [[Sample(tokens=list(ids) + list(g.token_ids), response_length=len(g.token_ids),
                    loss_mask=[1] * len(g.token_ids), reward=0.0, group_id=first_group_id + i,
                    index=i, rollout_log_probs=list(g.log_probs),
                    rollout_routed_experts=g.routed_experts)
             for i, g in enumerate(gens)]]
