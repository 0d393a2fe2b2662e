"""Megatron's flags that slime scripts pass: the model architecture, the training switches and
Ray placement, as records ``TrainConfig`` is composed of (same flag names, one home each).

* :class:`ModelArchArgs`: ``--num-layers``, ``--hidden-size``, ``--swiglu``, ... (slime's
  ``scripts/models/*.sh``). vime builds the model from the HF config, so these are *checked*
  against it (:func:`check_architecture`): a mismatch is an error naming both values, so a
  script written for another checkpoint never trains the wrong shape silently.
* :class:`MegatronSwitchArgs`: the dropouts, ``--sequence-parallel``,
  ``--attention-backend``, ... Each is wired where vime has the setting (dropout must be 0)
  and otherwise accepted with the one-line note in ``NOTES`` (printed at launch).
* :class:`PlacementArgs`: ``--actor-num-nodes`` / ``--actor-num-gpus-per-node`` are checked
  against the ``torchrun`` world, which is what places ranks in vime.

Example: ``--num-layers 36`` against the embedded model (2 layers) raises ``--num-layers=36:
does not match .../config.json ("num_hidden_layers": 2) ...``.
"""

import json
import math
from typing import Any

import attrs

from vime_pure.errors import VimeError, field_error
from vime_shell.models.hf_config import MODEL_TYPE_ALIASES
from vime_shell.settings.common import setting_list
from vime_shell.settings.moe_architecture import (LayerPatternError, given_values,
                                                  hf_num_experts, moe_hf_values,
                                                  moe_layer_pattern)


# slime's --spec values -> the model types whose layers vime builds for it
SPEC_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "slime_plugins.models.glm4 get_glm_spec": ("glm4",),
    **dict.fromkeys(("slime_plugins.models.qwen3_5 get_qwen3_5_spec",
                     "miles_plugins.models.qwen3_5 get_qwen3_5_spec"),
                    ("qwen3_5_text", "qwen3_5_moe_text")),
    "slime_plugins.models.qwen3_next get_qwen3_next_spec": ("qwen3_next",),
    "slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec": ("minimax_m2",),
    **dict.fromkeys(("slime_plugins.models.glm5.glm5 get_glm5_spec",
                     "miles_plugins.models.glm5.glm5 get_glm5_spec"), ("glm_moe_dsa",))}
# config.json's count of multi-token prediction layers (Qwen3.5 / Qwen3-Next, DeepSeek-V3 / GLM)
MTP_KEYS: tuple[str, ...] = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
# the model types whose layers are Qwen3.5's: linear and gated attention, (1 + w) norms
GATED_DELTA_NET_TYPES: tuple[str, ...] = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


class ModelArgsError(VimeError):
    """A Megatron flag that contradicts the HF config or the launched world."""


def _f(help: str, section: str, choices: tuple | None = None, default: Any = None) -> Any:
    return attrs.field(default=default, metadata={"help": help, "section": section,
                                                  "choices": choices, "nargs": None})


