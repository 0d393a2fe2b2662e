"""Routing replay (R3) runs on the shared 2-rank gloo spawn (``model_workers``, read by
``test_routing_replay``).

The HF engine generates a rollout on the tiny Qwen3-MoE with ``return_routed_experts=True``;
the batch carries the routes through packing into every micro-batch row; the trainer trains
two Adam steps per run from the same checkpoint. Runs (DP2 unless named): ``free`` (the
routers choose), ``replay`` (the engine's routes), ``replay_ep2`` (experts split over both
ranks), ``forced`` (random routes, recorded by a hook on every router) and
``forced_recompute`` (the same with full recompute: the routers run again in the backward).
"""

import attrs
import numpy as np

from tests.shell.megatron_workers import _optim

GLOBAL_BATCH, MAX_TOKENS = 8, 40
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)


def engine_batch(hf_dir: str, seed: int = 3):
    """16 samples (4 prompts x 4) generated with routes by the HF engine, GRPO advantages."""
    from vime_pure import RolloutBatch, Sample
    from vime_shell.engines.base import SamplingParams
    from vime_shell.engines.hf import HfEngine

    rng = np.random.default_rng(seed)
    engine = HfEngine(hf_dir, return_routed_experts=True)
    prompts = [rng.integers(0, 128, int(rng.integers(3, 9))).tolist() for _ in range(4)]
    gens = engine.generate([p for p in prompts for _ in range(4)],
                           SamplingParams(max_new_tokens=6, seed=seed))
    output = [[Sample(tokens=prompts[p] + list(g.token_ids), response_length=len(g.token_ids),
                      reward=float(rng.random()), group_id=4 * p + j, prompt_group=p,
                      rollout_log_probs=list(g.log_probs), rollout_routed_experts=g.routed_experts)
               for j, g in enumerate(gens[4 * p:4 * p + 4])] for p in range(4)]
    return RolloutBatch.from_samples(output), gens


def _random_routes(batch, seed: int = 9):
    """Distinct random experts per token and layer, in the batch's layout (the tiny MoE
    models of these tests: 2 MoE layers, 4 experts)."""
    rng = np.random.default_rng(seed)
    t, width = batch.rollout_routed_experts.shape
    layers, topk, experts = 2, width // 2, 4
    order = np.argsort(rng.random((t, layers, experts)), axis=2)[:, :, :topk]
    return order.reshape(t, width).astype(np.int16)


def _recorded(trainer) -> list:
    """Every router forward's chosen experts (sorted per token), appended by forward hooks."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen: list = []
    for chunk in trainer.model:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(lambda m, args, out: seen.append(
                    (m.layer_number, out[1].nonzero()[:, 1].view(out[1].shape[0], -1)
                     .sort(dim=1).values.cpu().numpy())))
    return seen


def train(hf_dir: str, batch, *, replay: bool, options: dict | None = None, ep: int = 1,
          record: bool = False) -> dict:
    """Two Adam steps over ``batch``; losses, final weights and (``record``) router choices."""
    from vime_pure import rank_batch, with_log_probs
    from vime_shell.megatron.model_options import ModelOptions
    from vime_shell.megatron.trainer import MegatronTrainer, TrainerConfig
    from vime_shell.rollout.synthetic import synthetic_schedule

    model = ModelOptions(moe_enable_routing_replay=replay, **(options or {}))
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=_optim(False), model=model),
                                      ep=ep)
    seen = _recorded(trainer) if record else None
    schedule = synthetic_schedule(batch, trainer.layout, global_batch_size=GLOBAL_BATCH,
                                  max_tokens_per_gpu=MAX_TOKENS)
    mine = rank_batch(batch, schedule, dp_rank=trainer.dp_rank)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    out: dict = {"old": old, "microbatches": len(mine.microbatches)}
    results = trainer.train(with_log_probs(mine, old_log_probs=old))
    out["losses"] = [r.metrics["loss"] for r in results]
    out["final"] = {k: v.numpy() for k, v in trainer.hf_state_dict().items()}
    if record:  # the log-prob pass's router choices against the routes each row replayed
        rows = trainer._tensors(mine.microbatches)
        out["recorded"] = [(layer, chosen) for layer, chosen in seen[:2 * len(rows)]]
        out["given"] = [np.sort(row.routed_experts.cpu().numpy().reshape(-1, 2, 2)[:, layer - 1],
                                axis=1) for row in rows for layer in (1, 2)]
    trainer.shutdown()
    return out


def routing_runs(hf_dir: str) -> dict:
    """Every run of the module docstring on the launched world."""
    batch, gens = engine_batch(hf_dir)
    forced = attrs.evolve(batch, rollout_routed_experts=_random_routes(batch))
    out = {"route_shapes": [g.routed_experts.shape for g in gens],
           "token_counts": [len(s) for s in np.split(batch.tokens, batch.token_offsets[1:-1])]}
    out["free"] = train(hf_dir, batch, replay=False)
    out["replay"] = train(hf_dir, batch, replay=True)
    out["replay_ep2"] = train(hf_dir, batch, replay=True, ep=2)
    out["forced"] = train(hf_dir, forced, replay=True, record=True)
    out["forced_recompute"] = train(hf_dir, forced, replay=True, options=FULL_RECOMPUTE)
    return out
