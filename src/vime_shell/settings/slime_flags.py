"""slime's and miles' flags that are not ``TrainConfig`` fields: aliases, engine flags, and the
table of flags vime does not support.

* ``ALIASES``: another spelling of a vime flag (``--load-debug-rollout-data`` is
  ``--load-rollout-data``); the parser adds it as an option string of the same setting, and a
  ``--config`` file may use it as a key.
* Engine flags: ``--vllm-X V`` (the vLLM port of slime) is vLLM's engine argument ``X``;
  ``--sglang-X V`` is the vLLM argument ``SGLANG_TO_VLLM`` names, and where there is none it is
  accepted with a one-line warning saying so (:func:`engine_flags`).
* ``UNSUPPORTED``: every other flag the anchors' example scripts pass, with the reason or the
  vime equivalent: ``vime train --fp8-format e4m3`` prints ``--fp8-format: not supported in
  vime (FP8 training: ...)`` and exits 2. The line comes from this table, never from spelling
  distance. At slime's default (``UNSUPPORTED_OFF``: ``--fp8-recipe delayed``) such a flag
  leaves its feature off, so it is accepted with a note
  (:func:`default_flags`): a flag at its default no-op value is never an error.
* ``SLIME_VALUES``: slime's spelling of a value vime spells otherwise (slime's default rollout
  function is vime's; Megatron's default ``allgather`` dispatcher is vime's ``alltoall``;
  ``--rollout-top-k -1`` is off), slime's legacy one-path ``--eval-prompt-data PATH``, an
  eval set named ``aime``, and miles' FSDP-backend switches in Megatron's terms
  (:func:`slime_values`).
* ``SECRET_FLAGS``: ``--wandb-key`` goes to W&B through ``WANDB_API_KEY`` only; :func:`redact`
  hides its value in a recorded command line.

Example: ``engine_flags(["--sglang-mem-fraction-static", "0.7"])`` maps to
``--rollout-gpu-memory-utilization`` (an alias), and ``engine_flags(["--sglang-ep-size", "8"])``
gives the warning ``--sglang-ep-size 8: no vLLM equivalent in vime; ignored``.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from vime_shell.rollout.filters import ANCHOR_FILTERS, BUILT_IN_FILTER
from vime_shell.rollout.functions import DEFAULT_ROLLOUT_FUNCTION, SFT_ROLLOUT_FUNCTION
from vime_shell.rollout.teacher import ANCHOR_OPD_REWARDS, OPD_REWARD

# alias flag -> the TrainConfig field it sets (same type, same meaning)
ALIASES: dict[str, str] = {
    "--load-debug-rollout-data": "load_rollout_data",
    "--save-debug-rollout-data": "save_rollout_data",
    "--sglang-mem-fraction-static": "rollout_gpu_memory_utilization",
    "--vllm-gpu-memory-utilization": "rollout_gpu_memory_utilization",
    "--sglang-disable-cuda-graph": "rollout_enforce_eager",
    "--vllm-enforce-eager": "rollout_enforce_eager",
    "--sglang-dtype": "rollout_dtype",
    "--vllm-dtype": "rollout_dtype",
    "--offload-rollout": "colocate",  # slime: the engine releases its memory while training
    "--custom-tis-function-path": "tis_function",  # the anchors' paths: ANCHOR_TIS_FUNCTIONS
    "--muon-nesterov": "muon_use_nesterov",  # Megatron-LM main's name (0.16: --muon-use-...)
}

# the anchors' --custom-tis-function-path values -> vime's built-in TIS function of the same
# meaning (vime loads no TIS plugin: its weights are computed on whole samples, before the
# micro-batches, where the anchors' hook sees one micro-batch's CP slice)
_MIS = "train_infer_mismatch_helper.mis.compute_mis_weights"
ANCHOR_TIS_FUNCTIONS: dict[str, str] = {
    "slime.backends.megatron_utils.loss.vanilla_tis_function": "vanilla",
    "slime.backends.megatron_utils.loss.icepop_function": "icepop",
    "miles.backends.training_utils.loss_hub.corrections.vanilla_tis_function": "vanilla",
    "miles.backends.training_utils.loss_hub.corrections.icepop_function": "icepop",
    **{f"examples.{where}{_MIS}{suffix}": "mis" for where in ("", "infra_features.")
       for suffix in ("", "_with_cp", "_fsdp")},
}

# --sglang-X -> vLLM's engine argument of the same meaning
SGLANG_TO_VLLM: dict[str, str] = {
    "max-running-requests": "max_num_seqs",
    "chunked-prefill-size": "max_num_batched_tokens",
    "kv-cache-dtype": "kv_cache_dtype",
    "context-length": "max_model_len",
    "load-format": "load_format",
    "page-size": "block_size",
}

# --sglang-X with no vLLM counterpart in vime (router, DP attention, speculative decoding,
# kernel and disaggregation settings): the warning
SGLANG_ONLY = "no vLLM equivalent in vime"

# FP8 (and slime's int4 QAT rollouts) run on GPU kernels only: Transformer Engine's FP8 GEMMs
# need Hopper-class GPUs, and no CPU run could check them
FP8 = ("FP8 training: Transformer Engine's FP8 kernels need Hopper-class GPUs, which vime's "
       "CPU-checked path cannot exercise; vime trains in bf16 or fp32")

# slime's switches that live in the job's environment (its Ray runtime env) -> the reason
UNSUPPORTED_ENV: dict[str, str] = {
    "OPEN_TRAINING_INT4_FAKE_QAT_FLAG": "int4 quantisation-aware training (slime's fake-"
    "quantised int4 weights, for int4 checkpoints served in SGLang): a GPU-only precision "
    "format; vime trains in bf16 or fp32",
}

UNSUPPORTED: dict[str, str] = {
    # precision formats vime does not train in
    "--fp8-format": FP8, "--fp8-recipe": FP8, "--fp8-param-gather": FP8,
    # data, rollout and evaluation
    "--multimodal-keys": "multimodal prompts: vime's samples are token ids of text, and "
    "its engines and bridge load text-only models (images, audio and video need a "
    "processor path and vision towers end to end)",
    # no parser of miles defines it (miles exits on it: only its Kimi-K2.5 LoRA recipe passed
    # it, and miles' fix drops the line), so it has no meaning to keep
    "--filter-zero-reward-samples": "miles has no such flag (its parser refuses it too); to "
    "drop prompt groups whose rewards are all equal, use --dynamic-sampling-filter-path "
    "vime_shell.rollout.filters:nonzero_reward_std",
    # weight sync and serving
    "--critic-num-nodes": "critics (PPO value models)",
    "--critic-num-gpus-per-node": "critics (PPO value models)",
}


# slime's choices that vime's choice lists lack: "--flag value" -> the reason or equivalent
UNSUPPORTED_VALUES: dict[str, str] = {
    "--loss-type custom_loss": "a loss plugin; vime's objectives are policy_loss (with "
    "--advantage-estimator grpo, gspo, cispo or reinforce_plus_plus_baseline) and sft_loss",
    "--advantage-estimator ppo": "PPO needs a critic (value model); use grpo, gspo, cispo "
    "or reinforce_plus_plus_baseline",
    "--advantage-estimator reinforce_plus_plus": "per-token discounted returns; use "
    "reinforce_plus_plus_baseline (with --kl-coef for its KL in the reward)",
    "--rm-type ifbench": "IFBench's instruction checkers (and their language packages) are "
    "not bundled; pass them as --custom-rm-path",
    "--rm-type random": "a random reward trains nothing; use --custom-rm-path for a stub",
    "--optimizer dist_muon": "Megatron's layer-wise distributed Muon; vime's Muon runs "
    "without the distributed optimizer: use --optimizer muon",
    "--muon-tp-mode distributed": "Newton-Schulz with all-reduced Gram matrices; "
    "--muon-tp-mode duplicated gives the same update (the whole matrix on each TP rank)",
    "--muon-fp32-matmul-prec low": "torch has no 'low' float32 matmul precision (Megatron "
    "fails on it too); use medium (bf16 Newton-Schulz) or high",
}


# slime's defaults of flags in UNSUPPORTED, at which their feature is off (a no-op; accepted
# with a note). Sources, as typed on a command line: THUDM/slime slime/utils/arguments.py
# (624b824) and megatron-core's TransformerConfig default (--fp8-recipe).
UNSUPPORTED_OFF: dict[str, tuple[str, ...]] = {
    "--fp8-recipe": ("delayed",),
}

# slime's value of a vime setting that vime spells otherwise: (setting, slime's value) ->
# (vime's value, the launch note, or None when the meaning is identical)
SLIME_VALUES: dict[tuple[str, Any], tuple[Any, str | None]] = {
    ("rollout_function_path", "slime.rollout.sglang_rollout.generate_rollout"): (
        DEFAULT_ROLLOUT_FUNCTION, "slime's default rollout function; vime's default "
        f"({DEFAULT_ROLLOUT_FUNCTION}) is its counterpart"),
    **{("rollout_function_path", f"{anchor}.rollout.sft_rollout.generate_rollout"): (
        SFT_ROLLOUT_FUNCTION, "slime's SFT rollout function; vime's counterpart is "
        f"{SFT_ROLLOUT_FUNCTION} (conversations with assistant-turn loss masks)")
       for anchor in ("slime", "miles")},
    **{("custom_rm_path", path): (
        OPD_REWARD, "on-policy distillation's reward (0: the teacher alone teaches); vime asks "
        "the teacher for its log-probs itself (--opd-type sglang)") for path in
       ANCHOR_OPD_REWARDS},
    **{("dynamic_sampling_filter_path", path): (
        BUILT_IN_FILTER, "slime's filter of prompt groups whose rewards are all equal; vime's "
        f"counterpart is {BUILT_IN_FILTER}") for path in ANCHOR_FILTERS},
    ("moe_token_dispatcher_type", "allgather"): (
        "alltoall", "Megatron's default dispatcher; vime's MoE uses alltoall (allgather "
        "refuses the variable sequence lengths vime packs; the routing is the same)"),
    **{("tis_function", path): (name, f"vime's built-in {name} TIS weights (--tis-function "
                                      f"{name})") for path, name in ANCHOR_TIS_FUNCTIONS.items()},
    ("rollout_top_k", -1): (0, None),  # SGLang's and slime's "off"
    ("eval_top_k", -1): (0, None),
    ("log_probs_chunk_size", -1): (None, None),  # slime: -1, no chunking
}
LEGACY_EVAL_SET = "aime"  # slime's name for a lone --eval-prompt-data PATH
SECRET_FLAGS: tuple[str, ...] = ("--wandb-key",)


def unsupported_line(flag: str) -> str | None:
    """The table's line for ``flag`` (or ``"--flag value"`` for a refused choice), or None
    when it is not in the table."""
    why = UNSUPPORTED.get(flag) or UNSUPPORTED_VALUES.get(flag)
    return None if why is None else f"{flag}: not supported in vime ({why})"


def engine_flags(tokens: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Split ``tokens`` (unparsed command-line words) into ``(engine_args, warnings, rest)``:
    ``--vllm-X V`` / mapped ``--sglang-X V`` become ``X=V`` vLLM engine arguments, unmapped
    ``--sglang-X`` a warning line, every other token stays in ``rest``. A flag's values are
    the words up to the next ``--flag``; none means ``true``."""
    engine, warnings, rest = [], [], []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, inline = token.partition("=")
        prefix = next((p for p in ("--vllm-", "--sglang-") if name.startswith(p)), None)
        if prefix is None:
            rest.append(token)
            i += 1
            continue
        values = [inline] if eq else []
        i += 1
        while not eq and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        value = " ".join(values) if values else "true"
        key = name[len(prefix):]
        vllm = key.replace("-", "_") if prefix == "--vllm-" else SGLANG_TO_VLLM.get(key)
        if vllm is None:
            warnings.append(f"{name}{' ' + value if values else ''}: {SGLANG_ONLY}; ignored")
        else:
            engine.append(f"{vllm}={value}")
    return engine, warnings, rest


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """``"max_num_seqs=64"`` -> ``("max_num_seqs", 64)``: ints, floats and true/false typed."""
    key, _, value = text.partition("=")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def _matches(text: str, default: str) -> bool:
    """``"0"`` is ``"0.0"``: numbers compare as numbers, other words as written."""
    try:
        return float(text) == float(default)
    except ValueError:
        return text == default


