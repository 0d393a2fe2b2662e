"""On-policy distillation (``--use-opd``, slime's and miles'): each token's advantage minus
``--opd-kl-coef x (student log-prob - teacher log-prob)`` on top of any estimator, the teacher
a frozen model in the trainer (``--opd-type megatron --opd-teacher-load DIR``) or a server
(``--opd-type sglang`` at ``--rm-url`` or ``--opd-teacher-urls``: SGLang's ``/generate``,
asked after each rollout, ``vime_shell.rollout.teacher``).

Asserted: the shaping is slime's formula, per token, and acts on the advantages only (the
teacher gets no gradient); the flags follow slime's and miles' rules (a type and a teacher
with ``--use-opd``, a teacher without it is an error, a teacher of another architecture fails
at launch naming both values); the server's log-probs land on every sample (retried through a
503, routed by metadata to miles' named teachers) and travel with the batch to the records
(``tests/property`` checks every column on the way; here a packed exchange piece); and a run
whose reward is constant (GRPO advantages 0) learns from the teacher alone: 8 rollouts on the
embedded model with a teacher of other weights bring the logged reverse KL down (its
per-rollout estimate is noisy: the mean of the last 3 against the first), and the --save-hf
export is written. The teacher server run (slime's script's flags, a stand-in SGLang server
answering with transformers) logs rollout 0's reverse KL within 1e-4 of the in-trainer
teacher's: the same samples, the same teacher, two forwards.
"""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tests.sglang_teacher import position_log_probs, sglang_teacher, teacher_log_probs
from vime_pure import BatchingPolicy, ParallelLayout, RolloutBatch, Sample, rank_batch, schedule_for
from vime_pure.data.shares import output_part, plan_shares, share_of_batch
from vime_pure.policy_config import LossConfig
from vime_pure.torch_ops.policy_loss import kl_shaped_advantages
from vime_shell.engines.base import SamplingParams
from vime_shell.engines.hf import HfEngine
from vime_shell.engines.hf_async import HfAsyncFront
from vime_shell.models.embedded import EmbeddedSpec, build_embedded
from vime_shell.rollout import remote_reward
from vime_shell.rollout.teacher import (ANCHOR_OPD_POST_PROCESS, Teacher, TeacherError,
                                        response_entries, response_log_probs)
from vime_shell.sources.exchange import pack_piece, unpack_piece
from vime_shell.storage.dump import load_rollout_batch
from vime_shell.settings.common import ConfigError
from vime_shell.settings.train_config import TrainConfig

SRC = str(Path(__file__).resolve().parents[1] / "src")


@given(st.lists(st.tuples(st.floats(-3, 3), st.floats(-6, -0.01), st.floats(-6, -0.01)),
                min_size=1, max_size=8), st.floats(0, 4))
def test_the_shaping_is_slimes_formula(tokens, coef):
    """``A - coef * (student - teacher)`` per token (slime's ``apply_opd_kl_to_advantages``),
    detached: the loss's gradient flows through the surrogate's log-probs only."""
    adv, student, teacher = (torch.tensor(c, dtype=torch.float64) for c in zip(*tokens))
    student = student.clone().requires_grad_(True)
    shaped = kl_shaped_advantages(adv, student, teacher, coef=coef, kind="k1")
    torch.testing.assert_close(shaped, adv - coef * (student.detach() - teacher))
    assert not shaped.requires_grad