def _arch(help: str) -> Any:
    return _f(f"{help}; checked against the HF config", "architecture")


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class ModelArchArgs:
    """Megatron model-architecture flags (checked, never used to build the model)."""

    num_layers: int | None = _arch("decoder layers")
    hidden_size: int | None = _arch("hidden size")
    ffn_hidden_size: int | None = _arch("MLP intermediate size")
    num_attention_heads: int | None = _arch("attention heads")
    group_query_attention: bool | None = _arch("grouped-query attention")
    num_query_groups: int | None = _arch("key-value heads")
    kv_channels: int | None = _arch("head dimension")
    vocab_size: int | None = _arch("vocabulary size")
    max_position_embeddings: int | None = _arch("context length of the position table")
    position_embedding_type: str | None = _f("position embedding; checked against the HF "
                                             "config", "architecture", ("rope",))
    use_rotary_position_embeddings: bool | None = _arch("RoPE")
    no_position_embedding: bool | None = _arch("no learned absolute position table (Megatron's "
                                               "switch; every family vime builds uses RoPE)")
    rotary_base: float | None = _arch("RoPE theta")
    rotary_percent: float | None = _arch("share of the head dimension rotated")
    normalization: str | None = _f("norm kind; checked against the HF config",
                                   "architecture", ("RMSNorm", "LayerNorm"))
    norm_epsilon: float | None = _arch("norm epsilon")
    swiglu: bool | None = _arch("SwiGLU MLP")
    disable_bias_linear: bool | None = _arch("linear layers without bias")
    add_qkv_bias: bool | None = _arch("bias on the QKV projection")
    qk_layernorm: bool | None = _arch("norm of queries and keys")
    apply_layernorm_1p: bool | None = _arch("norms scaled by 1 + w (Qwen3.5)")
    attention_output_gate: bool | None = _arch("attention output gated by sigmoid (Qwen3.5)")
    use_gated_attention: bool | None = _arch("Qwen3.5's gated attention (slime's alias of "
                                             "--attention-output-gate)")
    untie_embeddings_and_output_weights: bool | None = _arch("separate LM head")
    spec: tuple[str, ...] | None = setting_list(
        "slime's layer-spec plugin (MODULE FUNCTION); vime builds the layers from config.json, "
        "so it is checked to name that model's spec: "
        + "; ".join(f"{k} ({', '.join(t)})" for k, t in SPEC_MODEL_TYPES.items()),
        "architecture")
    post_self_attn_layernorm: bool | None = _arch("GLM-4's norm after attention")
    post_mlp_layernorm: bool | None = _arch("GLM-4's norm after the MLP")
    rotary_interleaved: bool | None = _arch("RoPE on interleaved pairs (GLM-4)")
    multi_latent_attention: bool | None = _arch("multi-latent attention (DeepSeek-V3, Kimi-K2, "
                                                "Moonlight: kv_lora_rank in config.json)")
    q_lora_rank: int | None = _arch("MLA query low-rank size (none: a full query projection)")
    kv_lora_rank: int | None = _arch("MLA key-value low-rank size")
    qk_head_dim: int | None = _arch("MLA query/key head size without RoPE (qk_nope_head_dim)")
    qk_pos_emb_head_dim: int | None = _arch("MLA query/key RoPE head size (qk_rope_head_dim)")
    v_head_dim: int | None = _arch("MLA value head size")
    num_experts: int | None = _arch("MoE experts")
    moe_ffn_hidden_size: int | None = _arch("MoE expert intermediate size")
    moe_shared_expert_intermediate_size: int | None = _arch("MoE shared-expert size")
    mtp_num_layers: int | None = _arch("multi-token prediction layers (the checkpoint's; "
                                       "trained with --enable-mtp-training, else --save-hf "
                                       "carries them unchanged)")
    softmax_type: str | None = _f("attention softmax: learnable is gpt-oss's per-head sinks; "
                                  "checked against the HF config (model_type gpt_oss has "
                                  "them, every other family vanilla)", "architecture",
                                  ("vanilla", "off-by-one", "learnable"))
    window_size: str | None = _f(
        "sliding-window attention as Megatron's LEFT,RIGHT; checked against the HF config's "
        "sliding_window W, which vime applies exactly as transformers does (the query and "
        "the W-1 tokens before it: W-1,0). miles' gpt-oss scripts write W,0 for the same "
        "checkpoint (Megatron's 129-token window for W=128); vime accepts it and still "
        "trains the checkpoint's W tokens", "architecture")
    window_attn_skip_freq: str | None = _f(
        "which layers slide: N (every N-th layer has full attention) or a 0/1 list such as "
        "'[1,0]*12' (1: sliding); checked against the HF config's layer_types",
        "architecture")
    make_vocab_size_divisible_by: int | None = _f(
        "vime never pads the vocabulary: TP must divide the HF vocab_size (checked)",
        "architecture")


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class MegatronSwitchArgs:
    """Megatron training switches slime passes through (module docstring)."""

    attention_dropout: float | None = _f("must be 0: RL log-prob ratios need a deterministic "
                                         "forward (vime always trains without dropout)",
                                         "megatron")
    hidden_dropout: float | None = _f("must be 0 (see --attention-dropout)", "megatron")
    sequence_parallel: bool | None = _f("Megatron's sequence parallelism with TP > 1 on "
                                        "TransformerEngine (packed rows padded to a multiple "
                                        "of TP); off at TP 1 (as in Megatron) and on the local "
                                        "spec (a launch note says which)", "megatron")
    attention_softmax_in_fp32: bool | None = _f("accepted; always on in vime", "megatron")
    enable_experimental: bool | None = _f("accepted; Megatron's switch for its experimental "
                                          "features, which slime's GLM-5 scripts pass for "
                                          "sparse attention: vime builds that (glm5_bridge) "
                                          "without it", "megatron")
    allgather_cp: bool | None = _f(
        "slime's all-gather context parallelism for DeepSeek-sparse-attention models (GLM-5): "
        "vime's sparse-attention layers always gather keys and values over CP; the tokens "
        "keep vime's zigzag split (slime's cuts the packed row in CP pieces), the same loss. "
        "With --context-parallel-size > 1 on another model it is refused, as slime refuses "
        "it", "megatron")
    accumulate_allreduce_grads_in_fp32: bool | None = _f("accepted; always on in vime "
                                                         "(fp32 gradient reduce)", "megatron")
    attention_backend: str | None = _f("accepted; vime picks the kernels by platform (TE on "
                                       "CUDA, torch on CPU)", "megatron",
                                       ("flash", "fused", "unfused", "local", "auto"))
    bf16: bool | None = _f("accepted; vime trains in bf16 on CUDA, fp32 on CPU", "megatron")
    masked_softmax_fusion: bool | None = _f("accepted; fusions are set by platform",
                                            "megatron")
    gradient_accumulation_fusion: bool | None = _f("accepted; fusions are set by platform",
                                                   "megatron")
    rope_fusion: bool | None = _f("accepted; fusions are set by platform", "megatron")
    check_for_nan_in_loss_and_grad: bool | None = _f("accepted; vime's loss checks are "
                                                     "its own", "megatron")
    log_probs_chunk_size: int | None = _f("accepted; vime computes log-probs per packed "
                                          "micro-batch (--max-tokens-per-gpu bounds memory; "
                                          "slime's -1, no chunking, is unset)", "megatron")
    transformer_impl: str | None = _f("accepted; vime picks the layer spec by platform "
                                      "(TransformerEngine on CUDA when installed, else local)",
                                      "megatron", ("transformer_engine", "local"))
    qkv_format: str | None = _f("accepted; vime packs by platform (thd with TransformerEngine, "
                                "block-diagonal masks on the local spec)", "megatron",
                                ("thd", "bshd", "sbhd"))
    deterministic_mode: bool | None = _f("accepted; CPU runs are deterministic for a --seed; "
                                         "on CUDA vime does not switch Megatron's or vLLM's "
                                         "kernels to deterministic ones", "megatron")
    moe_token_drop_policy: str | None = _f("accepted; vime's MoE is dropless (no capacity "
                                           "factor), so no token is dropped", "megatron",
                                           ("probs", "position"))
    moe_enable_deepep: bool | None = _f("accepted; DeepEP is vime's --moe-token-dispatcher-"
                                        "type flex (CUDA only; checked to agree)", "megatron")
    moe_router_bias_update_rate: float | None = _f("accepted; vime keeps a DeepSeek-V3 "
                                                   "router's expert bias as the checkpoint has "
                                                   "it (rate 0, as slime's scripts pass: an "
                                                   "RL step must not move the routing the "
                                                   "engine used); Qwen-style routers have "
                                                   "none", "megatron")

    # slime's own switches that change nothing in vime
    use_tensorboard: bool | None = _f("accepted; vime always writes TensorBoard events when "
                                      "tensorboard is installed (<run-dir>/tb)", "slime")
    check_weight_update_equal: bool | None = _f("accepted; vime checks every weight sync by the "
                                                "engine-trainer log-prob gap", "slime")
    no_save_optim: bool | None = _f("accepted; vime checkpoints always hold the optimizer "
                                    "state (an exact resume)", "slime")
    megatron_to_hf_mode: str | None = _f("accepted; vime converts with its own bridge",
                                         "slime", ("bridge", "raw"))
    data_pad_size_multiplier: int | None = _f("accepted; vime pads packed rows to what the "
                                              "layout needs", "slime")
    train_backend: str | None = _f("accepted; vime trains with Megatron-core (miles' fsdp: "
                                   "data parallelism over the ranks with the distributed "
                                   "optimizer's sharded state, the same loss and gradients)",
                                   "slime", ("megatron", "fsdp"))
    # miles' FSDP backend's switches
    gradient_checkpointing: bool | None = _f("accepted; miles' FSDP activation checkpointing "
                                             "is Megatron's full-layer recompute, set unless "
                                             "--recompute-granularity is given", "slime")
    attn_implementation: str | None = _f("accepted; the HF attention kernel of miles' FSDP "
                                         "backend; vime's Megatron layers pick theirs by "
                                         "platform", "slime")
    dump_details: str | None = _f("accepted; vime dumps each rollout batch under "
                                  "DIR/rollout_data (--save-rollout-data) and logs the "
                                  "training numbers in metrics.jsonl; miles' train-data, "
                                  "trajectory and event dumps have no vime counterpart",
                                  "slime")
    train_env_vars: str | None = _f("accepted; a JSON object of environment variables, set in "
                                    "every training rank before the trainer is built (miles "
                                    "sets them on its Ray actors)", "slime")
    model_name: str | None = _f("accepted; vime reads the architecture from --hf-checkpoint "
                                "and converts with its own bridge", "slime")
    use_rollout_logprobs: bool | None = _f("accepted; vime's PPO ratio uses the trainer's "
                                           "log-probs as pi_old (the engine's feed --use-tis / "
                                           "--use-rs and the weight-sync check)", "slime")
    update_weight_mode: str | None = _f("accepted; vime syncs full weights in-process over "
                                        "torch.distributed (--update-weight-buffer-size)",
                                        "slime", ("full", "delta"))
    update_weight_transport: str | None = _f("accepted; vime syncs in-process (no NCCL group "
                                             "of its own, no disk)", "slime", ("nccl", "disk"))
    update_weight_transfer_mode: str | None = _f("accepted; vime syncs in-process, bucketed "
                                                 "by --update-weight-buffer-size", "slime")
    update_weight_disk_dir: str | None = _f("accepted; vime syncs in-process and writes "
                                            "nothing there", "slime")
    update_weight_local_checkpoint_dir: str | None = _f("accepted; vime syncs in-process and "
                                                        "writes nothing there", "slime")
    update_weight_delta_encoding: str | None = _f("accepted; vime syncs full weights",
                                                  "slime")
    update_weight_delta_checksum: str | None = _f("accepted; vime syncs full weights and "
                                                  "checks each sync by the log-prob gap",
                                                  "slime", ("xxh3-128", "blake3", "adler32"))
    wandb_always_use_train_step: bool | None = _f("accepted; vime logs one W&B record per "
                                                  "rollout, its step the rollout index",
                                                  "slime")
    use_fault_tolerance: bool | None = _f("accepted; vime checks every rank's health always "
                                          "(--rollout-health-check-*) but cannot restart a "
                                          "rank of a torchrun job: a rank that stops "
                                          "answering ends the job, resume with --load",
                                          "slime")

    def check_switches(self) -> None:
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if value is not None and value != 0:
                raise field_error(ModelArgsError, _flag(name), value,
                                  "is not supported: vime trains without dropout (the PPO "
                                  "ratio compares two forwards of the same weights)",
                                  f"pass {_flag(name)} 0.0 or drop it")
        dispatcher = getattr(self, "moe_token_dispatcher_type", None)  # a MoE record's field
        if self.moe_enable_deepep and dispatcher not in (None, "flex"):
            raise field_error(ModelArgsError, "--moe-enable-deepep", True,
                              f"needs --moe-token-dispatcher-type flex, not {dispatcher}", "pass both, as Megatron "
                              "requires, or drop --moe-enable-deepep")
        if self.log_probs_chunk_size is not None and self.log_probs_chunk_size < 1:
            raise field_error(ModelArgsError, "--log-probs-chunk-size",
                              self.log_probs_chunk_size, "must be >= 1", "drop it")
        self.train_env()

    def train_env(self) -> dict[str, str]:
        """``--train-env-vars`` as a mapping (empty when unset). Example: ``'{"A": "1"}'``
        gives ``{"A": "1"}``; anything but a JSON object of strings is an error."""
        if self.train_env_vars is None:
            return {}
        try:
            env = json.loads(self.train_env_vars)
        except ValueError as exc:
            raise field_error(ModelArgsError, "--train-env-vars", self.train_env_vars,
                              f"is not JSON ({exc})", "pass e.g. '{\"NAME\": \"value\"}'"
                              ) from None
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise field_error(ModelArgsError, "--train-env-vars", self.train_env_vars,
                              "is not a JSON object of strings",
                              "pass e.g. '{\"NAME\": \"value\"}'")
        return env


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class PlacementArgs:
    """slime's Ray placement, checked against the ``torchrun`` world that places vime's ranks."""

    actor_num_nodes: int | None = _f("checked: must equal torchrun's --nnodes (WORLD_SIZE / "
                                     "LOCAL_WORLD_SIZE)", "placement")
    actor_num_gpus_per_node: int | None = _f("checked: must equal torchrun's "
                                             "--nproc-per-node (LOCAL_WORLD_SIZE)", "placement")
    num_gpus_per_node: int | None = _f("checked as --actor-num-gpus-per-node: engines and "
                                       "trainer share the torchrun ranks", "placement")

    def check_placement(self, *, world_size: int, ranks_per_node: int | None) -> None:
        """Without torchrun (no ``LOCAL_WORLD_SIZE``) the world is one node."""
        ranks_per_node = ranks_per_node or world_size
        nodes = max(1, world_size // max(1, ranks_per_node))
        for name, want, torchrun in (("actor_num_gpus_per_node", ranks_per_node,
                                      "--nproc-per-node"),
                                     ("num_gpus_per_node", ranks_per_node, "--nproc-per-node"),
                                     ("actor_num_nodes", nodes, "--nnodes")):
            value = getattr(self, name)
            if value is not None and value != want:
                raise field_error(ModelArgsError, _flag(name), value,
                                  f"does not match the launched world ({torchrun} {want}, "
                                  f"world size {world_size}); torchrun places vime's ranks",
                                  f"launch with torchrun {torchrun} {value}, or drop the flag")


# wired where they have a meaning (sequence_parallel's note: cli/train.launch_notes)
NOTED = tuple(f.name for f in attrs.fields(MegatronSwitchArgs)
              if f.name not in ("attention_dropout", "hidden_dropout",
                                "sequence_parallel"))


def notes(cfg: Any) -> list[str]:
    """One line per accepted switch that has no effect in vime, for the launch log."""
    return [f"{_flag(name)}: {attrs.fields_dict(MegatronSwitchArgs)[name].metadata['help']}"
            for name in NOTED if getattr(cfg, name) is not None]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _hf_values(hf: dict[str, Any]) -> dict[str, Any]:
    """What each architecture flag means in HF config terms (absent keys: unknown)."""
    heads = hf.get("num_attention_heads")
    hidden = hf.get("hidden_size")
    kind = hf.get("model_type")
    qkv_bias = hf.get("attention_bias", MODEL_TYPE_ALIASES.get(str(kind), kind) == "qwen2")
    act = hf.get("hidden_act")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    mla = hf.get("kv_lora_rank") is not None
    glm4 = hf.get("model_type") == "glm4"
    gated = hf.get("model_type") in GATED_DELTA_NET_TYPES
    out = {
        # 0 for a checkpoint without MTP layers (Megatron builds none for 0)
        "mtp_num_layers": next((hf[k] for k in MTP_KEYS if hf.get(k) is not None), 0),
        "apply_layernorm_1p": gated, "attention_output_gate": gated,
        "use_gated_attention": gated,
        "post_self_attn_layernorm": glm4, "post_mlp_layernorm": glm4,
        "softmax_type": "learnable" if kind == "gpt_oss" else "vanilla",
        # MLA de-interleaves its RoPE dims itself (slime's MLA scripts pass no such flag)
        "rotary_interleaved": None if mla else glm4,
        "multi_latent_attention": mla, "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": hf.get("kv_lora_rank"), "qk_head_dim": hf.get("qk_nope_head_dim"),
        "qk_pos_emb_head_dim": hf.get("qk_rope_head_dim"), "v_head_dim": hf.get("v_head_dim"),
        "num_layers": hf.get("num_hidden_layers"), "hidden_size": hidden,
        "ffn_hidden_size": hf.get("intermediate_size"), "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        # MLA's heads are the five sizes below; Megatron reads no kv_channels for them, and
        # slime's MLA scripts pass unrelated values (DeepSeek 128, Kimi-K2 64): not checked
        "kv_channels": None if mla else hf.get("head_dim") or (
            hidden // heads if hidden and heads else None),
        "vocab_size": hf.get("vocab_size"),
        "max_position_embeddings": hf.get("max_position_embeddings"),
        "no_position_embedding": True,  # RoPE everywhere: no family has a learned table
        # transformers 5 writes RoPE settings under rope_parameters
        "rotary_base": hf.get("rope_theta", rope.get("rope_theta")),
        "rotary_percent": hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)),
        "norm_epsilon": hf.get("rms_norm_eps", hf.get("layer_norm_eps")),
        "normalization": "RMSNorm" if "rms_norm_eps" in hf else None,
        "swiglu": act in ("silu", "swish") if act else None,
        # Megatron's MLA projections have no bias whatever --add-qkv-bias says (slime's
        # GLM-4.7 model file passes it): not checked under MLA
        "add_qkv_bias": None if mla else bool(qkv_bias),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
        "num_experts": hf_num_experts(hf),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size"),
        # Qwen2-MoE's width, or DeepSeek's and GLM-4.5's experts x moe_intermediate_size
        "moe_shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size") or (
            hf["n_shared_experts"] * hf["moe_intermediate_size"]
            if hf.get("n_shared_experts") and hf.get("moe_intermediate_size") else None),
    }
    qk_norm = {"qwen3": True, "qwen3_moe": True, **dict.fromkeys(GATED_DELTA_NET_TYPES, True),
               "minimax_m2": True, "qwen2": False, "gpt_oss": False,
               "qwen2_moe": False, "llama": False, "mistral": False}
    out["qk_layernorm"] = True if mla else hf.get("use_qk_norm", qk_norm.get(  # GLM-4.5's key
        str(hf.get("model_type"))))
    return out


