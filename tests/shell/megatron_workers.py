"""Code the Megatron shell tests run inside spawned processes (module level, so it pickles).

One spawn of 2 gloo processes runs every layout in turn (DP2, DP2 + distributed optimizer +
overlap, TP2, PP2, PP2xVPP2), then tears the process group down and runs DP1 on rank 0: each
process pays megatron's import cost once. For every layout it records the HF round trip, the
log-prob and logit parity with transformers, packed-vs-unpacked log-probs, what each rank ran
(the trace), per-step metrics and the final weights.
"""

import time

import attrs
import numpy as np

NUM_GROUPS, GLOBAL_BATCH, MAX_TOKENS, LR = 32, 24, 48, 1e-4
ROLLOUT_SEEDS = (11, 12)  # two rollout batches, each giving steps of [24, 8] groups

PACKING_CHECK_LAYOUTS = ("dp1", "pp2")
RESUME_CHECK_LAYOUTS = ("dp1", "dp2_distopt_overlap")  # resumed with the layout that saved
# A checkpoint taken by the key's layout, loaded into another: (name, trainer kwargs).
CROSS_LAYOUT_RESUMES = {"pp2": ("dp2", {}),
                        "dp2_distopt_overlap": ("tp2_distopt", {"tp": 2, "distopt": True})}
LAYOUTS: dict[str, dict] = {
    "dp2": {},
    "dp2_distopt_overlap": {"distopt": True},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "pp2_vpp2": {"pp": 2, "vpl": 1},
    "pp2_uneven": {"pp": 2, "first": 1},  # 4 layers as 1 + 3 (--decoder-first-pipeline-...)
}


def rollout_batch(vocab_size: int, seed: int):
    from vime_shell.rollout.synthetic import synthetic_batch

    return synthetic_batch(vocab_size, num_groups=NUM_GROUPS, seed=seed)


def rollout_schedule(batch, layout):
    from vime_shell.rollout.synthetic import synthetic_schedule

    return synthetic_schedule(batch, layout, global_batch_size=GLOBAL_BATCH,
                              max_tokens_per_gpu=MAX_TOKENS)


def rank_rollout(vocab_size: int, seed: int, trainer, loss_mode: str = "group_token_mean"):
    """This rank's records of a rollout batch, built by the core (``rank_batch``)."""
    from vime_pure import rank_batch

    batch = rollout_batch(vocab_size, seed)
    schedule = rollout_schedule(batch, trainer.layout)
    mine = rank_batch(batch, schedule, dp_rank=trainer.dp_rank, cp_rank=trainer.cp_rank,
                      cp_size=trainer.layout.cp, loss_mode=loss_mode, norm=8.0)
    return batch, schedule, mine


def _scored(mine) -> np.ndarray:
    """Batch-coordinate indices of the response tokens this rank's records score."""
    return np.concatenate([mb.response_index for mb in mine.microbatches])


def _hf_log_probs(hf_model, batch) -> np.ndarray:
    """transformers' per-token log-probs of every response in batch coordinates, one sample at
    a time (the unpacked reference)."""
    import torch

    out = np.zeros(int(batch.response_offsets[-1]))
    with torch.no_grad():
        for i in range(batch.num_samples):
            toks = torch.as_tensor(batch.sample_tokens(i).astype(np.int64))[None]
            logp = torch.log_softmax(hf_model(toks).logits[0].double(), -1)
            r, n = int(batch.response_lengths[i]), toks.shape[1]
            out[batch.response_offsets[i]:batch.response_offsets[i + 1]] = (
                logp[n - r - 1:n - 1].gather(1, toks[0, n - r:, None])[:, 0].numpy())
    return out


def _optim(distopt: bool):
    """Adam at ``LR``; ``distopt``: the distributed optimizer with overlapped grad reduce and
    param gather."""
    from vime_shell.megatron.trainer import OptimConfig

    return OptimConfig(lr=LR, use_distributed_optimizer=distopt, overlap_grad_reduce=distopt,
                       overlap_param_gather=distopt)


