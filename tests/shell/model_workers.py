"""Model-feature runs inside the shared Megatron spawn (``megatron_workers.all_layouts_worker``):
activation recompute, Llama-3 RoPE, Qwen2-/Qwen3-MoE with expert parallelism.

Every run trains the two synthetic rollouts of ``megatron_workers`` (4 Adam steps) and
records the per-step losses, the last step's reduced gradient, the final HF weights and how
often each decoder layer's modules ran forward (recompute runs them again in the backward).
"""

import time

import numpy as np

from tests.shell.routing_workers import routing_runs
from tests.shell.megatron_workers import (ROLLOUT_SEEDS, _hf_log_probs, _logit_diff, _main_grads,
                                          _in_batch, _max_diff, _optim, _scored,
                                          rank_rollout)

RECOMPUTE = {
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective",
                      recompute_modules=("core_attn", "mlp", "layernorm")),
}
AUX = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
# MoE runs on the 2-rank world: (name, trainer kwargs, ModelOptions kwargs)
MOE_TWO_RANKS = (("ep2", {"ep": 2}, {}),
                 ("ep2_recompute", {"ep": 2}, RECOMPUTE["full_uniform"]),
                 ("ep2_aux", {"ep": 2}, AUX),
                 ("dp2_aux", {}, AUX))


def _count_forwards(trainer) -> dict[str, int]:
    """Forward calls of every decoder layer's MLP (an MoE layer's experts) and core attention
    (hooks)."""
    counts = {"mlp": 0, "core_attention": 0}

    def hook(kind):
        def count(module, args, output):
            counts[kind] += 1
        return count

    for chunk in trainer.model:
        for layer in chunk.module.decoder.layers:
            getattr(layer.mlp, "experts", layer.mlp).register_forward_hook(hook("mlp"))
            # a linear-attention layer (Qwen3.5's) counts as its attention
            getattr(layer.self_attention, "core_attention", layer.self_attention) \
                .register_forward_hook(hook("core_attention"))
    return counts


def _offload_round_trip(trainer, out: dict) -> None:
    """``--offload-train`` between two rollouts: what it frees, and that it comes back."""
    params = [p for chunk in trainer.model for p in chunk.parameters()]
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    report = trainer.offload()
    out["offload"] = {"bytes": report.bytes, "storages": report.storages,
                      "param_bytes_left": sum(p.untyped_storage().nbytes() for p in params),
                      "param_bytes": sum(p.numel() * p.element_size() for p in params)}
    trainer.reload()
    after = trainer.hf_state_dict()
    out["offload"]["roundtrip_max"] = max(float((after[k] - before[k]).abs().max())
                                          for k in before)


def train_run(hf_dir: str, options: dict | None = None, with_parity: bool = False,
              offload: bool = False, recompute_loss: bool = False, **trainer_kwargs) -> dict:
    """Train both rollouts under ``options`` (``ModelOptions`` fields); see the module.
    ``offload``: an ``--offload-train`` round trip between the rollouts;
    ``recompute_loss``: ``--recompute-loss-function``."""
    import torch
    from transformers import AutoModelForCausalLM

    from vime_pure import with_log_probs
    from vime_shell.megatron.model_options import ModelOptions
    from vime_shell.megatron.trainer import MegatronTrainer, TrainerConfig
    from vime_shell.models.auto_config import auto_config

    t0 = time.perf_counter()
    config = TrainerConfig(optim=_optim(False), model=ModelOptions(**(options or {})),
                           recompute_loss_function=recompute_loss)
    trainer = MegatronTrainer.from_hf(hf_dir, config, **trainer_kwargs)
    vocab = trainer.bridge.hf_config.vocab_size
    out: dict = {"losses": [], "forwards": []}
    if with_parity:
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, config=auto_config(hf_dir),
                                                         dtype=torch.float32)
        out["logit_max"] = _logit_diff(trainer, hf_model, vocab)
        out["export_keys"] = sorted(trainer.hf_state_dict())
    counts = _count_forwards(trainer)
    for r, seed in enumerate(ROLLOUT_SEEDS):
        if offload and r == 1:
            _offload_round_trip(trainer, out)
        batch, _, mine = rank_rollout(vocab, seed, trainer)
        old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
        if with_parity and r == 0:
            out["hf_logprob_max"] = _max_diff(_in_batch(mine, old, batch),
                                              _hf_log_probs(hf_model, batch), _scored(mine))
        before = dict(counts)
        results = trainer.train(with_log_probs(mine, old_log_probs=old))
        out["losses"].extend(res.metrics["loss"] for res in results)
        out["forwards"].append({k: counts[k] - before[k] for k in counts})
        out["microbatches"] = sum(res.num_microbatches for res in results)
    out["grad"] = _main_grads(trainer)
    out["final"] = {k: v.numpy() for k, v in trainer.hf_state_dict().items()}
    out["chunk_layers"] = [len(chunk.module.decoder.layers) for chunk in trainer.model]
    out["transformer"] = {k: getattr(trainer.bridge.config, k) for k in (
        "recompute_granularity", "recompute_method", "num_moe_experts", "moe_router_pre_softmax",
        "moe_shared_expert_gate", "expert_model_parallel_size")}
    trainer.shutdown()
    out["seconds"] = time.perf_counter() - t0
    return out


