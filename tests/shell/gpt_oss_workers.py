"""gpt-oss runs in one spawned gloo process (``tests/shell/test_gpt_oss.py``): a tiny gpt-oss
(``TinyModelSpec(arch="gpt_oss")``: sinks, a 4-token window on layers 0 and 2 of 4, YaRN,
biased router and experts) converted and checked against transformers, its log-probs on
packed rows in both CPU attention layouts against transformers' one sample at a time, two
rollouts trained, then exported as ``--save-hf`` writes it and reloaded by transformers.
"""

import tempfile

import numpy as np

from tests.shell.megatron_workers import (ROLLOUT_SEEDS, _hf_log_probs, _in_batch, _logit_diff,
                                          _max_diff, _optim, _scored, conversion_only,
                                          rank_rollout)


def gpt_oss_worker(rank: int, hf_dir: str) -> dict:
    import warnings

    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    hf_logging.set_verbosity_error()
    detect_platform()
    dist.init_process_group("gloo")
    out = {"conversion": conversion_only(hf_dir), "train": train_and_reload(hf_dir)}
    dist.destroy_process_group()
    return out


def _packed_parity(trainer, mine, batch, hf_model) -> dict:
    """Max |log-prob - transformers'| of this rank's records in each CPU attention layout
    (a packed row with a block mask, and one padded row per sample), and how long the
    samples of the packed rows are (the window must cut inside them)."""
    reference = _hf_log_probs(hf_model, batch)
    out = {"longest_sample": max(int(mb.seq_lengths.max()) for mb in mine.microbatches),
           "samples_per_row": max(len(mb.seq_lengths) for mb in mine.microbatches)}
    for layout in ("mask", "padded"):
        trainer.layout_of = lambda record, layout=layout: layout
        logps = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
        out[layout] = _max_diff(_in_batch(mine, logps, batch), reference, _scored(mine))
    del trainer.layout_of
    return out


def train_and_reload(hf_dir: str) -> dict:
    """Two rollouts trained (4 Adam steps), the first's old log-probs against transformers;
    then the trained weights exported through ``save_hf_checkpoint`` (what ``--save-hf``
    calls) and reloaded by transformers: its logits against the trainer's."""
    import torch
    from transformers import AutoModelForCausalLM

    from vime_pure import with_log_probs
    from vime_shell.megatron.trainer import MegatronTrainer, TrainerConfig
    from vime_shell.storage.hf_export import save_hf_checkpoint

    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=_optim(False)))
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    vocab = hf_model.config.vocab_size
    out: dict = {"losses": []}
    start = trainer.hf_state_dict()
    for r, seed in enumerate(ROLLOUT_SEEDS):
        batch, _, mine = rank_rollout(vocab, seed, trainer)
        old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
        if r == 0:
            out["hf_logprob_max"] = _max_diff(_in_batch(mine, old, batch),
                                              _hf_log_probs(hf_model, batch), _scored(mine))
            out["packed"] = _packed_parity(trainer, mine, batch, hf_model)
        results = trainer.train(with_log_probs(mine, old_log_probs=old))
        out["losses"].extend(res.metrics["loss"] for res in results)
    final = trainer.hf_state_dict()
    out["moved"] = sorted(k for k in final if not torch.equal(final[k], start[k]))
    out["keys"] = sorted(final)
    with tempfile.TemporaryDirectory() as root:
        streamed = (pair for bucket in trainer.hf_buckets(1 << 20) for pair in bucket)
        target = save_hf_checkpoint(streamed, source_dir=hf_dir, target_dir=f"{root}/hf")
        reloaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        out["reloaded_class"] = type(reloaded).__name__
        out["reload_logit_max"] = _logit_diff(trainer, reloaded, vocab)
        out["reload_tensor_max"] = max(
            float((reloaded.state_dict()[k] - final[k]).abs().max()) for k in final)
    out["trained_logit_moved"] = _logit_diff(trainer, hf_model, vocab)
    trainer.shutdown()
    out["losses_finite"] = bool(np.all(np.isfinite(out["losses"])))
    return out
