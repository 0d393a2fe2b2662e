"""``TrainConfig``: every setting of ``vime train``, validated at launch, with slime flag names.

Sources, later wins: the defaults (the embedded CPU demo), a ``--config`` file (YAML, JSON or
TOML; keys spelled ``global_batch_size`` or ``global-batch-size``, flat or by section), then
command-line flags (``--global-batch-size 64``; bools as ``--balance-data`` /
``--no-balance-data``; optional values accept ``none``): ``vime_shell.loop.config_flags``
reads them. The fields of Megatron's and slime's pass-through flags come from the records of
``vime_shell.loop.megatron_args``.

Invariants the tests assert: a ``TrainConfig`` that exists is valid (types, ranges, names,
and that a rollout's groups fill whole optimizer steps unless ``allow_partial_train_step``);
every bad value raises :class:`ConfigError` naming the field, the value and the fix; an unknown
key or flag is an error with the closest valid name, never ignored; ``to_dict`` round-trips.

Defaults are the measured demo (reverse2 from scratch on 2 CPU cores, the embedded 334k-param
Qwen2): 16 prompts x 8 samples, temperature 1, answers capped at the task's length, lr 3e-4,
one optimizer step per rollout (``global_batch_size`` = 128 groups). With the HF engine, the
built-in single-turn rollout and a plain-torch GRPO step standing in for the trainer, the mean
reward went from 0.00 to >= 0.8 (10-rollout average) after 133-152 rollouts (6 runs).
"""

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any, get_args, get_origin

import attrs

from vime_pure.config import BALANCES, PACKINGS, BatchingPolicy, policy_from_flags
from vime_pure.data.rewards import RewardNormalization
from vime_pure.denominators import LOSS_MODES, REJECTION_DENOMINATORS
from vime_pure.errors import LossConfigError, VimeError, field_error
from vime_pure.policy_config import KL_KINDS, RS_LEVELS, LossConfig, RejectionConfig
from vime_shell.engines import ENGINE_NAMES
from vime_shell.loop.megatron_args import (MegatronSwitchArgs, ModelArchArgs, ModelArgsError,
                                           PlacementArgs)
from vime_shell.megatron.config import OptimConfig, OptimConfigError
from vime_shell.megatron.model_options import (MOE_DISPATCHERS, MOE_LOAD_BALANCING,
                                               MOE_ROUTER_DTYPES, RECOMPUTE_GRANULARITIES,
                                               RECOMPUTE_METHODS, RECOMPUTE_MODULES,
                                               ModelOptions)
from vime_shell.engines.layout import (DEFAULT_GPU_MEMORY_UTILIZATION,
                                       DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE, ROLLOUT_DTYPES,
                                       EngineLayoutError, check_gpu_memory_utilization)
from vime_shell.rollout.functions import (DEFAULT_ROLLOUT_FUNCTION, MAX_GENERATION_ROUNDS,
                                          PER_SAMPLE_ROLLOUT_FUNCTION)
from vime_shell.rollout.rewards import RM_CHOICES
from vime_shell.rollout.tasks import TASKS


ESTIMATOR_METHOD = {"grpo": "grpo", "gspo": "gspo",
                    "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}
ESTIMATORS: tuple[str, ...] = tuple(ESTIMATOR_METHOD)
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine", "inverse-square-root")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning")
# LossConfig's field -> the flag a user writes (the error names the flag).
LOSS_FLAGS = {"eps_clip": "--eps-clip", "eps_clip_high": "--eps-clip-high",
              "dual_clip": "--eps-clip-c", "kl_coef": "--kl-loss-coef",
              "kl_kind": "--kl-loss-type", "entropy_coef": "--entropy-coef",
              "use_tis": "--use-tis", "tis_clip": "--tis-clip", "tis_clip_low": "--tis-clip-low",
              "sequence_ratio": "--advantage-estimator"}
SAVE_HF_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DEFAULT_NUM_ROLLOUT = 300
DEFAULT_GLOBAL_BATCH_SIZE = 128
DEFAULT_LOSS_MODE = "group_token_mean"
SECTIONS: tuple[str, ...] = ("model", "data", "rollout", "reward", "eval", "batching", "loss",
                             "optimizer", "parallelism", "memory", "moe", "checkpoint", "logging",
                             "architecture", "megatron", "slime", "placement")


class ConfigError(VimeError):
    """A training setting that is invalid, unknown or inconsistent with another one."""


def _f(default: Any, help: str, section: str, choices: Sequence[Any] | None = None,
       nargs: str | None = None) -> Any:
    return attrs.field(default=default, metadata={"help": help, "section": section,
                                                  "choices": choices, "nargs": nargs})


def _tuple_field(help: str, section: str) -> Any:
    """An optional list setting (``--flag A B``, a list in a config file), stored as a tuple."""
    return attrs.field(default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v,
                       metadata={"help": help, "section": section, "choices": None,
                                 "nargs": "+"})