def test_flags_follow_slimes_rules(tmp_path):
    teacher = str(tmp_path)
    cfg = TrainConfig(use_opd=True, opd_type="megatron", opd_teacher_load=teacher,
                      opd_kl_coef=0.5)
    assert cfg.loss_config() == LossConfig(opd_kl_coef=0.5)
    assert TrainConfig(opd_kl_coef=0.5).loss_config().opd_kl_coef == 0.0  # off without --use-opd
    with pytest.raises(ConfigError, match="--opd-type=None: is required with --use-opd"):
        TrainConfig(use_opd=True, opd_teacher_load=teacher)
    with pytest.raises(ConfigError, match="--opd-teacher-load=None: is required"):
        TrainConfig(use_opd=True, opd_type="megatron")
    with pytest.raises(ConfigError, match="is set but --use-opd is not"):
        TrainConfig(opd_teacher_load=teacher)
    server = dict(use_opd=True, opd_type="sglang")
    with pytest.raises(ConfigError, match="--rm-url=None: is required with --opd-type sglang"):
        TrainConfig(**server)
    with pytest.raises(ConfigError, match="is set with --opd-type sglang, whose teacher is a"):
        TrainConfig(**server, rm_url="http://t/generate", opd_teacher_load=teacher)
    with pytest.raises(ConfigError, match="--opd-teacher-urls='math': is not NAME=URL"):
        TrainConfig(**server, opd_teacher_urls=("math",))
    with pytest.raises(ConfigError, match="names the teacher 'a' twice"):
        TrainConfig(**server, opd_teacher_urls=("a=http://x", "a=http://y"))
    with pytest.raises(ConfigError, match="--rm-type='remote_rm': has no reward server"):
        TrainConfig(**server, rm_url="http://t/generate", rm_type="remote_rm")
    with pytest.raises(ConfigError, match="--custom-reward-post-process-path=.*is on-policy"):
        TrainConfig(custom_reward_post_process_path=ANCHOR_OPD_POST_PROCESS[0])
    with pytest.raises(ConfigError, match="--opd-teacher-urls=.*but --opd-type is megatron"):
        TrainConfig(use_opd=True, opd_type="megatron", opd_teacher_load=teacher,
                    opd_teacher_urls=("default=http://x",))
    # --rm-type remote_rm without --rm-url and without OPD is the reward's own launch error
    assert TrainConfig(rm_type="remote_rm").reward_url is None
    # --rm-url is the teacher's in slime's form, the reward server's beside miles' teachers
    assert TrainConfig(**server, rm_url="http://t/generate").reward_url is None
    assert TrainConfig(**server, rm_url="http://r", opd_teacher_urls=(
        "default=http://t",)).reward_url == "http://r"


def test_the_server_teacher_scores_every_sample(tmp_path, monkeypatch):
    """Each sample's response log-probs are the teacher's (one request per sample, retried
    through a 503), a sample goes to the teacher its metadata names, else to ``default``;
    a reply of the wrong shape names the URL and the sample."""
    monkeypatch.setattr(remote_reward, "RM_URL_BACKOFF_S", 0.01)
    model_dir = build_embedded(tmp_path, EmbeddedSpec(seed=1))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    samples = [Sample(tokens=[5, 6, 7, 8, 9], response_length=3, metadata={"opd_teacher": "b"}),
               Sample(tokens=[5, 6, 7], response_length=1), Sample(tokens=[4], response_length=0)]
    with sglang_teacher(model_dir, fail_first=1) as (url, seen):
        cfg = TrainConfig(use_opd=True, opd_type="sglang", opd_teacher_urls=(
            f"a={url}?a", f"b={url}?b", f"default={url}?default"))
        Teacher.build(cfg).score([samples])
        assert [s.teacher_log_probs for s in samples[1:]][1] == []
        for s in samples[:2]:
            want = teacher_log_probs(model, list(s.tokens))[-s.response_length:]
            np.testing.assert_allclose(s.teacher_log_probs, want, rtol=0, atol=1e-6)
        assert len(seen) == 3 and seen[-1]["sampling_params"]["max_new_tokens"] == 0
    picked = Teacher(urls={"a": "http://a", "default": "http://d"})
    assert picked.url_of(samples[0]) == "http://d" and picked.url_of(Sample(
        metadata={"opd_teacher": "a"})) == "http://a"
    with pytest.raises(TeacherError, match=r"metadata\['opd_teacher'\]='b': names none of"):
        Teacher(urls={"a": "http://a"}).url_of(samples[0])
    with pytest.raises(TeacherError, match="http://t, sample 0: the reply .* has no meta_info"):
        response_log_probs({"text": ""}, 5, 3, where="http://t, sample 0")
    with pytest.raises(TeacherError, match="response token 1 has the log-prob entry"):
        response_log_probs({"meta_info": {"input_token_logprobs": [
            [None, 1, None], [-1.0, 2, None], [None, 3, None]]}}, 3, 2, where="t")