def default_flags(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``tokens`` into ``(notes, rest)``: every ``FLAG VALUE`` / ``FLAG=VALUE`` of
    ``UNSUPPORTED_OFF`` at slime's default becomes a note; everything else stays in ``rest``
    (a flag at another value keeps its table line). Example: ``["--softmax-type",
    "vanilla"]`` gives the note ``--softmax-type vanilla: slime's default, a no-op (not
    supported in vime: attention sinks (gpt-oss))``."""
    notes, rest = [], []
    i = 0
    while i < len(tokens):
        name, eq, inline = tokens[i].partition("=")
        value = inline if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
        offs = UNSUPPORTED_OFF.get(name, ())
        if value is not None and any(_matches(value, off) for off in offs):
            notes.append(f"{name} {value}: slime's default, a no-op (not supported in vime: "
                         f"{UNSUPPORTED[name]})")
            i += 1 if eq else 2
            continue
        rest.append(tokens[i])
        i += 1
    return notes, rest


def slime_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` (setting name -> value) with slime's spellings in vime's (``SLIME_VALUES``,
    ``LEGACY_EVAL_SET``), and a launch note per change whose meaning needs one. Example:
    ``{"eval_prompt_data": ["aime.jsonl"]}`` -> ``{"eval_prompt_data": ("aime",
    "aime.jsonl")}``."""
    out, notes = dict(values), []
    for (name, slime), (vime, note) in SLIME_VALUES.items():
        if name in out and out[name] == slime and type(out[name]) is type(slime):
            out[name] = vime
            if note is not None:
                notes.append(f"--{name.replace('_', '-')} {slime}: {note}")
    notes += _miles_fsdp(out) + _fully_async_rollout(out) + _nothing_to_overlap(out)
    if out.get("prefill_num_servers") is not None:
        notes.append(f"--prefill-num-servers {out['prefill_num_servers']}: slime's prefill-"
                     "decode disaggregation; vime's engines prefill and decode each request "
                     "themselves (the same rollouts, another serving layout)")
    evals = out.get("eval_prompt_data")
    if isinstance(evals, str):
        evals = [evals]
    if isinstance(evals, (list, tuple)) and len(evals) == 1:
        out["eval_prompt_data"] = (LEGACY_EVAL_SET, evals[0])
        notes.append(f"--eval-prompt-data {evals[0]}: one path is slime's legacy form, an eval "
                     f"set named {LEGACY_EVAL_SET} (eval/{LEGACY_EVAL_SET}/...)")
    return out, notes


