"""Code the Muon tests run inside spawned processes (module level, so it pickles).

One spawn of 2 gloo processes trains the tiny GQA Qwen2 (4 heads in 2 KV groups, biases on
QKV) with ``--optimizer muon``: TP2 duplicated (with a save after the first rollout and a
resume from it), DP2 with overlapped gradient reduce, and one TP2 blockwise step checked per
shard; then rank 0 alone (a world of 1) runs TP1, the one-step checks against the float64
reference below, the TP2 checkpoint loaded at TP1, an Adam trainer refusing it, and a bf16
trainer (Megatron's fp32 main parameters under Muon).

The reference is written from the update rule's definition, not from vime's code: float64,
plain matrix products, Megatron's quintic coefficients, Megatron's rule that biases and 1-D
parameters get no weight decay.
"""

import numpy as np

LR, WEIGHT_DECAY, MOMENTUM = 2e-3, 0.1, 0.9
ADAM_BETAS, ADAM_EPS = (0.9, 0.98), 1e-8
QUINTIC_REFERENCE = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                     (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                     (2.8366, -3.0525, 1.2012))
ROLLOUT_SEEDS = (11, 12)


def reference_orthogonalize(u: np.ndarray, steps: int = 5) -> np.ndarray:
    """Newton-Schulz in float64: Frobenius-normalise the (wide) matrix, then X <- aX + bAX +
    cAAX with A = X X^T, coefficients in turn."""
    wide = u.T if u.shape[0] > u.shape[1] else u
    x = wide / max(np.linalg.norm(wide), 1e-7)
    for i in range(steps):
        a, b, c = QUINTIC_REFERENCE[i % 5]
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if u.shape[0] > u.shape[1] else x


def reference_muon_update(u: np.ndarray, qkv: tuple[int, int, int] | None,
                          scale_mode: str = "spectral") -> np.ndarray:
    """The scaled orthogonalised update of one matrix; ``qkv``: its Q, K, V rows per group."""
    def scaled(m: np.ndarray) -> np.ndarray:
        rows, cols = m.shape
        scale = {"spectral": max(rows, cols) ** 0.5, "unit_rms_norm": (rows / cols) ** 0.5,
                 "shape_scaling": max(1.0, rows / cols) ** 0.5}[scale_mode]
        return reference_orthogonalize(m) * scale

    if qkv is None:
        return scaled(u)
    per_group = sum(qkv)
    groups = u.reshape(u.shape[0] // per_group, per_group, u.shape[1])
    bounds = np.cumsum((0,) + qkv)
    out = np.empty_like(groups)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = groups[:, lo:hi, :]
        out[:, lo:hi, :] = scaled(part.reshape(-1, u.shape[1])).reshape(part.shape)
    return out.reshape(u.shape)


def _settings(**kw):
    from vime_shell.megatron.config import MuonSettings

    return MuonSettings(momentum=MOMENTUM, **kw)


def _trainer(hf_dir: str, *, tp: int = 1, clip: float = 1.0, overlap: bool = False,
             optimizer: str = "muon", **muon):
    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    optim = OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=ADAM_BETAS[0],
                        adam_beta2=ADAM_BETAS[1], adam_eps=ADAM_EPS, clip_grad=clip,
                        overlap_grad_reduce=overlap, optimizer=optimizer,
                        muon=_settings(**muon))
    return MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=optim), tp=tp)


def _rollout(trainer, seed: int):
    from tests.shell.megatron_workers import rank_rollout
    from vime_pure import with_log_probs

    _, _, mine = rank_rollout(trainer.bridge.hf_config.vocab_size, seed, trainer)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    return with_log_probs(mine, old_log_probs=old)


def _weights(trainer) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in trainer.hf_state_dict().items()}


def train_two_rollouts(hf_dir: str, save: str | None = None, **kw) -> dict:
    """Two rollouts (2 optimizer steps each) from the HF weights; ``save``: a checkpoint after
    the first, and a fresh trainer resumed from it that trains the second again."""
    trainer = _trainer(hf_dir, **kw)
    losses = [r.metrics["loss"] for r in trainer.train(_rollout(trainer, ROLLOUT_SEEDS[0]))]
    if save is not None:
        trainer.save_checkpoint(save)
    losses += [r.metrics["loss"] for r in trainer.train(_rollout(trainer, ROLLOUT_SEEDS[1]))]
    out = {"final": _weights(trainer), "losses": losses}
    trainer.shutdown()
    if save is not None:
        out["resumed"] = resume(hf_dir, save, **kw)
    return out


def resume(hf_dir: str, checkpoint: str, **kw) -> dict:
    """A fresh trainer loads ``checkpoint`` and trains the second rollout."""
    trainer = _trainer(hf_dir, **kw)
    rng = trainer.load_checkpoint(checkpoint)
    losses = [r.metrics["loss"] for r in trainer.train(_rollout(trainer, ROLLOUT_SEEDS[1]))]
    out = {"final": _weights(trainer), "losses": losses, "rng_restored": rng,
           "steps_done": trainer.steps_done}
    trainer.shutdown()
    return out


def _named(trainer) -> dict:
    from mbridge.core.util import unwrap_model

    return {name: p for name, p in unwrap_model(trainer.model[0]).named_parameters()}


def _qkv_rows(trainer) -> tuple[int, int, int]:
    c = trainer.bridge.config
    return (c.num_attention_heads // c.num_query_groups * c.kv_channels, c.kv_channels,
            c.kv_channels)


