"""vime inspect DUMP: a rollout dump as text a person can read.

Per sample: its group and prompt group, status, reward and advantage, the decoded prompt and
response, and, for dumps written by vime train, the label and metadata. --samples N limits the
output (default 8, 0 for all); --json prints one JSON object per sample instead.

The text is decoded with the tokenizer the dump records (vime train records its model's
directory and the tokenizer's fingerprint), or with --hf-checkpoint's when given. When the
recorded directory has changed since, a one-line note says so (the text is decoded with it
anyway); when it is gone, inspect stops and asks for --hf-checkpoint; a dump that records no
tokenizer (an older one) is decoded with the embedded model's, and a note says so.

Example: vime inspect runs/demo/rollouts/rollout_3.npz --samples 2
"""

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from vime_pure.data.sample import STATUSES
from vime_pure.errors import VimeError, field_error
from vime_shell.storage.dump import load_rollout_batch, read_dump_header
from vime_shell.storage.manifest import tokenizer_fingerprint


class InspectError(VimeError):
    """``vime inspect`` cannot decode a dump faithfully."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", type=Path, help="a rollout dump (--save-rollout-data)")
    p.add_argument("--hf-checkpoint", type=Path, default=None,
                   help="model directory whose tokenizer decodes (default: the one the dump "
                        "records; the embedded model for a dump that records none)")
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


def tokenizer_dir(dump: Path, record: Mapping | None, hf_checkpoint: Path | None,
                  embedded: Callable[[], Path]) -> tuple[Path, str | None]:
    """The model directory whose tokenizer decodes ``dump``, and a one-line note for the
    user (None: nothing to say). ``record``: the dump's ``tokenizer`` (``{"path", "sha256"}``,
    None in an older dump); ``embedded()`` builds or finds the embedded model.

    Example: a dump recording ``/models/mine`` whose files are unchanged decodes with it and
    no note; with ``/models/mine`` deleted it is an :class:`InspectError` asking for
    ``--hf-checkpoint``.
    """
    if not (isinstance(record, Mapping) and isinstance(record.get("path"), str)):
        record = None  # an older dump's (or a foreign writer's): no usable record
    if hf_checkpoint is not None:
        if record is None or tokenizer_fingerprint(hf_checkpoint) == record.get("sha256"):
            return hf_checkpoint, None
        return hf_checkpoint, (f"note: --hf-checkpoint {hf_checkpoint}'s tokenizer is not the "
                               f"one that wrote this dump ({record['path']})")
    if record is None:
        path = embedded()
        return path, (f"note: {dump} does not record its tokenizer (written by an older vime): "
                      f"decoding with the embedded model's ({path}); pass --hf-checkpoint "
                      "MODEL_DIR if it came from another model")
    path, want = Path(record["path"]), record.get("sha256")
    found = tokenizer_fingerprint(path)
    if found == want:
        return path, None
    if found is None and tokenizer_fingerprint(fallback := embedded()) == want:
        return fallback, None  # the embedded model's, rebuilt elsewhere (a cleared cache)
    if found is None:
        raise field_error(InspectError, "dump", str(dump), f"was written with the tokenizer "
                          f"of {path}, which is gone", "pass --hf-checkpoint with that "
                          "model's directory")
    return path, (f"note: the tokenizer of {path} changed since it wrote {dump}: the text "
                  "may be wrong; pass --hf-checkpoint with the model that wrote it")


def run(args: argparse.Namespace) -> int:
    batch = load_rollout_batch(args.dump)
    header = read_dump_header(args.dump)
    annotations = header.get("annotations")
    # transformers (and torch) only when inspecting: `vime train`'s errors must stay fast
    from vime_shell.models.embedded import build_embedded
    from vime_shell.models.tokenizer import load_tokenizer

    model, note = tokenizer_dir(args.dump, header.get("tokenizer"), args.hf_checkpoint,
                                build_embedded)
    if note is not None:
        print(note, file=sys.stderr)
    tokenizer = load_tokenizer(model)
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