def _resume(hf_dir: str, checkpoint: str, vocab: int, *, tp=1, pp=1, vpl=None,
            distopt=False) -> dict:
    """A fresh trainer loads the checkpoint taken before rollout 2 and trains rollout 2 again."""
    from vime_pure import with_log_probs
    from vime_shell.megatron.trainer import MegatronTrainer, TrainerConfig

    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=_optim(distopt)), tp=tp,
                                      pp=pp, num_layers_per_virtual_stage=vpl)
    rng_restored = trainer.load_checkpoint(checkpoint)
    loaded = {k: v.numpy() for k, v in trainer.hf_state_dict().items()}
    _, _, mine = rank_rollout(vocab, ROLLOUT_SEEDS[1], trainer)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    results = trainer.train(with_log_probs(mine, old_log_probs=old))
    out = {"final": {k: v.numpy() for k, v in trainer.hf_state_dict().items()},
           "metrics": [r.metrics for r in results], "steps_done": trainer.steps_done,
           "scheduler_groups": int(trainer.scheduler.num_steps), "loaded": loaded,
           "rng_restored": rng_restored}
    trainer.shutdown()
    return out


def _in_batch(mine, logps: np.ndarray, batch) -> np.ndarray:
    """Share-coordinate log-probs (``compute_log_probs``) placed at their batch positions
    (NaN elsewhere), so passes over different schedules compare token by token."""
    out = np.full(int(batch.response_offsets[-1]), np.nan)
    for mb in mine.microbatches:
        out[mb.response_index] = logps[mb.share_index]
    return out


