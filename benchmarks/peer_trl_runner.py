"""TRL's side of ``benchmarks.peer_trl``: one ``GRPOTrainer`` run on the prompts vime drew.

Runs in the TRL venv (``.venv-trl``), never in vime's: it imports only TRL, transformers,
datasets and torch, so it sees nothing of vime. Its inputs come from the harness:

- ``--model-dir``: the embedded model directory (``build_embedded()``), so both frameworks start
  from the same weights and the same 19-token tokenizer;
- ``--prompts``: JSONL rows ``{"step": k, "prompt": "47>", "label": "74"}``, 16 per step, in
  vime's order (``get_task("reverse2").examples(16, seed=S, rollout_id=k)``). With
  ``shuffle_dataset=False`` TRL's ``RepeatSampler`` walks them in file order, each repeated
  ``num_generations`` times, so step ``k`` generates for exactly vime's prompts of rollout ``k``.

It writes ``--steps-out``: one JSONL line per optimizer step, flushed at ``on_step_end``:
``{"step": 0, "t_begin": ..., "t_end": ..., "rollout_s": 0.031, "generate_s": 0.024,
"tokens": 640, "reward": 0.0, "prompts": ["47>", ...]}``; times are ``time.time()`` (wall clock,
comparable with the harness's launch stamp), ``cpu_begin``/``cpu_end`` the process's CPU time
(``time.process_time()``, all threads). ``rollout_s`` is TRL's whole rollout side
(``_generate_and_score_completions``: generation, decoding, reward, advantages), the counterpart
of vime's ``rollout_s``; ``generate_s`` its generation part. ``tokens``: prompt + completion
tokens of the step, TRL's own ``num_input_tokens_seen`` increment (vime's ``tokens`` counts the
same). The first line (``"meta"``) records the versions and the effective ``GRPOConfig``.

Settings (the issue's shared setup; ``--set key=value`` overrides any ``GRPOConfig`` field):
16 prompts x 8 generations = one 128-completion batch per optimizer step, no gradient
accumulation; max completion length 2 (= the answer), temperature 1; lr 3e-4 constant; epsilon
0.2; beta 0; loss_type "grpo"; num_iterations 1; no vLLM; CPU; fp32 (``bf16=False``: TRL's default
is bf16 autocast, vime trains in fp32) and no gradient checkpointing (TRL's default recomputes
activations, vime does not).

Run (the harness does): ``.venv-trl/bin/python benchmarks/peer_trl_runner.py --model-dir DIR
--prompts p.jsonl --steps-out s.jsonl --seed 0 --max-steps 300 --output-dir /tmp/trl``.
"""

import argparse
import ast
import json
import time


def grpo_settings(args: argparse.Namespace) -> dict:
    """The ``GRPOConfig`` keyword arguments; ``--set`` values override them.

    Example: ``--set bf16=True --set gradient_checkpointing=True`` gives TRL's out-of-the-box
    precision and memory settings instead of vime's fp32 without recomputation.
    """
    settings = dict(
        output_dir=args.output_dir, max_steps=args.max_steps, seed=args.seed,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        gradient_accumulation_steps=1, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, temperature=1.0, top_p=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, epsilon=0.2, beta=0.0, loss_type="grpo", num_iterations=1,
        use_vllm=False, use_cpu=True, bf16=False, gradient_checkpointing=False,
        shuffle_dataset=False, report_to="none", save_strategy="no", logging_steps=10,
        dataloader_num_workers=0)
    for item in args.set:
        key, _, text = item.partition("=")
        try:
            settings[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            settings[key] = text  # a plain string, e.g. lr_scheduler_type=linear
    return settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="peer_trl_runner")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--steps-out", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    # Heavy imports after argument parsing; their time is part of the startup the harness sees.
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]}
                                          for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"  # TRL requires it; loading resets the saved side
    out = open(args.steps_out, "w")  # noqa: SIM115 (written by callbacks until train() ends)
    step_info: dict = {}

    def exact_match(prompts, completions, label, **_):
        """1.0 when the decoded completion equals the label, as vime's exact_match_reward."""
        rewards = [1.0 if c == y else 0.0 for c, y in zip(completions, label, strict=True)]
        # The sampler repeats each prompt num_generations times in a row: every 8th is the
        # step's prompt list, in the order TRL drew them (the harness checks it is vime's).
        step_info.update(reward=sum(rewards) / len(rewards),
                         prompts=list(prompts[::args.num_generations]))
        return rewards

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that times its rollout side; the training math is TRL's, untouched."""

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            step_info["rollout_s"] = time.perf_counter() - t0
            return result

        def _generate(self, prompts):
            t0 = time.perf_counter()
            result = super()._generate(prompts)
            step_info["generate_s"] = time.perf_counter() - t0
            return result

    class StepLog(TrainerCallback):
        def __init__(self):
            self.t_begin, self.tokens_seen = 0.0, 0

        def on_step_begin(self, args_, state, control, **kwargs):
            self.t_begin, self.cpu_begin = time.time(), time.process_time()

        def on_step_end(self, args_, state, control, **kwargs):
            tokens = state.num_input_tokens_seen - self.tokens_seen
            self.tokens_seen = state.num_input_tokens_seen
            out.write(json.dumps(dict(step=state.global_step - 1, t_begin=self.t_begin,
                                      t_end=time.time(), cpu_begin=self.cpu_begin,
                                      cpu_end=time.process_time(), tokens=int(tokens),
                                      **step_info)) + "\n")
            out.flush()

    config = GRPOConfig(**grpo_settings(args))
    trainer = TimedGRPOTrainer(model=args.model_dir, reward_funcs=[exact_match],
                               args=config, train_dataset=dataset, processing_class=tokenizer,
                               callbacks=[StepLog()])
    meta = {"meta": True, "versions": {m.__name__: m.__version__ for m in
                                       (trl, transformers, torch, datasets)},
            "torch_threads": torch.get_num_threads(),
            "grpo_config": {k: v for k, v in grpo_settings(args).items() if k != "output_dir"},
            "steps_per_generation": config.steps_per_generation,
            "generation_batch_size": config.generation_batch_size,
            "param_dtype": str(next(trainer.model.parameters()).dtype)}
    out.write(json.dumps(meta) + "\n")
    out.flush()
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