def test_top_k_distillation_scores_the_engines_top_tokens(tmp_path):
    """miles' ``--opd-log-prob-top-k``: the engine reports each generated token's K most likely
    tokens (raw log-probs, most likely first: the model's own top-K there, the sync and the
    per-request HF engines alike), the teacher server scores the union of their ids in one
    request per sample, and each response token's ``opd_reverse_kl`` is the estimate over the
    student's top-K, weighted by the student's softmax over them, from the two models."""
    k = 4
    student_dir = build_embedded(tmp_path / "s", EmbeddedSpec(seed=0))
    teacher_dir = build_embedded(tmp_path / "t", EmbeddedSpec(seed=1))
    student, teacher = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
                        for d in (student_dir, teacher_dir))
    engine = HfEngine(student_dir)
    params = SamplingParams(max_new_tokens=5, seed=3, top_log_probs=k)
    prompts = [[5, 6, 7], [8, 9]]
    gens = engine.generate(prompts, params)
    one = asyncio.run(HfAsyncFront(engine).generate(prompts[1], params))
    samples = []
    for prompt, gen in [*zip(prompts, gens), (prompts[1], one)]:
        tokens = prompt + list(gen.token_ids)
        full = position_log_probs(student, tokens)[len(prompt) - 1:]
        values, ids = full.topk(k, dim=-1)
        np.testing.assert_array_equal(gen.top_token_ids, ids.numpy())
        np.testing.assert_allclose(gen.top_log_probs, values.numpy(), atol=1e-5)
        samples.append(Sample(tokens=tokens, response_length=len(gen.token_ids),
                              rollout_top_log_probs=gen.top_pairs()))
    with sglang_teacher(teacher_dir) as (url, seen):
        Teacher(urls={"default": url}, top_k=k).score([samples])
    # the requests run concurrently: each reply is matched to its sample by the tokens sent
    bodies = {tuple(body["input_ids"]): body for body in seen}
    for sample in samples:
        body = bodies[tuple(sample.tokens)]
        union = sorted({y for entries in sample.rollout_top_log_probs for y, _ in entries})
        assert body["token_ids_logprob"] == union and "top_logprobs_num" not in body
        prompt_len = len(sample.tokens) - sample.response_length
        t_full = position_log_probs(teacher, list(sample.tokens))[prompt_len - 1:]
        want = []
        for entries, t_row in zip(sample.rollout_top_log_probs, t_full):
            ids, ls = [int(y) for y, _ in entries], torch.tensor([v for _, v in entries])
            want.append(float((torch.softmax(ls, 0) * (ls - t_row[ids])).sum()))
        np.testing.assert_allclose(sample.opd_reverse_kl, want, atol=1e-5)
        assert sample.teacher_log_probs is None