def llama3_run(hf_dir: str) -> dict:
    """Llama-3.x RoPE: the rotary frequencies against transformers', 48-position logits, one
    training rollout."""
    import torch
    from transformers import AutoModelForCausalLM

    from vime_shell.megatron.trainer import MegatronTrainer
    from vime_shell.models.auto_config import auto_config

    trainer = MegatronTrainer.from_hf(hf_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, config=auto_config(hf_dir),
                                                     dtype=torch.float32)
    ours = trainer.model[0].module.rotary_pos_emb.inv_freq
    toks = torch.as_tensor(np.random.default_rng(7).integers(0, 128, (1, 48)))
    with torch.no_grad():
        logits = trainer.model[0](toks, torch.arange(48)[None], None)
        ref = hf_model(toks).logits
    dim = hf_model.config.head_dim
    plain = 1.0 / hf_model.config.rope_parameters["rope_theta"] ** (
        torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    out = {"inv_freq_max": float((ours - hf_model.model.rotary_emb.inv_freq).abs().max()),
           "scaled_dims": int((hf_model.model.rotary_emb.inv_freq != plain).sum()),
           "logit_max": float((logits - ref).abs().max())}
    trainer.shutdown()
    out.update(train_run(hf_dir))
    return out


def streaming_export_run(hf_dir: str, limit: int = 40_000) -> dict:
    """``--save-hf`` streamed: the trainer's buckets, cast to bf16 as the loop does, into the
    writer with a small shard limit; the most exported bytes alive at once (every bf16 host
    copy tracked until it is freed), against the model's size."""
    import tempfile
    import weakref

    from safetensors.torch import load_file

    from vime_shell.megatron.trainer import MegatronTrainer
    from vime_shell.run.hf_save import as_export_dtype
    from vime_shell.storage.hf_export import save_hf_checkpoint

    trainer = MegatronTrainer.from_hf(hf_dir)
    alive = {"now": 0, "peak": 0}

    def release(size: int) -> None:
        alive["now"] -= size

    def tracked():
        for exported in trainer.hf_buckets(limit):  # as --save-hf does it, in bf16
            bucket = list(as_export_dtype(dict(exported), "bfloat16").items())
            del exported
            for name, tensor in bucket:
                size = tensor.numel() * tensor.element_size()
                alive["now"] += size
                alive["peak"] = max(alive["peak"], alive["now"])
                weakref.finalize(tensor, release, size)
            yield from bucket
            del bucket

    with tempfile.TemporaryDirectory() as root:
        target = save_hf_checkpoint(tracked(), source_dir=hf_dir, target_dir=f"{root}/hf",
                                    max_shard_size=limit)
        shards = sorted(target.glob("model-*.safetensors"))
        exported = {k: v for shard in shards for k, v in load_file(shard).items()}
    reference = trainer.hf_state_dict()
    trainer.shutdown()
    return {"peak": alive["peak"], "limit": limit, "shards": len(shards),
            "dtypes": sorted({str(t.dtype) for t in exported.values()}),
            "model_bytes": sum(t.numel() * 2 for t in reference.values()),
            "largest": max(t.numel() * 2 for t in reference.values()),
            "max_diff": max(float((exported[k].float() - reference[k].bfloat16().float())
                                  .abs().max()) for k in reference),
            "keys_equal": set(exported) == set(reference)}


def features_two_ranks(dirs: dict[str, str]) -> dict:
    """The MoE runs of ``MOE_TWO_RANKS`` and the routing-replay runs on the 2-rank world."""
    out = {name: train_run(dirs["qwen3_moe"], options, with_parity=name == "ep2", **kwargs)
           for name, kwargs, options in MOE_TWO_RANKS}
    out["routing"] = routing_runs(dirs["qwen3_moe"])  # R3, test_routing_replay
    # 6 layers as 4 + 2, each stage in 2 virtual stages (chunks of 2 and of 1 layer)
    out["uneven"] = train_run(dirs["dense6"], pp=2, first_stage_layers=4)
    out["uneven_vpp"] = train_run(dirs["dense6"], pp=2, first_stage_layers=4,
                                  num_virtual_stages=2)
    return out


def features_one_rank(dirs: dict[str, str]) -> dict:
    """World of 1: recompute variants (dense and MoE), Llama-3 RoPE, the EP1 MoE reference,
    Qwen2-MoE (shared expert gate)."""
    out = {"dense_none": train_run(dirs["dense"])}
    out.update({f"dense_{name}": train_run(dirs["dense"], opts)
                for name, opts in RECOMPUTE.items()})
    out["dense_offload"] = train_run(dirs["dense"], offload=True)
    out["dense_recompute_loss"] = train_run(dirs["dense"], recompute_loss=True)
    out["streaming_export"] = streaming_export_run(dirs["dense"])
    out["moe_ep1"] = train_run(dirs["qwen3_moe"], with_parity=True)
    out["moe_ep1_recompute_moe"] = train_run(
        dirs["qwen3_moe"], dict(recompute_granularity="selective", recompute_modules=("moe",)))
    out["qwen2_moe"] = train_run(dirs["qwen2_moe"], with_parity=True)
    out["llama3"] = llama3_run(dirs["llama3"])
    out["dense6"] = train_run(dirs["dense6"])  # the uneven pipelines' DP1 reference
    return out
