"""DeepSeek sparse attention (DSA) as GLM-5 runs it, in the core-attention slot of Megatron's
multi-latent attention (slime's ``--spec slime_plugins.models.glm5.glm5``).

Each query attends to at most ``index_topk`` earlier tokens of its sample: the ones a small
*lightning indexer* scores highest. The indexer (``wq_b``, ``wk``, ``k_norm``,
``weights_proj``, named as in the checkpoint) scores query ``t`` against key ``u`` as
``sum_h w_h(x_t) * relu(q_h(t) . k(u) / sqrt(d))`` with ``w = weights_proj(x) / sqrt(H)``,
``q = wq_b(qr)`` (``qr``: the normalised low-rank query, MLA's ``q_a_layernorm`` output) and
``k = k_norm(wk(x))``; the first ``qk_rope_head_dim`` of each is rotated in interleaved pairs
(GLM-5's indexer, where DeepSeek-V3.2's rotates the last, half-split). This is transformers'
``GlmMoeDsaIndexer``, which the rollout engine runs, reproduced on Megatron's layout.

Why not megatron-core 0.16's own ``DSAttention``: its indexer needs ``fast_hadamard_transform``
(GPU-only) for DeepSeek-V3.2's rotation, which GLM-5 does not apply, rotates the other end of
the head, and refuses packed rows; its sparse kernel applies only a causal mask, so in a
packed row a query whose sample has fewer than ``index_topk`` tokens would attend into the
samples before it.

What vime's layer does:
- **The indexer is not trained**, as in slime's GLM-5 spec and transformers': its inputs are
  detached and it runs without gradient; its weights are frozen (``requires_grad=False``), so
  neither the policy loss nor Adam's weight decay moves them, and ``--save-hf`` exports them
  as loaded.
- **Masks.** A key is *allowed* for a query when the record's attention layout lets the query
  see it (the CPU block-diagonal mask, the padded rows' causal mask, or the samples of the THD
  ``cu_seqlens``) and the indexer selected it. Index scores of keys the layout blocks are
  ``-inf`` before the top-k, as transformers masks them, so the selection never leaves the
  sample.
- **Cross-layer index sharing** (GLM-5.2, ``config.json`` ``indexer_types``): a ``"shared"``
  layer has no indexer and reuses the selection of the last ``"full"`` layer before it. The
  selection is kept per micro-batch (:class:`SelectionStore`, keyed by the micro-batch's mask
  or ``PackedSeqParams``, which Megatron's recompute passes again), so a recomputed layer and
  interleaved pipeline micro-batches read their own. A pipeline stage must start on a full
  layer (``vime_shell.run.model_checks``; slime refuses the same split).
- **Ties.** Scores tie exactly where the ReLU zeroes every head (a score of 0), and which of
  the tied keys a top-k keeps is unspecified in torch's ``topk`` (it depends on the row's
  length and layout, so it differs between a packed row, a sample alone and a decode step).
  vime keeps the earlier key (a stable sort): the same selection in every layout, split and
  packing. An engine that breaks a tie otherwise attends to another key there; the gap check
  after each weight sync measures what that costs.
- **Parallelism.** Sequence parallelism: the indexer's inputs are gathered over TP (the heads
  of the attention are this rank's, the selection is every rank's). Context parallelism (THD,
  zigzag chunks as the records cut them): keys, values and the indexer's keys are gathered
  over CP and put in row order, and each rank's queries attend to the whole row: slime's
  ``--allgather-cp`` attention. The backward sums each key's gradient over the CP ranks.
- **Cost.** The reference computation holds the ``[heads, queries, keys]`` scores of a row, as
  Megatron's unfused DSA does; slime's tilelang kernels, which skip unselected keys, are
  GPU-only.

Example: ``SparseCoreAttention(config, layer_number=1, ..., hf_config=glm5_config,
store=SelectionStore(in_flight()))`` in a layer spec's ``core_attention``; its output equals
transformers' ``GlmMoeDsaAttention`` on the same weights (``tests/shell/test_glm5.py``).
"""

from collections import OrderedDict

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding

from vime_shell.megatron.attention import causal_mask, gather_zigzag, softmax_attention
from vime_shell.megatron.tensors import block_causal_mask
from vime_shell.models.hf_config import ModelLoadError

FULL, SHARED = "full", "shared"  # config.json's indexer_types