def test_top_k_flags_follow_miles_rules():
    """A top-K needs a teacher server, a strategy vime's engines serve, K >= 0; the engine is
    asked for K log-probs in training rounds only; a sample without the engine's top-K, or a
    teacher reply without the scored ids, is a TeacherError naming the sample."""
    server = dict(use_opd=True, opd_type="sglang", rm_url="http://t/generate")
    cfg = TrainConfig(**server, opd_log_prob_top_k=16, opd_top_k_strategy="intersection")
    assert cfg.opd_engine_top_k == 16 and TrainConfig(**server).opd_engine_top_k == 0
    with pytest.raises(ConfigError, match="--opd-log-prob-top-k=-1: must be >= 0"):
        TrainConfig(**server, opd_log_prob_top_k=-1)
    with pytest.raises(ConfigError, match="--opd-log-prob-top-k=4: needs --use-opd --opd-type "
                                          "sglang"):
        TrainConfig(opd_log_prob_top_k=4)
    with pytest.raises(ConfigError, match="--opd-top-k-strategy='union': needs the student's "
                                          "server to score"):
        TrainConfig(**server, opd_log_prob_top_k=4, opd_top_k_strategy="union")
    TrainConfig(opd_top_k_strategy="union")  # without a top-K the strategy is a no-op
    teacher = Teacher(urls={"default": "http://t"}, top_k=2, strategy="intersection")
    sample = Sample(tokens=[1, 2, 3], response_length=2)
    with pytest.raises(TeacherError, match="sample 0: --opd-log-prob-top-k 2 needs the engine's"
                                           " top-k log-probs of each of the 2 response tokens"):
        teacher._one(sample, 0)
    assert teacher._request([1, 2, 3], [{5: -0.1}, {6: -0.2}])["top_logprobs_num"] == 2
    per = attrs.evolve(teacher, per_position=True)._request([1, 2, 3], [{5: -0.1}, {6: -0.2}])
    assert per["token_ids_logprob_positions"] == [[], [5], [6]]
    with pytest.raises(TeacherError, match="t: the reply .* has no meta_info.input_top_logprobs"):
        response_entries({"meta_info": {}}, "input_top_logprobs", 3, 2, "t")


def test_teacher_log_probs_travel_with_the_batch_to_the_records():
    """Sample -> batch column -> a packed exchange piece -> the DP rank's share -> every
    record at its own tokens (CP 2: each rank scores its zigzag chunks)."""
    samples = [[Sample(tokens=list(range(1, 9)), response_length=5, reward=1.0,
                       teacher_log_probs=[-0.5, -1.0, -1.5, -2.0, -2.5]),
                Sample(tokens=[1, 2, 3], response_length=2, reward=0.0,
                       teacher_log_probs=[-3.0, -3.5])]]
    batch = RolloutBatch.from_samples(samples)
    np.testing.assert_array_equal(batch.teacher_log_probs,
                                  [-0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5])
    share = share_of_batch(batch, np.arange(2))
    part, meta = output_part(samples)
    meta, plan = plan_shares(meta, ParallelLayout(dp=1), BatchingPolicy(
        global_batch_size=1, max_tokens_per_gpu=64))
    assert meta.has_teacher
    unpacked = unpack_piece(pack_piece(share), plan)
    np.testing.assert_array_equal(unpacked.teacher_log_probs, share.teacher_log_probs)
    schedule = schedule_for(batch, ParallelLayout(dp=1, cp=2), BatchingPolicy(
        global_batch_size=1, max_tokens_per_gpu=64))
    scored = {}
    for cp_rank in range(2):
        mine = rank_batch(batch, schedule, dp_rank=0, cp_size=2, cp_rank=cp_rank)
        for mb in mine.microbatches:
            scored.update(zip(mb.response_index.tolist(), mb.teacher_log_probs.tolist()))
    assert [scored[j] for j in range(7)] == batch.teacher_log_probs.tolist()


def _train(tmp_path: Path, *extra: str, run: str = "run",
           reward: str = "tests.test_opd:no_reward") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vime_shell.cli", "train", "--run-dir", str(tmp_path / run),
         "--num-rollout", "8", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
         "--global-batch-size", "32", "--lr", "1e-3", "--custom-rm-path", reward, *extra],
        capture_output=True, text=True, timeout=600, cwd=str(Path(SRC).parent),
        env={"PYTHONPATH": f"{SRC}:{Path(SRC).parent}", "PATH": "", "OMP_NUM_THREADS": "1",
             "HOME": str(tmp_path), "VIME_CACHE_DIR": str(tmp_path / "cache")})


def no_reward(sample) -> float:
    """A constant reward: GRPO's advantages are 0, so only the teacher teaches."""
    return 0.0


def _reverse_kl(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["opd_reverse_kl"] for x in lines if x]


