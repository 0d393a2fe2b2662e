"""Everything about a ``vime train`` run that can be checked before a model is built.

``launch_checks(cfg)`` reads only files and the configuration: the model directory's
``config.json`` (without transformers), export paths and sizes, that TP divides the vocabulary,
the parallel layout for the launched world (``vime_shell.megatron.layout``), the rollout
engines' layout (``vime_shell.engines.layout``: engine sizes against the world, the node and the
model's attention heads), the batching policy's feasibility (``vime_pure.check_feasible``),
every plugin path (``--rollout-function-path``, ``--custom-rm-path``,
``--dynamic-sampling-filter-path``, the ``--rm-type`` module), the prompt and eval datasets
(every row, with the configured keys and label rules; then every prompt rendered and tokenized
against the model's context, the one step that loads transformers, and only with datasets),
the chat template when ``--apply-chat-template`` asks for one, the reference model directory,
the optional W&B package, and the run's files (``check_run_paths``: run directory, ``--load``,
``--save``, replayed dumps). A bad run then fails with one line (in well under a second, or
a few seconds with a dataset to tokenize) instead of after the model is built.

Example: ``launch_checks(TrainConfig(tensor_model_parallel_size=3))`` on the embedded model
raises ``ConfigError: tensor_model_parallel_size=3: does not divide the model's
vocab_size=20 ...``.
"""

import dataclasses
import importlib.util
import os
from pathlib import Path

import attrs

from vime_pure.config import check_feasible
from vime_pure.errors import field_error
from vime_shell.agents.agent import load_agent
from vime_shell.engines import engine_traits, engines_with, resolve_engine_name, vllm_available
from vime_pure.async_pool import AsyncPoolError
from vime_shell.engines.layout import EngineLayout, EngineLayoutError, resolve_engine_layout
from vime_shell.engines.roles import RankRoles, RankRolesError, resolve_rank_roles
from vime_shell.megatron.layout import (context_parallel_available,
                                        local_rank_from_env, rank_from_env,
                                        ranks_per_node_from_env, resolve_layout,
                                        world_size_from_env)
from vime_shell.models.embedded import build_embedded
from vime_shell.models.hf_config import (check_config, has_chat_template, read_config_json,
                                         read_config_summary)
from vime_shell.rollout.data import DataKeys, fit_prompts, read_prompt_file
from vime_shell.rollout.functions import PER_SAMPLE_ROLLOUT_FUNCTION, encode_prompt
from vime_shell.rollout.sft import conversation_tokens
from vime_shell.rollout.plugins import load_callable, load_generate_function
from vime_shell.rollout.rewards import RM_CHOICES, Rewarder
from vime_shell.rollout.tasks import TaskExample, get_task
from vime_shell.run.checkpoint_index import (TRACKER, check_dataset, check_waiting_groups,
                                             resume_checkpoint)
from vime_shell.run.model_checks import check_model_settings
from vime_shell.run.ownership import check_ownership, check_unlocked, run_id_for
from vime_shell.run.run_dir import check_run_dir, dump_dir
from vime_shell.settings.data import DEFAULT_LABEL_KEY
from vime_shell.settings.flags import load_config_file
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.megatron_args import ModelArgsError, check_architecture
from vime_shell.settings.slime_flags import UNSUPPORTED_ENV
from vime_shell.settings.train_config import ConfigError, TrainConfig
from vime_shell.sources.replay import ReplaySource
from vime_shell.storage.export_target import check_export_target
from vime_shell.storage.hf_check import check_hf_dir
from vime_shell.storage.sizes import ExportError, parse_size


def model_dir(cfg: TrainConfig) -> Path:
    """The initial weights: ``--ref-load`` (slime: where training starts, and the KL
    reference), else ``--hf-checkpoint``, else the embedded model (built on first use)."""
    chosen = cfg.ref_load or cfg.hf_checkpoint
    return Path(chosen).expanduser() if chosen else build_embedded()


