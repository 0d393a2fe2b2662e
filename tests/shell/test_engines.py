"""HfEngine and engine selection on the embedded tiny Qwen2 (CPU, in-process).

Asserts the protocol invariants of :mod:`vime_shell.engines.base`: token / log-prob lengths and
finish reasons; raw log-probs equal a direct forward of prompt + response to 1e-5 (left padding
included); per-request seeds give reproducible, batch-independent and diverse samples; weight
updates (tensors or directory) make the engine match the new weights; bad input is a typed error.
"""

import pytest
import torch

from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.engines import (
    EngineError, Generation, SamplingParams, resolve_engine_name, select_engine, vllm_available,
)
from vime_shell.engines.hf import HfEngine
from vime_shell.engines.weights import load_safetensors_dir, save_safetensors_dir

LOGPROB_TOL = 1e-5
PROMPTS = ["12>", "3+4=", "aabab#", "07=", "9>"]  # mixed lengths: exercises left padding


@pytest.fixture(scope="module")
def dirs(embedded_pair):
    return embedded_pair


@pytest.fixture(scope="module")
def tok(dirs):
    return load_tokenizer(dirs[0])


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def assert_generation_invariants(gens: list[Generation], params: SamplingParams) -> None:
    for g in gens:
        assert 1 <= len(g.token_ids) == len(g.log_probs) <= params.max_new_tokens
        assert all(lp <= 0.0 for lp in g.log_probs)
        ends_on_stop = g.token_ids[-1] in params.stop_token_ids
        assert (g.finish_reason == "stop") == ends_on_stop
        assert (g.finish_reason == "length") == (not ends_on_stop)
        assert not set(g.token_ids[:-1]) & set(params.stop_token_ids)


def forward_logprobs(model, prompt: list[int], response: tuple[int, ...]) -> list[float]:
    """Log-probs of ``response`` from one unpadded forward of prompt + response."""
    seq = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt):, None])[:, 0].tolist()


def max_gap(gens, model, prompts) -> float:
    return max(abs(a - b) for g, p in zip(gens, prompts)
               for a, b in zip(g.log_probs, forward_logprobs(model, p, g.token_ids)))


def test_sampled_logprobs_equal_a_direct_forward(dirs, prompts, tok):
    engine = HfEngine(dirs[0])
    params = SamplingParams(max_new_tokens=6, seed=5, stop_token_ids=(tok.eos_token_id,))
    gens = engine.generate(prompts * 4, params)
    assert_generation_invariants(gens, params)
    assert max_gap(gens, engine.model, prompts * 4) < LOGPROB_TOL


def test_greedy_picks_the_argmax_and_top_k_1_is_greedy(dirs, prompts):
    engine = HfEngine(dirs[0])
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=4, top_k=1, seed=9))
    assert [g.token_ids for g in greedy] == [g.token_ids for g in top1]
    for g, p in zip(greedy, prompts):
        seq = torch.tensor([list(p) + list(g.token_ids)])
        with torch.no_grad():
            argmax = engine.model(input_ids=seq).logits[0, len(p) - 1:-1].argmax(-1).tolist()
        assert tuple(argmax) == g.token_ids


def test_group_samples_differ_and_seeds_reproduce(dirs, prompts):
    engine = HfEngine(dirs[0])
    group = [prompts[0]] * 8
    params = SamplingParams(max_new_tokens=4, seed=100)
    first = engine.generate(group, params)
    assert len({g.token_ids for g in first}) > 1, "identical samples give zero advantages"
    assert engine.generate(group, params) == first
    # Request i uses seed + i whatever else is in the batch.
    tail = engine.generate(group[2:], SamplingParams(max_new_tokens=4, seed=102))
    assert [g.token_ids for g in tail] == [g.token_ids for g in first[2:]]
    unseeded = SamplingParams(max_new_tokens=4)
    assert engine.generate(group, unseeded) != engine.generate(group, unseeded)


def test_no_stop_tokens_means_the_models_eos_does_not_stop(dirs, prompts, tok):
    engine = HfEngine(dirs[0])
    params = SamplingParams(max_new_tokens=8, seed=1)
    gens = engine.generate(prompts * 20, params)
    assert all(g.finish_reason == "length" and len(g.token_ids) == 8 for g in gens)
    assert any(tok.eos_token_id in g.token_ids for g in gens)  # sampled, but not a stop


