"""Multi-token prediction layers trained beside the policy (slime's ``--enable-mtp-training``
with ``--mtp-num-layers N --mtp-loss-scaling-factor f``), through Megatron-core's own MTP block.

What each part does, and why it is here:

- **Build** (:func:`adjust_bridge`): Megatron's MTP block spec from the last decoder layer's
  local or TransformerEngine spec, on the stage that holds the output layer
  (``get_gpt_mtp_block_spec`` returns None elsewhere); mbridge's DeepSeek-V3 provider would
  build it with TransformerEngine hard-coded, so the MLA bridge takes mbridge's plain provider.
- **Names** (:class:`MtpNames`): a DeepSeek-V3-style checkpoint (DeepSeek-V3, Kimi-K2,
  GLM-4.7-Flash, GLM-4.5 / 4.6 / 4.7 MoE) keeps MTP layer ``i`` as decoder layer ``num_hidden_layers + i``: ``enorm``,
  ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a whole layer (attention, MoE); its
  ``embed_tokens`` and ``shared_head.head`` are copies of the model's embedding and output
  layer, which the MTP layers share (exported as those copies). mbridge's own mapping assumes
  DeepSeek-V3's 61 layers; this one reads the count from the config. MiMo keeps them as
  ``model.mtp_layers.i`` (``token_layernorm``, ``hidden_layernorm``, ``input_proj``,
  ``final_layernorm``), its ``input_proj`` over ``[hidden, embedding]``, Megatron's
  ``eh_proj`` over ``[embedding, hidden]``: the halves swap on load and export.
- **Loss** (:func:`mtp_postprocess`): Megatron 0.16's ``GPTModel._postprocess`` computes the
  MTP loss only beside its own language-model loss from ``labels``, while vime's objective
  reads the logits. This ``_postprocess`` runs the MTP block on the decoder's hidden states,
  adds each depth's cross entropy through Megatron's ``MTPLossAutoScaler`` (so it
  backpropagates with the policy loss and Megatron's schedule scales it alike) and returns the
  logits. As slime's Megatron patch: the MTP layers' inputs (the hidden states, the token
  embeddings) and the output layer's weight are detached, so **only the MTP layers learn
  from it** and the policy's gradient is unchanged.
- **Accounting**: depth ``k`` at position ``q`` predicts the label of position ``q + k`` (the
  token ``q + k + 1``), weighted as the policy weighs that token: ``m / D`` of its sample
  (``vime_pure.torch_ops.loss.token_weights``, the record's loss mode) times the step factor,
  rolled with Megatron's ``roll_tensor`` (per packed sequence under THD, across CP ranks).
  The MTP loss is ``f / N`` times the sum over depths, so, as the policy's, it does not depend
  on the micro-batch split. A token at position ``< N`` of its sample (a prompt of at most
  ``N`` tokens) gets no MTP weight: in a packed row its MTP position would lie in the sample
  before it. Reported: ``mtp_loss``, the token mean of the cross entropy over every depth.
- **No recompute in the MTP layers**: under ``--recompute-granularity full`` megatron-core
  0.16 checkpoints each MTP layer, and its gradients then differ from plain autograd's (up to
  1.7e-3 on ``eh_proj``, the same loss; measured on the tiny MiMo, whose decoder recomputes
  exactly); the MTP layers run without it (one layer's activations kept), the decoder with it.

Example: ``adjust_bridge(bridge, NAMES_OF["mimo"], layer_spec, use_te)`` at build, then per
training forward ``with mtp_inputs(chunk, labels, weights): chunk(tokens, ...)``.
"""

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import attrs
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

from vime_pure.errors import VimeError, field_error
from vime_shell.models.hf_config import MTP_MODEL_TYPES


@attrs.frozen(kw_only=True)
class MtpNames:
    """How a checkpoint family names MTP layer ``i`` (module docstring). ``prefix``: its
    tensors' prefix (``{n}``: ``num_hidden_layers + i``, ``{i}``: ``i``); ``direct``: Megatron's
    MTP parts -> the checkpoint's suffixes; ``shared``: the model's weights whose copies each
    MTP layer keeps, -> their suffixes; ``hidden_first``: ``eh_proj`` takes ``[hidden,
    embedding]`` (Megatron's takes ``[embedding, hidden]``: the halves swap)."""

    prefix: str
    direct: dict[str, str]
    shared: dict[str, str] = attrs.field(factory=dict)
    hidden_first: bool = False


_DEEPSEEK = MtpNames(prefix="model.layers.{n}.",
                     direct={"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                             "eh_proj.weight": "eh_proj.weight",
                             "final_layernorm.weight": "shared_head.norm.weight"},
                     shared={"embedding.word_embeddings.weight": "embed_tokens.weight",
                             "output_layer.weight": "shared_head.head.weight"})
