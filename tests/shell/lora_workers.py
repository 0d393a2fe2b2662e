"""LoRA runs in one 2-process gloo spawn (``tests/shell/test_lora.py``): DP2, TP2 and PP2
each train the two synthetic rollouts of ``megatron_workers`` with adapters on every linear
layer, and record what the tests compare.
"""

import time

from tests.shell.megatron_workers import ROLLOUT_SEEDS, _logit_diff, rank_rollout

LORA_LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
LR = 1e-2  # adapters start at B = 0: a large step makes their update visible in 4 steps


def _config(targets=("all-linear",)):
    from vime_shell.megatron.lora_options import LoraOptions
    from vime_shell.megatron.trainer import OptimConfig, TrainerConfig

    return TrainerConfig(optim=OptimConfig(lr=LR),
                         lora=LoraOptions(rank=4, alpha=8, target_modules=targets))


def _base_export(trainer) -> dict:
    """The base weights alone, under HF names (the adapters left out)."""
    from vime_shell.megatron.bridge import hf_state_dict
    from vime_shell.megatron.lora import merged

    with merged(trainer.model, merge=False):
        return {k: v.numpy() for k, v in hf_state_dict(trainer.bridge, trainer.model).items()}


def _train(trainer, vocab: int, seed: int) -> list:
    from vime_pure import with_log_probs

    _, _, mine = rank_rollout(vocab, seed, trainer)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    return [r.metrics for r in trainer.train(with_log_probs(mine, old_log_probs=old))]


def lora_run(hf_dir: str, name: str, checkpoint: str | None = None, **layout) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from vime_shell.megatron.lora import adapter_parameters
    from vime_shell.megatron.trainer import MegatronTrainer

    t0 = time.perf_counter()
    trainer = MegatronTrainer.from_hf(hf_dir, _config(), **layout)
    vocab = trainer.bridge.hf_config.vocab_size
    trainable = [p for c in trainer.model for p in c.parameters() if p.requires_grad]
    out = {"fresh": {k: v.numpy() for k, v in trainer.hf_state_dict().items()},
           "trainable": sum(p.numel() for p in trainable),
           "adapter": sum(p.numel() for c in trainer.model for p in adapter_parameters(c)),
           "metrics": []}
    for r, seed in enumerate(ROLLOUT_SEEDS):
        if r == 1 and checkpoint is not None:
            trainer.save_checkpoint(checkpoint)
        out["metrics"] += _train(trainer, vocab, seed)
    out["final"] = {k: v.numpy() for k, v in trainer.hf_state_dict().items()}
    out["base"] = _base_export(trainer)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_model.load_state_dict({k: torch.as_tensor(v) for k, v in out["final"].items()},
                             strict=False)  # a tied LM head is the embedding
    out["logit_max"] = _logit_diff(trainer, hf_model, vocab)
    trainer.shutdown()
    if checkpoint is not None:
        resumed = MegatronTrainer.from_hf(hf_dir, _config(), **layout)
        resumed.load_checkpoint(checkpoint)
        resumed_metrics = _train(resumed, vocab, ROLLOUT_SEEDS[1])
        out["resume"] = {"final": {k: v.numpy() for k, v in resumed.hf_state_dict().items()},
                         "metrics": resumed_metrics}
        resumed.shutdown()
    out["seconds"] = time.perf_counter() - t0
    return out


def lora_worker(rank: int, hf_dir: str, checkpoint_root: str) -> dict:
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    return {name: lora_run(hf_dir, name, checkpoint=(f"{checkpoint_root}/{name}"
                                                     if name != "pp2" else None), **layout)
            for name, layout in LORA_LAYOUTS.items()}