@pytest.mark.parametrize("via", ["tensors", "path"])
def test_weight_update_changes_outputs_and_matches_new_weights(dirs, prompts, tmp_path, via):
    engine, reference = HfEngine(dirs[0]), HfEngine(dirs[1])
    params = SamplingParams(max_new_tokens=4, seed=3)
    before = engine.generate(prompts, params)
    new = load_safetensors_dir(dirs[1])
    if via == "tensors":
        engine.update_weights_from_tensors(new.items())
    else:
        engine.update_weights_from_path(save_safetensors_dir(tmp_path / "sync", new.items()))
    after = engine.generate(prompts, params)
    assert after != before
    # Log-probs included, exactly: the same prompts in one call, the same weights' bits.
    assert after == reference.generate(prompts, params)
    assert max_gap(after, reference.model, prompts) < LOGPROB_TOL


def test_bad_input_is_a_typed_error(dirs, tmp_path):
    engine = HfEngine(dirs[0])
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(EngineError, match=r"prompts\[1\]"):
        engine.generate([[3], []], params)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([[3, 10_000]], params)
    with pytest.raises(EngineError, match="not a parameter"):
        engine.update_weights_from_tensors([("model.nope.weight", torch.zeros(1))])
    name, tensor = next(iter(load_safetensors_dir(dirs[0]).items()))
    with pytest.raises(EngineError, match="shape"):
        engine.update_weights_from_tensors([(name, torch.zeros(tensor.numel() + 1))])
    with pytest.raises(EngineError, match="safetensors"):
        engine.update_weights_from_path(tmp_path)
    save_safetensors_dir(tmp_path / "partial", [(name, tensor)])
    with pytest.raises(EngineError, match="lacks"):
        engine.update_weights_from_path(tmp_path / "partial")
    with pytest.raises(EngineError, match="config.json"):
        HfEngine(tmp_path)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p"),
    (dict(max_new_tokens=2, top_k=-1), "top_k"),
    (dict(max_new_tokens=2, stop_token_ids=(-3,)), "stop_token_ids"),
    (dict(max_new_tokens=2, seed=-1), "seed"),
])
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(EngineError, match=field):
        SamplingParams(**kwargs)


def test_engine_selection_by_capability_and_by_name(dirs):
    expected = "vllm" if torch.cuda.is_available() and _has_vllm() else "hf"
    assert resolve_engine_name(None) == expected
    assert resolve_engine_name("hf") == "hf"
    with pytest.raises(EngineError, match="rollout_engine"):
        resolve_engine_name("sglang")
    assert select_engine("hf", dirs[0]).name == "hf"
    if not _has_vllm():
        with pytest.raises(EngineError, match="not installed"):
            select_engine("vllm", dirs[0])


def _has_vllm() -> bool:
    return vllm_available()


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    root = tmp_path_factory.mktemp("hf-moe")
    return tuple(build_tiny_hf_model(root / f"m{seed}", TinyModelSpec(arch="qwen3_moe",
                                                                      num_layers=2, seed=seed))
                 for seed in (1, 2))


def test_moe_weights_sync_into_transformers_fused_experts(moe_pair):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(moe_pair[1], dtype=torch.float32)
    toks = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    for update in ("tensors", "path"):
        engine = HfEngine(moe_pair[0])
        if update == "tensors":  # per-expert checkpoint names, as the trainer exports them
            engine.update_weights_from_tensors(load_safetensors_dir(moe_pair[1]).items())
        else:
            engine.update_weights_from_path(moe_pair[1])
        with torch.no_grad():
            assert torch.equal(engine.model(toks).logits, reference(toks).logits), update


def test_routed_experts_are_the_routers_top_k_of_every_token(moe_pair, dirs):
    engine = HfEngine(moe_pair[0], return_routed_experts=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=0))
    for p, g in zip(prompts, gens):
        seq = torch.tensor([p + list(g.token_ids)])
        assert g.routed_experts.shape == (seq.shape[1], 2, 2)  # every token, 2 layers, top-2
        with torch.no_grad():
            logits = engine.model(seq, output_router_logits=True).router_logits
        for layer, lg in enumerate(logits):
            expected = lg.topk(2, dim=-1).indices.sort(dim=-1).values
            assert torch.equal(torch.from_numpy(g.routed_experts[:, layer]).long()
                               .sort(dim=-1).values, expected)
    assert HfEngine(moe_pair[0]).generate(prompts, SamplingParams(
        max_new_tokens=3, seed=0))[0].routed_experts is None  # only when asked
    with pytest.raises(EngineError, match="return_routed_experts=True: needs an MoE model"):
        HfEngine(dirs[0], return_routed_experts=True)