def spec_refusal(spec: str) -> str:
    """Why vime does not build the layer spec ``spec`` (``MODULE FUNCTION`` or ``MODULE``):
    every spec of slime's and miles' scripts is in ``SPEC_MODEL_TYPES``, so another is one
    vime does not know."""
    return "a layer spec vime does not build"


def check_spec(spec: tuple[str, ...] | None, model_type: Any, hf_dir: str) -> None:
    """``--spec MODULE FUNCTION`` names the layer spec of ``model_type`` that vime builds;
    the specs vime does not build are refused with their reason."""
    if spec is None:
        return
    key = " ".join(spec)
    if key not in SPEC_MODEL_TYPES:
        raise field_error(ModelArgsError, "--spec", key,
                          f"not supported in vime ({spec_refusal(key)})",
                          f"vime builds the layers from config.json; the specs it knows: "
                          f"{list(SPEC_MODEL_TYPES)}")
    if model_type not in SPEC_MODEL_TYPES[key]:
        raise field_error(ModelArgsError, "--spec", key,
                          f"is the spec of {' or '.join(SPEC_MODEL_TYPES[key])}, and "
                          f"{hf_dir}/config.json has "
                          f'"model_type": {model_type!r}', "drop --spec, or pass the "
                          "--hf-checkpoint the script was written for")


