"""Multi-token prediction training (``--enable-mtp-training``, ``vime_shell.megatron.mtp``) in
one 2-process gloo spawn (``tests/shell/test_mtp.py``), on a tiny GLM-4.7-Flash whose last
decoder layer is turned into its MTP layer under DeepSeek-V3's names (:func:`with_deepseek_mtp`)
and a tiny MiMo (a Qwen2 whose last layer is MTP layer 0 under MiMo's names, :func:`as_mimo`).

Each run trains the first step of ``megatron_workers``' first synthetic rollout, then the same
step three more times, and records the step's gradients by parameter name, the MTP losses and
the names the export and the weight sync carry. At world size 1, :func:`reference_worker`
checks the first step's MTP loss of a model against its MTP module written out in
transformers' layers.
"""

import json
from pathlib import Path

import numpy as np

from tests.shell.megatron_workers import ROLLOUT_SEEDS, _optim, rank_rollout

FACTOR = 0.2  # slime's --mtp-loss-scaling-factor
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}  # slime's MTP scripts'


def with_deepseek_mtp(model: Path) -> Path:
    """``model``'s last decoder layer as its MTP layer (DeepSeek-V3's names: ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head``, copies of the embedding and the output layer)
    and ``num_nextn_predict_layers: 1`` in its config."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((model / "config.json").read_text())
    n, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    (file,) = model.glob("*.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(7)

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=gen)

    p = f"model.layers.{n}."
    tensors.update({p + "enorm.weight": norm(), p + "hnorm.weight": norm(),
                    p + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=gen),
                    p + "shared_head.norm.weight": norm(),
                    p + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file(tensors, file, metadata={"format": "pt"})
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    if "mlp_layer_types" in config:  # GLM-4.7-Flash's; GLM-4.5's states first_k_dense_replace
        config["mlp_layer_types"] = config["mlp_layer_types"][:n]
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def as_mimo(model: Path) -> Path:
    """``model`` (a Qwen2) as a MiMo checkpoint: its last decoder layer as MTP layer 0 under
    MiMo's names (``model.mtp_layers.0.*``, ``token_layernorm``, ``hidden_layernorm``,
    ``input_proj`` over ``[hidden, embedding]``, ``final_layernorm``), ``model_type`` mimo."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((model / "config.json").read_text())
    n, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    (file,) = model.glob("*.safetensors")
    gen = torch.Generator().manual_seed(8)
    tensors = {k.replace(f"model.layers.{n}.", "model.mtp_layers.0."): v
               for k, v in load_file(file).items()}
    p = "model.mtp_layers.0."
    tensors.update({p + name: 1 + 0.1 * torch.randn(hidden, generator=gen) for name in (
        "token_layernorm.weight", "hidden_layernorm.weight", "final_layernorm.weight")})
    tensors[p + "input_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1, model_type="mimo",
                  architectures=["MiMoForCausalLM"])
    config.pop("layer_types", None)  # transformers 5's Qwen2 list of n + 1; MiMo's has none
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def mtp_worker(rank: int, hf_dir: str) -> dict:
    """DP2 with and without MTP training, PP2, and DP2 under full recompute (module
    docstring)."""
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = {"dp2": mtp_run(hf_dir, FACTOR), "dp2_plain": mtp_run(hf_dir, None),
           "pp2": mtp_run(hf_dir, FACTOR, pp=2),
           "dp2_recompute": mtp_run(hf_dir, FACTOR, options=RECOMPUTE)}
    dist.barrier()
    dist.destroy_process_group()
    return out


def reference_worker(rank: int, hf_dir: str) -> dict:
    """:func:`reference_run` in a process of its own (one model family per process: Megatron
    pins the attention backend in the environment)."""
    import warnings

    import torch.distributed as dist

    from vime_shell.megatron.platform import detect_platform

    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    detect_platform()
    dist.init_process_group("gloo")
    out = reference_run(hf_dir)
    dist.destroy_process_group()
    return out


def _trainer(hf_dir: str, factor: float | None, options: dict | None = None, **kwargs):
    from vime_shell.megatron.model_options import ModelOptions
    from vime_shell.megatron.trainer import MegatronTrainer, TrainerConfig

    model = ModelOptions(mtp_loss_scaling_factor=factor, **(options or {}))
    return MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=_optim(False), model=model),
                                   **kwargs)


def _first_step(trainer):
    from vime_pure import with_log_probs

    vocab = trainer.bridge.hf_config.vocab_size
    batch, _, mine = rank_rollout(vocab, ROLLOUT_SEEDS[0], trainer)
    old = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    return batch, with_log_probs(mine, old_log_probs=old).steps[0]


