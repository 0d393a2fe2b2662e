"""``HfEngine``: transformers ``generate`` in-process, the CPU / CI / embedded-default engine.

How it meets the protocol's invariants (see :mod:`vime_shell.engines.base`):
- Sampling happens in our own logits processor with one ``torch.Generator`` per request, seeded
  ``seed + i``; it turns the chosen token into the only finite logit and lets ``generate`` pick it
  greedily. A request's draw therefore depends on its seed alone, not on batch composition, and
  the samples of a group differ.
- Log-probs come from the **raw** logits (``output_logits=True``), never from processed scores;
  so do the top-k log-probs asked for with ``SamplingParams.top_log_probs`` (:func:`top_entries`).
- Prompts are left-padded (``generate`` needs that for batched decoding); the padding side is
  set on every call, because loading a tokenizer or model can reset it.
- Per-request budgets (``max_context_len``) and stop strings are applied to each row after the
  batched ``generate``: decoding is causal, so a row's first ``k`` tokens do not depend on how
  long it ran on. Stop strings are matched on the text of the model directory's tokenizer.
- Routed experts (``return_routed_experts=True``, MoE models, for routing replay): ``generate``
  does not expose its routers' choices, so one forward of the same weights over each prompt +
  response (right-padded) gives them: what every MoE layer's router picked for every token,
  read off the router (transformers 5's ``*TopKRouter`` modules return ``(logits, weights,
  indices)``), so an expert bias or group-limited routing (DeepSeek-V3, GLM-4.5, MiniMax-M2)
  is the router's own, not a top-k of its logits.
"""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          LogitsProcessorList)

from vime_pure.errors import field_error
from vime_shell.engines.base import (
    EngineError, Generation, NamedTensors, SamplingParams, check_prompts, stop_string_end,
)
from vime_shell.engines.group import EngineOptions
from vime_shell.engines.layout import EngineLayout
from vime_shell.engines.weights import load_safetensors_dir
from vime_shell.models.auto_config import auto_config
from vime_shell.models.hf_names import fused_expert_name, fused_expert_slice, in_memory_name

if TYPE_CHECKING:  # what AutoModelForCausalLM builds: a PreTrainedModel with GenerationMixin
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM


class _SeededSampler:
    """Logits processor sampling row ``i`` with its own generator; returns one-hot logits."""

    def __init__(self, seeds: Sequence[int], params: SamplingParams, device: torch.device):
        self.params = params
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = choose_tokens(scores, self.generators, self.params)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen[:, None], 0.0)
        return out