def check_architecture(cfg: Any, hf: dict[str, Any], hf_dir: str) -> None:
    """Every architecture flag given equals what the HF config says (module docstring)."""
    check_spec(cfg.spec, hf.get("model_type"), hf_dir)
    want = _hf_values(hf)
    for name, actual in want.items():
        given = getattr(cfg, name)
        if given is None or actual is None:
            continue
        same = (math.isclose(float(given), float(actual), rel_tol=1e-6)
                if isinstance(given, float) else given == actual)
        if not same:
            raise field_error(ModelArgsError, _flag(name), given,
                              f"does not match {hf_dir}/config.json "
                              f"({_config_says(name, actual, hf)})",
                              f"{_fix(name, actual)} (the checkpoint's "
                              "value), or the --hf-checkpoint the script was written for")
    hf_moe = moe_hf_values(hf)
    for name, given in given_values(cfg, hf.get("num_hidden_layers")).items():
        actual = hf_moe[name]
        same = (math.isclose(float(given), float(actual), rel_tol=1e-6)
                if isinstance(given, float) and actual is not None else given == actual)
        if actual is not None and not same:
            raise field_error(ModelArgsError, _flag(name), getattr(cfg, name),
                              f"does not match {hf_dir}/config.json ({_moe_hf_text(name)}: "
                              f"{actual!r})", "pass the checkpoint's value, or the "
                              "--hf-checkpoint the script was written for")
    _check_window(cfg, hf, hf_dir)
    if cfg.disable_bias_linear and want["add_qkv_bias"] and not cfg.add_qkv_bias:
        raise field_error(ModelArgsError, "--disable-bias-linear", True,
                          f"but the HF config of {hf_dir} has QKV biases", "add --add-qkv-bias")