def launch_checks(cfg: TrainConfig, hf_dir: Path) -> LaunchPlan:
    """Check ``cfg`` against the model in ``hf_dir`` and the launched world (module docstring)."""
    for name, why in UNSUPPORTED_ENV.items():  # slime's switches set in the job's environment
        if os.environ.get(name, "0") not in ("", "0"):
            raise field_error(ConfigError, name, os.environ[name], f"is set in the environment: "
                              f"not supported in vime ({why})", f"unset {name}")
    if cfg.ref_load is not None:  # the initial weights (model_dir): an HF directory
        _check_same_model(cfg.ref_load, "--ref-load", cfg.hf_checkpoint)
    if cfg.opd_teacher_load is not None:  # on-policy distillation's teacher: the trained model's
        _check_same_model(cfg.opd_teacher_load, "--opd-teacher-load", hf_dir)
    flag = "--ref-load" if cfg.ref_load else "--hf-checkpoint"  # where the weights come from
    if not (hf_dir / "config.json").is_file():
        raise field_error(ConfigError, flag, str(hf_dir), "has no config.json",
                          "pass a Hugging Face model directory, or omit it for the embedded model")
    if cfg.save_hf is not None:
        check_export_target(cfg.save_hf, overwrite=cfg.save_hf_overwrite, protected={
            "the source model (--hf-checkpoint)": hf_dir,
            "the reference model (--ref-load)": cfg.ref_load,
            "the teacher model (--opd-teacher-load)": cfg.opd_teacher_load,
            "the run directory (--run-dir)": cfg.run_dir,
            "the checkpoint directory (--save)": cfg.save,
            "the checkpoint directory (--load)": cfg.load,
            "the rollout dump directory (--save-rollout-data)": dump_dir(cfg.save_rollout_data)})
    try:
        parse_size(cfg.save_hf_max_shard_size, "--save-hf-max-shard-size")
    except ExportError as exc:
        raise ConfigError(str(exc)) from exc
    check_config(read_config_json(hf_dir, flag), hf_dir / "config.json", flag)  # every key read
    summary = read_config_summary(hf_dir, flag)
    tp = cfg.tensor_model_parallel_size
    if summary.vocab_size % tp:  # Megatron's vocab-parallel embedding splits rows evenly
        raise field_error(ConfigError, "tensor_model_parallel_size", tp,
                          f"does not divide the model's {summary.vocab_size} vocabulary rows "
                          '("vocab_size" in config.json)',
                          "use a TP size that divides it, or pad the model's embedding and "
                          "LM head with reserved rows as Megatron's --make-vocab-size-"
                          "divisible-by does (the embedded model has 20 rows: TP 1, 2 or 4)")
    try:  # slime's Megatron flags: the architecture against the HF config, Ray placement
        check_architecture(cfg, read_config_json(hf_dir, flag), str(hf_dir))
        cfg.check_placement(world_size=world_size_from_env(),
                            ranks_per_node=ranks_per_node_from_env())
    except ModelArgsError as exc:
        raise ConfigError(str(exc)) from None
    cp = cfg.context_parallel_size
    roles = rank_roles(cfg)
    layout = resolve_layout(
        world_size=roles.num_trainers if roles else world_size_from_env(), num_layers=summary.num_layers,
        supports_context_parallel=cp > 1 and context_parallel_available(), tp=tp,
        pp=cfg.pipeline_model_parallel_size, cp=cp,
        num_layers_per_virtual_stage=cfg.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages=cfg.num_virtual_stages_per_pipeline_rank,
        ep=cfg.expert_model_parallel_size, etp=cfg.expert_tensor_parallel_size,
        num_experts=summary.num_experts,
        first_stage_layers=cfg.decoder_first_pipeline_num_layers,
        last_stage_layers=cfg.decoder_last_pipeline_num_layers)
    check_model_settings(cfg, summary, layout)
    policy = cfg.batching_policy()
    check_feasible(layout.scheduler_layout(), policy)
    engine_layout = _engine_layout(cfg, summary.num_attention_heads, roles)
    for flag, path in (("--rollout-function-path", cfg.rollout_function_path),
                       ("--eval-function-path", cfg.eval_function_path),
                       ("--custom-rm-path", cfg.custom_rm_path),
                       ("--dynamic-sampling-filter-path", cfg.dynamic_sampling_filter_path),
                       ("--custom-rollout-log-function-path",
                        cfg.custom_rollout_log_function_path)):
        if path is not None:
            load_callable(path, flag=flag)
    if cfg.custom_generate_function_path is not None:
        load_generate_function(cfg.custom_generate_function_path)
    if cfg.custom_agent_function_path is not None:
        load_agent(cfg.custom_agent_function_path)
    if cfg.partial_rollout and engine_layout is not None and engine_layout.num_engines > 1 \
            and engine_layout.gpus_per_engine > 1 and not cfg.asynchrony.pooled:
        raise field_error(ConfigError, "--partial-rollout", True,
                          f"keeps one buffer of unfinished groups per engine, on engines of one "
                          f"rank each, but this run has {engine_layout.num_engines} engines of "
                          f"{engine_layout.gpus_per_engine} ranks",
                          "pass --rollout-num-gpus-per-engine 1 with several engines, or one "
                          "engine (--rollout-num-gpus equal to --rollout-num-gpus-per-engine), "
                          "or --fully-async (every engine's pool cuts at each sync)")
    Rewarder.build(rm_type=cfg.rm_type, custom_rm_path=cfg.custom_rm_path,
                   group_rm=cfg.group_rm, reward_timeout=cfg.reward_timeout, args=cfg,
                   reward_key=cfg.reward_key, rm_url=cfg.reward_url)
    _check_side_inputs(cfg, hf_dir)
    if engine_layout is not None:
        _check_engine_args(cfg)
        check_engine_sampling(cfg)
    prompts, dropped, eval_sets = _prompt_sets(cfg, hf_dir, summary.max_position_embeddings)
    # --num-rollout, else what --num-epoch passes need (dynamic sampling may draw more prompts
    # per rollout, so it is a lower bound on the passes made).
    num_rollout = cfg.resolved_num_rollout(None if prompts is None else len(prompts))
    run_id = check_run_paths(cfg, num_rollout)
    return LaunchPlan(hf_dir=hf_dir, layout=layout, policy=policy, prompts=prompts,
                      task=get_task(cfg.task) if prompts is None else None, eval_sets=eval_sets,
                      num_rollout=num_rollout, engine_layout=engine_layout, run_id=run_id,
                      prompts_dropped=dropped, vocab_size=summary.vocab_size, roles=roles)


