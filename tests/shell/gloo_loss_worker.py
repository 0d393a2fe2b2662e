"""Worker of the gloo loss tests: one 4-process world runs every (dp, cp) layout on sub-groups.

Each layout trains a tiny position-wise model (embedding -> linear head, so a CP rank can score
its own zigzag positions) for one step as the Megatron shell would: per micro-batch the
per-token policy loss goes through ``microbatch_loss`` over step-level denominators, times
``megatron_loss_scale`` and Megatron's own ``cp / num_microbatches``; gradients are then summed
by a real ``all_reduce`` over the DP x CP group and averaged like DDP. Group rank 0 compares
with the single-process reference (the oracle on the unsplit step) and writes the deviations.
Each layout also trains the GSPO and CISPO surrogates in one loss mode; GSPO's per-sample sums
go through the shell's own CP reduce (``objective.cp_sum``) over the layout's CP groups.
"""


import torch
import torch.distributed as dist

from tests.loss_helpers import Step, oracle_loss, step_denominators
from tests.shell.gloo_world import worker_body
from vime_pure import (LossMode, Metric, MetricError, merge_metrics, metric_values)
from vime_pure.cp import zigzag_offsets
from vime_pure.denominators import megatron_loss_scale
from vime_pure.torch_ops.loss import microbatch_loss, sample_index_from_lengths
from vime_pure.torch_ops.policy_loss import entropy_from_logits, policy_loss, token_log_probs
from vime_shell.megatron.collectives import gather_metrics, gather_step_report, source_rank
from vime_shell.megatron.objective import cp_sum

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]
SURROGATES = ("gspo", "cispo")  # beside ppo (every loss mode), in SURROGATE_MODE
SURROGATE_MODE = LossMode.GROUP_TOKEN_MEAN
VOCAB, HIDDEN, K = 13, 8, 2


def make_step() -> tuple[Step, list[torch.Tensor]]:
    """10 samples in 4 interleaved groups; one all-masked sample; tokens per sample."""
    g = torch.Generator().manual_seed(1234)
    group_ids = [0, 1, 0, 2, 3, 1, 0, 2, 3, 3]
    prompts = [2, 3, 5, 2, 4, 3, 2, 5, 3, 2]
    resp = [5, 9, 3, 12, 4, 7, 6, 3, 10, 8]
    masks = [(torch.rand(r, generator=g) < 0.8).float().tolist() for r in resp]
    masks[4] = [0.0] * resp[4]
    tokens = [torch.randint(0, VOCAB, (p + r,), generator=g) for p, r in zip(prompts, resp)]
    return Step(group_ids, prompts, masks), tokens


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB))