def sliding_layers(hf: dict[str, Any]) -> list[int] | None:
    """config.json's sliding layers as Megatron's 0/1 list (1: sliding), None without a
    sliding window (``sliding_window`` unset, or no ``sliding_attention`` layer)."""
    types = hf.get("layer_types")
    if not hf.get("sliding_window") or not isinstance(types, list) \
            or "sliding_attention" not in types:
        return None
    return [int(t == "sliding_attention") for t in types]


def _check_window(cfg: Any, hf: dict[str, Any], hf_dir: str) -> None:
    """``--window-size`` and ``--window-attn-skip-freq`` describe config.json's sliding
    window and its layers (the flags' help says how)."""
    layers = sliding_layers(hf)
    where = f"{hf_dir}/config.json"
    for name in ("window_size", "window_attn_skip_freq"):
        if getattr(cfg, name) is not None and layers is None:
            raise field_error(ModelArgsError, _flag(name), getattr(cfg, name),
                              f"describes sliding-window attention, and {where} has none "
                              '(no "sliding_window" with "sliding_attention" layer_types)',
                              "drop it, or pass the --hf-checkpoint the script was written for")
    if layers is None:
        return
    width = int(hf["sliding_window"])
    if cfg.window_size is not None:
        given = cfg.window_size.replace(" ", "").strip("()[]")
        if given not in (f"{width - 1},0", f"{width},0"):
            raise field_error(ModelArgsError, "--window-size", cfg.window_size,
                              f'does not match {where} ("sliding_window": {width}: the query '
                              f"and the {width - 1} tokens before it)",
                              f"pass --window-size {width - 1},0 (miles' {width},0 is "
                              "accepted too), or drop it")
    if cfg.window_attn_skip_freq is not None:
        text = cfg.window_attn_skip_freq
        try:
            pattern = [int(i % int(text) != 0) for i in range(1, len(layers) + 1)] \
                if text.strip().isdigit() else moe_layer_pattern(text, len(layers))
        except (LayerPatternError, ZeroDivisionError):
            raise field_error(ModelArgsError, "--window-attn-skip-freq", text,
                              "is neither a positive int nor a 0/1 list written as Python",
                              "pass e.g. 2 or '[1,0]*12'") from None
        if pattern != layers:
            raise field_error(ModelArgsError, "--window-attn-skip-freq", text,
                              f'does not match {where} ("layer_types": sliding layers '
                              f"{layers}, 1 sliding)", "pass that list, or drop it")