# slime's fully asynchronous rollout function: in vime a mode (--fully-async), not a function
FULLY_ASYNC_ROLLOUTS: tuple[str, ...] = (
    "slime.rollout.fully_async_rollout.generate_rollout_fully_async",)


def _fully_async_rollout(out: dict[str, Any]) -> list[str]:
    """slime's fully-async rollout function as vime's ``--fully-async`` with its default
    rollout function, in place; a note (``--train-async`` given stays an error: the two
    modes exclude each other)."""
    if out.get("rollout_function_path") not in FULLY_ASYNC_ROLLOUTS:
        return []
    path, out["rollout_function_path"] = out["rollout_function_path"], DEFAULT_ROLLOUT_FUNCTION
    if not out.get("train_async"):
        out.setdefault("fully_async", True)  # unless given
    return [f"--rollout-function-path {path}: slime's fully asynchronous rollout, which is "
            f"vime's --fully-async (a persistent pool on every engine rank) running "
            f"{DEFAULT_ROLLOUT_FUNCTION}"]


def _nothing_to_overlap(out: dict[str, Any]) -> list[str]:
    """``--train-async`` (slime's ``train_async.py``) with the SFT rollout, which generates
    nothing: there is no rollout to overlap with training, so the steps run in order, as
    slime's scripts run SFT under ``train_async.py``; in place, with a note."""
    if not (out.get("train_async") and out.get("rollout_function_path") == SFT_ROLLOUT_FUNCTION):
        return []
    out["train_async"] = False
    return ["--train-async: the SFT rollout generates nothing, so there is no generation to "
            "overlap; training one step after another"]


