"""``TrainConfig``: every setting of ``vime train``, validated at launch, with slime flag names.

Sources, later wins: the defaults (the embedded CPU demo), a ``--config`` file (YAML, JSON or
TOML; keys spelled ``global_batch_size`` or ``global-batch-size``), then command-line flags
(``--global-batch-size 64``; bools as ``--balance-data`` / ``--no-balance-data``; optional values
accept ``none``).

Invariants the tests assert: a ``TrainConfig`` that exists is valid (types, ranges, names,
and that a rollout's groups fill whole optimizer steps unless ``allow_partial_train_step``);
every bad value raises :class:`ConfigError` naming the field, the value and the fix; an unknown
key or flag is an error with the closest valid name, never ignored; ``to_dict`` round-trips.

Defaults are the measured demo (reverse2 from scratch on 2 CPU cores, the embedded 334k-param
Qwen2): 16 prompts x 8 samples, temperature 1, answers capped at the task's length, lr 3e-4,
one optimizer step per rollout (``global_batch_size`` = 128 groups). With the HF engine, the
built-in single-turn rollout and a plain-torch GRPO step standing in for the trainer, the mean
reward went from 0.00 to >= 0.8 (10-rollout average) after 133-152 rollouts (6 runs).
"""

import argparse
import difflib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from vime_pure.config import BALANCES, PACKINGS, BatchingPolicy, policy_from_flags
from vime_pure.denominators import LOSS_MODES
from vime_pure.errors import VimeError, field_error
from vime_shell.engines import ENGINE_NAMES
from vime_shell.rollout.tasks import TASKS

ESTIMATORS = ("grpo", "reinforce_plus_plus_baseline", "gspo")


class ConfigError(VimeError):
    """A training setting that is invalid, unknown or inconsistent with another one."""


def _f(default: Any, help: str) -> Any:
    return attrs.field(default=default, metadata={"help": help})