def mtp_run(hf_dir: str, factor: float | None, options: dict | None = None, **kwargs) -> dict:
    """The first step, its gradients by name, then three more steps on it (module docstring);
    ``options``: ``ModelOptions`` fields."""
    trainer = _trainer(hf_dir, factor, options, **kwargs)
    _, step = _first_step(trainer)
    results = [trainer.train_step(step)]
    grads = {name: p.main_grad.numpy().copy() for chunk in trainer.model
             for name, p in chunk.module.named_parameters() if p.requires_grad}
    results += [trainer.train_step(step) for _ in range(3)]
    out = {"grads": grads, "losses": [r.metrics["loss"] for r in results],
           "mtp_losses": [r.metrics.get("mtp_loss") for r in results],
           "export": sorted(name for name, _ in trainer.export_hf()),
           "synced": sorted(name for name, _ in trainer.engine_weights()),
           "mtp_built": any(getattr(c.module, "mtp_process", False) for c in trainer.model)}
    trainer.shutdown()
    return out


def reference_run(hf_dir: str) -> dict:
    """The first step's reported MTP loss at DP1, and DeepSeek-V3's MTP module on the same
    tokens in transformers' layers (:func:`hf_mtp_losses`): the mean cross entropy of every
    trained token from the third of its sample on."""
    trainer = _trainer(hf_dir, FACTOR)
    batch, step = _first_step(trainer)
    reported = trainer.train_step(step).metrics["mtp_loss"]
    trainer.shutdown()
    losses = []
    for record in step.microbatches:
        for i in sorted(set(record.sample_indices.tolist())):
            tokens = batch.sample_tokens(i).tolist()
            mask = batch.sample_loss_mask(i)
            ce = hf_mtp_losses(hf_dir, tokens)  # ce[q]: token q + 2 from position q
            start = len(tokens) - len(mask)
            losses += [float(ce[j - 2]) for j in range(max(start, 2), len(tokens))
                       if mask[j - start]]
    return {"reported": reported, "hf": float(np.mean(losses)), "tokens": len(losses)}


_HF_CACHE: dict = {}
# the checkpoint's MTP parts by family: (prefix, enorm, hnorm, eh_proj, final norm, whether
# eh_proj takes [hidden, embedding])
_PARTS = {**dict.fromkeys(("glm4_moe_lite", "glm4_moe"), (
              "model.layers.{n}.", "enorm", "hnorm", "eh_proj", "shared_head.norm", False)),
          "mimo": ("model.mtp_layers.0.", "token_layernorm", "hidden_layernorm", "input_proj",
                   "final_layernorm", True)}


def _hf_models(hf_dir: str):
    """transformers' model of ``hf_dir`` and its MTP decoder layer, loaded under its names."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vime_shell.models.auto_config import auto_config

    if hf_dir in _HF_CACHE:
        return _HF_CACHE[hf_dir]
    kind = json.loads((Path(hf_dir) / "config.json").read_text())["model_type"]
    config = auto_config(hf_dir)
    main = AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32)
    n = config.num_hidden_layers
    prefix = _PARTS[kind][0].format(n=n)
    (file,) = Path(hf_dir).glob("*.safetensors")
    tensors = {k.removeprefix(prefix): v for k, v in load_file(file).items()
               if k.startswith(prefix)}
    if kind == "mimo":  # a dense Qwen2 layer: its own names
        layer = type(main.model.layers[0])(config, layer_idx=n - 1)  # a full-attention one
        missing, _ = layer.load_state_dict(tensors, strict=False)
        assert not missing, missing
    else:  # an MoE layer: transformers fuses its experts on load
        config.num_hidden_layers += 1
        layer = AutoModelForCausalLM.from_pretrained(hf_dir, config=config,
                                                     dtype=torch.float32).model.layers[n]
    _HF_CACHE[hf_dir] = kind, main.eval(), layer.eval(), tensors
    return _HF_CACHE[hf_dir]


def hf_mtp_losses(hf_dir: str, tokens: list[int]):
    """The checkpoint's MTP depth 1 on ``tokens`` in transformers' layers: position ``q``'s
    cross entropy for token ``q + 2``, from ``eh_proj`` over ``enorm(embed(t[q+1]))`` and
    ``hnorm(h[q])`` (MiMo's ``input_proj`` over ``[hidden, embedding]``), through the MTP
    decoder layer (RoPE at position ``q``, causal), its final norm and the output layer; ``h``:
    the model's final (normed) hidden states."""
    import torch

    kind, main, layer, w = _hf_models(hf_dir)
    _, enorm, hnorm, eh, final, hidden_first = _PARTS[kind]

    def rms(x, name):
        return w[f"{name}.weight"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                     + main.config.rms_norm_eps)

    with torch.no_grad():
        ids = torch.tensor([tokens])
        h = rms(main.model(ids).last_hidden_state[:, :-1], hnorm)  # positions 0 .. T-2
        e = rms(main.model.embed_tokens(ids[:, 1:]), enorm)  # token q + 1 at position q
        x = torch.cat([h, e] if hidden_first else [e, h], -1) @ w[f"{eh}.weight"].T
        t = x.shape[1]
        positions = torch.arange(t)[None]
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=causal, position_ids=positions,
                    position_embeddings=main.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        logits = rms(out, final) @ main.lm_head.weight.T
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 2:], reduction="none")