def score(net, tokens: torch.Tensor, ranges) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the response tokens scored by logit ``ranges``."""
    pos = torch.cat([torch.arange(a, b) for a, b in ranges])
    logits = net(tokens[pos])
    return token_log_probs(logits, tokens[pos + 1]), entropy_from_logits(logits)


def per_token_inputs(step: Step):
    """Fixed old/ref log-probs and advantages per response token of the step."""
    g = torch.Generator().manual_seed(99)
    n = step.num_tokens
    return -2.5 + 0.3 * torch.randn(n, generator=g), torch.randn(n, generator=g)


def run_layout(rank: int, dp: int, cp: int, group, mode: LossMode, surrogate: str = "ppo",
               cp_group=None) -> dict:
    step, tokens = make_step()
    old, adv = per_token_inputs(step)
    dens = step_denominators(step, mode, "original")
    d, c = divmod(rank, cp)
    net = model()
    partials = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "clipfrac": 0.0}
    metrics = {"entropy": Metric(0.0, 0.0), "logp_min": Metric(0.0, 0.0, "min"),
               "ratio_max": Metric(0.0, 0.0, "max")}
    scale = megatron_loss_scale(mode, K, step.num_groups, dp, cp, num_samples=10)
    for k in range(K):
        ids = [i for i in range(10) if i % dp == d and (i // dp) % K == k]
        if not ids:
            continue
        offs = [zigzag_offsets(step.total_length(i), len(step.loss_masks[i]), c, cp) for i in ids]
        pieces = [score(net, tokens[i], o.logits) for i, o in zip(ids, offs)]
        logp, ent = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        sel = torch.cat([torch.arange(a, b) + step.offsets[i] for i, o in zip(ids, offs)
                         for a, b in o.response])
        mask = torch.cat([torch.tensor(step.loss_masks[i])[a:b] for i, o in zip(ids, offs)
                          for a, b in o.response])
        idx = sample_index_from_lengths(torch.tensor([o.num_response_tokens for o in offs]))
        terms = policy_loss(logp, old[sel], adv[sel], ref_log_probs=old[sel] - 0.1, kl_coef=0.05,
                            surrogate=surrogate, loss_mask=mask, sample_index=idx,
                            num_samples=len(ids),
                            reduce=None if cp_group is None else cp_sum(cp_group))
        den = torch.as_tensor(dens[ids], dtype=torch.float32)
        partial = microbatch_loss(terms.total, mask, idx, den)
        (partial * scale * cp / K).backward()  # Megatron: x cp / num_microbatches
        for key, v in (("loss", partial), ("pg", microbatch_loss(terms.pg, mask, idx, den)),
                       ("kl", microbatch_loss(terms.kl, mask, idx, den)),
                       ("clipfrac", microbatch_loss(terms.clipped, mask, idx, den))):
            partials[key] += float(v.detach())
        kept = mask > 0
        local = {"entropy": Metric(float((ent.detach() * mask).sum()), float(mask.sum())),
                 "logp_min": Metric.of(logp.detach()[kept].tolist(), "min"),
                 "ratio_max": Metric.of(terms.ratio[kept].tolist(), "max")}
        metrics = {key: merge_metrics([metrics[key], local[key]]) for key in metrics}
    for p in net.parameters():  # DDP: sum over the DP x CP group, then average
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group)
        p.grad = grad / (dp * cp)
    report = gather_step_report(partials, step.num_groups, mode, cp=cp, num_samples=10,
                                group=group)
    gathered = gather_metrics(metrics, group)
    if dist.get_rank() != source_rank(group):
        return {}
    return compare_with_reference(step, tokens, old, adv, mode, net, report, gathered,
                                  surrogate)


def compare_with_reference(step, tokens, old, adv, mode, net, report, gathered,
                           surrogate: str = "ppo") -> dict:
    ref_net = model()
    pieces = [score(ref_net, t, [(step.prompt_lengths[i] - 1, step.total_length(i) - 1)])
              for i, t in enumerate(tokens)]
    logp, ent = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
    lengths = torch.tensor([len(m) for m in step.loss_masks])
    terms = policy_loss(logp, old, adv, ref_log_probs=old - 0.1, kl_coef=0.05,
                        surrogate=surrogate,
                        loss_mask=torch.tensor([v for m in step.loss_masks for v in m]),
                        sample_index=sample_index_from_lengths(lengths))
    loss = oracle_loss(step, terms.total, mode, "original")
    loss.backward()
    grad_dev = max(float((p.grad - q.grad).abs().max())
                   for p, q in zip(net.parameters(), ref_net.parameters()))
    mask = torch.tensor([v for m in step.loss_masks for v in m]) > 0
    expected_metrics = {"entropy": float(ent.detach()[mask].mean()),
                        "logp_min": float(logp.detach()[mask].min()),
                        "ratio_max": float(terms.ratio[mask].max())}
    expected_report = {"loss": float(loss.detach()),
                       "kl": float(oracle_loss(step, terms.kl, mode, "original"))}
    got = metric_values(gathered)
    return {"grad_dev": grad_dev,
            "grad_norm": max(float(p.grad.abs().max()) for p in ref_net.parameters()),
            "report_dev": max(abs(report[k] - v) for k, v in expected_report.items()),
            "metric_dev": max(abs(got[k] - v) for k, v in expected_metrics.items())}


def gather_semantics(rank: int) -> dict:
    """Groups {0,1} and {2,3}: metric dicts land on global ranks 0 and 2."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    out = gather_metrics({"r": Metric(float(rank), 1.0)}, group)
    raw: list | None = [None, None] if rank == 2 else None
    if rank >= 2:  # torch's own API: dst is global, group_dst is group-relative
        dist.gather_object(rank, raw, dst=2, group=group)
        by_group_dst: list | None = [None, None] if rank == 2 else None
        dist.gather_object(rank * 10, by_group_dst, group_dst=0, group=group)
        raw = None if raw is None else raw + (by_group_dst or [])
    mismatch = None
    if rank >= 2:
        try:
            gather_step_report({"loss": 1.0, **({"extra": 1.0} if rank == 3 else {})}, 1,
                               "group_token_mean", group=group)
        except MetricError as exc:
            mismatch = str(exc)
    return {"gathered": None if out is None else metric_values(out), "raw": raw,
            "source": source_rank(group), "mismatch": mismatch}


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    worker_body(rank, world, init_file, out_dir, _layouts)


def _layouts(rank: int, result: dict) -> None:
    result["layouts"] = {}
    for dp, cp in LAYOUTS:
        group = dist.new_group(list(range(dp * cp)))  # every rank joins every new_group
        # every rank joins every new_group: the layout's CP groups, one per DP index
        cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
        for mode in LossMode:
            if rank < dp * cp:
                res = run_layout(rank, dp, cp, group, mode)
                if res:
                    result["layouts"][f"{dp}x{cp}:{mode.value}"] = res
        for surrogate in SURROGATES:
            if rank < dp * cp:
                res = run_layout(rank, dp, cp, group, SURROGATE_MODE, surrogate,
                                 cp_group=cp_groups[rank // cp] if cp > 1 else None)
                if res:
                    result["layouts"][f"{dp}x{cp}:{surrogate}"] = res
    result["gather"] = gather_semantics(rank)
