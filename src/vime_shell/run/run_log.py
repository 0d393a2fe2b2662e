"""What a ``vime train`` run reports: ``metrics.jsonl``, TensorBoard, a progress bar, PNG plots.

Only global rank 0 writes. ``<run_dir>/metrics.jsonl`` holds one JSON object per rollout, in
rollout order, flushed as soon as the rollout ends (``REQUIRED_KEYS`` are always present). On a
resumed run the lines of rollouts at or after the resume point (and a torn last line, with a
warning) are dropped first, so the file never holds a rollout twice; a new run never empties an
earlier run's file (:mod:`vime_shell.run.run_dir` moves it aside or refuses). TensorBoard
scalars go to ``<run_dir>/tb`` when the ``tensorboard`` package is installed (silently skipped
otherwise). At the end,
``curves.png`` (reward, loss, entropy and gradient norm per rollout; on-policy GRPO's loss
is ~0 by construction, entropy and gradient norm show the learning) and ``schedule.png``
(per-rank micro-batch token loads of the last rollout's first step) are drawn with
:mod:`vime_shell.run.plots`. On a terminal the progress bar stays at the bottom: progress
lines, log records and Python warnings print above it (:func:`lines_above_bar`).

Example line (the demo's rollout 0): ``{"rollout": 0, "reward_mean": 0.0, "loss": 0.0,
"num_groups": 128, "num_microbatches": 1, "logprob_gap": 1.0e-07, "entropy": 2.92,
"dp_imbalance": 1.0, "tokens_per_s": 1815.0, ...}``.
"""

import contextlib
import json
import logging
import math
import sys
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from tqdm import tqdm

from vime_pure.errors import field_error
from vime_shell.run.plots import plot_curves, plot_step_loads
from vime_shell.run.run_dir import (CURVES, METRICS, SCHEDULE_PLOT, TENSORBOARD,  # noqa: F401
                                    RunDirError)
from vime_shell.settings.common import ConfigError
from vime_shell.settings.slime_flags import redact
from vime_shell.storage.files import write_atomic

try:  # TensorBoard is optional: scalars are written only when it is installed
    from torch.utils.tensorboard import SummaryWriter
    HAS_TENSORBOARD = True
except ImportError:
    HAS_TENSORBOARD = False

REQUIRED_KEYS = ("rollout", "reward_mean", "loss", "num_groups", "num_microbatches",
                 "logprob_gap")