def _prompt_sets(cfg: TrainConfig, hf_dir: Path, context_len: int | None):
    """``(train rows or None, rows --rollout-max-prompt-len dropped, eval sets)``: every row
    read and checked (labels, chat messages without a template: before any tokenizer loads),
    then rendered and tokenized against the model's context (``fit_prompts``)."""
    sft = not cfg.generates  # sft_rollout: every row a conversation, rendered whole
    # a conversation carries its own answers: sft_rollout reads a label only if one is named
    label_key = None if sft and cfg.label_key == DEFAULT_LABEL_KEY else cfg.label_key
    keys = DataKeys(input_key=cfg.input_key, label_key=label_key,
                    metadata_key=cfg.metadata_key, tool_key=cfg.tool_key,
                    apply_chat_template=cfg.apply_chat_template or sft,
                    any_label=cfg.custom_rm_path is not None)
    train = None if cfg.prompt_data is None else read_prompt_file(cfg.prompt_data, keys)
    pairs = cfg.eval_prompt_data or ()
    eval_keys = attrs.evolve(keys, input_key=cfg.eval_input_key or cfg.input_key,
                             label_key=cfg.eval_label_key or cfg.label_key, flag_prefix="--eval-")
    evals = [(name, read_prompt_file(path, eval_keys))
             for name, path in zip(pairs[::2], pairs[1::2])]
    if cfg.eval_config is not None:
        evals += [(name, read_prompt_file(path, set_keys))
                  for name, path, set_keys in eval_config_sets(cfg.eval_config, eval_keys)]
    names = [name for name, _ in evals]
    if len(set(names)) != len(names):
        raise field_error(ConfigError, "eval set names", names, "repeat a name (their metrics "
                          "would mix)", "give every --eval-prompt-data / --eval-config set its "
                          "own name")
    if train is None and not evals:
        return None, 0, ()
    # transformers (and torch) load only here, for a run with datasets: a bad flag stays fast.
    from vime_shell.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(hf_dir)

    def encode(row: TaskExample) -> list[int]:
        return encode_prompt(tokenizer, row, cfg.apply_chat_template)

    def conversation(row: TaskExample) -> list[int]:
        return conversation_tokens(tokenizer, row.prompt, row.tools, cfg.loss_mask_type)[0]

    # sft_rollout's sample is the whole conversation: it must fit, with nothing generated
    train_encode, response = (conversation, 0) if sft else (encode, cfg.max_response_len)
    prompts, dropped = None, 0
    if train is not None:
        prompts, dropped = fit_prompts(*train, encode=train_encode, context_len=context_len,
                                       response_len=response,
                                       max_prompt_len=cfg.rollout_max_prompt_len)
        if not prompts:
            raise field_error(ConfigError, "rollout_max_prompt_len", cfg.rollout_max_prompt_len,
                              f"drops every prompt of {cfg.prompt_data}",
                              "raise it, or shorten the prompts")
    eval_response = cfg.eval_max_response_len or cfg.max_response_len
    eval_sets = tuple((name, fit_prompts(*rows, encode=encode, context_len=context_len,
                                         response_len=eval_response, max_prompt_len=None,
                                         response_flag="--eval-max-response-len",
                                         evaluation=True)[0])
                      for name, rows in evals)
    return prompts, dropped, eval_sets