def _max_diff(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> float:
    return float(np.max(np.abs(a[where] - b[where])))


def _logit_diff(trainer, hf_model, vocab: int) -> float | None:
    """Max |logits - transformers| on a fixed batch (full-vocab gather under TP); None for PP."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if mpu.get_pipeline_model_parallel_world_size() > 1:
        return None
    toks = torch.as_tensor(np.random.default_rng(5).integers(0, vocab, (2, 12)))
    pos = torch.arange(12)[None].expand(2, 12)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(trainer.model[0](toks, pos, None))
        ref = hf_model(toks).logits
    return float((logits - ref).abs().max())


def run_layout(hf_dir: str, name: str, tp=1, pp=1, vpl=None, distopt=False, first=None) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vime_pure import BatchingPolicy, VimeError, rank_batch, schedule_for, with_log_probs
    from vime_shell.megatron.trainer import MegatronTrainer, TrainerConfig
    from vime_shell.models.auto_config import auto_config

    t0 = time.perf_counter()
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=_optim(distopt)), tp=tp,
                                      pp=pp, num_layers_per_virtual_stage=vpl,
                                      first_stage_layers=first)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, config=auto_config(hf_dir),
                                                     dtype=torch.float32)
    vocab = hf_model.config.vocab_size
    stage_layers = len(trainer.model[0].module.decoder.layers)
    original = load_file(f"{hf_dir}/model.safetensors")
    exported = trainer.hf_state_dict()
    out: dict = {"name": name, "layout": attrs.asdict(trainer.layout), "dp_rank": trainer.dp_rank,
                 "roundtrip_keys_equal": set(exported) == set(original),
                 "roundtrip_max": max(float((exported[k] - original[k]).abs().max())
                                      for k in original),
                 "logit_max": _logit_diff(trainer, hf_model, vocab),
                 "metrics": [], "trace": [], "lr": [], "stage_layers": stage_layers}
    checkpoint = f"{hf_dir}-ckpt-{name}"
    for r, seed in enumerate(ROLLOUT_SEEDS):
        if r == 1 and (name in RESUME_CHECK_LAYOUTS or name in CROSS_LAYOUT_RESUMES):
            trainer.save_checkpoint(checkpoint)
            out["at_save"] = {k: v.numpy() for k, v in trainer.hf_state_dict().items()}
        batch, schedule, mine = rank_rollout(vocab, seed, trainer)
        # old log-probs, recomputed as in RL
        old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
        if r == 0:
            mine_idx = _scored(mine)
            out["hf_logprob_max"] = _max_diff(_in_batch(mine, old, batch),
                                              _hf_log_probs(hf_model, batch), mine_idx)
            # Singleton micro-batches: DP1 and PP2 (a VPP plan would need microbatch_group
            # multiples; TP2 pays ~10 gloo all-reduces per forward, so it is left out for time).
            if name in PACKING_CHECK_LAYOUTS:
                alone = schedule_for(batch, trainer.layout.scheduler_layout(), BatchingPolicy(
                    global_batch_size=batch.num_groups, micro_batch_size=1))
                single = rank_batch(batch, alone, dp_rank=trainer.dp_rank)
                logps = trainer.compute_log_probs(single.microbatches, single.num_response_tokens)
                logps = _in_batch(single, logps, batch)
                out["packing_max"] = _max_diff(_in_batch(mine, old, batch), logps, mine_idx)
                # Each CPU attention layout forced (the trainer picks by FLOPs): a packed row
                # with a block mask, and one padded row per sample.
                for layout in ("mask", "padded"):
                    trainer.layout_of = lambda record, layout=layout: layout
                    forced = trainer.compute_log_probs(mine.microbatches,
                                                       mine.num_response_tokens)
                    out[f"packing_max_{layout}"] = _max_diff(_in_batch(mine, forced, batch),
                                                             logps, mine_idx)
                del trainer.layout_of  # back to the class's choice by FLOPs
            if trainer.layout.vpp > 1:  # an odd micro-batch count cannot interleave
                try:
                    trainer.compute_log_probs(mine.microbatches[:1], mine.num_response_tokens)
                except VimeError as exc:
                    out["vpp_error"] = str(exc)
        start = len(trainer.trace)
        results = trainer.train(with_log_probs(mine, old_log_probs=old))
        out["metrics"].extend(res.metrics for res in results)
        out["lr"].extend(res.lr for res in results)
        out["trace"].extend((r, step - trainer.steps_done + len(results), samples, tokens)
                            for step, samples, tokens in trainer.trace[start:])
    out["scheduler_groups"] = int(trainer.scheduler.num_steps)
    out["final"] = {k: v.numpy() for k, v in trainer.hf_state_dict().items()}
    trainer.shutdown()
    if name in RESUME_CHECK_LAYOUTS:
        out["resume"] = _resume(hf_dir, checkpoint, vocab, tp=tp, pp=pp, vpl=vpl,
                                distopt=distopt)
    if name in CROSS_LAYOUT_RESUMES:
        target, kwargs = CROSS_LAYOUT_RESUMES[name]
        out["cross_resume"] = {"into": target, **_resume(hf_dir, checkpoint, vocab, **kwargs)}
    out["seconds"] = time.perf_counter() - t0
    return out


def _main_grads(trainer) -> np.ndarray:
    """The gradient DDP reduced into the main-grad buffers, as one flat vector (trained
    parameters: a frozen one, such as DeepSeek-V3's expert bias, has none)."""
    import torch

    return torch.cat([p.main_grad.reshape(-1) for chunk in trainer.model
                      for p in chunk.module.parameters() if p.requires_grad]).numpy().copy()


def loss_modes(hf_dir: str) -> dict:
    """One training step in every loss mode, with two micro-batch splits of the same step (a
    48-token and a 512-token budget), on the launched world (DP1 or DP2): the reported loss
    and the gradient each rank's DDP reduced, per (mode, budget)."""
    from vime_pure import BatchingPolicy, LossMode, rank_batch, schedule_for, with_log_probs
    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=LR,
                                                                             clip_grad=0.0)))
    batch = rollout_batch(trainer.bridge.hf_config.vocab_size, ROLLOUT_SEEDS[0])
    out = {}
    for mode in LossMode:
        for budget in (48, 512):
            policy = BatchingPolicy(global_batch_size=batch.num_groups, max_tokens_per_gpu=budget)
            schedule = schedule_for(batch, trainer.layout.scheduler_layout(), policy)
            mine = rank_batch(batch, schedule, dp_rank=trainer.dp_rank, loss_mode=mode,
                              norm=8.0)
            trainer.load_hf_weights(hf_dir)  # every (mode, split) starts from the same weights
            # Without old log-probs: the on-policy shortcut (the forward's own, detached).
            (result,) = trainer.train(mine)
            out[(mode.value, budget)] = {"loss": result.metrics["loss"],
                                         "microbatches": result.num_microbatches,
                                         "grad": _main_grads(trainer)}
            if budget == 48:  # the same step with old log-probs recomputed by a forward pass
                trainer.load_hf_weights(hf_dir)
                old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
                (again,) = trainer.train(with_log_probs(mine, old_log_probs=old))
                out[(mode.value, "recomputed")] = {"loss": again.metrics["loss"],
                                                   "grad": _main_grads(trainer)}
    trainer.shutdown()
    return out