@attrs.frozen(kw_only=True)
class TrainConfig(ModelArchArgs, MegatronSwitchArgs, PlacementArgs):
    """All ``vime train`` settings, named as slime's flags. Example:
    ``TrainConfig(prompt_data="train.jsonl", apply_chat_template=True, rm_type="math")``.

    Megatron's architecture flags, pass-through switches and Ray placement come from the
    records in ``vime_shell.loop.megatron_args`` (each checks its own fields)."""

    # model and engine
    hf_checkpoint: str | None = _f(None, "HF model dir; default: the embedded tiny Qwen2", "model")
    rollout_engine: str | None = _f(None, "rollout engine; default: by capability", "model",
                                    ENGINE_NAMES)
    rollout_num_gpus: int | None = _f(None, "ranks that host a rollout engine; default: every "
                                      "rank; with --no-colocate, --train-async or "
                                      "--fully-async the last N ranks run engines only (as "
                                      "slime's non-colocated mode)", "model")
    rollout_num_gpus_per_engine: int = _f(1, "ranks (GPUs) per engine: vLLM's tensor-parallel "
                                          "size", "model")
    rollout_dtype: str | None = _f(None, "engine dtype; default: the trainer's (bf16 on CUDA, "
                                   "fp32 on CPU)", "model", ROLLOUT_DTYPES)
    colocate: bool | None = _f(None, "engines sleep while the trainer runs; default: on with "
                               "CUDA vLLM", "model")
    rollout_gpu_memory_utilization: float = _f(DEFAULT_GPU_MEMORY_UTILIZATION,
                                               "share of each GPU the awake engine may claim",
                                               "model")
    update_weight_buffer_size: int = _f(DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE, "bytes per weight-"
                                        "sync bucket (a decoder layer is never split)", "model")
    rollout_enable_expert_parallel: bool = _f(False, "vLLM expert parallelism inside each "
                                              "engine (MoE): each engine rank holds and is "
                                              "sent only its experts", "model")
    rollout_enforce_eager: bool = _f(False, "vLLM without CUDA graphs (faster start, slower "
                                     "decode)", "model")
    vllm_engine_args: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v,
        metadata={"help": "vLLM engine arguments KEY=VALUE; what --vllm-KEY VALUE and the "
                  "mapped --sglang-X flags become", "section": "model", "choices": None,
                  "nargs": "+"})
    # data
    prompt_data: str | None = _f(None, "prompt dataset, .jsonl or .parquet; default: the "
                                 "built-in --task", "data")
    input_key: str = _f("prompt", "row field holding the prompt (text or chat messages)", "data")
    label_key: str | None = _f("label", "row field holding the reference answer", "data")
    metadata_key: str | None = _f(None, "row field holding a metadata dict", "data")
    tool_key: str | None = _f(None, "row field holding tools for the chat template", "data")
    apply_chat_template: bool = _f(False, "render prompts with the tokenizer's chat template",
                                   "data")
    rollout_shuffle: bool = _f(False, "shuffle the dataset each epoch (seeded, resumable)",
                               "data")
    rollout_seed: int | None = _f(None, "seed of prompt order and sampling; default --seed",
                                  "data")
    num_epoch: int | None = _f(None, "passes over the dataset; sets the rollout count when "
                               "--num-rollout is not given (slime's rule)", "data")
    task: str = _f("reverse2", "built-in task supplying prompts and labels without "
                   "--prompt-data", "data", tuple(TASKS))
    # rollout
    rollout_function_path: str = _f(DEFAULT_ROLLOUT_FUNCTION,
                                    "rollout function, 'pkg.mod:fn'", "rollout")
    custom_generate_function_path: str | None = _f(
        None, "per-sample 'pkg.mod:fn', slime's async generate(args, sample, sampling_params) "
        "-> Sample | list[Sample]; it may await vime_shell.rollout.functions.generate for each "
        "turn", "rollout")
    partial_rollout: bool = _f(False, "abort unfinished generations once a rollout has its "
                               "groups; they continue under the new weights in a later "
                               "rollout (per-sample generation)", "rollout")
    mask_offpolicy_in_partial_rollout: bool = _f(False, "loss mask 0 for every token of a "
                                                 "partial rollout generated under older "
                                                 "weights (vime: also of samples that finished "
                                                 "before the last sync)", "rollout")
    sglang_server_concurrency: int = _f(512, "requests in flight per engine in per-sample "
                                        "generation (vime: on the HF or vLLM engine)",
                                        "rollout")
    rollout_num_turns: int = _f(2, "turns per execution of the compact rollout (2-3)", "rollout")
    rollout_turn_reward: str = _f("mean", "compact rollout reward over turns", "rollout",
                                  ("mean", "all"))
    num_rollout: int | None = _f(None, f"rollout batches to generate and train on; default "
                                 f"{DEFAULT_NUM_ROLLOUT}, or what --num-epoch needs", "rollout")
    rollout_batch_size: int = _f(16, "prompts (prompt groups) per rollout batch", "rollout")
    n_samples_per_prompt: int = _f(8, "rollout executions per prompt", "rollout")
    rollout_temperature: float = _f(1.0, "sampling temperature", "rollout")
    rollout_top_p: float = _f(1.0, "nucleus sampling mass", "rollout")
    rollout_top_k: int = _f(0, "top-k sampling, 0 for off", "rollout")
    rollout_max_response_len: int | None = _f(None, "max new tokens; default: the built-in "
                                              "task's answer length", "rollout")
    # stop controls
    rollout_stop: tuple[str, ...] | None = _tuple_field(
        "stop strings: a response ends once its text contains one (the stop string stays in "
        "the response)", "rollout")
    rollout_stop_token_ids: tuple[int, ...] | None = _tuple_field(
        "more stop token ids; generation always stops at the tokenizer's EOS, the "
        "generation_config.json eos_token_id and, with --apply-chat-template, the template's "
        "end-of-turn token (e.g. <|im_end|>)", "rollout")
    rollout_max_context_len: int | None = _f(None, "max prompt + response tokens: a "
                                             "response's budget is the smaller of this minus "
                                             "its prompt and --rollout-max-response-len",
                                             "rollout")
    over_sampling_batch_size: int | None = _f(None, "prompts drawn per generation round under "
                                              "dynamic sampling", "rollout")
    dynamic_sampling_filter_path: str | None = _f(None, "keep a prompt group when "
                                                  "'pkg.mod:fn(samples)' (or slime's "
                                                  "fn(args, samples)) is true, e.g. "
                                                  "vime_shell.rollout.filters:nonzero_reward_std",
                                                  "rollout")
    custom_rollout_log_function_path: str | None = _f(
        None, "slime's fn(rollout_id, args, samples, metrics, seconds), called on rank 0 after "
        "each rollout's generation; vime's metrics.jsonl is written whatever it returns",
        "rollout")
    dynamic_sampling_max_rounds: int = _f(8, "generation rounds per rollout under dynamic "
                                          "sampling before training on what passed (a rollout "
                                          "where nothing passed is logged and skipped)",
                                          "rollout")
    dynamic_sampling_fill_filtered: bool = _f(False, "when fewer prompts than "
                                              "--rollout-batch-size pass within the rounds, "
                                              "fill the batch with filtered-out ones",
                                              "rollout")
    # asynchronous training on separate rollout ranks (slime / miles names)
    train_async: bool = _f(False, "one step off (slime's train_async.py): engines on "
                           "--rollout-num-gpus ranks of their own generate rollout k+1 while "
                           "the trainer trains rollout k", "rollout")
    fully_async: bool = _f(False, "a persistent pool on one engine rank keeps "
                           "--rollout-batch-size groups in flight; each step trains the "
                           "first completed groups within --max-weight-staleness", "rollout")
    max_weight_staleness: int | None = _f(None, "max versions between a group's weights and "
                                          "the trainer's (staler groups are regenerated, "
                                          "counted); default 1", "rollout")
    update_weights_interval: int = _f(1, "rollouts between weight syncs to the engines",
                                      "rollout")
    # reward
    rm_type: str | None = _f(None, "built-in reward (slime's rule rewards by name; boxed_X "
                             "grades the last \\boxed{} with X); default exact, or remote_rm "
                             "with --rm-url", "reward", RM_CHOICES)
    rm_url: str | None = _f(None, "reward server: POST {prompt, response, label} JSON per "
                            "sample, concurrently, retried with backoff", "reward")
    reward_key: str | None = _f(None, "the trained entry of a dict reward (dapo: score)",
                                "reward")
    custom_rm_path: str | None = _f(None, "reward function 'pkg.mod:fn': fn(sample), or "
                                    "slime's [async] fn(args, sample) / with --group-rm "
                                    "fn(args, samples)", "reward")
    group_rm: bool = _f(False, "--custom-rm-path takes all samples of one prompt and returns "
                        "their rewards", "reward")
    advantage_estimator: str = _f("grpo", "rewards to advantages; gspo also trains with "
                                  "GSPO's sequence-level importance ratio", "reward",
                                  ESTIMATORS)
    disable_grpo_std_normalization: bool = _f(False, "GRPO/GSPO advantages without the "
                                              "division by the group's std (Dr. GRPO)",
                                              "reward")
    disable_rewards_normalization: bool = _f(False, "advantages are the raw rewards (no "
                                             "per-prompt centring or scaling)", "reward")
    normalize_advantages: bool = _f(False, "whiten advantages over the batch's rollout groups "
                                    "(slime: over tokens)", "reward")
    # evaluation
    eval_prompt_data: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v,
        metadata={"help": "NAME PATH [NAME PATH ...] eval sets", "section": "eval",
                  "choices": None, "nargs": "+"})
    eval_config: str | None = _f(None, "YAML/JSON file of eval sets with their own keys: "
                                 "{datasets: [{name, path, input_key, label_key}]} (beside "
                                 "--eval-prompt-data)", "eval")
    eval_interval: int | None = _f(None, "evaluate every N rollouts (and after the last); "
                                   "default with --eval-prompt-data: before the first and "
                                   "after the last", "eval")
    n_samples_per_eval_prompt: int = _f(1, "samples per eval prompt (pass@k uses them)", "eval")
    eval_max_response_len: int | None = _f(None, "max new tokens in eval; default "
                                           "--rollout-max-response-len", "eval")
    eval_temperature: float | None = _f(None, "eval sampling temperature; default "
                                        "--rollout-temperature", "eval")
    skip_eval_before_train: bool = _f(False, "no evaluation before the first rollout", "eval")
    eval_top_p: float | None = _f(None, "eval nucleus mass; default --rollout-top-p", "eval")
    eval_top_k: int | None = _f(None, "eval top-k; default --rollout-top-k", "eval")
    eval_stop: tuple[str, ...] | None = _tuple_field("eval stop strings; default "
                                                     "--rollout-stop", "eval")
    eval_stop_token_ids: tuple[int, ...] | None = _tuple_field(
        "eval stop token ids (besides the default ones); default --rollout-stop-token-ids",
        "eval")
    eval_max_context_len: int | None = _f(None, "eval max prompt + response tokens; default "
                                          "--rollout-max-context-len", "eval")
    eval_input_key: str | None = _f(None, "eval rows' prompt field; default --input-key",
                                    "eval")
    eval_label_key: str | None = _f(None, "eval rows' label field; default --label-key",
                                    "eval")
    # batching (global_batch_size counts groups = rollout executions, never samples)
    global_batch_size: int | None = _f(None, f"groups (rollout executions) per optimizer step; "
                                       f"default {DEFAULT_GLOBAL_BATCH_SIZE}, or the rollout's "
                                       "groups / --num-steps-per-rollout; slime counts samples, "
                                       "the same for single-turn rollouts", "batching")
    num_steps_per_rollout: int | None = _f(None, "optimizer steps per rollout; sets "
                                           "--global-batch-size (which, if given too, must "
                                           "agree)", "batching")
    max_tokens_per_gpu: int | None = _f(1024, "token budget of a packed micro-batch", "batching")
    micro_batch_size: int | None = _f(None, "samples per static micro-batch (with "
                                      "--max-tokens-per-gpu none, or slime's way: without "
                                      "--use-dynamic-batch-size)", "batching")
    use_dynamic_batch_size: bool | None = _f(None, "slime's switch for --max-tokens-per-gpu "
                                             "packing (vime's default); off with "
                                             "--micro-batch-size: static micro-batches",
                                             "batching")
    packing: str = _f("ffd", "bin-packing algorithm", "batching", PACKINGS)
    balance: str | None = _f(None, "DP balance; overrides the two below", "batching", BALANCES)
    balance_data: bool = _f(False, "balance tokens across DP ranks (balance=tokens)", "batching")
    balance_by_flops: bool = _f(False, "balance estimated FLOPs across DP ranks (balance=flops)",
                                "batching")
    allow_partial_train_step: bool = _f(False, "train a short last step instead of dropping; "
                                        "implied by --dynamic-sampling-filter-path (without "
                                        "--dynamic-sampling-fill-filtered)", "batching")
    # loss
    loss_mode: str | None = _f(None, f"loss denominators; default {DEFAULT_LOSS_MODE} "
                               "(token_mean under --calculate-per-token-loss)", "loss",
                               LOSS_MODES)
    calculate_per_token_loss: bool = _f(False, "slime's name for --loss-mode token_mean", "loss")
    eps_clip: float = _f(0.2, "PPO ratio clip", "loss")
    eps_clip_high: float | None = _f(None, "upper ratio clip (DAPO clip-higher); default "
                                     "--eps-clip", "loss")
    eps_clip_c: float | None = _f(None, "dual-clip bound c > 1: a negative-advantage token's "
                                  "loss is capped at -A * c", "loss")
    kl_coef: float = _f(0.0, "slime's reward-shaping KL: no effect with grpo/gspo (as in "
                        "slime); other estimators: 0 only (use --use-kl-loss --kl-loss-coef)",
                        "loss")
    use_kl_loss: bool = _f(False, "add a KL penalty against a frozen reference model", "loss")
    kl_loss_coef: float = _f(0.0, "weight of the KL penalty", "loss")
    kl_loss_type: str = _f("low_var_kl", "KL estimator", "loss", KL_KINDS)
    ref_load: str | None = _f(None, "HF dir of the initial weights and the KL reference "
                              "(slime: where training starts); default --hf-checkpoint", "loss")
    entropy_coef: float = _f(0.0, "entropy bonus weight", "loss")
    use_tis: bool = _f(False, "truncated importance sampling (decoupled PPO): weight the "
                       "surrogate by clamp(pi_old / pi_behaviour, --tis-clip-low, --tis-clip)",
                       "loss")
    tis_clip: float = _f(2.0, "TIS weight cap", "loss")
    tis_clip_low: float = _f(0.0, "TIS weight floor", "loss")
    use_rs: bool = _f(False, "reject tokens (or samples, --rs-level) whose pi_old / "
                      "pi_behaviour leaves [--rs-lower-bound, --rs-upper-bound] (MIS / IcePop; "
                      "the keys of slime's mis.py as flags)", "loss")
    rs_level: str = _f("token", "what --use-rs tests: each token, the sample's ratio "
                       "product (sequence) or its geometric mean", "loss", RS_LEVELS)
    rs_lower_bound: float | None = _f(None, "--use-rs band floor; default --tis-clip-low",
                                      "loss")
    rs_upper_bound: float | None = _f(None, "--use-rs band cap; default --tis-clip", "loss")
    rs_denominator: str = _f("original", "denominator after --use-rs: the masks before "
                             "rejection (slime) or the surviving tokens", "loss",
                             REJECTION_DENOMINATORS)
    logprob_gap_tolerance: float | None = _f(None, "max mean engine-trainer log-prob gap "
                                             "after a sync; default: by --rollout-dtype (fp32 "
                                             "1e-4)", "loss")
    # optimizer
    lr: float = _f(3e-4, "Adam learning rate", "optimizer")
    min_lr: float = _f(0.0, "learning rate floor of the decay", "optimizer")
    lr_warmup_iters: int = _f(0, "warmup length in optimizer steps", "optimizer")
    lr_warmup_fraction: float | None = _f(None, "warmup as a share of the run's optimizer "
                                          "steps (--num-rollout x steps per rollout)",
                                          "optimizer")
    lr_decay_iters: int | None = _f(None, "decay length in optimizer steps", "optimizer")
    lr_decay_style: str = _f("constant", "LR decay shape", "optimizer", LR_DECAY_STYLES)
    weight_decay: float = _f(0.0, "AdamW weight decay", "optimizer")
    clip_grad: float = _f(1.0, "gradient-norm clip, 0 for off", "optimizer")
    adam_beta1: float = _f(0.9, "Adam beta1", "optimizer")
    adam_beta2: float = _f(0.999, "Adam beta2", "optimizer")
    adam_eps: float = _f(1e-8, "Adam epsilon", "optimizer")
    use_distributed_optimizer: bool = _f(False, "shard optimizer state over DP ranks",
                                         "optimizer")
    overlap_grad_reduce: bool = _f(False, "overlap the DP gradient reduce with backward",
                                   "optimizer")
    overlap_param_gather: bool = _f(False, "overlap the distributed optimizer's gather with "
                                    "forward", "optimizer")
    seed: int = _f(0, "seeds prompts, sampling and initialisation", "optimizer")
    # parallel layout (Megatron names; the data-parallel size is world / (tp * pp * cp))
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size", "parallelism")
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size", "parallelism")
    context_parallel_size: int = _f(1, "context-parallel size (needs TransformerEngine)",
                                    "parallelism")
    num_layers_per_virtual_pipeline_stage: int | None = _f(None, "layers per virtual stage",
                                                           "parallelism")
    num_virtual_stages_per_pipeline_rank: int | None = _f(None, "virtual stages (model chunks) "
                                                          "per pipeline rank; what uneven "
                                                          "stages take", "parallelism")
    expert_model_parallel_size: int = _f(1, "expert-parallel size (MoE): experts split over "
                                         "this many ranks", "parallelism")
    expert_tensor_parallel_size: int | None = _f(None, "tensor-parallel size inside an expert; "
                                                 "default --tensor-model-parallel-size",
                                                 "parallelism")
    decoder_first_pipeline_num_layers: int | None = _f(None, "layers of the first pipeline "
                                                       "stage (uneven pipelines)", "parallelism")
    decoder_last_pipeline_num_layers: int | None = _f(None, "layers of the last pipeline stage",
                                                      "parallelism")
    # memory: activation recompute, optimizer and trainer offload
    recompute_granularity: str | None = _f(None, "activation recompute: full layers or "
                                           "selective modules", "memory",
                                           RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = _f(None, "full recompute: uniform chunks or the first "
                                      "layers of each stage (block)", "memory", RECOMPUTE_METHODS)
    recompute_num_layers: int | None = _f(None, "full recompute: layers per chunk (uniform) or "
                                          "per stage (block)", "memory")
    recompute_modules: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v,
        metadata={"help": f"selective recompute: some of {', '.join(RECOMPUTE_MODULES)} "
                  "(Megatron's default core_attn)", "section": "memory", "choices": None,
                  "nargs": "+"})
    recompute_loss_function: bool = _f(False, "recompute the loss's fp32 log-softmax in the "
                                       "backward instead of keeping it", "memory")
    optimizer_cpu_offload: bool = _f(False, "Adam state and step on the CPU (CUDA only)",
                                     "memory")
    overlap_cpu_optimizer_d2h_h2d: bool = _f(False, "overlap the offloaded optimizer's copies "
                                             "(with --optimizer-cpu-offload)", "memory")
    use_precision_aware_optimizer: bool = _f(False, "TransformerEngine FusedAdam with low-"
                                             "precision state (CUDA + TE only)", "memory")
    offload_train: bool = _f(False, "weights, gradients and optimizer state leave the "
                             "accelerator while the engines generate", "memory")
    # MoE (unset: what the checkpoint's config.json says)
    moe_router_topk: int | None = _f(None, "experts per token; default the checkpoint's", "moe")
    moe_aux_loss_coeff: float | None = _f(None, "load-balancing loss weight", "moe")
    moe_z_loss_coeff: float | None = _f(None, "router z-loss weight", "moe")
    moe_router_load_balancing_type: str | None = _f(None, "load-balancing loss; default none "
                                                    "(RL)", "moe", MOE_LOAD_BALANCING)
    moe_token_dispatcher_type: str | None = _f(None, "token dispatcher; default alltoall (flex: "
                                               "DeepEP, CUDA only)", "moe", MOE_DISPATCHERS)
    moe_router_dtype: str | None = _f(None, "router precision", "moe", MOE_ROUTER_DTYPES)
    moe_grouped_gemm: bool | None = _f(None, "grouped expert GEMM (CUDA only; default on with "
                                       "TransformerEngine)", "moe")
    moe_permute_fusion: bool | None = _f(None, "fused token permutation (CUDA + TE only)",
                                         "moe")
    use_rollout_routing_replay: bool = _f(False, "replay the experts the engine routed each "
                                          "token to in the trainer's routers (R3; the HF "
                                          "engine, or vLLM on CUDA)", "moe")
    # checkpoints, rollout dumps and replay, HF export
    save: str | None = _f(None, "checkpoint directory", "checkpoint")
    save_interval: int = _f(50, "rollouts between checkpoints", "checkpoint")
    load: str | None = _f(None, "checkpoint directory to resume from", "checkpoint")
    save_rollout_data: str | None = _f(None, "dump every rollout batch to this path template "
                                       "(must contain {rollout_id})", "checkpoint")
    load_rollout_data: str | None = _f(None, "replay dumps from this path template (or one "
                                       "literal path, replayed every rollout)", "checkpoint")
    load_rollout_data_mode: str = _f("train-only", "train-only: no engine; forge: keep the "
                                     "engine and its weight syncs", "checkpoint",
                                     ("train-only", "forge"))
    debug_rollout_only: bool = _f(False, "generate, reward, dump (--save-rollout-data) and "
                                  "log, with no trainer and no optimizer", "checkpoint")
    debug_train_only: bool = _f(False, "slime's train-only debugging: what --load-rollout-data "
                                "in train-only mode does (no engine); requires it", "checkpoint")
    load_rollout_data_fallback: bool = _f(False, "replay rollout 0's dump when a rollout's "
                                          "dump is missing", "checkpoint")
    save_hf: str | None = _f(None, "write the trained weights as an HF checkpoint here, at the "
                             "end; a path with {rollout_id} (e.g. 'hf/iter_{rollout_id}') is "
                             "written every --save-hf-interval rollouts too", "checkpoint")
    save_hf_interval: int | None = _f(None, "rollouts between HF exports of a --save-hf "
                                      "{rollout_id} template; default --save-interval",
                                      "checkpoint")
    save_hf_max_shard_size: str = _f("5GB", "size limit of one safetensors shard", "checkpoint")
    save_hf_dtype: str | None = _f(None, "dtype of the exported weights; default: the model "
                                   "config's torch_dtype (the trainer may compute in fp32)",
                                   "checkpoint", SAVE_HF_DTYPES)
    save_hf_overwrite: bool = _f(False, "let --save-hf write into a non-empty directory no "
                                 "vime export wrote (only the exported files are replaced "
                                 "there; vime-only flag)", "checkpoint")
    allow_dataset_change: bool = _f(False, "let --load resume although --prompt-data changed "
                                    "since the checkpoint (size or content; vime-only flag)",
                                    "checkpoint")
    # logging
    run_dir: str = _f("runs/train", "metrics.jsonl, TensorBoard and plots go here (vime demo "
                      "uses runs/demo)", "logging")
    overwrite_run_dir: bool = _f(False, "a new run in a run dir that holds metrics moves them "
                                 "to <run-dir>/previous-<timestamp>/ (else: an error)", "logging")
    log_level: str = _f("info", "log level; debug logs on every rank", "logging", LOG_LEVELS)
    log_interval: int = _f(1, "rollouts between progress lines when stderr is not a terminal "
                           "(evals, skipped rollouts and the last rollout always print)",
                           "logging")
    use_wandb: bool = _f(False, "also log to Weights & Biases (pip install vime[wandb])",
                         "logging")
    wandb_project: str = _f("vime", "W&B project", "logging")
    wandb_group: str | None = _f(None, "W&B group", "logging")
    wandb_mode: str = _f("offline", "W&B mode; offline needs no network", "logging",
                         ("online", "offline", "disabled"))
    # input and training checks (issue 19)
    rollout_max_prompt_len: int | None = _f(None, "drop --prompt-data prompts longer than this "
                                            "many tokens at launch (counted in the log), as "
                                            "slime; default: keep all, and refuse a prompt "
                                            "that leaves no room for the response in the "
                                            "model's context", "data")
    reward_timeout: float | None = _f(None, "seconds one reward call may take; over it the "
                                      "run stops naming the sample (vime only)", "reward")
    skip_nonfinite_grad_steps: bool = _f(False, "skip an optimizer step whose gradient norm "
                                         "is NaN/inf and count it (skipped_steps) instead of "
                                         "stopping the run (vime only; Megatron skips only "
                                         "fp16 loss-scale overflows)", "optimizer")
    logprob_check: bool = _f(True, "--no-logprob-check: run with a rollout function that "
                             "returns no engine log-probs; the weight-sync check is then off "
                             "(metrics: logprob_check 0)", "loss")

    def __attrs_post_init__(self) -> None:
        _check_types(self)
        for name in ("rollout_num_turns", "rollout_batch_size", "log_interval",
                     "n_samples_per_prompt", "save_interval",
                     "n_samples_per_eval_prompt", "dynamic_sampling_max_rounds",
                     "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size",
                     "sglang_server_concurrency"):
            _at_least(name, getattr(self, name), 1)
        # global_batch_size, max_tokens_per_gpu, micro_batch_size: BatchingPolicy checks them
        for name in ("rollout_max_response_len", "num_epoch", "eval_interval",
                     "eval_max_response_len", "num_steps_per_rollout", "over_sampling_batch_size",
                     "lr_decay_iters", "expert_tensor_parallel_size",
                     "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                     "num_rollout", "save_hf_interval"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        for name in ("seed", "rollout_top_k", "lr_warmup_iters"):
            _at_least(name, getattr(self, name), 0)
        if self.eval_top_k is not None:
            _at_least("eval_top_k", self.eval_top_k, 0)
        for name in ("rollout_max_context_len", "eval_max_context_len"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 2)
        for name in ("rollout_stop_token_ids", "eval_stop_token_ids"):
            for tok in getattr(self, name) or ():
                _at_least(name, tok, 0)
        for name in ("rollout_stop", "eval_stop"):
            if any(not s for s in getattr(self, name) or ()):
                raise field_error(ConfigError, name, list(getattr(self, name)),
                                  "holds an empty string (it would stop at once)",
                                  "drop the empty entry")
        if self.rollout_seed is not None:
            _at_least("rollout_seed", self.rollout_seed, 0)
        for name, value in self._choices():
            _one_of(name, value, _field(name).metadata["choices"])
        self._check_numbers()
        try:
            self.check_switches()
        except ModelArgsError as exc:
            raise ConfigError(str(exc)) from None
        self._check_data()
        self._check_inputs()
        self._check_loss()
        if self.save_rollout_data is not None and "{rollout_id}" not in self.save_rollout_data:
            raise field_error(ConfigError, "save_rollout_data", self.save_rollout_data,
                              "lacks {rollout_id}: every rollout would overwrite one file",
                              "use e.g. 'dumps/rollout_{rollout_id}.npz'")
        self.model_options()  # recompute / MoE consistency (ModelOptions' own checks)
        if self.use_precision_aware_optimizer and not self.use_distributed_optimizer:
            raise field_error(ConfigError, "use_precision_aware_optimizer", True,
                              "needs the distributed optimizer (Megatron's rule)",
                              "pass --use-distributed-optimizer")
        if self.overlap_cpu_optimizer_d2h_h2d and not self.optimizer_cpu_offload:
            raise field_error(ConfigError, "overlap_cpu_optimizer_d2h_h2d", True,
                              "needs --optimizer-cpu-offload", "pass both, or drop it")
        if self.save_hf_interval is not None and not self.save_hf_is_template:
            raise field_error(ConfigError, "save_hf_interval", self.save_hf_interval,
                              "needs a --save-hf path with {rollout_id} (each export gets its "
                              "own directory)", "pass e.g. --save-hf 'hf/iter_{rollout_id}'")
        self.batching_policy()  # BatchingPolicy's own checks (max_tokens / micro_batch_size)
        self._check_async()
        self._check_steps()

    def _choices(self):
        for f in attrs.fields(type(self)):
            value = getattr(self, f.name)
            if f.metadata.get("choices") is not None and value is not None:
                yield f.name, value

    def _check_numbers(self) -> None:
        _in_range("rollout_temperature", self.rollout_temperature, 0.0, 100.0, "use 1.0")
        if self.eval_temperature is not None:
            _in_range("eval_temperature", self.eval_temperature, 0.0, 100.0, "use 1.0 or 0")
        _in_range("rollout_top_p", self.rollout_top_p, 1e-6, 1.0, "use 1.0")
        if self.eval_top_p is not None:
            _in_range("eval_top_p", self.eval_top_p, 1e-6, 1.0, "use 1.0")
        self.loss_config()  # the loss and optimizer knobs' ranges live in their records
        self.optim_config()
        for name in ("rs_lower_bound", "rs_upper_bound"):
            if getattr(self, name) is not None:
                _in_range(name, getattr(self, name), 0.0, 1e6, "use e.g. 0.5 / 2.0")
        if self.logprob_gap_tolerance is not None:
            _in_range("logprob_gap_tolerance", self.logprob_gap_tolerance, 0.0, 1e9,
                      "use 1e-4 (fp32), or omit it for the rollout dtype's default")
        try:
            check_gpu_memory_utilization(self.rollout_gpu_memory_utilization)
        except EngineLayoutError as exc:
            raise ConfigError(str(exc)) from exc
        if self.dynamic_sampling_max_rounds > MAX_GENERATION_ROUNDS:
            raise field_error(ConfigError, "dynamic_sampling_max_rounds",
                              self.dynamic_sampling_max_rounds,
                              f"exceeds {MAX_GENERATION_ROUNDS}, the rounds a rollout's seed "
                              "range holds", "raise --over-sampling-batch-size instead")
        if self.rollout_num_turns > 3:
            raise field_error(ConfigError, "rollout_num_turns", self.rollout_num_turns,
                              "must be 2 or 3", "use 2 (or the single-turn rollout)")

    def _check_async(self) -> None:
        _at_least("update_weights_interval", self.update_weights_interval, 1)
        if self.max_weight_staleness is None:
            return
        _at_least("max_weight_staleness", self.max_weight_staleness, 0)
        if not (self.train_async or self.fully_async):
            raise field_error(ConfigError, "max_weight_staleness", self.max_weight_staleness,
                              "bounds asynchronous training only",
                              "add --train-async or --fully-async, or drop it")

    @property
    def effective_max_weight_staleness(self) -> int:
        """``--max-weight-staleness``, default 1 (one step off's own staleness)."""
        return 1 if self.max_weight_staleness is None else self.max_weight_staleness

    def _check_data(self) -> None:
        if self.prompt_data is not None and self.rollout_max_response_len is None:
            raise field_error(ConfigError, "rollout_max_response_len", None,
                              "has no default with --prompt-data (the built-in tasks set it)",
                              "pass --rollout-max-response-len, e.g. 1024")
        if self.num_epoch is not None and self.prompt_data is None:
            raise field_error(ConfigError, "num_epoch", self.num_epoch, "needs --prompt-data",
                              "pass --num-rollout with a built-in task")
        if self.eval_prompt_data is not None and len(self.eval_prompt_data) % 2:
            raise field_error(ConfigError, "eval_prompt_data", list(self.eval_prompt_data),
                              "is not NAME PATH pairs",
                              "pass e.g. --eval-prompt-data gsm8k test.jsonl aime aime.jsonl")
        has_evals = self.eval_prompt_data is not None or self.eval_config is not None
        if self.eval_interval is not None and not has_evals:
            raise field_error(ConfigError, "eval_interval", self.eval_interval,
                              "needs --eval-prompt-data",
                              "pass e.g. --eval-prompt-data gsm8k test.jsonl")
        filtered = self.dynamic_sampling_filter_path is not None
        self._check_partial()
        if self.dynamic_sampling_fill_filtered and not filtered:
            raise field_error(ConfigError, "dynamic_sampling_fill_filtered", True,
                              "fills only what a dynamic-sampling filter removed",
                              "pass --dynamic-sampling-filter-path, or drop the flag")
        if self.over_sampling_batch_size is not None:
            if not filtered and not self.partial_rollout:
                raise field_error(ConfigError, "over_sampling_batch_size",
                                  self.over_sampling_batch_size,
                                  "over-samples only for a dynamic-sampling filter or a "
                                  "partial rollout",
                                  "pass --dynamic-sampling-filter-path or --partial-rollout, "
                                  "or drop the flag")
            if self.over_sampling_batch_size < self.rollout_batch_size:
                raise field_error(ConfigError, "over_sampling_batch_size",
                                  self.over_sampling_batch_size,
                                  f"is below rollout_batch_size={self.rollout_batch_size}",
                                  "draw at least as many prompts per round as a batch needs")
        compact = self.rollout_function_path.endswith("compact_rollout")
        if compact and self.group_rm:
            raise field_error(ConfigError, "group_rm", True,
                              "does not apply to compact_rollout (its reward is per turn)",
                              "use a per-sample --custom-rm-path")

    def _check_partial(self) -> None:
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise field_error(ConfigError, "mask_offpolicy_in_partial_rollout", True,
                              "has no effect without --partial-rollout",
                              "pass --partial-rollout, or drop the flag")
        if self.partial_rollout and (self.over_sampling_batch_size or 0) \
                <= self.rollout_batch_size:
            raise field_error(ConfigError, "partial_rollout", True,
                              "cuts nothing unless more groups are in flight than a rollout "
                              f"trains (--rollout-batch-size {self.rollout_batch_size})",
                              "pass --over-sampling-batch-size, e.g. "
                              f"{self.rollout_batch_size * 3 // 2}")
        per_sample = self.rollout_function_path in (DEFAULT_ROLLOUT_FUNCTION,
                                                    PER_SAMPLE_ROLLOUT_FUNCTION)
        if self.partial_rollout and not per_sample:
            raise field_error(ConfigError, "partial_rollout", True,
                              f"needs per-sample generation, not --rollout-function-path "
                              f"{self.rollout_function_path}",
                              "drop --rollout-function-path (or name "
                              f"{PER_SAMPLE_ROLLOUT_FUNCTION}) and pass your per-sample "
                              "function as --custom-generate-function-path")

    @property
    def effective_rollout_function_path(self) -> str:
        """The rollout function the loop runs: ``--rollout-function-path``, or the per-sample
        driver ``generate_rollout`` when the default is left and ``--custom-generate-function-
        path`` or ``--partial-rollout`` asks for per-sample generation."""
        if self.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION and (
                self.custom_generate_function_path is not None or self.partial_rollout):
            return PER_SAMPLE_ROLLOUT_FUNCTION
        return self.rollout_function_path

    def rejection_config(self) -> RejectionConfig | None:
        """The ``--use-rs`` settings as the core's record (None without ``--use-rs``); unset
        bounds default to the TIS clamp, as in slime's mis.py. Example: ``--use-tis
        --tis-clip 5 --tis-clip-low 0.5 --use-rs`` rejects tokens outside [0.5, 5] (IcePop)."""
        if not self.use_rs:
            return None
        lower = self.tis_clip_low if self.rs_lower_bound is None else self.rs_lower_bound
        upper = self.tis_clip if self.rs_upper_bound is None else self.rs_upper_bound
        return RejectionConfig(level=self.rs_level, lower=lower, upper=upper,
                               denominator=self.rs_denominator)

    def _check_rejection(self) -> None:
        if not self.use_rs:
            changed = [k for k, v in _rejection_defaults().items() if getattr(self, k) != v]
            if changed:
                raise field_error(ConfigError, changed[0], getattr(self, changed[0]),
                                  "has no effect without --use-rs", "pass --use-rs, or drop it")
            return
        lower = self.tis_clip_low if self.rs_lower_bound is None else self.rs_lower_bound
        upper = self.tis_clip if self.rs_upper_bound is None else self.rs_upper_bound
        if lower > upper:
            raise field_error(ConfigError, "rs_lower_bound", lower,
                              f"exceeds the band's cap {upper} (--rs-upper-bound, default "
                              "--tis-clip)", "pass a lower bound below the upper one")

    def _check_inputs(self) -> None:
        for name in ("seed", "rollout_seed"):  # torch and numpy seeds are 64-bit
            value = getattr(self, name)
            if value is not None and value >= 2**63:
                raise field_error(ConfigError, name, value, "must be below 2**63",
                                  "pass a smaller seed, e.g. 0")
        if self.rollout_max_prompt_len is not None:
            _at_least("rollout_max_prompt_len", self.rollout_max_prompt_len, 1)
        if self.reward_timeout is not None:
            _in_range("reward_timeout", self.reward_timeout, 1e-3, 1e6, "pass seconds, e.g. 30")
        names = list((self.eval_prompt_data or ())[::2])
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise field_error(ConfigError, "eval_prompt_data", list(self.eval_prompt_data),
                              f"names the eval set(s) {twice} more than once, and each name "
                              "keys its metrics (eval/<name>/...)",
                              "give every eval set its own name")

    def _check_loss(self) -> None:
        if self.lr_warmup_fraction is not None:
            _in_range("lr_warmup_fraction", self.lr_warmup_fraction, 0.0, 1.0, "use e.g. 0.03")
            if self.lr_warmup_iters or self.num_epoch is not None:
                raise field_error(ConfigError, "--lr-warmup-fraction", self.lr_warmup_fraction,
                                  "needs --num-rollout (not --num-epoch) and no "
                                  "--lr-warmup-iters", "pass one warmup length")
        bad = next((a for a in self.vllm_engine_args or () if "=" not in a.strip("=")), None)
        if bad is not None:
            raise field_error(ConfigError, "--vllm-engine-args", bad, "is not KEY=VALUE",
                              "pass e.g. --vllm-engine-args max_num_seqs=64")
        if self.debug_rollout_only:
            for name in ("load_rollout_data", "save", "load", "save_hf"):
                if getattr(self, name) is not None:
                    raise field_error(ConfigError, "--debug-rollout-only", True,
                                      f"builds no trainer, so --{name.replace('_', '-')} has "
                                      "nothing to act on", f"drop --{name.replace('_', '-')}")
        if self.debug_train_only and (self.load_rollout_data is None
                                      or self.load_rollout_data_mode != "train-only"):
            raise field_error(ConfigError, "--debug-train-only", True,
                              "trains on dumped rollouts without an engine",
                              "pass --load-debug-rollout-data PATH (train-only mode)")
        if not 0 <= self.kl_coef < 1e6:
            raise field_error(ConfigError, "--kl-coef", self.kl_coef, "must be >= 0",
                              "pass --kl-coef 0")
        if self.kl_coef != 0 and self.advantage_estimator not in ("grpo", "gspo"):
            raise field_error(ConfigError, "--kl-coef", self.kl_coef,
                              f"(slime's per-token KL reward shaping for "
                              f"{self.advantage_estimator}) is not supported in vime",
                              "pass --kl-coef 0, or train a KL penalty with --use-kl-loss "
                              "--kl-loss-coef")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise field_error(ConfigError, "--use-dynamic-batch-size", True,
                              "packs to --max-tokens-per-gpu, which is none",
                              "pass --max-tokens-per-gpu, e.g. 9216")
        if self.calculate_per_token_loss and self.loss_mode not in (None, "token_mean"):
            raise ConfigError(
                f"--calculate-per-token-loss contradicts --loss-mode {self.loss_mode}: slime's "
                "--calculate-per-token-loss means --loss-mode token_mean. Fix: drop one of "
                "the two flags.")
        if self.advantage_estimator == "gspo" and self.context_parallel_size > 1:
            raise ConfigError(
                f"--advantage-estimator gspo with --context-parallel-size "
                f"{self.context_parallel_size}: GSPO's sequence ratio averages a whole "
                "response, which context parallelism splits over ranks. Fix: use "
                "--context-parallel-size 1 with gspo.")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            raise field_error(ConfigError, "kl_loss_coef", self.kl_loss_coef,
                              "has no effect without --use-kl-loss",
                              "pass --use-kl-loss, or --kl-loss-coef 0")
        self._check_rejection()

    def _check_steps(self) -> None:
        groups = self.groups_per_rollout
        steps = self.num_steps_per_rollout
        if steps is not None and groups % steps:
            raise field_error(ConfigError, "num_steps_per_rollout", steps,
                              f"does not divide the {groups} groups of a rollout",
                              f"use a divisor of {groups}")
        if steps is not None and self.global_batch_size not in (None, groups // steps):
            raise ConfigError(
                f"--num-steps-per-rollout {steps} gives {groups // steps} groups per step "
                f"({groups} groups per rollout / {steps}), but --global-batch-size is "
                f"{self.global_batch_size}. Fix: drop one of the two flags (slime requires "
                "them to agree).")
        if groups % self.effective_global_batch_size and not self.partial_steps:
            raise field_error(
                ConfigError, "global_batch_size", self.effective_global_batch_size,
                f"does not divide the {groups} groups of a rollout (rollout_batch_size="
                f"{self.rollout_batch_size} x n_samples_per_prompt={self.n_samples_per_prompt})",
                f"use a divisor of {groups} (e.g. {groups}), or --allow-partial-train-step")

    @property
    def effective_loss_mode(self) -> str:
        """``--loss-mode``, or ``token_mean`` under ``--calculate-per-token-loss``."""
        if self.loss_mode is not None:
            return self.loss_mode
        return "token_mean" if self.calculate_per_token_loss else DEFAULT_LOSS_MODE

    @property
    def effective_global_batch_size(self) -> int:
        """Groups per optimizer step: ``--global-batch-size``, or the rollout's groups divided
        by ``--num-steps-per-rollout`` (slime's rule)."""
        if self.num_steps_per_rollout is not None:
            return self.groups_per_rollout // self.num_steps_per_rollout
        return (DEFAULT_GLOBAL_BATCH_SIZE if self.global_batch_size is None
                else self.global_batch_size)

    def resolved_num_rollout(self, dataset_rows: int | None) -> int:
        """Rollouts the run makes: ``--num-rollout``, else the rollouts ``--num-epoch``
        passes over ``dataset_rows`` prompts need, else the default (slime's precedence).

        Example: ``--num-epoch 3`` over 8 rows at ``--rollout-batch-size 4`` gives 6; with
        ``--num-rollout 2`` as well, 2.
        """
        if self.num_rollout is not None:
            return self.num_rollout
        if self.num_epoch is not None and dataset_rows is not None:
            # dynamic sampling may draw more prompts per rollout: a lower bound on the passes
            return -(-self.num_epoch * dataset_rows // self.rollout_batch_size)
        return DEFAULT_NUM_ROLLOUT

    @property
    def save_hf_is_template(self) -> bool:
        """``--save-hf`` holds ``{rollout_id}``: one export directory per interval."""
        return self.save_hf is not None and "{rollout_id}" in self.save_hf

    @property
    def partial_steps(self) -> bool:
        """``--allow-partial-train-step``, implied by dynamic sampling: a rollout may keep
        fewer prompts than ``--rollout-batch-size``, and its groups must still train (unless
        ``--dynamic-sampling-fill-filtered`` keeps every batch full)."""
        return self.allow_partial_train_step or (self.dynamic_sampling_filter_path is not None
                                                 and not self.dynamic_sampling_fill_filtered)

    @property
    def warmup_iters(self) -> int:
        """``--lr-warmup-iters``, or slime's ``--lr-warmup-fraction`` of the run's steps:
        0.1 of 300 rollouts x 1 step is 30 steps."""
        if self.lr_warmup_fraction is None:
            return self.lr_warmup_iters
        steps = self.num_rollout * (self.groups_per_rollout // self.effective_global_batch_size)
        return round(self.lr_warmup_fraction * steps)

    @property
    def effective_max_tokens_per_gpu(self) -> int | None:
        """The packing budget, or None for static micro-batches: slime's rule, where
        ``--micro-batch-size`` without ``--use-dynamic-batch-size`` is static (its
        ``--max-tokens-per-gpu`` then bounds nothing). Example: ``--micro-batch-size 4`` ->
        None; with ``--use-dynamic-batch-size`` the budget stays and the two conflict."""
        if self.micro_batch_size is not None and not self.use_dynamic_batch_size:
            return None
        return self.max_tokens_per_gpu

    @property
    def groups_per_rollout(self) -> int:
        """Rollout groups the built-in rollouts produce per batch: prompts x samples."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    def loss_config(self) -> LossConfig:
        """The objective's knobs, validated once by their record (``LossConfig``); its error is
        re-raised naming the flag. Example: ``--eps-clip 0`` -> ``--eps-clip=0: must lie in
        (0, 1). Fix: use e.g. 0.2.``"""
        try:
            return LossConfig(eps_clip=self.eps_clip, eps_clip_high=self.eps_clip_high,
                              dual_clip=self.eps_clip_c,
                              kl_coef=self.kl_loss_coef if self.use_kl_loss else 0.0,
                              kl_kind=self.kl_loss_type, entropy_coef=self.entropy_coef,
                              use_tis=self.use_tis, tis_clip=self.tis_clip,
                              tis_clip_low=self.tis_clip_low,
                              sequence_ratio=self.advantage_estimator == "gspo")
        except LossConfigError as exc:
            field, _, rest = str(exc).partition("=")
            raise ConfigError(f"{LOSS_FLAGS[field]}={rest}") from None

    def optim_config(self) -> OptimConfig:
        """Adam and the LR schedule, validated by their record (``OptimConfig``). Warmup and
        decay lengths are optimizer steps in the flags (as in slime) and groups in the trainer
        (its schedule advances by each step's real group count), so they are multiplied by the
        groups per full step: ``--lr-warmup-iters 10`` with 128 groups per step warms up over
        1280 groups."""
        per_step = self.effective_global_batch_size
        try:
            return OptimConfig(
                lr=self.lr, min_lr=self.min_lr, weight_decay=self.weight_decay,
                adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2, adam_eps=self.adam_eps,
                clip_grad=self.clip_grad, lr_warmup_groups=self.warmup_iters * per_step,
                lr_decay_groups=None if self.lr_decay_iters is None
                else self.lr_decay_iters * per_step,
                lr_decay_style=self.lr_decay_style,
                use_distributed_optimizer=self.use_distributed_optimizer,
                overlap_grad_reduce=self.overlap_grad_reduce,
                overlap_param_gather=self.overlap_param_gather,
                optimizer_cpu_offload=self.optimizer_cpu_offload,
                overlap_cpu_optimizer_d2h_h2d=self.overlap_cpu_optimizer_d2h_h2d,
                use_precision_aware_optimizer=self.use_precision_aware_optimizer,
                skip_nonfinite_grad_steps=self.skip_nonfinite_grad_steps)
        except OptimConfigError as exc:
            raise ConfigError(_flag_named(str(exc))) from None

    def reward_normalization(self) -> RewardNormalization:
        """How rewards become advantages (the core's record)."""
        return RewardNormalization(method=ESTIMATOR_METHOD[self.advantage_estimator],
                                   normalize_std=not self.disable_grpo_std_normalization,
                                   center=not self.disable_rewards_normalization,
                                   whiten=self.normalize_advantages)

    def model_options(self) -> ModelOptions:
        """The trainer's recompute and MoE settings (``vime_shell.megatron.model_options``)."""
        try:
            return ModelOptions(
                recompute_granularity=self.recompute_granularity,
                recompute_method=self.recompute_method,
                recompute_num_layers=self.recompute_num_layers,
                recompute_modules=self.recompute_modules, moe_router_topk=self.moe_router_topk,
                moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                moe_z_loss_coeff=self.moe_z_loss_coeff,
                moe_router_load_balancing_type=self.moe_router_load_balancing_type,
                moe_token_dispatcher_type=self.moe_token_dispatcher_type,
                moe_router_dtype=self.moe_router_dtype, moe_grouped_gemm=self.moe_grouped_gemm,
                moe_permute_fusion=self.moe_permute_fusion,
                moe_enable_routing_replay=self.use_rollout_routing_replay)
        except VimeError as exc:
            raise ConfigError(str(exc)) from exc

    def batching_policy(self) -> BatchingPolicy:
        """The scheduler's policy, from the one builder ``vime_pure.policy_from_flags``."""
        try:
            return policy_from_flags(
                global_batch_size=self.effective_global_batch_size,
                max_tokens_per_gpu=self.effective_max_tokens_per_gpu,
                micro_batch_size=self.micro_batch_size, packing=self.packing,
                balance=self.balance, balance_data=self.balance_data,
                balance_by_flops=self.balance_by_flops,
                allow_partial_train_step=self.partial_steps)
        except VimeError as exc:
            raise ConfigError(str(exc)) from exc

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def section(self, name: str) -> dict[str, Any]:
        """One section's settings (a view: the flat fields stay the one copy). Example:
        ``TrainConfig().section("loss")["eps_clip"] == 0.2``."""
        if name not in SECTIONS:
            raise field_error(ConfigError, "section", name, "is not a section",
                              f"use one of {list(SECTIONS)}")
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))
                if f.metadata["section"] == name}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "config") -> "TrainConfig":
        """Build from a mapping with ``snake_case`` or ``dash-case`` keys; unknown keys fail."""
        fields = {f.name for f in attrs.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in fields:
                close = difflib.get_close_matches(name, sorted(fields), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(fields)}"
                raise field_error(ConfigError, f"{source} key", key, "is not a setting", hint)
            out[name] = _from_text(attrs.fields_dict(cls)[name], value)
        return cls(**out)


def _flag_named(message: str) -> str:
    """A record's ``field=value: ...`` message with the field spelled as its flag."""
    field, _, rest = message.partition("=")
    return f"--{field.replace('_', '-')}={rest}"


def _field(name: str) -> attrs.Attribute:
    return attrs.fields_dict(TrainConfig)[name]


def field_type(f: attrs.Attribute) -> tuple[type, bool]:
    """The field's base type (``tuple`` for ``tuple[str, ...]``) and whether None is allowed."""
    args = get_args(f.type)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else f.type
    return get_origin(base) or base, optional


def _element_type(f: attrs.Attribute) -> type:
    """``int`` for a ``tuple[int, ...]`` setting, ``str`` for ``tuple[str, ...]``."""
    base = next(a for a in get_args(f.type) if a is not type(None)) if get_args(f.type) \
        and type(None) in get_args(f.type) else f.type
    return get_args(base)[0]


def _from_text(f: attrs.Attribute, value: Any) -> Any:
    """A float setting written as text becomes the number: PyYAML (YAML 1.1) reads ``lr: 3e-4``
    as the string ``"3e-4"`` (it wants ``3.0e-4``). Other text is left for the type check."""
    if isinstance(value, str) and f.type in (float, float | None):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_types(cfg: TrainConfig) -> None:
    for f in attrs.fields(type(cfg)):
        value = getattr(cfg, f.name)
        base, optional = field_type(f)
        if value is None and optional:
            continue
        ok = (isinstance(value, base) and not (base is int and isinstance(value, bool))
              or base is float and isinstance(value, int) and not isinstance(value, bool))
        if ok and base is tuple:
            kind = _element_type(f)
            ok = all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
        if not ok:
            raise field_error(ConfigError, f.name, value,
                              f"must be {'None or ' if optional else ''}"
                              f"a {base.__name__}", f"e.g. {f.name}={f.default!r}")


def _at_least(name: str, value: int, lo: int) -> None:
    if value < lo:
        raise field_error(ConfigError, name, value, f"must be >= {lo}", f"pass {name} >= {lo}")


def _rejection_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in attrs.fields(TrainConfig) if f.name.startswith("rs_")}


def _in_range(name: str, value: float, lo: float, hi: float, fix: str) -> None:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise field_error(ConfigError, name, value, f"must be in [{lo}, {hi}]", fix)


def _one_of(name: str, value: object, options: Sequence[object]) -> None:
    if value not in options:
        raise field_error(ConfigError, name, value, "is not a valid choice",
                          f"use one of {[o for o in options if o is not None]}")