class Indexer(torch.nn.Module):
    """GLM-5's lightning indexer of one layer (module docstring); frozen."""

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        heads, dim = int(hf_config.index_n_heads), int(hf_config.index_head_dim)
        self.heads, self.dim = heads, dim
        self.rope_dim = int(hf_config.qk_rope_head_dim)
        self.wq_b = torch.nn.Linear(int(hf_config.q_lora_rank), heads * dim, bias=False)
        self.wk = torch.nn.Linear(int(hf_config.hidden_size), dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.weights_proj = torch.nn.Linear(int(hf_config.hidden_size), heads, bias=False)
        self.to(dtype)
        for param in self.parameters():
            param.requires_grad_(False)

    def queries(self, qr: torch.Tensor, rope: tuple) -> torch.Tensor:
        """``qr`` [s, b, q_lora_rank] at ``rope`` (cos, sin ``[s, rope_dim / 2]``) -> [s, b, H, D]."""
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.dim))
        cos, sin = rope
        return _rotate_first(q, cos[:, None, None], sin[:, None, None], self.rope_dim)

    def keys(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        """``x`` [s, b, hidden] -> [s, b, D]."""
        cos, sin = rope
        return _rotate_first(self.k_norm(self.wk(x)), cos[:, None], sin[:, None], self.rope_dim)

    def scores(self, x_q: torch.Tensor, qr: torch.Tensor, x_k: torch.Tensor, q_rope: tuple,
               k_rope: tuple) -> torch.Tensor:
        """Index scores ``[b, sq, sk]`` (fp32) of queries at ``x_q`` / ``qr`` against keys at
        ``x_k``."""
        q = self.queries(qr, q_rope).float()
        k = self.keys(x_k, k_rope).float()
        per_head = torch.relu(torch.einsum("sbhd,tbd->bsht", q, k) * self.dim ** -0.5)
        weights = self.weights_proj(x_q).float() * self.heads ** -0.5  # [sq, b, H]
        return torch.einsum("bsht,sbh->bst", per_head, weights)


def _rotate_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rope_dim: int) -> torch.Tensor:
    """RoPE on the first ``rope_dim`` of ``x``'s last axis, in interleaved pairs ``(x0, x1),
    (x2, x3), ...`` written back de-interleaved (evens, then odds), as transformers'
    ``apply_rotary_pos_emb_interleave`` writes them (a permutation shared by queries and keys,
    so the scores are the interleaved rotation's)."""
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin, rest], dim=-1)