def rank_roles(cfg: TrainConfig) -> RankRoles | None:
    """Separate trainer and engine ranks (``engines/roles.py``) and the asynchronous modes'
    own rules; None when engines live inside the trainer ranks."""
    try:  # the mode as one value; its construction checks K >= lag + I - 1
        asynchrony = cfg.asynchrony
        roles = resolve_rank_roles(world_size=world_size_from_env(),
                                   rollout_num_gpus=cfg.rollout_num_gpus, colocate=cfg.colocate,
                                   asynchrony=asynchrony)
    except (RankRolesError, AsyncPoolError) as exc:
        raise ConfigError(str(exc)) from exc
    if roles is not None and cfg.debug_rollout_only:  # its loop lays engines over every rank
        mode = asynchrony.flag or "--no-colocate"
        raise field_error(ConfigError, "debug_rollout_only", True, f"runs no trainer, and "
                          f"{mode} puts the engines on ranks of their own beside a trainer",
                          f"drop {mode} (a rollout-only run with --rollout-num-gpus N runs N "
                          "engines and leaves the other ranks idle)")
    if roles is None and cfg.update_weights_interval > 1:
        raise field_error(ConfigError, "--update-weights-interval", cfg.update_weights_interval,
                          "needs engines on ranks of their own (the colocated loop trains on "
                          "policy only)", "add --train-async or --fully-async with "
                          "--rollout-num-gpus, or drop it")
    if roles is not None and cfg.load_rollout_data is not None:
        raise field_error(ConfigError, "--load-rollout-data", cfg.load_rollout_data,
                          "replays into the colocated loop only", "drop --rollout-num-gpus "
                          "/ --train-async / --fully-async for a replay")
    if asynchrony.pooled and cfg.rollout_num_gpus_per_engine > 1 \
            and engine_traits(cfg.rollout_engine).tensor_parallel:
        raise field_error(ConfigError, "--rollout-num-gpus-per-engine",
                          cfg.rollout_num_gpus_per_engine, f"must be 1 with --fully-async and "
                          f"{engine_traits(cfg.rollout_engine).label} (its tensor-parallel "
                          "ranks run every generate call together, and the pool on an "
                          "engine's leader does not drive its peers' calls yet; an engine "
                          "holding a replica per rank, --rollout-engine hf, runs)",
                          "pass --rollout-num-gpus-per-engine 1 (--rollout-num-gpus N gives N "
                          "pools), or use --train-async")
    need = asynchrony.staleness_needed(carries_groups=cfg.partial_rollout)
    if asynchrony.bounded and asynchrony.max_staleness < need:  # one step off, carrying
        raise field_error(ConfigError, "--max-weight-staleness", asynchrony.max_staleness,
                          f"is below {need}: with --partial-rollout and {asynchrony.flag} a "
                          "group carried into the next rollout trains one version later "
                          "than the batch it started in", f"pass --max-weight-staleness "
                          f"{need}, or use --fully-async (its pools carry nothing)")
    return roles



_EVAL_SET_KEYS = ("name", "path", "input_key", "label_key", "metadata_key", "tool_key",
                  "rm_type")