def _moe_hf_text(name: str) -> str:
    """Where :func:`moe_hf_values` read ``name``'s value from, for the error."""
    return {"moe_layer_freq": "its MoE layers (first_k_dense_replace / mlp_only_layers / "
            "decoder_sparse_step)", "moe_router_score_function": "scoring_func",
            "moe_router_pre_softmax": "not norm_topk_prob",
            "moe_router_topk_scaling_factor": "routed_scaling_factor",
            "moe_router_num_groups": "n_group", "moe_router_group_topk": "topk_group",
            "moe_router_enable_expert_bias": "topk_method == 'noaux_tc'",
            "moe_shared_expert_gate": "model_type's shared-expert gate",
            "rope_type": "rope_scaling.rope_type", "rotary_scaling_factor": "rope_scaling.factor",
            }.get(name, f"rope_scaling.{name}")


def _config_says(name: str, actual: Any, hf: dict[str, Any]) -> str:
    """What config.json holds for flag ``name``: its key and value as written, and what that
    means for the flag when the flag's value is derived (``"hidden_act": 'gelu'`` means no
    ``--swiglu``), never the derived value alone (``"hidden_act": False`` misled)."""
    key = _hf_key(name)
    if key not in hf or hf[key] == actual:
        return f'"{key}": {actual!r}'
    means = (("" if actual else "no ") + _flag(name)) if isinstance(actual, bool) \
        else f"{_flag(name)} {actual!r}"
    return f'"{key}": {hf[key]!r}, which means {means}'


def _hf_key(name: str) -> str:
    return {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
            "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim",
            "rotary_base": "rope_theta", "rotary_percent": "partial_rotary_factor",
            "norm_epsilon": "rms_norm_eps", "normalization": "rms_norm_eps",
            "swiglu": "hidden_act", "add_qkv_bias": "attention_bias",
            "untie_embeddings_and_output_weights": "not tie_word_embeddings",
            "num_experts": "num_experts", "moe_ffn_hidden_size": "moe_intermediate_size",
            "qk_layernorm": "model_type's q/k norm", "multi_latent_attention": "kv_lora_rank",
            "qk_head_dim": "qk_nope_head_dim", "qk_pos_emb_head_dim": "qk_rope_head_dim",
            "post_self_attn_layernorm": "model_type", "post_mlp_layernorm": "model_type",
            "rotary_interleaved": "model_type", "apply_layernorm_1p": "model_type",
            "attention_output_gate": "model_type", "use_gated_attention": "model_type",
            "mtp_num_layers": "mtp_num_hidden_layers / num_nextn_predict_layers",
            "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
            }.get(name, name)


def _fix(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{'pass' if value else 'drop'} {_flag(name)}"
    return f"pass {_flag(name)} {value}"
