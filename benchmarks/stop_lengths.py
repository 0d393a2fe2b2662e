"""Response lengths and truncation rate before and after the chat-template stop (issue 20).

A tiny tied Qwen2 with a byte-level BPE tokenizer and a Qwen chat template whose tokenizer EOS
is the base model's ``<|endoftext|>`` (``vime_shell.models.chat_model``) generates for the same
prompts and seeds twice: stopping only at the tokenizer's EOS (before), and at the default stops
``vime train`` now uses with ``--apply-chat-template`` (after: the template's ``<|im_end|>``
too). Prints the response-length percentiles and the truncated fraction of each.
Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.stop_lengths`` (``--quick``).
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np

from vime_pure.data.generation_stats import response_length_stats
from vime_pure.data.sample import STATUSES, Status
from vime_shell.engines.base import SamplingParams
from vime_shell.engines.hf import HfEngine
from vime_shell.models.chat_model import build_chat_model
from vime_shell.models.tokenizer import default_stop_token_ids, load_tokenizer
from vime_shell.rollout.functions import encode_prompt
from vime_shell.rollout.tasks import TaskExample

_CODE = {"stop": STATUSES.index(Status.COMPLETED), "length": STATUSES.index(Status.TRUNCATED),
         "abort": STATUSES.index(Status.ABORTED)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=3.0)
    args = parser.parse_args(argv)
    n = 32 if args.quick else 256
    with tempfile.TemporaryDirectory() as tmp:
        path = build_chat_model(Path(tmp) / "qwen", eos_token="<|endoftext|>",
                                tie_word_embeddings=True, generation_eos=False)
        tok = load_tokenizer(path)
        engine = HfEngine(path)
        prompts = [encode_prompt(tok, TaskExample(prompt=f"What is {i % 12} + {i // 12}?",
                                                  label=""), True) for i in range(n)]
        out = {}
        for name, stops in (("before (tokenizer EOS only)", (tok.eos_token_id,)),
                            ("after (+ template end-of-turn)",
                             default_stop_token_ids(tok, path, chat_template=True))):
            params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=0,
                                    temperature=args.temperature, stop_token_ids=stops)
            gens = engine.generate(prompts, params)
            lengths = np.array([len(g.token_ids) for g in gens], dtype=np.int64)
            codes = np.array([_CODE[g.finish_reason] for g in gens], dtype=np.uint8)
            out[name] = stats = response_length_stats(lengths, codes)
            print(f"  {name:32s} stops {tok.convert_ids_to_tokens(list(stops))}: p10/p50/p90 "
                  f"{stats['response_len_p10']:.0f}/{stats['response_len_p50']:.0f}/"
                  f"{stats['response_len_p90']:.0f} tokens, truncated "
                  f"{stats['truncated_frac']:.1%} ({n} responses, cap {args.max_new_tokens})")
    return out


if __name__ == "__main__":
    main()