@pytest.mark.slow
def test_the_teacher_alone_teaches(tmp_path):
    teacher = build_embedded(tmp_path / "teachers", EmbeddedSpec(seed=1))
    done = _train(tmp_path, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load",
                  str(teacher), "--save-hf", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    kl = _reverse_kl(tmp_path / "run")
    assert len(kl) == 8 and kl[0] > 0.05 and sum(kl[-3:]) / 3 < 0.5 * kl[0], kl
    assert (tmp_path / "hf" / "config.json").is_file()
    # The same teacher as a server, with slime's script's flags: the same first rollout.
    anchor = "slime.rollout.on_policy_distillation"
    with sglang_teacher(teacher) as (url, seen):
        done = _train(tmp_path, "--use-opd", "--opd-type", "sglang", "--rm-url", url,
                      "--custom-reward-post-process-path", f"{anchor}.post_process_rewards",
                      run="server", reward=f"{anchor}.reward_func")
    assert done.returncode == 0, done.stderr[-2000:]
    served = _reverse_kl(tmp_path / "server")
    assert len(seen) == 8 * 8 * 4  # every sample of every rollout, once
    assert served[0] == pytest.approx(kl[0], abs=1e-4), (served, kl)
    assert sum(served[-3:]) / 3 < 0.5 * served[0], served
    other = build_embedded(tmp_path / "wider", EmbeddedSpec(num_hidden_layers=3))
    done = _train(tmp_path, "--dry-run", "--use-opd", "--opd-type", "megatron",
                  "--opd-teacher-load", str(other), run="dry")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--opd-teacher-load=" in done.stderr
    assert "has --num-layers=3, the trained model 2" in done.stderr


@pytest.mark.slow
def test_top_k_distillation_from_a_server_trains_on_its_estimates(tmp_path):
    """miles' top-k script's flags (``--opd-log-prob-top-k 16 --opd-top-k-strategy
    only-student --opd-reward-weight-mode student_p``, its reward plugins) against a stand-in
    SGLang teacher: every sample is scored on the engine's top-16 ids; rollout 0's dumped
    ``opd_reverse_kl`` is the estimate recomputed here from the two models on the dumped
    tokens, and its token mean is the logged ``opd_reverse_kl``. No learning is asserted:
    the estimate is a function of each position's prefix, not of the sampled token, so as an
    advantage offset its expected gradient is 0 (docs/train.md)."""
    k = 16
    teacher_dir = build_embedded(tmp_path / "teachers", EmbeddedSpec(seed=1))
    anchor = "miles.rollout.on_policy_distillation"
    with sglang_teacher(teacher_dir) as (url, seen):
        done = _train(tmp_path, "--use-opd", "--opd-type", "sglang", "--rm-url", url,
                      "--opd-log-prob-top-k", str(k), "--opd-top-k-strategy", "only-student",
                      "--opd-reward-weight-mode", "student_p",
                      "--custom-reward-post-process-path", f"{anchor}.post_process_rewards",
                      "--save-rollout-data", str(tmp_path / "dumps" / "r{rollout_id}.npz"),
                      run="topk", reward=f"{anchor}.reward_func")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(seen) == 8 * 8 * 4 and all(b["token_ids_logprob"] for b in seen)
    batch = load_rollout_batch(tmp_path / "dumps" / "r0.npz")
    assert batch.teacher_log_probs is None and batch.opd_reverse_kl is not None
    student, teacher = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
                        for d in (build_embedded(tmp_path / "student"), teacher_dir))
    for i in range(batch.num_samples):
        tokens = batch.sample_tokens(i).tolist()
        start = len(tokens) - int(batch.response_lengths[i]) - 1
        s_full, t_full = (position_log_probs(m, tokens)[start:] for m in (student, teacher))
        ls, ids = s_full.topk(k, dim=-1)
        want = (torch.softmax(ls, -1) * (ls - t_full.gather(1, ids))).sum(-1)
        got = batch.opd_reverse_kl[batch.response_offsets[i]:batch.response_offsets[i + 1]]
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
    mask = batch.loss_masks.astype(bool)
    logged = _reverse_kl(tmp_path / "topk")
    assert len(logged) == 8
    assert logged[0] == pytest.approx(float(batch.opd_reverse_kl[mask].mean()), abs=1e-5)
