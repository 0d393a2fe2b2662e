"""Process bodies of the tied-embedding layout tests (importable, so ``spawn`` can run them).

``tied_layouts_worker`` runs DP2, TP2, PP2 and PP2 x VPP2 in turn on one 2-process world over a
tied, BPE, chat-template tiny Qwen2: for each, the export right after loading (names and values
against the checkpoint), one training step, and the trained export loaded into transformers
(the engine side of a weight sync), whose log-probs must equal the trainer's.
``train_layouts_worker`` then runs ``vime train`` (the CLI) per layout in the same world;
``tied_worker`` is both, in one spawn.
"""

import numpy as np

TIED_LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2},
                "pp2_vpp2": {"pp": 2, "vpl": 1}}


def _log_probs(trainer, batch):
    from vime_pure import rank_batch, schedule_for
    from vime_pure.config import BatchingPolicy

    policy = BatchingPolicy(global_batch_size=batch.num_groups, max_tokens_per_gpu=64)
    schedule = schedule_for(batch, trainer.layout.scheduler_layout(), policy)
    mine = rank_batch(batch, schedule, dp_rank=trainer.dp_rank)
    return mine, trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)


def _batch(vocab: int):
    from vime_pure import RolloutBatch, Sample

    rng = np.random.default_rng(0)
    samples = [[Sample(tokens=rng.integers(3, vocab, size=6).tolist(), response_length=3,
                       reward=float(g % 2), group_id=4 * p + g) for g in range(2)]
               for p in range(4)]
    return RolloutBatch.from_samples(samples)


def run_tied(hf_dir: str, tp: int = 1, pp: int = 1, vpl: int | None = None) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vime_pure import with_log_probs
    from vime_shell.engines.hf import HfEngine
    from vime_shell.megatron.config import OptimConfig
    from vime_shell.megatron.trainer import MegatronTrainer, TrainerConfig

    # adam_eps 1: the first Adam update is ~lr x gradient (not lr x sign), so the layouts'
    # trained weights agree to round-off, which compares their gradients
    optim = OptimConfig(lr=1e-2, adam_eps=1.0)
    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=optim), tp=tp,
                                      pp=pp, num_layers_per_virtual_stage=vpl)
    original = load_file(f"{hf_dir}/model.safetensors")
    names = [name for name, _ in trainer.export_hf()]
    exported = trainer.hf_state_dict()
    out = {"vpp": trainer.layout.vpp, "names_unique": len(names) == len(set(names)),
           "keys_equal": set(exported) == set(original),
           "roundtrip_max": max(float((exported[k] - original[k]).abs().max())
                                for k in original)}
    batch = _batch(int(original["model.embed_tokens.weight"].shape[0]))
    mine, old = _log_probs(trainer, batch)
    trainer.train(with_log_probs(mine, old_log_probs=old))
    trained = trainer.hf_state_dict()
    _, after = _log_probs(trainer, batch)
    engine = HfEngine.from_model(AutoModelForCausalLM.from_pretrained(hf_dir,
                                                                       dtype=torch.float32))
    engine.update_weights_from_tensors(trained.items())  # the weight sync's engine side
    with torch.no_grad():
        ids = torch.as_tensor(batch.tokens.reshape(batch.num_samples, -1))
        logits = engine.model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    engine_logp = logp[:, -3:].reshape(-1).numpy()
    index = np.concatenate([mb.share_index for mb in mine.microbatches]) \
        if trainer.owns_loss else np.zeros(0, dtype=np.int64)
    scored = np.concatenate([np.arange(3 * i, 3 * i + 3) for mb in mine.microbatches
                             for i in mb.sample_indices.tolist()]) if trainer.owns_loss else index
    out["moved"] = max(float((trained[k] - original[k]).abs().max()) for k in original)
    out["trained"] = {k: t.numpy().copy() for k, t in trained.items()}
    out["engine_vs_trainer"] = (float(np.abs(after[index] - engine_logp[scored]).max())
                                if index.size else None)
    trainer.shutdown()
    return out


def tied_layouts_worker(rank: int, hf_dir: str) -> dict:
    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    detect_platform()
    dist.init_process_group("gloo")
    results = {name: run_tied(hf_dir, **kwargs) for name, kwargs in TIED_LAYOUTS.items()}
    dist.barrier()
    return results


# -- `vime train` end to end on the tied model, every layout ----------------------------------

TRAIN_LAYOUTS = {"dp2": [], "tp2": ["--tensor-model-parallel-size", "2"],
                 "pp2": ["--pipeline-model-parallel-size", "2"],
                 "pp2_vpp2": ["--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "1"]}


def parity_reward(sample) -> float:
    """1 for an odd-length response: random responses vary in length, so every group has a
    non-zero reward spread (GRPO advantages) and the weights move."""
    return float(len(sample.metadata["response"]) % 2)


def train_argv(root: str, name: str, hf_dir: str, data: str) -> list[str]:
    """The ``vime train`` command of layout ``name``: 2 rollouts of 4 prompts x 4 samples, two
    optimizer steps each, a weight sync after each, and the export after the last."""
    return ["train", "--hf-checkpoint", hf_dir, "--prompt-data", data, "--input-key", "prompt",
            "--label-key", "answer", "--apply-chat-template",
            "--custom-rm-path", "tests.shell.tied_workers:parity_reward",
            "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--global-batch-size", "8", "--rollout-max-response-len", "6",
            "--max-tokens-per-gpu", "64", "--lr", "1e-3", "--seed", "3",
            "--run-dir", f"{root}/{name}/run", "--save-hf", f"{root}/{name}/hf_{{rollout_id}}",
            "--save-hf-interval", "2", *TRAIN_LAYOUTS[name]]


def tied_worker(rank: int, root: str, hf_dir: str, data: str) -> dict:
    """Both tied-model runs in one 2-process world (one spawn): one step per layout, then
    ``vime train`` per layout."""
    return {"steps": tied_layouts_worker(rank, hf_dir),
            "train": train_layouts_worker(rank, root, hf_dir, data)}


def train_layouts_worker(rank: int, root: str, hf_dir: str, data: str) -> dict:
    """``vime train`` (the CLI entry point) for every layout in turn in one 2-process world;
    a hook on the loop records, after the last rollout's sync, the trainer's HF-named
    weights (rank 0) and the largest difference of the engine's weights from them."""
    import functools

    from vime_shell.cli.main import main
    from vime_shell.run import driver as loop_module

    original = loop_module.run_training
    out = {}
    for name in TRAIN_LAYOUTS:
        seen: dict = {}

        def hook(event, seen=seen):
            state = event.trainer.hf_state_dict()  # collective: every rank calls it
            if event.engine is not None:
                params = dict(event.engine.model.named_parameters())
                seen["engine_vs_trainer"] = max(float((params[k] - t).abs().max())
                                                for k, t in state.items())
            if rank == 0:
                seen["state"] = {k: t.numpy().copy() for k, t in state.items()}

        loop_module.run_training = functools.partial(original, on_rollout=hook)
        try:
            seen["code"] = main(train_argv(root, name, hf_dir, data))
        finally:
            loop_module.run_training = original
        out[name] = seen
    return out
