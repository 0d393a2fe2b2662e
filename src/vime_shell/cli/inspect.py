"""vime inspect DUMP: a rollout dump as text a person can read.

Per sample: its group and prompt group, status, reward and advantage, the decoded prompt and
response (with the model directory's tokenizer: --hf-checkpoint, default the embedded model),
and, for dumps written by vime train, the label and metadata. --samples N limits the output
(default 8, 0 for all); --json prints one JSON object per sample instead.

Example: vime inspect runs/demo/rollouts/rollout_3.npz --samples 2
"""

import argparse
import json
from pathlib import Path

import numpy as np

from vime_pure.data.sample import STATUSES
from vime_shell.models.embedded import build_embedded
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.storage.dump import load_rollout_batch, read_dump_annotations


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", type=Path, help="a rollout dump (--save-rollout-data)")
    p.add_argument("--hf-checkpoint", type=Path, default=None,
                   help="model directory whose tokenizer decodes (default: the embedded model)")
    p.add_argument("--samples", type=int, default=8, help="samples to print (0: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")
    p.set_defaults(handler=run)


def sample_rows(batch, annotations, tokenizer) -> list[dict]:
    """Every sample of ``batch`` as a plain dict with decoded text. Example key set:
    ``index, group_id, prompt_group, status, reward, advantage, prompt, response, label,
    metadata``."""
    groups, prompts = batch.original_group_ids(), batch.prompt_group_values
    rows = []
    for i in range(batch.num_samples):
        tokens = batch.sample_tokens(i).tolist()
        cut = len(tokens) - int(batch.response_lengths[i])
        note = annotations[i] if annotations else {}
        rows.append({
            "index": int(batch.sample_indices[i]), "group_id": groups[i],
            "prompt_group": prompts[int(batch.prompt_groups[i])] if len(prompts) else None,
            "status": STATUSES[int(batch.statuses[i])].value,
            "reward": float(batch.rewards[i]), "advantage": float(batch.advantages[i]),
            "prompt": tokenizer.decode(tokens[:cut]), "response": tokenizer.decode(tokens[cut:]),
            "label": note.get("label"), "metadata": note.get("metadata")})
    return rows


def run(args: argparse.Namespace) -> int:
    batch = load_rollout_batch(args.dump)
    annotations = read_dump_annotations(args.dump)
    tokenizer = load_tokenizer(args.hf_checkpoint or build_embedded())
    rows = sample_rows(batch, annotations, tokenizer)
    shown = rows if args.samples <= 0 else rows[:args.samples]
    if args.json:
        for row in shown:
            print(json.dumps(row, default=str))
        return 0
    rewards = batch.rewards[np.unique(batch.group_ids, return_index=True)[1]]
    print(f"{args.dump}: {batch.num_samples} samples in {batch.num_groups} groups, reward mean "
          f"{rewards.mean():.3f} (per group)" + ("" if annotations else
                                                 "; no labels or metadata in this dump"))
    for row in shown:
        print(f"--- sample {row['index']}  group {row['group_id']}  prompt group "
              f"{row['prompt_group']}  {row['status']}  reward {row['reward']:g}  advantage "
              f"{row['advantage']:+.3f}")
        print(f"prompt:   {row['prompt']!r}")
        print(f"response: {row['response']!r}")
        if annotations:
            print(f"label:    {row['label']!r}   metadata: {row['metadata']}")
    if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more (--samples 0 prints all)")
    return 0