def conversion_only(hf_dir: str, native: bool = False) -> dict:
    """HF round trip and logit parity of a model at world size 1 (no training); ``native``:
    against transformers' own class of the checkpoint's model_type, not the class vime reads
    its config as (GLM-4.7-Flash is read as DeepSeek-V3)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vime_shell.megatron.trainer import MegatronTrainer
    from vime_shell.models.auto_config import auto_config

    trainer = MegatronTrainer.from_hf(hf_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(
        hf_dir, **({} if native else {"config": auto_config(hf_dir)}), dtype=torch.float32)
    original = load_file(f"{hf_dir}/model.safetensors")
    exported = trainer.hf_state_dict()
    out = {"roundtrip_keys_equal": set(exported) == set(original),
           "roundtrip_max": max(float((exported[k] - original[k]).abs().max()) for k in original),
           "logit_max": _logit_diff(trainer, hf_model, hf_model.config.vocab_size)}
    trainer.shutdown()
    return out


def compat_report() -> dict:
    """Facts about the installed CPU compatibility layer, checked by test_launch."""
    import torch

    from vime_shell.megatron import cuda_compat

    ids = [id(getattr(torch.cuda, n)) for n in cuda_compat.PATCHED_ATTRIBUTES]
    t = torch.zeros(2, device="cuda")
    torch.cuda.manual_seed(3)
    a = torch.rand(2)
    torch.cuda.manual_seed(3)
    state = torch.cuda.get_rng_state()
    b = torch.rand(1)
    torch.cuda.set_rng_state(state)
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().synchronize()
    return {
        "reinstall": cuda_compat.install(), "distinct": len(set(ids)) == len(ids),
        "is_available": torch.cuda.is_available(), "zeros_device": t.device.type,
        "cuda_is_identity": t.cuda() is t, "type_name": t.type(),
        "int_device": torch.empty(3, device=torch.cuda.current_device()).device.type,
        "to_int": t.to(0).device.type,
        "manual_seed_repeats": torch.equal(a[:1], b) and torch.equal(b, torch.rand(1)),
    }


def all_layouts_worker(rank: int, hf_dir: str, llama_dir: str, names: tuple[str, ...],
                       with_dp1: bool, feature_dirs: dict[str, str] | None = None) -> dict:
    """Every layout of ``names`` on the 2-process world, then DP1 on rank 0 (world of 1);
    with ``feature_dirs``, also the model-feature runs of ``model_workers`` (recompute,
    Llama-3 RoPE, MoE with EP) on both worlds."""
    from tests.shell.model_workers import features_one_rank, features_two_ranks

    import warnings

    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from vime_shell.megatron.platform import detect_platform

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)
    detect_platform()
    compat = compat_report()
    dist.init_process_group("gloo")
    results = {name: run_layout(hf_dir, name, **LAYOUTS[name]) for name in names}
    results["loss_modes_dp2"] = loss_modes(hf_dir)
    if feature_dirs:
        results["features_2"] = features_two_ranks(feature_dirs)
    dist.barrier()
    dist.destroy_process_group()
    if with_dp1 and rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        results["dp1"] = run_layout(hf_dir, "dp1")
        results["loss_modes_dp1"] = loss_modes(hf_dir)
        results["llama_conversion"] = conversion_only(llama_dir)
        if feature_dirs:
            results["features_1"] = features_one_rank(feature_dirs)
        dist.destroy_process_group()
    results["compat"] = compat
    return results