class SelectionStore:
    """The top-k selections of a model chunk's full layers, per micro-batch (module
    docstring): ``put`` by a full layer that shared layers read, ``get`` by those. Holds the
    last ``capacity`` micro-batches: :func:`in_flight` of them, what a pipeline schedule
    can still recompute (each entry is a ``[b, sq, sk]`` mask per full layer)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_batch: OrderedDict[object, dict[int, torch.Tensor]] = OrderedDict()

    def put(self, batch: object, layer: int, selected: torch.Tensor) -> None:
        self._by_batch.setdefault(batch, {})[layer] = selected
        self._by_batch.move_to_end(batch)
        while len(self._by_batch) > self.capacity:
            self._by_batch.popitem(last=False)

    def get(self, batch: object, layer: int, reader: int) -> torch.Tensor:
        try:
            return self._by_batch[batch][layer]
        except KeyError:
            raise ModelLoadError(
                f"layer {reader}: a shared DSA layer needs the top-k selection of layer "
                f"{layer}, which did not run on this pipeline stage for this micro-batch. Fix: "
                "split the pipeline so that every stage starts on a full indexer layer "
                "(config.json indexer_types).") from None


def in_flight() -> int:
    """An upper bound on the micro-batches whose backward a rank's pipeline schedule has not
    run yet (Megatron's 1F1B warm-up, interleaved or not), plus the one in hand."""
    stages = mpu.get_pipeline_model_parallel_world_size()
    chunks = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    return 2 * stages * chunks + 1


def batch_key(attention_mask, packed_seq_params) -> object:
    """What identifies a micro-batch to every layer and to its recompute: the
    ``PackedSeqParams`` object (THD), else the mask's storage (a forward without either, one
    causal row, is one key)."""
    if packed_seq_params is not None:
        return id(packed_seq_params)
    return None if attention_mask is None else attention_mask.data_ptr()


def source_layer(indexer_types: tuple[str, ...], layer_number: int) -> int:
    """The 1-based layer whose selection layer ``layer_number`` uses: itself when full, else
    the last full layer before it (transformers passes each layer's top-k to the next; the
    first layer is full, ``hf_config.sparse_indexer_types``)."""
    return max(n for n in range(1, layer_number + 1) if indexer_types[n - 1] == FULL)


class SparseCoreAttention(MegatronModule):
    """MLA's core attention with GLM-5's sparse selection (module docstring). Takes what
    Megatron's MLA gives a DSA core attention: queries / keys ``[s, b, h, dk]``, values
    ``[s, b, h, dv]``, the mask ``[b or 1, 1, s, s]`` (True = blocked) or THD
    ``packed_seq_params``, and ``x`` (the layer's normalised input) and ``qr``; returns
    ``[s, b, h * dv]``. ``indexer_types``: the checkpoint's, as launch read and checked them
    (``vime_shell.models.hf_config.sparse_indexer_types``)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None, *, hf_config,
                 indexer_types: tuple[str, ...], store: SelectionStore):
        super().__init__(config=config)
        types = indexer_types
        self.layer_number = layer_number
        self.source = source_layer(types, layer_number)
        self.store = store
        self.topk = int(hf_config.index_topk)
        self.softmax_scale = softmax_scale
        self.indexer = Indexer(hf_config, config.params_dtype) \
            if self.source == layer_number else None
        # a full layer keeps its selection only where a shared layer reads it
        self.read_later = self.indexer is not None and any(
            source_layer(types, n) == layer_number
            for n in range(layer_number + 1, len(types) + 1) if types[n - 1] == SHARED)
        # transformers' own rotary frequencies for the indexer (its RoPE type and scaling)
        rotary = GlmMoeDsaRotaryEmbedding(hf_config)
        self.register_buffer("inv_freq", rotary.inv_freq.float(), persistent=False)
        self.rope_scaling = float(rotary.attention_scaling)

    def forward(self, query, key, value, attention_mask, x=None, qr=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        lengths = None if packed_seq_params is None else \
            torch.diff(packed_seq_params.cu_seqlens_q).tolist()
        cp = mpu.get_context_parallel_world_size()
        if cp > 1:
            key, q_pos = gather_zigzag(key, lengths, cp)
            value, _ = gather_zigzag(value, lengths, cp)
        else:
            q_pos = torch.arange(query.shape[0], device=query.device)
        blocked = _blocked(attention_mask, lengths, q_pos)  # [b or 1, sq, sk]
        batch = batch_key(attention_mask, packed_seq_params)
        if self.indexer is None:
            selected = self.store.get(batch, self.source, self.layer_number)
        else:
            selected = self._select(x, qr, blocked, q_pos, cp, lengths)
            if self.read_later:
                self.store.put(batch, self.layer_number, selected)
        return softmax_attention(query, key, value, (blocked | ~selected)[:, None],
                                 self.softmax_scale)

    @torch.no_grad()
    def _select(self, x, qr, blocked, q_pos, cp, lengths) -> torch.Tensor:
        """``[b, sq, sk]`` bool: the keys the indexer picks for each query."""
        assert self.indexer is not None  # a full layer (forward)
        x, qr = x.detach(), qr.detach()
        if self.config.sequence_parallel and mpu.get_tensor_model_parallel_world_size() > 1:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            qr = gather_from_sequence_parallel_region(qr, tensor_parallel_output_grad=False)
        if qr.dim() == 2:  # THD: Megatron's MLA drops the batch axis of qr
            qr = qr.unsqueeze(1)
        x_k = gather_zigzag(x, lengths, cp)[0] if cp > 1 else x
        # transformers' cos / sin: its frequencies times its attention scaling (YaRN's mscale)
        angles = torch.outer(torch.arange(x_k.shape[0], device=x.device).float(),
                             self.inv_freq.to(x.device))
        cos, sin = angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling
        scores = self.indexer.scores(x, qr, x_k, (cos[q_pos], sin[q_pos]), (cos, sin))
        return top_keys(scores.masked_fill(blocked, float("-inf")), self.topk)


def top_keys(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[b, sq, sk]`` bool: each query's ``k`` highest-scoring keys, the earlier key first
    among equal scores (module docstring: ties)."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)


def _blocked(attention_mask, lengths, q_pos) -> torch.Tensor:
    """``[b or 1, sq, sk]`` True where the layout blocks the queries at row positions ``q_pos``
    from the row's keys: the samples of the THD ``lengths`` (``tensors.block_causal_mask``),
    else the record's mask, else causal."""
    if lengths is not None:
        return block_causal_mask(lengths, q_pos.device)[:, 0, q_pos]
    if attention_mask is not None:
        return attention_mask[:, 0]
    return causal_mask(len(q_pos), q_pos.device)[None]