log = logging.getLogger(__name__)
progress_log = logging.getLogger("vime.train")  # the run's own lines (run.logs formats them)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rollout records of ``<run_dir>/metrics.jsonl`` (empty when absent).

    A torn last line (the run was killed while writing it) is dropped with a warning: that
    rollout was not checkpointed, so a resumed run logs it again. A bad line before the last
    is corruption, a ``RunDirError`` naming the line. Example: ``{"rollout": 0, ...}\n{"roll``
    reads as one record.
    """
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_bytes().splitlines(), 1)
             if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if isinstance(record, dict) and isinstance(record.get("rollout"), int):
            records.append(record)
        elif n == lines[-1][0]:
            log.warning("%s:%d: dropping a torn last line (the run stopped while writing it; "
                        "a resumed run logs that rollout again)", path, n)
        else:
            raise field_error(RunDirError, f"{path}:{n}", line[:60].decode(errors="replace"),
                              "is not a metrics record", "restore the file from a copy, or "
                              "start a new run with --overwrite-run-dir")
    return records


class RunLogger:
    """Rank 0's sink for per-rollout records. ``enabled=False`` (other ranks) does nothing."""

    def __init__(self, run_dir: str | Path, *, start: int, total: int, enabled: bool,
                 progress: bool | None = None, wandb: Mapping[str, object] | None = None):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.records: list[dict] = []
        self._tb = self._bar = self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        earlier = read_metrics(self.run_dir)
        if earlier and start == 0:  # a new run: never empty an earlier run's log (run_dir.py)
            raise field_error(RunDirError, "run_dir", str(run_dir),
                              f"holds {METRICS} with {len(earlier)} records of an earlier run",
                              "move them aside first (--overwrite-run-dir) or resume (--load)")
        kept = [r for r in earlier if r["rollout"] < start]
        self.records = kept
        path = self.run_dir / METRICS
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = path.open("a")
        self._tb = _tensorboard(self.run_dir / TENSORBOARD)
        if wandb is not None:
            self._wandb = _wandb_run(self.run_dir, wandb)
        self._routing = contextlib.ExitStack()
        if sys.stderr.isatty() if progress is None else progress:
            self._bar = tqdm(total=total, initial=start, unit="rollout", dynamic_ncols=True)
            self._routing.enter_context(lines_above_bar())

    @property
    def has_progress_bar(self) -> bool:
        return self._bar is not None

    def line(self, text: str) -> None:
        """A progress line: above the bar on a terminal (the bar stays at the bottom),
        else a log line."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(f"vime train: {text}", file=sys.stderr)
        else:
            progress_log.info(text)

    def log_eval(self, rollout: int, metrics: Mapping[str, float]) -> None:
        """An evaluation-only line (the weights after the last rollout): ``eval_only`` set."""
        if not self.enabled:
            return
        clean = {"rollout": rollout, "eval_only": True,
                 **{k: _json_value(v) for k, v in metrics.items()}}
        self.records.append(clean)
        self._write(clean)

    def log(self, record: Mapping[str, object]) -> None:
        if not self.enabled:
            return
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:  # a loop bug, not user input: the record is built in one place
            raise KeyError(f"metrics record lacks {missing}")
        clean = {k: _json_value(v) for k, v in record.items()}
        self.records.append(clean)
        self._write(clean)
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"reward {fmt(clean['reward_mean'], '.3f')} loss {fmt(clean['loss'], '+.4f')} "
                f"gap {fmt(clean['logprob_gap'], '.1e')} mb {clean['num_microbatches']} "
                f"{clean.get('tokens_per_s', 0):.0f} tok/s", refresh=False)
            self._bar.update(1)

    def _write(self, clean: dict) -> None:
        """One line to metrics.jsonl (flushed), its numbers to TensorBoard and W&B."""
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step = int(clean["rollout"])
        scalars = {k: v for k, v in clean.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rollout"}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def finish(self, last_schedule=None) -> list[Path]:
        """Close the sinks and draw the plots; returns the PNG paths written."""
        if not self.enabled:
            return []
        self._file.close()
        self._routing.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        out = []
        trained = [r for r in self.records if not r.get("eval_only")]
        if trained:
            out += _plotted(lambda: plot_curves(curve_panels(self.records),
                                                self.run_dir / CURVES,
                                                title=f"{len(trained)} rollouts",
                                                log_panels=LOG_PANELS,
                                                light_lines=LIGHT_LINES))
        if last_schedule is not None and last_schedule.steps:
            out += _plotted(lambda: plot_step_loads(last_schedule, self.run_dir / SCHEDULE_PLOT,
                                                    step=0))
        return out


class _AboveBar(logging.Handler):
    """A console handler's twin (level, formatter, filters) that prints with ``tqdm.write``."""

    def __init__(self, like: logging.Handler, stream):
        super().__init__(like.level)
        self.setFormatter(like.formatter)
        self.filters = list(like.filters)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging never raises into the run
            self.handleError(record)


@contextlib.contextmanager
def lines_above_bar() -> Iterator[None]:
    """While the progress bar is drawn, every line bound for the terminal goes above it
    (``tqdm.write``: clear the bar, print, redraw) instead of into it: each console handler
    of every logger (vime's warnings and notes, transformers', the last-resort handler of
    loggers without one) and Python warnings (a library's ``warnings.warn``). Other handlers
    (files) are left alone; everything is restored afterwards. Example: a ``UserWarning`` at
    rollout 3 prints as its own line, and the bar below it still reads ``3/10``."""
    consoles = {id(sys.stdout), id(sys.stderr)}
    loggers = [logging.root, *(x for x in logging.root.manager.loggerDict.values()
                               if isinstance(x, logging.Logger) and x.handlers)]
    saved = [(logger, logger.handlers) for logger in loggers]
    shown, last_resort = warnings.showwarning, logging.lastResort

    def above(handler: logging.Handler) -> logging.Handler:
        stream = getattr(handler, "stream", None)
        is_console = isinstance(handler, logging.StreamHandler) and id(stream) in consoles
        return _AboveBar(handler, stream) if is_console else handler

    def show(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line)
        tqdm.write(text.rstrip("\n"), file=sys.stderr)

    try:
        for logger, handlers in saved:
            logger.handlers = [above(h) for h in handlers]
        if last_resort is not None:
            logging.lastResort = _AboveBar(last_resort, sys.stderr)
        warnings.showwarning = show
        yield
    finally:
        for logger, handlers in saved:
            logger.handlers = handlers
        warnings.showwarning, logging.lastResort = shown, last_resort


LOG_PANELS = frozenset({"logprob_gap"})  # spans decades (1e-7 healthy, 1e-3 a missed sync)
LIGHT_LINES = frozenset({"max"})  # grad_norm_max, drawn lighter beside the mean


def _plotted(draw) -> list[Path]:
    """``[draw()]``, or ``[]`` with a warning: a plot that cannot be drawn or written (a full
    disk, a broken matplotlib backend) never costs the run its checkpoint or HF export."""
    try:
        return [draw()]
    except Exception as exc:  # noqa: BLE001 - plots are a convenience; the metrics are kept
        log.warning("could not draw a plot (%s: %s); metrics.jsonl holds every value",
                    type(exc).__name__, exc)
        return []


def curve_panels(records: list[dict]) -> dict:
    """Reward (train, and every eval set), entropy, gradient norm (the mean over each
    rollout's optimizer steps, and their max as a lighter line), the engine-trainer log-prob
    gap (log scale), KL, response length (mean and p90) and truncation rate against rollout. No loss panel: an on-policy step's surrogate is ~0 by construction (ratio 1), so
    its curve is float noise; entropy and gradient norm show the learning."""
    def line(key: str) -> tuple[list[float], list[float]]:
        points = [(r["rollout"], r[key]) for r in records if r.get(key) is not None]
        return [x for x, _ in points], [y for _, y in points]

    evals = sorted({k for r in records for k in r if k.startswith("eval/")
                    and k.endswith("/reward_mean")})
    panels = {"reward_mean": {"reward_mean": line("reward_mean"),
                              **{k.removesuffix("/reward_mean"): line(k) for k in evals}}}
    for key in ("entropy", "grad_norm", "logprob_gap", "kl", "truncated_frac"):
        if any(r.get(key) is not None for r in records):
            panels[key] = {key: line(key)}
    if any(r.get("grad_norm_max") is not None for r in records):  # older runs' records lack it
        panels["grad_norm"] = {"mean": line("grad_norm"), "max": line("grad_norm_max")}
    if any(r.get("response_len_mean") is not None for r in records):
        panels["response_len"] = {"mean": line("response_len_mean"),
                                  "p90": line("response_len_p90")}
    return panels


def fmt(value: object, spec: str) -> str:
    """A metric for a log line: ``format(value, spec)``, or ``-`` for a metric with no value
    (None: nothing was measured). Example: ``fmt(0.25, ".3f") == "0.250"``, ``fmt(None, ".3f")
    == "-"``."""
    return "-" if value is None else format(value, spec)


def _json_value(value: object) -> object:
    if hasattr(value, "item"):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _tensorboard(path: Path) -> "SummaryWriter | None":
    return SummaryWriter(str(path)) if HAS_TENSORBOARD else None


def _wandb_run(run_dir: Path, config: Mapping[str, object]):
    """A W&B run in ``--wandb-dir`` or ``run_dir`` (``--wandb-mode offline`` needs no
    network), named as slime names it (:func:`wandb_names`). Its key comes from
    ``WANDB_API_KEY`` (``--wandb-key`` put it there); ``config`` holds no key."""
    import wandb  # optional extra; launch checks made sure it is installed

    group, name = wandb_names(config.get("wandb_group"),
                              bool(config.get("disable_wandb_random_suffix")))
    where = Path(str(config.get("wandb_dir") or run_dir)).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    host = config.get("wandb_host")
    mode = config["wandb_mode"]
    if mode not in ("online", "offline", "disabled"):  # the settings' choices
        raise field_error(ConfigError, "--wandb-mode", mode, "is not a W&B mode",
                          "pass online, offline or disabled")
    run_id = _text(config.get("wandb_run_id"))
    with _redacted_argv():  # W&B records the command line; --wandb-key's value stays out
        return wandb.init(project=str(config["wandb_project"]),
                          entity=_text(config.get("wandb_team")), group=group, name=name,
                          id=run_id, resume="allow" if run_id else None,
                          mode=mode, dir=str(where), config=dict(config),
                          settings=wandb.Settings(base_url=str(host)) if host else None,
                          reinit=True)


def _text(value: object) -> str | None:
    """An optional setting's text (None stays None)."""
    return None if value is None else str(value)


@contextlib.contextmanager
def _redacted_argv() -> Iterator[None]:
    """``sys.argv`` without secret values (``slime_flags.redact``) while W&B reads it."""
    saved = sys.argv
    sys.argv = redact(saved)
    try:
        yield
    finally:
        sys.argv = saved


def wandb_names(group: object, disable_suffix: bool) -> tuple[str | None, str | None]:
    """slime's W&B group and run name: ``--wandb-group`` plus a random 6-character suffix
    (unless ``--disable-wandb-random-suffix``), the run named ``<group>-RANK_0`` (vime logs
    from rank 0). Without a group, W&B picks both."""
    if group is None:
        return None, None
    if disable_suffix:
        return str(group), str(group)
    group = f"{group}_{uuid.uuid4().hex[:6]}"
    return group, f"{group}-RANK_0"