def eval_config_sets(path: str, defaults: DataKeys) -> list[tuple[str, str, DataKeys]]:
    """``--eval-config``: ``(name, path, keys)`` per dataset; unset keys take ``defaults``
    (``--eval-input-key``, else ``--input-key``); a relative path is read next to the file; an
    ``rm_type`` scores that set with its own built-in reward (slime's per-dataset rm_type).
    Example entry: ``{"name": "aime", "path": "aime.jsonl", "input_key": "problem",
    "label_key": "answer", "rm_type": "math"}``."""
    data = load_config_file(path)
    entries = data.get("datasets")
    if set(data) != {"datasets"} or not isinstance(entries, list) or not entries:
        raise field_error(ConfigError, "--eval-config", path, "does not hold one non-empty "
                          "'datasets' list", "write datasets: [{name: aime, path: aime.jsonl, "
                          "input_key: problem, label_key: answer}]")
    out = []
    for i, entry in enumerate(entries):
        where = f"--eval-config {path} datasets[{i}]"
        if not isinstance(entry, dict) or not {"name", "path"} <= set(entry) or \
                set(entry) - set(_EVAL_SET_KEYS) or \
                not all(isinstance(v, str) and v for v in entry.values()):
            raise field_error(ConfigError, where, entry, "is not an eval set",
                              f"give name and path, and optionally {list(_EVAL_SET_KEYS[2:])}, "
                              "all as non-empty strings")
        if entry.get("rm_type", RM_CHOICES[0]) not in RM_CHOICES:
            raise field_error(ConfigError, f"{where} rm_type", entry["rm_type"],
                              "is not a built-in reward", f"use one of {list(RM_CHOICES)}")
        keys = attrs.evolve(defaults, **{k: v for k, v in entry.items() if k.endswith("_key")},
                            rm_type=entry.get("rm_type"), flag_prefix=f"{where} ")
        file = Path(entry["path"]).expanduser()  # relative: next to the config file
        out.append((entry["name"], str(file if file.is_absolute() else Path(path).parent / file),
                    keys))
    return out


def _engine_layout(cfg: TrainConfig, num_attention_heads: int | None,
                   roles: RankRoles | None = None) -> EngineLayout | None:
    """Which ranks host which engine; None for a train-only replay (no engine at all).

    Without ``--rollout-engine`` the engine is the one the loop builds (by capability)."""
    if cfg.load_rollout_data is not None and cfg.load_rollout_data_mode == "train-only":
        return None
    try:
        return resolve_engine_layout(  # separate ranks: every engine rank hosts an engine
            world_size=roles.num_engine_ranks if roles else world_size_from_env(),
            rollout_num_gpus=None if roles else cfg.rollout_num_gpus,
            rollout_num_gpus_per_engine=cfg.rollout_num_gpus_per_engine,
            engine=resolve_engine_name(cfg.rollout_engine),
            gpus_per_node=ranks_per_node_from_env(),
            num_attention_heads=num_attention_heads,
            per_request=cfg.effective_rollout_function_path == PER_SAMPLE_ROLLOUT_FUNCTION)
    except EngineLayoutError as exc:
        raise ConfigError(str(exc)) from exc


def _check_engine_args(cfg: TrainConfig) -> None:
    """``--vllm-engine-args`` name arguments of vLLM's ``EngineArgs`` (checked when vLLM is
    installed: a wrong name would otherwise fail only when the engine is built)."""
    if not cfg.vllm_engine_args or not vllm_available():
        return
    from vllm.engine.arg_utils import EngineArgs  # seconds to import: only for these flags

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for arg in cfg.vllm_engine_args:
        key = arg.partition("=")[0]
        if key not in known:
            raise field_error(ConfigError, "--vllm-engine-args", arg,
                              f"names no vLLM engine argument ({key!r})",
                              "use a field of vllm.engine.arg_utils.EngineArgs, or drop the "
                              "--vllm-/--sglang- flag it came from")


def check_engine_sampling(cfg: TrainConfig) -> None:
    """A temperature the run's engine refuses (its traits' ``max_temperature``: vLLM's 2)
    fails here, not at the first generation after the model is built; vime's own range
    (0..100) holds for the HF engine."""
    engine = engine_traits(cfg.rollout_engine)
    limit = engine.max_temperature
    if limit is None:
        return
    for flag in ("rollout_temperature", "eval_temperature"):
        value = getattr(cfg, flag)
        if value is not None and value > limit:
            raise field_error(ConfigError, flag, value,
                              f"is above {engine.label}'s limit of {limit:g}",
                              f"use at most {limit:g}, or --rollout-engine "
                              f"{engines_with(lambda t: t.max_temperature is None)}")


