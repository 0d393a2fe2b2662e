"""LoRA on MoE experts in one 2-process gloo spawn (``tests/shell/test_lora_experts.py``).

A tiny Qwen3-MoE (2 layers, 4 experts, top-2) trains the two synthetic rollouts of
``megatron_workers`` (2 Adam steps each) with adapters on every linear layer, in miles' two
expert layouts (per-expert, ``--experts-shared-outer-loras``) and two layouts of the 2 ranks
(DP2 with every expert on each rank, EP2 with two experts per rank). Each run records what the
tests compare: the exports before training, after it and of the base alone, the merged expert
weights re-derived in float64 from this rank's own factors, the logits of the export in
transformers, and the shared factors each rank holds.
"""

import time

from tests.shell.megatron_workers import ROLLOUT_SEEDS, _logit_diff, rank_rollout

LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}}
EXPERT_LAYOUTS = {"per_expert": False, "shared_outer": True}
LR = 1e-2  # adapters start at B = 0: a large step makes their update visible in 4 steps
RESUMED = ("shared_outer", "ep2")  # the run that also resumes from its checkpoint


def _config(shared_outer: bool):
    from vime_shell.megatron.lora_options import LoraOptions
    from vime_shell.megatron.trainer import OptimConfig, TrainerConfig

    return TrainerConfig(optim=OptimConfig(lr=LR), lora=LoraOptions(
        rank=4, alpha=8, target_modules=("all-linear",), experts_shared_outer=shared_outer))


def _numpy(state: dict) -> dict:
    return {k: v.numpy() for k, v in state.items()}


def _base_export(trainer) -> dict:
    from vime_shell.megatron.bridge import hf_state_dict
    from vime_shell.megatron.lora import merged

    with merged(trainer.model, merge=False):
        return _numpy(hf_state_dict(trainer.bridge, trainer.model))


def _train(trainer, vocab: int, seed: int) -> list:
    from vime_pure import with_log_probs

    _, _, mine = rank_rollout(vocab, seed, trainer)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    return [r.metrics for r in trainer.train(with_log_probs(mine, old_log_probs=old))]


def _experts(trainer):
    """``(layer index, global expert index, expert MLP)`` of this rank's routed experts."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import unwrap_model

    for layer in unwrap_model(trainer.model[0]).decoder.layers:
        experts = layer.mlp.experts
        first = mpu.get_expert_model_parallel_rank() * experts.num_local_experts
        for local, expert in enumerate(experts.local_experts):
            yield layer.layer_number - 1, first + local, expert


def _merged_gap(trainer, export: dict) -> float:
    """Max |export - (W + alpha/rank x B A)| over this rank's experts, the reference in
    float64 from the wrappers' base weights and factors."""
    gaps = []
    for layer, e, expert in _experts(trainer):
        prefix = f"model.layers.{layer}.mlp.experts.{e}."
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        want1 = fc1.base_layer.weight.double() + fc1.scaling * (
            fc1.factor_b.double() @ fc1.factor_a.double())
        gate, up = want1.chunk(2, dim=0)  # Megatron's fc1 is [gate; up]
        want2 = fc2.base_layer.weight.double() + fc2.scaling * (
            fc2.factor_b.double() @ fc2.factor_a.double())
        for name, want in (("gate_proj", gate), ("up_proj", up), ("down_proj", want2)):
            got = export[f"{prefix}{name}.weight"]
            gaps.append(float(abs(got.astype("float64") - want.detach().numpy()).max()))
    return max(gaps)


def _factors(trainer) -> dict:
    """Every adapter factor this rank holds, by parameter name."""
    from vime_shell.megatron.lora import adapter_parameters

    names = {id(p): n for n, p in trainer.model[0].named_parameters()}
    return {names[id(p)]: p.detach().numpy().copy()
            for p in adapter_parameters(trainer.model[0])}


def _sharing(trainer) -> dict:
    """Which expert factors are one object across a layer's experts (the shared-outer ones)."""
    firsts: dict = {}
    shared = {"fc1_A": True, "fc1_B": True, "fc2_A": True, "fc2_B": True}
    for layer, _, expert in _experts(trainer):
        for key, factor in (("fc1_A", expert.linear_fc1.factor_a),
                            ("fc1_B", expert.linear_fc1.factor_b),
                            ("fc2_A", expert.linear_fc2.factor_a),
                            ("fc2_B", expert.linear_fc2.factor_b)):
            first = firsts.setdefault((layer, key), factor)
            shared[key] = shared[key] and first is factor
    return shared


def lora_expert_run(hf_dir: str, shared_outer: bool, scratch: str, resume: bool,
                    **layout) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from vime_shell.megatron.lora import adapter_parameters
    from vime_shell.megatron.trainer import MegatronTrainer
    from vime_shell.storage.hf_export import save_hf_checkpoint

    rank = torch.distributed.get_rank()
    checkpoint = f"{scratch}/ckpt" if resume else None  # one path: saving is collective
    t0 = time.perf_counter()
    trainer = MegatronTrainer.from_hf(hf_dir, _config(shared_outer), **layout)
    vocab = trainer.bridge.hf_config.vocab_size
    trainable = [p for c in trainer.model for p in c.parameters() if p.requires_grad]
    out = {"fresh": _numpy(trainer.hf_state_dict()), "sharing": _sharing(trainer),
           "trainable": sum(p.numel() for p in trainable),
           "adapter": sum(p.numel() for c in trainer.model for p in adapter_parameters(c)),
           "metrics": []}
    for r, seed in enumerate(ROLLOUT_SEEDS):
        if r == 1 and checkpoint is not None:
            trainer.save_checkpoint(checkpoint)
        out["metrics"] += _train(trainer, vocab, seed)
    out["final"] = _numpy(trainer.hf_state_dict())
    out["base"] = _base_export(trainer)
    out["merged_gap"] = _merged_gap(trainer, out["final"])
    out["factors"] = _factors(trainer)
    # the merged export written as --save-hf writes it, loaded back by transformers
    export = save_hf_checkpoint({k: torch.as_tensor(v) for k, v in out["final"].items()},
                                source_dir=hf_dir, target_dir=f"{scratch}/export_{rank}")
    hf_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    out["logit_max"] = _logit_diff(trainer, hf_model, vocab)
    trainer.shutdown()
    if checkpoint is not None:
        resumed = MegatronTrainer.from_hf(hf_dir, _config(shared_outer), **layout)
        resumed.load_checkpoint(checkpoint)
        _train(resumed, vocab, ROLLOUT_SEEDS[1])
        out["resumed"] = _numpy(resumed.hf_state_dict())
        resumed.shutdown()
    out["seconds"] = time.perf_counter() - t0
    return out


def lora_experts_worker(rank: int, hf_dir: str, root: str) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    return {(expert_layout, name): lora_expert_run(
        hf_dir, shared, f"{root}/{expert_layout}_{name}",
        resume=(expert_layout, name) == RESUMED, **layout)
        for expert_layout, shared in EXPERT_LAYOUTS.items()
        for name, layout in LAYOUTS.items()}