def one_step_errors(hf_dir: str, nesterov: bool = False, tp: int = 1, **muon) -> dict:
    """One optimizer step (no clipping) against the float64 reference, on this rank's
    (local) tensors: max |actual - reference| weight change over lr, per optimizer; the
    Muon update is O(1) per entry, so this is its error relative to the update."""
    trainer = _trainer(hf_dir, clip=0.0, tp=tp, nesterov=nesterov, **muon)
    step = _rollout(trainer, ROLLOUT_SEEDS[0]).steps[0]
    named = _named(trainer)
    before = {n: p.detach().double().numpy().copy() for n, p in named.items()}
    trainer.train_step(step)
    errors = {"muon": 0.0, "adam": 0.0, "muon_relative": 0.0}
    kinds = {"muon": 0, "adam": 0}
    for name, p in named.items():
        w0, w1 = before[name], p.detach().double().numpy()
        g = p.main_grad.double().numpy()
        muon_param = p.ndim == 2 and not getattr(p, "is_embedding_or_output_parameter", False)
        if muon_param:
            buf = (1 - MOMENTUM) * g
            u = g + MOMENTUM * (buf - g) if nesterov else buf
            qkv = _qkv_rows(trainer) if "linear_qkv.weight" in name and \
                muon.get("split_qkv", True) else None
            update = reference_muon_update(u, qkv, muon.get("scale_mode", "spectral"))
            want = w0 * (1 - LR * WEIGHT_DECAY) - LR * update
            errors["muon_relative"] = max(errors["muon_relative"], float(
                np.linalg.norm(w1 - want) / np.linalg.norm(LR * update)))
        else:
            decay = 0.0 if p.ndim == 1 or name.endswith(".bias") else WEIGHT_DECAY
            m, v = (1 - ADAM_BETAS[0]) * g, (1 - ADAM_BETAS[1]) * g * g
            want = w0 * (1 - LR * decay) - LR * (m / (1 - ADAM_BETAS[0])) / (
                np.sqrt(v / (1 - ADAM_BETAS[1])) + ADAM_EPS)
        kind = "muon" if muon_param else "adam"
        kinds[kind] += 1
        errors[kind] = max(errors[kind], float(np.max(np.abs(w1 - want))) / LR)
    trainer.shutdown()
    return {"errors": errors, "counts": kinds}


def bf16_chain(hf_dir: str) -> dict:
    """A bf16 trainer on CPU (the CUDA dtype): what Muon's Megatron wrapper holds, and one
    rollout's losses and gradient norms."""
    import attrs
    import torch

    from vime_shell.megatron.muon import LAYOUT_ATTR
    from vime_shell.megatron.platform import detect_platform
    from vime_shell.megatron.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    platform = attrs.evolve(detect_platform(), dtype=torch.bfloat16)
    optim = OptimConfig(lr=LR, optimizer="muon", muon=_settings())
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=optim), platform=platform)
    chain = trainer.optimizer.chained_optimizers
    main = [p for g in chain[0].optimizer.param_groups for p in g["params"]]
    results = trainer.train(_rollout(trainer, ROLLOUT_SEEDS[0]))
    out = {"wrappers": [type(o).__name__ for o in chain],
           "inner": [type(o.optimizer).__name__ for o in chain],
           "main_fp32_with_layout": all(p.dtype == torch.float32 and hasattr(p, LAYOUT_ATTR)
                                        for p in main),
           "losses": [r.metrics["loss"] for r in results],
           "grad_norms": [r.grad_norm for r in results]}
    trainer.shutdown()
    return out


def adam_refusal(hf_dir: str, checkpoint: str) -> str:
    """The error an Adam trainer gives on a Muon checkpoint."""
    from vime_shell.megatron.checkpoint import CheckpointError

    trainer = _trainer(hf_dir, optimizer="adam")
    try:
        trainer.load_checkpoint(checkpoint)
    except CheckpointError as exc:
        return str(exc)
    finally:
        trainer.shutdown()
    return "loaded"


def muon_worker(rank: int, hf_dir: str, root: str) -> dict:
    """Every Muon run of ``test_muon`` (module docstring)."""
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {"tp2": train_two_rollouts(hf_dir, save=f"{root}/tp2", tp=2,
                                     fp32_matmul_prec="high"),
           "dp2_overlap": train_two_rollouts(hf_dir, overlap=True, fp32_matmul_prec="high"),
           "tp2_blockwise_step": one_step_errors(hf_dir, tp=2, tp_mode="blockwise",
                                                 fp32_matmul_prec="high")}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["tp1"] = train_two_rollouts(hf_dir, fp32_matmul_prec="high")
        out["tp2_into_tp1"] = resume(hf_dir, f"{root}/tp2", fp32_matmul_prec="high")
        out["step_high"] = one_step_errors(hf_dir, fp32_matmul_prec="high")
        out["step_high_nesterov_unsplit"] = one_step_errors(
            hf_dir, nesterov=True, fp32_matmul_prec="high", split_qkv=False,
            scale_mode="unit_rms_norm")
        out["step_medium"] = one_step_errors(hf_dir)
        out["adam_refusal"] = adam_refusal(hf_dir, f"{root}/tp2")
        out["bf16"] = bf16_chain(hf_dir)
        dist.destroy_process_group()
    return out