def _check_side_inputs(cfg: TrainConfig, hf_dir: Path) -> None:
    """The chat template, the reference model and the optional packages a run asks for."""
    # every shard's header, before minutes of loading (--ref-load: the weights training starts from)
    check_hf_dir(hf_dir, "--ref-load" if cfg.ref_load else "--hf-checkpoint")
    if cfg.apply_chat_template and not has_chat_template(hf_dir):
        raise field_error(ConfigError, "apply_chat_template", True,
                          f"but {hf_dir} has no chat template (tokenizer_config.json "
                          "'chat_template' or chat_template.jinja)",
                          "use an instruct model's directory, or drop --apply-chat-template")
    if cfg.use_wandb and importlib.util.find_spec("wandb") is None:
        raise field_error(ConfigError, "use_wandb", True, "but wandb is not installed",
                          "pip install 'vime[wandb]', or drop --use-wandb")


def _check_same_model(path: str, flag: str, model: str | Path | None) -> None:
    """``path`` (``--ref-load``, ``--opd-teacher-load``) is an HF directory of the same
    architecture as ``model`` (``--hf-checkpoint``; for the teacher, the trained model)."""
    other = Path(path).expanduser()
    if not (other / "config.json").is_file():
        megatron = (other / TRACKER).is_file() or any(other.glob("iter_*"))
        raise field_error(ConfigError, flag, path,
                          "is a Megatron checkpoint; vime reads HF weights" if megatron else
                          "is not an HF model directory",
                          "pass an HF directory (save_pretrained, or vime's --save-hf)"
                          + (", or drop --ref-load to start from --hf-checkpoint"
                             if flag == "--ref-load" else ""))
    if model is not None:
        a = read_config_summary(Path(model).expanduser(), "--hf-checkpoint")
        b = read_config_summary(other, flag)
        for name in ("model_type", "num_layers", "vocab_size"):
            if getattr(a, name) != getattr(b, name):
                raise field_error(ConfigError, flag, path,
                                  f"has {name}={getattr(b, name)!r}, the trained model "
                                  f"{getattr(a, name)!r}", "pass the same model's weights")


def check_run_paths(cfg: TrainConfig, num_rollout: int | None = None) -> str:
    """The run's files: the run directory (``run_dir.check_run_dir``), output directories that
    can be created, the ``--load`` checkpoint (it must exist: a mistyped path never starts a
    new run; its files match its manifest; the dataset did not change; under
    ``--fully-async`` it owes no unfinished partial-rollout groups), the directories'
    owners and locks (``ownership.check_ownership``) and every dump ``--load-rollout-data``
    will replay (the first one read and validated). Returns the run id."""
    owner = rank_from_env() == 0  # rank 0 claims and writes; another rank may see its lock
    if owner:
        check_unlocked(cfg)  # first: another live run's directories, whatever they hold
    check_run_dir(cfg)
    outputs = (("run_dir", cfg.run_dir), ("save", cfg.save), ("save_hf", cfg.save_hf),
               ("save_rollout_data", cfg.save_rollout_data and str(
                   Path(cfg.save_rollout_data).parent)))
    for field, path in outputs:
        if path is not None:
            _check_writable(field, Path(path).expanduser())
    num_rollout = cfg.resolved_num_rollout(None) if num_rollout is None else num_rollout
    start = 0
    # None: a fresh start (also slime's first run of --load X --save X); every file checked
    # against the manifest (once a node), and the dataset's fingerprint
    found = resume_checkpoint(cfg.load, cfg.save, weights=cfg.hf_checkpoint,
                              verify=local_rank_from_env() == 0)
    if found is not None:
        check_dataset(found, cfg.prompt_data, cfg.allow_dataset_change)
        check_waiting_groups(found, cfg.fully_async)
        start = int(found.name.split("_")[-1])
    run_id = run_id_for(cfg)
    if owner:
        check_ownership(cfg, run_id)  # no other run's directories
    if cfg.load_rollout_data is not None and start < num_rollout:
        source = ReplaySource(template=cfg.load_rollout_data,
                              fallback=cfg.load_rollout_data_fallback)
        for rid in range(start, num_rollout):
            source.path(rid)  # a missing dump is a ReplayError naming it, now, not mid-run
        source.load(start)  # DumpFormatError for a damaged or foreign file
    return run_id


def _check_writable(field: str, path: Path) -> None:
    """An output directory can be created where it is asked for: its nearest existing ancestor
    is a writable directory (a typo that runs through a file, or a read-only mount, fails now,
    not at the first checkpoint)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise field_error(ConfigError, field, str(path), f"runs through the file {existing}",
                          "pass a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise field_error(ConfigError, field, str(path), f"is under {existing}, which is not "
                          "writable", "pass a directory you can write to")
