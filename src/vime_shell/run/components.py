"""The components' settings from the run's: the one place ``TrainConfig`` maps onto the
trainer's ``TrainerConfig``, the engines' ``EngineOptions`` and the LR lengths in groups.

Example: ``trainer_config(TrainConfig(lr_warmup_iters=10))`` with 128 groups per step warms
the trainer's LR up over 1280 groups; ``engine_options(cfg, cuda=False)`` picks the HF engine
in float32.
"""


from vime_shell.engines import engine_traits
from vime_shell.engines.group import EngineOptions
from vime_shell.engines.layout import default_rollout_dtype
from vime_shell.megatron.config import TrainerConfig
from vime_shell.rollout.functions import PER_SAMPLE_ROLLOUT_FUNCTION
from vime_shell.settings.slime_flags import parse_engine_arg
from vime_shell.settings.train_config import TrainConfig


def trainer_config(cfg: TrainConfig, num_rollout: int | None = None) -> TrainerConfig:
    """The trainer's settings from the run's: the one place flags map onto the trainer.

    LR warmup/decay lengths are optimizer steps in the flags (as in slime) and groups in the
    trainer (its schedule advances by each step's real group count):
    ``TrainConfig.lr_schedule`` converts them (``N`` steps are the groups of the run's first
    ``N`` steps, each at its real size), and without ``--lr-decay-iters`` decays over the
    whole run. Example:
    ``--lr-warmup-iters 10`` with 128 groups per step warms up over 1280 groups.
    """
    return TrainerConfig(optim=cfg.optim_config(num_rollout), loss=cfg.loss_config(),
                         model=cfg.model_options(), lora=cfg.lora_options(),
                         recompute_loss_function=cfg.recompute_loss_function, seed=cfg.seed,
                         sequence_parallel=bool(cfg.sequence_parallel))


def engine_options(cfg: TrainConfig, cuda: bool, num_experts: int | None = None) -> EngineOptions:
    """The engines' settings from the run's: the engine by capability unless named, the
    trainer's dtype unless ``--rollout-dtype``, sleep mode on CUDA vLLM unless ``--colocate``
    says otherwise. Example: on CPU, defaults give ``EngineOptions(engine="hf",
    dtype="float32", colocate=False)``."""
    engine = engine_traits(cfg.rollout_engine)
    return EngineOptions(
        engine=engine.name, dtype=cfg.rollout_dtype or default_rollout_dtype(cuda),
        colocate=cfg.colocate if cfg.colocate is not None else engine.default_colocate(cuda),
        gpu_memory_utilization=cfg.rollout_gpu_memory_utilization,
        update_weight_buffer_size=cfg.update_weight_buffer_size, seed=cfg.seed,
        enforce_eager=cfg.rollout_enforce_eager,
        expert_parallel=cfg.rollout_enable_expert_parallel, num_experts=num_experts,
        per_request=cfg.effective_rollout_function_path == PER_SAMPLE_ROLLOUT_FUNCTION,
        max_concurrency=cfg.sglang_server_concurrency,
        vllm_args=tuple(parse_engine_arg(a) for a in cfg.vllm_engine_args or ()),
        routed_experts=cfg.use_rollout_routing_replay, health=cfg.health_policy())