@attrs.frozen(kw_only=True)
class TrainConfig:
    """All ``vime train`` settings. Example: ``TrainConfig(lr=3e-4, num_rollout=50)``."""

    # model and engine
    hf_checkpoint: str | None = _f(None, "HF model dir; default: the embedded tiny Qwen2")
    rollout_engine: str | None = _f(None, f"one of {ENGINE_NAMES}; default: by capability")
    # rollouts
    task: str = _f("reverse2", "built-in task supplying prompts and labels")
    rollout_function_path: str = _f("vime_shell.rollout.functions:single_turn_rollout",
                                    "rollout function, 'pkg.mod:fn'")
    custom_rm_path: str | None = _f(None, "reward function 'pkg.mod:fn'; default exact match")
    rollout_num_turns: int = _f(2, "turns per execution of the compact rollout (2-3)")
    rollout_turn_reward: str = _f("mean", "compact rollout reward: mean of turns, or 'all'")
    num_rollout: int = _f(300, "rollout batches to generate and train on")
    rollout_batch_size: int = _f(16, "prompts per rollout batch")
    n_samples_per_prompt: int = _f(8, "rollout executions per prompt")
    rollout_temperature: float = _f(1.0, "sampling temperature")
    rollout_top_p: float = _f(1.0, "nucleus sampling mass")
    rollout_max_response_len: int | None = _f(None, "max new tokens; default: the answer length")
    # batching (global_batch_size counts groups = rollout executions, never samples)
    global_batch_size: int = _f(128, "groups per optimizer step")
    max_tokens_per_gpu: int | None = _f(1024, "token budget of a packed micro-batch")
    micro_batch_size: int | None = _f(None, "samples per static micro-batch")
    packing: str = _f("ffd", f"bin-packing algorithm, one of {PACKINGS}")
    balance: str | None = _f(None, f"DP balance, one of {BALANCES}; overrides the two below")
    balance_data: bool = _f(False, "balance tokens across DP ranks (balance=tokens)")
    balance_by_flops: bool = _f(False, "balance estimated FLOPs across DP ranks (balance=flops)")
    allow_partial_train_step: bool = _f(False, "train a short last step instead of dropping")
    # optimisation
    lr: float = _f(3e-4, "Adam learning rate")
    advantage_estimator: str = _f("grpo", f"one of {ESTIMATORS}")
    loss_mode: str = _f("group_token_mean", f"loss denominators, one of {LOSS_MODES}")
    eps_clip: float = _f(0.2, "PPO ratio clip")
    logprob_gap_tolerance: float = _f(1e-4, "max engine-trainer log-prob gap after a sync")
    # run
    seed: int = _f(0, "seeds prompts, sampling and initialisation")
    save: str | None = _f(None, "checkpoint directory")
    save_interval: int = _f(50, "rollouts between checkpoints")
    load: str | None = _f(None, "checkpoint directory to resume from")
    run_dir: str = _f("runs/demo", "metrics.jsonl, TensorBoard and plots go here")
    overwrite_run_dir: bool = _f(False, "a new run in a run dir that holds metrics moves "
                                 "them to <run-dir>/previous-<timestamp>/ (else: an error)")
    # parallel layout (Megatron names; the data-parallel size is world / (tp * pp))
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size")
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size")
    context_parallel_size: int = _f(1, "context-parallel size (needs TransformerEngine)")
    num_layers_per_virtual_pipeline_stage: int | None = _f(None, "layers per virtual stage")
    # rollout dumps and replay, HF export
    save_rollout_data: str | None = _f(None, "dump every rollout batch to this path template "
                                       "(must contain {rollout_id})")
    load_rollout_data: str | None = _f(None, "replay dumps from this path template (or one "
                                       "literal path, replayed every rollout)")
    load_rollout_data_mode: str = _f("train-only", "train-only: no engine; forge: keep the "
                                     "engine and its weight syncs")
    load_rollout_data_fallback: bool = _f(False, "replay rollout 0's dump when a rollout's "
                                          "dump is missing")
    save_hf: str | None = _f(None, "write the trained weights as an HF checkpoint here")
    save_hf_max_shard_size: str = _f("5GB", "size limit of one safetensors shard")

    def __attrs_post_init__(self) -> None:
        _check_types(self)
        for name in ("rollout_num_turns", "num_rollout", "rollout_batch_size",
                     "n_samples_per_prompt", "global_batch_size", "save_interval"):
            _at_least(name, getattr(self, name), 1)
        for name in ("rollout_max_response_len", "max_tokens_per_gpu", "micro_batch_size"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        _at_least("seed", self.seed, 0)
        _in_range("lr", self.lr, 0.0, 1.0, "use e.g. 3e-4 (the 334k-param embedded model), 1e-6 (7B)")
        _in_range("rollout_temperature", self.rollout_temperature, 0.0, 100.0, "use 1.0")
        _in_range("rollout_top_p", self.rollout_top_p, 1e-6, 1.0, "use 1.0")
        _in_range("eps_clip", self.eps_clip, 0.0, 10.0, "use 0.2")
        _in_range("logprob_gap_tolerance", self.logprob_gap_tolerance, 0.0, 1e9, "use 1e-4")
        _one_of("rollout_engine", self.rollout_engine, (None, *ENGINE_NAMES))
        _one_of("loss_mode", self.loss_mode, LOSS_MODES)
        _one_of("advantage_estimator", self.advantage_estimator, ESTIMATORS)
        _one_of("rollout_turn_reward", self.rollout_turn_reward, ("mean", "all"))
        _one_of("task", self.task, tuple(TASKS))
        if self.rollout_num_turns > 3:
            raise field_error(ConfigError, "rollout_num_turns", self.rollout_num_turns,
                              "must be 2 or 3", "use 2 (or the single-turn rollout)")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size"):
            _at_least(name, getattr(self, name), 1)
        _one_of("load_rollout_data_mode", self.load_rollout_data_mode, ("train-only", "forge"))
        if self.save_rollout_data is not None and "{rollout_id}" not in self.save_rollout_data:
            raise field_error(ConfigError, "save_rollout_data", self.save_rollout_data,
                              "lacks {rollout_id}: every rollout would overwrite one file",
                              "use e.g. 'dumps/rollout_{rollout_id}.npz'")
        self.batching_policy()  # BatchingPolicy's own checks (max_tokens / micro_batch_size)
        self._check_steps()

    def _check_steps(self) -> None:
        groups = self.rollout_batch_size * self.n_samples_per_prompt
        if groups % self.global_batch_size and not self.allow_partial_train_step:
            raise field_error(
                ConfigError, "global_batch_size", self.global_batch_size,
                f"does not divide the {groups} groups of a rollout (rollout_batch_size="
                f"{self.rollout_batch_size} x n_samples_per_prompt={self.n_samples_per_prompt})",
                f"use a divisor of {groups} (e.g. {groups}), or --allow-partial-train-step")

    @property
    def groups_per_rollout(self) -> int:
        """Rollout groups the built-in rollouts produce per batch: prompts x samples."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    def batching_policy(self) -> BatchingPolicy:
        """The scheduler's policy, from the one builder ``vime_pure.policy_from_flags``."""
        try:
            return policy_from_flags(
                global_batch_size=self.global_batch_size,
                max_tokens_per_gpu=self.max_tokens_per_gpu,
                micro_batch_size=self.micro_batch_size, packing=self.packing,
                balance=self.balance, balance_data=self.balance_data,
                balance_by_flops=self.balance_by_flops,
                allow_partial_train_step=self.allow_partial_train_step)
        except VimeError as exc:
            raise ConfigError(str(exc)) from exc

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "config") -> "TrainConfig":
        """Build from a mapping with ``snake_case`` or ``dash-case`` keys; unknown keys fail."""
        fields = {f.name for f in attrs.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in fields:
                close = difflib.get_close_matches(name, sorted(fields), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(fields)}"
                raise field_error(ConfigError, f"{source} key", key, "is not a setting", hint)
            out[name] = _from_text(attrs.fields_dict(cls)[name], value)
        return cls(**out)


def _from_text(f: attrs.Attribute, value: Any) -> Any:
    """A float setting written as text becomes the number: PyYAML (YAML 1.1) reads ``lr: 3e-4``
    as the string ``"3e-4"`` (it wants ``3.0e-4``). Other text is left for the type check."""
    if isinstance(value, str) and f.type in (float, float | None):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_types(cfg: TrainConfig) -> None:
    for f in attrs.fields(type(cfg)):
        value = getattr(cfg, f.name)
        if value is None and "None" in str(f.type):
            continue
        base = f.type.__args__[0] if "None" in str(f.type) else f.type
        ok = (isinstance(value, base) and not (base is int and isinstance(value, bool))
              or base is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise field_error(ConfigError, f.name, value,
                              f"must be {'None or ' if 'None' in str(f.type) else ''}"
                              f"a {base.__name__}", f"e.g. {f.name}={f.default!r}")


def _at_least(name: str, value: int, lo: int) -> None:
    if value < lo:
        raise field_error(ConfigError, name, value, f"must be >= {lo}", f"pass {name} >= {lo}")


def _in_range(name: str, value: float, lo: float, hi: float, fix: str) -> None:
    if not (math.isfinite(value) and lo <= value <= hi) or (name == "lr" and value == 0):
        raise field_error(ConfigError, name, value, f"must be in ({lo}, {hi}]"
                          if name == "lr" else f"must be in [{lo}, {hi}]", fix)


def _one_of(name: str, value: object, options: Sequence[object]) -> None:
    if value not in options:
        raise field_error(ConfigError, name, value, "is not a valid choice",
                          f"use one of {[o for o in options if o is not None]}")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``.yaml`` / ``.yml`` / ``.json`` / ``.toml`` file into a mapping."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise field_error(ConfigError, "--config", str(p), f"cannot be read ({exc})",
                          "pass an existing YAML, JSON or TOML file (UTF-8 text)") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif p.suffix == ".json":
            data = json.loads(text)
        elif p.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise field_error(ConfigError, "--config", str(p), "has an unknown extension",
                              "name it .yaml, .yml, .json or .toml")
    except (ValueError, yaml.YAMLError, RecursionError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # yaml.safe_load builds plain data only: a !!python/object tag fails here, unrun.
        raise field_error(ConfigError, "--config", str(p), f"does not parse ({exc})",
                          "fix the file's syntax") from None
    if not isinstance(data, dict):
        raise field_error(ConfigError, "--config", str(p), "does not hold a mapping",
                          "write one key: value per setting")
    odd = next((k for k in data if not isinstance(k, str)), None)
    if odd is not None or None in data:
        raise field_error(ConfigError, f"--config {p} key", odd, "is not a setting name",
                          "write setting names as keys, e.g. global_batch_size: 64")
    return data


def _optional(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one ``--dash-name`` flag per field; unset flags stay absent.

    Build the parser with ``allow_abbrev=False``: a typo such as ``--global-batch`` must fail,
    not silently mean ``--global-batch-size``.
    """
    parser.add_argument("--config", default=None, help="YAML / JSON / TOML file of settings")
    for f in attrs.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
            continue
        optional = "None" in str(f.type)
        base = f.type.__args__[0] if optional else f.type
        kind = _optional(base) if optional else base
        parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the flags that were given."""
    values = dict(vars(args))
    path = values.pop("config", None)
    merged = load_config_file(path) if path else {}
    merged = {k.replace("-", "_"): v for k, v in merged.items()}
    fields = {f.name for f in attrs.fields(TrainConfig)}
    merged.update({k: v for k, v in values.items() if k in fields})
    return TrainConfig.from_mapping(merged, source=f"--config {path}" if path else "flags")


def parse_train_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``vime train`` arguments. Example: ``parse_train_config(["--lr", "1e-3"]).lr``."""
    parser = argparse.ArgumentParser(prog="vime train", allow_abbrev=False)
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(argv))