# MiMo (Qwen2 with MTP layers; modeling_mimo.py's MiMoMTPLayers)
_MIMO = MtpNames(prefix="model.mtp_layers.{i}.",
                 direct={"enorm.weight": "token_layernorm.weight",
                         "hnorm.weight": "hidden_layernorm.weight",
                         "eh_proj.weight": "input_proj.weight",
                         "final_layernorm.weight": "final_layernorm.weight"},
                 hidden_first=True)
NAMES_OF: dict[str, MtpNames] = {**dict.fromkeys((t for t in MTP_MODEL_TYPES if t != "mimo"),
                                                 _DEEPSEEK), "mimo": _MIMO}
_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
MTP_REPORT = "vime_mtp_report"  # the chunk attribute holding a forward's MTP sums
MTP_INPUTS = "vime_mtp_inputs"  # the chunk attribute holding a training forward's MTP inputs
MTP_KEYS: tuple[str, ...] = ("mtp_loss",)  # a token mean over the MTP-trained tokens


class MtpError(VimeError):
    """A multi-token prediction setting the model or the run cannot honour."""


def adjust_bridge(bridge: Any, names: MtpNames, layer_spec: Callable[..., Any],
                  use_te: bool) -> None:
    """Build the MTP block on its stage with ``layer_spec``'s backend, and load and export its
    weights under the checkpoint's ``names`` (module docstring)."""
    spec_of, args_of, stage = bridge._get_transformer_layer_spec, bridge._get_gptmodel_args, {}
    to_mcore, to_hf = bridge._weight_to_mcore_format, bridge._weight_to_hf_format
    num_layers, num_mtp = bridge.config.num_layers, bridge.config.mtp_num_layers

    def layer_spec_remembered(vp_stage=None):  # the provider asks for it before the args
        stage["vp"] = vp_stage
        return spec_of(vp_stage)

    def gptmodel_args() -> dict:
        spec = get_gpt_mtp_block_spec(bridge.config, layer_spec(stage.get("vp")),
                                      use_transformer_engine=use_te, vp_stage=stage.get("vp"))
        return {**args_of(), "mtp_block_spec": spec}

    def weight_to_mcore(name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
        return _eh_proj_order(names, name, to_mcore(name, hf_weights))

    def weight_to_hf(name: str, weight: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
        hf_names, tensors = to_hf(name, _eh_proj_order(names, name, weight))
        copies = [names.prefix.format(n=num_layers + i, i=i) + names.shared[name]
                  for i in range(num_mtp)] if name in names.shared else []
        return hf_names + copies, tensors + [weight] * len(copies)

    bridge._get_transformer_layer_spec = layer_spec_remembered
    bridge._get_gptmodel_args = gptmodel_args
    bridge._weight_to_mcore_format = weight_to_mcore
    bridge._weight_to_hf_format = weight_to_hf


def _eh_proj_order(names: MtpNames, name: str, weight: torch.Tensor) -> torch.Tensor:
    """``eh_proj``'s input halves swapped where the checkpoint's takes ``[hidden, embedding]``
    (its own inverse: the same on load and export)."""
    if not (names.hidden_first and name.endswith("eh_proj.weight") and name.startswith("mtp.")):
        return weight
    half = weight.shape[1] // 2
    return torch.cat([weight[:, half:], weight[:, :half]], dim=1)


def hf_names(name: str, num_layers: int, names: MtpNames,
             decoder_names: Callable[[str], list[str]]) -> list[str] | None:
    """The checkpoint names of Megatron MTP weight ``name`` (its transformer layer's through
    ``decoder_names``, the decoder's mapping, as decoder layer ``num_layers + i``), or None for a
    non-MTP name. Example: ``mtp.layers.0.eh_proj.weight`` with 4 layers ->
    ``["model.layers.4.eh_proj.weight"]`` (DeepSeek-V3), ``["model.mtp_layers.0.input_proj.weight"]``
    (MiMo)."""
    match = _MTP_NAME.match(name)
    if match is None:
        return None
    i, rest = int(match.group(1)), match.group(2)
    layer = num_layers + i
    prefix = names.prefix.format(n=layer, i=i)
    if rest.startswith("transformer_layer."):
        proxied = decoder_names(f"decoder.layers.{layer}.{rest.removeprefix('transformer_layer.')}")
        return [prefix + n.removeprefix(f"model.layers.{layer}.") for n in proxied]
    if rest not in names.direct:
        raise field_error(MtpError, "MTP weight", name, "has no checkpoint name",
                          "report this: vime maps DeepSeek-V3's and MiMo's MTP layers")
    return [prefix + names.direct[rest]]


def attach(chunk: torch.nn.Module) -> None:
    """Give ``chunk`` (a ``GPTModel`` holding MTP layers) :func:`mtp_postprocess`, and its MTP
    layers a config without full recompute (module docstring)."""
    if getattr(chunk, "mtp_process", False):
        setattr(chunk, "_postprocess", MethodType(mtp_postprocess, chunk))
        block: Any = chunk.mtp
        for layer in block.layers:
            layer.config = dataclasses.replace(layer.config, recompute_granularity=None)


@contextlib.contextmanager
def mtp_inputs(chunk: torch.nn.Module, labels: torch.Tensor, weights: torch.Tensor
               ) -> Iterator[None]:
    """Within the block, ``chunk``'s forward trains its MTP layers on ``labels`` (each
    position's next token, ``[rows, columns]``) with per-position ``weights`` (module
    docstring); outside it (log-prob passes) the MTP layers do not run."""
    setattr(chunk, MTP_INPUTS, (labels, weights))
    try:
        yield
    finally:
        setattr(chunk, MTP_INPUTS, None)


def mtp_postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                    rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None,
                    decoder_input=None, attention_mask=None, inference_params=None,
                    packed_seq_params=None, sequence_len_offset=None,
                    runtime_gather_output=None, extra_block_kwargs=None,
                    inference_context=None):
    """``GPTModel._postprocess`` of a chunk with MTP layers: the logits ``[b, s, V/tp]``, the
    MTP loss attached to the hidden states that make them (module docstring)."""
    inputs = getattr(self, MTP_INPUTS, None)
    if inputs is None:
        return _logits(self, hidden_states, runtime_gather_output)
    mtp_labels, weights = inputs
    hidden = self.mtp(input_ids=input_ids, position_ids=position_ids,
                      hidden_states=hidden_states.detach(), attention_mask=attention_mask,
                      rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                      rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                      sequence_len_offset=sequence_len_offset,
                      embedding=_DetachedEmbedding(self.embedding),
                      **(extra_block_kwargs or {}))
    depths = torch.chunk(hidden, 1 + self.config.mtp_num_layers, dim=0)[1:]
    weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
              else self.output_layer.weight).detach()
    loss, ce_sum, count = hidden_states.new_zeros(()), 0.0, 0.0
    for depth in depths:
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=self.cp_group,
                                    packed_seq_params=packed_seq_params)
        weights, _ = roll_tensor(weights, shifts=-1, dims=-1, cp_group=self.cp_group,
                                 packed_seq_params=packed_seq_params)
        logits, _ = self.output_layer(depth, weight=weight,
                                      runtime_gather_output=runtime_gather_output)
        ce = self.compute_language_model_loss(mtp_labels, logits)  # [b, s]
        loss = loss + (ce * weights).sum()
        trained = (weights > 0).to(ce.dtype)
        ce_sum, count = ce_sum + (ce.detach() * trained).sum(), count + trained.sum()
    setattr(self, MTP_REPORT, {"mtp_sum": ce_sum, "mtp_tokens": count})
    scale = self.config.mtp_loss_scaling_factor / self.config.mtp_num_layers
    hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * loss)
    return _logits(self, hidden_states, runtime_gather_output)


def _logits(model, hidden_states: torch.Tensor, runtime_gather_output) -> torch.Tensor:
    """``[b, s, V/tp]`` logits of the decoder's hidden states, as ``_postprocess`` returns
    them without labels."""
    weight = model.shared_embedding_or_output_weight() \
        if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden_states, weight=weight,
                                   runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1).contiguous()


class _DetachedEmbedding:
    """The model's embedding, its output detached: the MTP loss leaves it untrained (slime)."""

    def __init__(self, embedding: torch.nn.Module):
        self.embedding = embedding

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        return self.embedding(**kwargs).detach()


def mtp_keys(options: Any) -> tuple[str, ...]:
    """The step report's MTP metrics: ``MTP_KEYS`` with ``--enable-mtp-training`` (``options``:
    the trainer's ``ModelOptions``), else none."""
    return MTP_KEYS if options.mtp_loss_scaling_factor is not None else ()


def pop_report(chunk: torch.nn.Module) -> dict[str, Any]:
    """The MTP sums of ``chunk``'s last training forward (empty if its MTP layers did not
    run), cleared."""
    report = getattr(chunk, MTP_REPORT, None) or {}
    setattr(chunk, MTP_REPORT, None)
    return report