def _miles_fsdp(out: dict[str, Any]) -> list[str]:
    """miles' FSDP-backend switches in Megatron's terms, in place; a note per setting changed.
    Each yields to the Megatron flag given (``values`` hold the given settings only)."""
    notes = []
    if out.get("train_backend") == "fsdp" and out.get("use_distributed_optimizer") is None:
        out["use_distributed_optimizer"] = True
        notes.append("--train-backend fsdp: turns on the distributed optimizer (FSDP shards "
                     "the optimizer state over the data-parallel ranks)")
    if out.get("gradient_checkpointing") and out.get("recompute_granularity") is None:
        out.update(recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=1)
        notes.append("--gradient-checkpointing: --recompute-granularity full "
                     "--recompute-method uniform --recompute-num-layers 1 (each layer's "
                     "activations recomputed, as FSDP's checkpointing does)")
    dump = out.get("dump_details")
    if dump is not None and out.get("save_rollout_data") is None:
        out["save_rollout_data"] = f"{dump}/rollout_data/rollout_{{rollout_id}}.npz"
        notes.append(f"--dump-details {dump}: --save-rollout-data "
                     f"{out['save_rollout_data']}")
    return notes


def redact(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of each ``SECRET_FLAGS`` flag replaced by ``***``, for a
    command line that is written down (the run's lock and owner records)."""
    out, hide = [], False
    for token in argv:
        name, eq, _ = token.partition("=")
        if hide:
            out.append("***")
        elif name in SECRET_FLAGS and eq:
            out.append(f"{name}=***")
        else:
            out.append(token)
        hide = name in SECRET_FLAGS and not eq and not hide
    return out