def top_entries(log_probs: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``k`` most likely tokens of each position of ``log_probs`` ``[..., V]`` (raw
    log-probs) as ``(ids int64, log-probs float32)`` arrays ``[..., k]``, most likely first;
    None for ``k == 0`` (not asked). Example: log-probs ``[[-2, -0.5, -1]]``, ``k=2`` ->
    ``([[1, 2]], [[-0.5, -1]])``."""
    if not k:
        return None
    values, ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    return ids.cpu().numpy().astype(np.int64), values.cpu().numpy().astype(np.float32)


def choose_tokens(scores: torch.Tensor, generators: Sequence[torch.Generator],
                  params: SamplingParams) -> torch.Tensor:
    """One token per row of ``scores`` [B, V]: row ``i`` drawn with ``generators[i]`` (one
    uniform per call), argmax when ``params.temperature == 0``. The batched ``generate`` and
    the per-request front (:mod:`vime_shell.engines.hf_async`) both sample here, so a request's
    draw depends on its seed and logits alone.
    Example: temperature 0 on ``[[0., 2., 1.]]`` chooses ``[1]``."""
    p = params
    logits = scores.float()
    if p.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=g, device=scores.device)
                     for g in generators]) * cdf[:, -1]
    chosen = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)
    return chosen.clamp_(max=logits.shape[-1] - 1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches ``top_p``."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = sorted_p.cumsum(dim=-1) - sorted_p < top_p  # always keeps the top token
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return probs * keep


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of a transformers 5 model, in layer order (module docstring)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


class HfEngine:
    """A Hugging Face causal LM generating in-process (CPU by default).

    Example: ``HfEngine("~/.cache/vime/embedded/...").generate([[5, 6, 14]],
    SamplingParams(max_new_tokens=2, seed=0))`` returns one ``Generation`` with 2 tokens.
    """

    name = "hf"

    def __init__(self, model_path: str | Path, *, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, tokenizer: Any = None,
                 return_routed_experts: bool = False):
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise field_error(EngineError, "model_path", str(path),
                              "is not a Hugging Face model directory (no config.json)",
                              "pass a directory saved with save_pretrained, e.g. the embedded "
                              "model from vime_shell.models.embedded.build_embedded()")
        model = AutoModelForCausalLM.from_pretrained(path, config=auto_config(path), dtype=dtype)
        self._init(model, seed=seed, device=device, return_routed_experts=return_routed_experts)
        self.model_path: Path | None = path
        self._tokenizer = tokenizer

    @classmethod
    def from_options(cls, hf_dir: str | Path, options: EngineOptions, layout: EngineLayout,
                     *, seed: int) -> "HfEngine":
        """The engine a run's settings ask for (``EngineGroup``'s build): on this rank's GPU
        when there is one, in ``options.dtype``; ``layout`` changes nothing (with several
        ranks per engine each rank holds a replica)."""
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return cls(hf_dir, seed=seed, device=device, dtype=getattr(torch, options.dtype),
                   return_routed_experts=options.routed_experts)

    @classmethod
    def from_model(cls, model: "CausalLM", *, seed: int = 0, device: str = "cpu",
                   tokenizer: Any = None, return_routed_experts: bool = False) -> "HfEngine":
        """Wrap an already-built ``PreTrainedModel`` (tests, in-process trainers); stop
        strings need ``tokenizer``."""
        engine = cls.__new__(cls)
        engine._init(model, seed=seed, device=device,
                     return_routed_experts=return_routed_experts)
        engine.model_path = None
        engine._tokenizer = tokenizer
        return engine

    def _decoder(self) -> Any:
        """The tokenizer that decodes responses for stop strings (loaded on first need)."""
        if self._tokenizer is None:
            if self.model_path is None:
                raise field_error(EngineError, "stop", "<stop strings>",
                                  "need a tokenizer, and this engine was built from a model "
                                  "object", "pass HfEngine.from_model(..., tokenizer=tok)")
            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        return self._tokenizer

    def _init(self, model: "CausalLM", *, seed: int, device: str,
              return_routed_experts: bool = False) -> None:
        self.topk = getattr(model.config, "num_experts_per_tok", None)
        if return_routed_experts and self.topk is None:
            raise field_error(EngineError, "return_routed_experts", True,
                              f"needs an MoE model, and {model.config.model_type} is dense",
                              "drop --use-rollout-routing-replay for a dense model")
        if return_routed_experts and not _routers(model):
            raise field_error(EngineError, "return_routed_experts", True,
                              f"finds no router module (*TopKRouter) in {type(model).__name__}",
                              "drop --use-rollout-routing-replay, or use the vLLM engine")
        self.return_routed_experts = return_routed_experts
        self.device = torch.device(device)
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy binds without self
        self.model: "CausalLM" = model.to(self.device).eval()  # type: ignore[arg-type]
        self.vocab_size = int(model.config.vocab_size)
        pad = model.config.pad_token_id
        if pad is None:
            pad = getattr(model.generation_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        # generate() fills unset options from the model's generation config, which would make
        # the model's EOS a stop token behind our back: stop tokens come from SamplingParams.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_token_id)
        # Unseeded calls draw their per-request seeds from this stream.
        self._seed_rng = np.random.default_rng(seed)
        self.weight_version = 0  # see RolloutEngine.weight_version

    def draw_seeds(self, n: int) -> list[int]:
        """``n`` request seeds from the engine's own stream (requests with ``seed=None``)."""
        return self._seed_rng.integers(0, 2**62, size=n).tolist()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]:
        ids = check_prompts(prompts, self.vocab_size)
        if not ids:
            return []
        if params.seed is None:
            seeds = self.draw_seeds(len(ids))
        else:  # params.request_seed(i), known to be an int here
            seeds = [params.seed + i for i in range(len(ids))]
        budgets = [params.max_new_tokens_for(len(p)) for p in ids]
        input_ids, attention = self._left_pad(ids)
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max(budgets),
            min_new_tokens=0, eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=self.pad_token_id, output_logits=True, return_dict_in_generate=True,
        )
        sampler = _SeededSampler(seeds, params, self.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention, generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
            )
        response = out.sequences[:, input_ids.shape[1]:]
        raw = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # [B, T, V]
        logp = raw.gather(-1, response[..., None]).squeeze(-1)
        top = top_entries(raw, params.top_log_probs)
        decode = self._decoder().decode if params.stop else None
        gens = [self._cut(response[i, :budgets[i]].tolist(), logp[i, :budgets[i]].tolist(),
                          params, decode, None if top is None else (top[0][i], top[1][i]))
                for i in range(len(ids))]
        return self._with_routes(ids, gens) if self.return_routed_experts else gens

    @torch.no_grad()
    def _with_routes(self, prompts: list[list[int]], gens: list[Generation]) -> list[Generation]:
        """``gens`` with the experts every prompt + response token is routed to (module
        docstring): ``[tokens, moe_layers, topk]`` int16 per generation."""
        seqs = [p + list(g.token_ids) for p, g in zip(prompts, gens)]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(seqs):  # right padding: causal, the real tokens see no pad
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
        chosen: list[torch.Tensor] = []  # each MoE layer's top-k ids, in forward order
        hooks = [m.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
                 for m in _routers(self.model)]
        try:
            self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        finally:
            for hook in hooks:
                hook.remove()
        top = torch.stack([c.view(len(seqs), width, -1) for c in chosen],
                          dim=2).to(torch.int16).cpu()
        return [attrs.evolve(g, routed_experts=top[i, :len(seq)].numpy())
                for i, (g, seq) in enumerate(zip(gens, seqs))]

    def _left_pad(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(ids), width), dtype=torch.long)
        for i, p in enumerate(ids):  # left padding: the prompt ends where generation starts
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        return input_ids.to(self.device), attention.to(self.device)

    @staticmethod
    def _cut(tokens: list[int], logps: list[float], params: SamplingParams,
             decode: Callable[[Sequence[int]], str] | None = None,
             top: tuple[np.ndarray, np.ndarray] | None = None) -> Generation:
        """Keep tokens up to and including the first stop token (dropping the padding after
        it), then up to the token completing the first stop string (``top``: each position's
        top-k ids and log-probs, cut alike)."""
        stops = set(params.stop_token_ids)
        end = next((j + 1 for j, tok in enumerate(tokens) if tok in stops), None)
        if decode is not None:
            at = stop_string_end(tokens[:end], decode, params.stop)
            end = end if at is None else at
        keep = slice(None, end if end is not None else len(tokens))
        return Generation(token_ids=tokens[keep], log_probs=logps[keep],
                          finish_reason="length" if end is None else "stop",
                          top_token_ids=None if top is None else top[0][keep],
                          top_log_probs=None if top is None else top[1][keep])

    def update_weights_from_tensors(self, named_tensors: NamedTensors) -> None:
        """Copy HF-named tensors into the model in place; unknown names or shapes are errors.
        A checkpoint's per-expert name goes into its slice of the fused expert tensors
        (:func:`fused_expert_slice`)."""
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        with torch.no_grad():
            for name, tensor in named_tensors:
                name = in_memory_name(name)
                target = params.get(name)
                if target is None:
                    target = fused_expert_slice(params, name)
                if target is None:
                    raise field_error(EngineError, "name", name,
                                      "is not a parameter of the engine's model",
                                      "export HF-named weights (mbridge export) for this model")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise field_error(EngineError, f"shape of {name}", tuple(tensor.shape),
                                      f"differs from the engine's {tuple(target.shape)}",
                                      "sync weights of the same architecture")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def update_weights_from_path(self, path: str | Path) -> None:
        """Load every ``*.safetensors`` in ``path``; all parameters must be present."""
        tensors = load_safetensors_dir(path)
        own = {n for n, _ in self.model.named_parameters()}  # tied weights are listed once
        names = map(in_memory_name, tensors)
        covered = {n if n in own else fused_expert_name(n) for n in names}
        missing = sorted(own - covered)
        if missing:
            raise field_error(EngineError, "path", str(path),
                              f"lacks {len(missing)} parameters, e.g. {missing[:3]}",
                              "save the complete model (save_pretrained / mbridge export)")
        self.update_weights_from_tensors(tensors.items())
        self.weight_version += 1

    def sleep(self, level: int = 1) -> None:
        """No-op: transformers has no sleep mode (the memory stays with the model)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """No-op, see :meth:`sleep`."""

    def close(self) -> None:
        # Frees the weights; a closed engine is never called again, so the attribute keeps
        # the model's type for every other method.
        self.model = None  # type: ignore[assignment]
