"""The objective (section ``loss``): denominators, PPO clips, KL, entropy, TIS and rejection.
The ranges live in the core's records (``LossConfig``, ``RejectionConfig`` in
``vime_pure.policy_config``); this record spells them as slime's flags.

Example: ``LossArgs(eps_clip=0)`` raises ``--eps-clip=0: must lie in (0, 1]. Fix: use e.g.
0.2 (1: no lower clip).`` (the core's ``LOSS_BOUNDS``, the one home of that bound).
"""

import math

import attrs

from vime_pure.denominators import LOSS_MODES, REJECTION_DENOMINATORS
from vime_pure.distillation import STUDENT_SCORED, TOP_K_STRATEGIES, WEIGHT_MODES
from vime_pure.errors import LossConfigError, field_error
from vime_pure.policy_config import (KL_KINDS, LOSS_TYPES, RS_LEVELS, TIS_FUNCTIONS,
                                     TIS_MODES, LossConfig, MisConfig, RejectionConfig)
from vime_shell.rollout.teacher import TeacherError, teacher_urls
from vime_shell.settings.common import (ConfigError, Record, flag, in_range, setting,
                                        setting_list)

SECTION = "loss"
DEFAULT_LOSS_MODE = "group_token_mean"
# LossConfig's field -> the flag a user writes (the error names the flag).
LOSS_FLAGS = {"eps_clip": "--eps-clip", "eps_clip_high": "--eps-clip-high",
              "dual_clip": "--eps-clip-c", "kl_coef": "--kl-loss-coef",
              "kl_kind": "--kl-loss-type", "entropy_coef": "--entropy-coef",
              "use_tis": "--use-tis", "tis_clip": "--tis-clip", "tis_clip_low": "--tis-clip-low",
              "surrogate": "--advantage-estimator", "reward_kl_coef": "--kl-coef",
              "loss_type": "--loss-type", "opd_kl_coef": "--opd-kl-coef",
              "tis_function": "--tis-function"}
# the policy flags supervised fine-tuning has no use for (it has no ratio, reference or
# advantages): set beside --loss-type sft_loss they are an error, not ignored
_POLICY_ONLY = ("use_tis", "use_rs", "use_kl_loss", "use_opd")
OPD_TYPES = ("megatron", "sglang")  # a frozen teacher in the trainer; a teacher server
_RS_FIELDS = ("rs_level", "rs_lower_bound", "rs_upper_bound", "rs_denominator",
              "rs_veto_threshold")
# slime's mis.py keys (its mis.yaml, --custom-config-path): they act with --tis-function mis
_MIS_FIELDS = ("tis_level", "tis_mode", "tis_lower_bound", "tis_upper_bound",
               "tis_batch_normalize")
MIS_FLAG = "--tis-function mis"
# MisConfig's and RejectionConfig's fields -> the flag a user writes (the error names the flag)
MIS_FLAGS = {"level": "--tis-level", "mode": "--tis-mode", "lower": "--tis-lower-bound",
             "upper": "--tis-upper-bound", "batch_normalize": "--tis-batch-normalize"}
RS_FLAGS = {"level": "--rs-level", "lower": "--rs-lower-bound", "upper": "--rs-upper-bound",
            "denominator": "--rs-denominator", "veto": "--rs-veto-threshold"}


def flag_error(exc: LossConfigError, flags: dict[str, str]) -> ConfigError:
    """A core record's ``field=value: ...`` error as the flag's (``flags``: field -> flag)."""
    field, _, rest = str(exc).partition("=")
    return ConfigError(f"{flags[field]}={rest}")


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class LossArgs(Record):
    """The flags of the core's ``LossConfig`` and ``RejectionConfig``."""

    loss_type: str = _f("policy_loss", "the objective: policy_loss (the policy gradient of "
                        "--advantage-estimator) or sft_loss (supervised fine-tuning: each "
                        "loss-masked token's negative log-likelihood, e.g. with the rollout "
                        "function vime_shell.rollout.sft:sft_rollout; slime's custom_loss: "
                        "not supported)", LOSS_TYPES)
    disable_compute_advantages_and_returns: bool = _f(
        False, "slime's flag for SFT: no advantages are used (with --loss-type sft_loss only; "
        "vime computes them anyway, from the zero rewards, and the SFT loss never reads them)")
    use_opd: bool = _f(False, "on-policy distillation: each token's advantage minus "
                       "--opd-kl-coef x (student log-prob - teacher log-prob), on top of any "
                       "--advantage-estimator (slime's); needs --opd-type")
    opd_type: str | None = _f(None, "where the teacher's log-probs come from: megatron (a "
                              "frozen teacher in the trainer, from --opd-teacher-load) or "
                              "sglang (a teacher server's /generate, at --rm-url or "
                              "--opd-teacher-urls, asked after each rollout)", OPD_TYPES)
    opd_kl_coef: float = _f(1.0, "weight of the teacher's reverse KL in the advantages")
    opd_teacher_load: str | None = _f(None, "the teacher: an HF directory of the trained "
                                      "model's architecture (slime: a Megatron checkpoint)")
    opd_teacher_urls: tuple[str, ...] | None = setting_list(
        "NAME=URL [NAME=URL ...] teacher servers (--opd-type sglang, miles'): a sample goes "
        "to the one its metadata's --opd-teacher-key names, else to 'default'", SECTION)
    opd_teacher_key: str = _f("opd_teacher", "the prompt rows' metadata entry naming their "
                              "teacher in --opd-teacher-urls")
    opd_log_prob_top_k: int = _f(0, "top-k distillation (--opd-type sglang, miles'): the "
                                 "engine reports each token's K most likely tokens, the "
                                 "teacher scores them, and each token's advantage loses "
                                 "--opd-kl-coef x the reverse-KL estimate over them "
                                 "(vime_pure.distillation); 0: the sampled token's. As in "
                                 "miles the estimate does not depend on the sampled token, so "
                                 "its expected gradient is 0 (docs/train.md)")
    opd_top_k_strategy: str = _f("only-student", "the tokens of top-k distillation: the "
                                 "student's top-k, or those also in the teacher's "
                                 "(intersection); miles' only-teacher, union and xor need the "
                                 "student's server to score the teacher's tokens, which vime's "
                                 "engines do not offer (an error)", TOP_K_STRATEGIES)
    opd_reward_weight_mode: str = _f("student_p", "the weights of top-k distillation: the "
                                     "softmax over the tokens of the student's log-probs, the "
                                     "teacher's, or uniform (none)", WEIGHT_MODES)
    opd_topk_per_position: bool = _f(False, "ask the teacher about each position's own "
                                     "top-k ids (token_ids_logprob_positions, a patched SGLang) "
                                     "instead of the union of all of them")
    enable_mtp_training: bool = _f(False, "train the checkpoint's multi-token prediction "
                                   "layers (--mtp-num-layers) beside the policy, on each "
                                   "trained token's cross entropy weighted as the policy "
                                   "weighs it; their inputs are detached, so the policy's "
                                   "gradient is unchanged (slime's); DeepSeek-V3's MTP layers "
                                   "(DeepSeek-V3, Kimi-K2, GLM-4.7-Flash, GLM-4.5 MoE) and "
                                   "MiMo's")
    mtp_loss_scaling_factor: float = _f(0.2, "weight of the MTP loss (over the MTP layers' "
                                        "mean; slime's default)")
    loss_mode: str | None = _f(None, f"loss denominators; default {DEFAULT_LOSS_MODE} "
                               "(token_mean under --calculate-per-token-loss)", LOSS_MODES)
    calculate_per_token_loss: bool = _f(False, "slime's name for --loss-mode token_mean")
    eps_clip: float = _f(0.2, "PPO ratio clip")
    eps_clip_high: float | None = _f(None, "upper ratio clip (DAPO clip-higher); default "
                                     "--eps-clip")
    eps_clip_c: float | None = _f(None, "dual-clip bound c > 1: a negative-advantage token's "
                                  "loss is capped at -A * c")
    kl_coef: float = _f(0.0, "slime's reward-shaping KL: with reinforce_plus_plus_baseline "
                        "each token's advantage minus kl_coef * KL(pi_old || reference) "
                        "(--kl-loss-type's estimator, reference --ref-load or "
                        "--hf-checkpoint); no effect with grpo/gspo, as in slime")
    use_kl_loss: bool = _f(False, "add a KL penalty against a frozen reference model")
    kl_loss_coef: float = _f(0.0, "weight of the KL penalty")
    kl_loss_type: str = _f("low_var_kl", "KL estimator", KL_KINDS)
    ref_load: str | None = _f(None, "HF dir of the initial weights and the KL reference "
                              "(slime: where training starts); default --hf-checkpoint")
    entropy_coef: float = _f(0.0, "entropy bonus weight")
    use_tis: bool = _f(False, "truncated importance sampling (decoupled PPO): weight the "
                       "surrogate by clamp(pi_old / pi_behaviour, --tis-clip-low, --tis-clip)")
    tis_clip: float = _f(2.0, "TIS weight cap")
    tis_clip_low: float = _f(0.0, "TIS weight floor")
    tis_function: str = _f("vanilla", "the --use-tis weight: vanilla (clamp into [--tis-clip-low, "
                           "--tis-clip]), icepop (the ratio inside that band, else 0) or mis "
                           "(slime's mis.py: --tis-level, --tis-mode, its bounds, batch "
                           "normalization per optimizer step); slime's --custom-tis-function-path "
                           "names them by the anchors' paths", TIS_FUNCTIONS)
    get_mismatch_metrics: bool = _f(False, "log mis.py's mismatch metrics (mis_*) with "
                                    "--tis-function mis, without --use-tis's weights "
                                    "(slime's)")
    tis_level: str = _f("token", "mis: the ratio weighed, per token, per sample (sequence) or "
                        "its geometric mean", RS_LEVELS)
    tis_mode: str = _f("truncate", "mis: bound the weight at --tis-upper-bound (truncate), "
                       "into the bounds (clip), or drop tokens outside them (mask)", TIS_MODES)
    tis_lower_bound: float | None = _f(None, "mis: the weight's floor; default 1 / "
                                       "--tis-upper-bound")
    tis_upper_bound: float = _f(2.0, "mis: the weight's cap")
    tis_batch_normalize: bool = _f(False, "mis: divide each optimizer step's weights by their "
                                   "mean (slime: each micro-batch's, on each rank)")
    use_rs: bool = _f(False, "reject tokens (or samples, --rs-level) whose pi_old / "
                      "pi_behaviour leaves [--rs-lower-bound, --rs-upper-bound] (MIS / IcePop; "
                      "the keys of slime's mis.py as flags)")
    rs_level: str = _f("token", "what --use-rs tests: each token, the sample's ratio "
                       "product (sequence) or its geometric mean", RS_LEVELS)
    rs_lower_bound: float | None = _f(None, "--use-rs band floor; default --tis-clip-low")
    rs_upper_bound: float | None = _f(None, "--use-rs band cap; default --tis-clip")
    rs_denominator: str = _f("original", "denominator after --use-rs: the masks before "
                             "rejection (slime) or the surviving tokens", REJECTION_DENOMINATORS)
    rs_veto_threshold: float | None = _f(None, "--use-rs: drop a whole sample when any "
                                         "loss-masked token's ratio is below it (mis.py's "
                                         "veto, e.g. 1e-4)")
    logprob_gap_tolerance: float | None = _f(None, "max mean engine-trainer log-prob gap "
                                             "after a sync; default: by --rollout-dtype (fp32 "
                                             "1e-4)")
    logprob_check: bool = _f(True, "--no-logprob-check: run with a rollout function that "
                             "returns no engine log-probs; the weight-sync check is then off "
                             "(metrics: logprob_check 0)")

    @property
    def effective_loss_mode(self) -> str:
        """``--loss-mode``, or ``token_mean`` under ``--calculate-per-token-loss``."""
        if self.loss_mode is not None:
            return self.loss_mode
        return "token_mean" if self.calculate_per_token_loss else DEFAULT_LOSS_MODE

    def loss_config_for(self, *, surrogate: str, reward_kl: bool = False) -> LossConfig:
        """The objective's knobs, validated once by their record (``LossConfig``); its error is
        re-raised naming the flag. ``surrogate`` and ``reward_kl`` (whether ``--kl-coef``
        shapes the advantages) come from the reward record's estimator."""
        try:
            return LossConfig(eps_clip=self.eps_clip, eps_clip_high=self.eps_clip_high,
                              dual_clip=self.eps_clip_c,
                              kl_coef=self.kl_loss_coef if self.use_kl_loss else 0.0,
                              kl_kind=self.kl_loss_type, entropy_coef=self.entropy_coef,
                              use_tis=self.use_tis, tis_clip=self.tis_clip,
                              tis_clip_low=self.tis_clip_low, surrogate=surrogate,
                              loss_type=self.loss_type,
                              opd_kl_coef=self.opd_kl_coef if self.use_opd else 0.0,
                              tis_function=self.tis_function,
                              reward_kl_coef=self.kl_coef if reward_kl else 0.0)
        except LossConfigError as exc:
            raise flag_error(exc, LOSS_FLAGS) from None

    @property
    def opd_server(self) -> bool:
        """On-policy distillation from a teacher server (``--use-opd --opd-type sglang``)."""
        return self.use_opd and self.opd_type == "sglang"

    def _check_opd(self) -> None:
        """slime's and miles' rules: --use-opd needs its type and its teacher (a directory for
        megatron, a server for sglang); a teacher without --use-opd is an error, not
        ignored."""
        if self.use_opd and self.opd_type is None:
            raise field_error(ConfigError, "--opd-type", None, "is required with --use-opd",
                              "pass --opd-type megatron (with --opd-teacher-load) or sglang")
        server = self.opd_server
        if self.use_opd and not server and self.opd_teacher_load is None:
            raise field_error(ConfigError, "--opd-teacher-load", None,
                              "is required with --opd-type megatron",
                              "pass the teacher's HF directory")
        if server and self.opd_teacher_load is not None:
            raise field_error(ConfigError, "--opd-teacher-load", self.opd_teacher_load,
                              "is set with --opd-type sglang, whose teacher is a server",
                              "drop it, or pass --opd-type megatron")
        for name, value in (("--opd-teacher-load", self.opd_teacher_load),
                            ("--opd-teacher-urls", self.opd_teacher_urls)):
            if value is not None and not self.use_opd:
                raise field_error(ConfigError, name, value if isinstance(value, str)
                                  else list(value), "is set but --use-opd is not",
                                  "add --use-opd, or drop it")
        if self.opd_teacher_urls is not None and self.opd_type != "sglang":
            raise field_error(ConfigError, "--opd-teacher-urls", list(self.opd_teacher_urls),
                              f"names teacher servers, but --opd-type is {self.opd_type}",
                              "pass --opd-type sglang")
        try:
            teacher_urls(self.opd_teacher_urls)
        except TeacherError as exc:
            raise ConfigError(str(exc)) from None
        self._check_top_k()

    def _check_top_k(self) -> None:
        """miles' rules for --opd-log-prob-top-k: >= 0, a teacher server's, and (vime's) a
        strategy whose student log-probs the engine reports (``vime_pure.distillation``)."""
        k = self.opd_log_prob_top_k
        if k < 0:
            raise field_error(ConfigError, "--opd-log-prob-top-k", k, "must be >= 0",
                              "use 0 to distil on the sampled token")
        if k and not self.opd_server:
            raise field_error(ConfigError, "--opd-log-prob-top-k", k,
                              "needs --use-opd --opd-type sglang (the teacher server scores "
                              "the tokens)", "add them, or drop --opd-log-prob-top-k")
        if k and self.opd_top_k_strategy not in STUDENT_SCORED:
            raise field_error(ConfigError, "--opd-top-k-strategy", self.opd_top_k_strategy,
                              "needs the student's server to score the teacher's top-k "
                              "tokens (SGLang's token_ids_logprob), which vime's engines do "
                              "not offer", f"use one of {list(STUDENT_SCORED)}")

    @property
    def opd_engine_top_k(self) -> int:
        """How many top log-probs the engine reports per generated token (top-k
        distillation's student side; 0 otherwise)."""
        return self.opd_log_prob_top_k if self.opd_server else 0

    def rejection_config(self) -> RejectionConfig | None:
        """The ``--use-rs`` settings as the core's record (None without ``--use-rs``); unset
        bounds default to the TIS clamp, as in slime's mis.py. Example: ``--use-tis
        --tis-clip 5 --tis-clip-low 0.5 --use-rs`` rejects tokens outside [0.5, 5] (IcePop)."""
        if not self.use_rs:
            return None
        return RejectionConfig(level=self.rs_level, lower=self._rs_band()[0],
                               upper=self._rs_band()[1], denominator=self.rs_denominator,
                               veto=self.rs_veto_threshold)

    def mis_config(self) -> MisConfig | None:
        """slime's mis.py weights as the core's record (None unless ``--tis-function mis``
        with ``--use-tis``, or with ``--get-mismatch-metrics`` for the metrics alone); its
        error is re-raised naming the key. Example: mis.yaml gives
        ``MisConfig(level="token", mode="truncate", lower=0.5, upper=2.0,
        batch_normalize=True)``."""
        if not (self.tis_function == "mis" and (self.use_tis or self.get_mismatch_metrics)):
            return None
        try:
            return MisConfig(level=self.tis_level, mode=self.tis_mode, lower=self._tis_band()[0],
                             upper=self.tis_upper_bound, batch_normalize=self.tis_batch_normalize)
        except LossConfigError as exc:
            raise flag_error(exc, MIS_FLAGS) from None

    def _tis_band(self) -> tuple[float, float]:
        """mis.py's weight bounds: the lower one defaults to 1 / upper."""
        upper = self.tis_upper_bound
        lower = self.tis_lower_bound
        return (1.0 / upper if upper > 0 else 0.0) if lower is None else lower, upper

    def _rs_band(self) -> tuple[float, float]:
        """The --use-rs band's defaults: the TIS bounds (mis.py's under --tis-function mis)."""
        low, high = (self._tis_band() if self.tis_function == "mis"
                     else (self.tis_clip_low, self.tis_clip))
        lower = low if self.rs_lower_bound is None else self.rs_lower_bound
        upper = high if self.rs_upper_bound is None else self.rs_upper_bound
        return lower, upper

    def _check(self) -> None:
        self.loss_config_for(surrogate="ppo", reward_kl=True)  # --kl-coef's range too
        self._check_opd()
        in_range("--mtp-loss-scaling-factor", self.mtp_loss_scaling_factor, 0.0, math.inf,
                 "use e.g. 0.2 (slime's default)")
        if self.loss_type == "sft_loss":
            for name in _POLICY_ONLY:
                if getattr(self, name):
                    flag = "--" + name.replace("_", "-")
                    raise field_error(ConfigError, flag, True, "acts on the policy loss, and "
                                      "--loss-type sft_loss trains no policy loss",
                                      f"drop {flag}, or train --loss-type policy_loss")
        elif self.disable_compute_advantages_and_returns:
            raise field_error(ConfigError, "--disable-compute-advantages-and-returns", True,
                              "leaves the policy loss (--loss-type policy_loss) no "
                              "advantages to train on",
                              "drop it, or pass --loss-type sft_loss")
        for name in ("rs_lower_bound", "rs_upper_bound"):
            in_range(name, getattr(self, name), 0.0, 1e6, "use e.g. 0.5 / 2.0")
        in_range("logprob_gap_tolerance", self.logprob_gap_tolerance, 0.0, 1e9,
                 "use 1e-4 (fp32), or omit it for the rollout dtype's default")
        if self.calculate_per_token_loss and self.loss_mode not in (None, "token_mean"):
            raise ConfigError(
                f"--calculate-per-token-loss contradicts --loss-mode {self.loss_mode}: slime's "
                "--calculate-per-token-loss means --loss-mode token_mean. Fix: drop one of "
                "the two flags.")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            raise field_error(ConfigError, "kl_loss_coef", self.kl_loss_coef,
                              "has no effect without --use-kl-loss",
                              "pass --use-kl-loss, or --kl-loss-coef 0")
        self._check_rejection()
        self._check_mis()

    def _check_mis(self) -> None:
        """The mis.py keys act with --use-tis --tis-function mis only; set otherwise they are
        an error, not ignored."""
        in_range("tis_lower_bound", self.tis_lower_bound, 0.0, 1e6, "use e.g. 0.5")
        in_range("tis_upper_bound", self.tis_upper_bound, 0.0, 1e6, "use e.g. 2.0")
        in_range("rs_veto_threshold", self.rs_veto_threshold, 0.0, 1.0, "use e.g. 1e-4")
        if self.get_mismatch_metrics and self.tis_function != "mis":
            raise field_error(ConfigError, "--get-mismatch-metrics", True,
                              "computes mis.py's metrics, which --tis-function "
                              f"{self.tis_function} has not", f"pass {MIS_FLAG} (slime: "
                              "--custom-tis-function-path to mis.py)")
        if self.mis_config() is not None:  # its record checks the mis.py keys
            return
        if self.tis_function != "vanilla" and not self.use_tis:
            raise field_error(ConfigError, "--tis-function", self.tis_function,
                              "weighs the surrogate only under --use-tis (as slime's TIS "
                              "function)", "pass --use-tis, or drop it")
        defaults = attrs.fields_dict(LossArgs)
        changed = [k for k in _MIS_FIELDS if getattr(self, k) != defaults[k].default]
        if changed:
            raise field_error(ConfigError, flag(changed[0]), getattr(self, changed[0]),
                              f"has no effect without --use-tis {MIS_FLAG}",
                              f"pass --use-tis {MIS_FLAG}, or drop it")

    def _check_rejection(self) -> None:
        if not self.use_rs:
            defaults = attrs.fields_dict(LossArgs)
            changed = [k for k in _RS_FIELDS if getattr(self, k) != defaults[k].default]
            if changed:
                raise field_error(ConfigError, changed[0], getattr(self, changed[0]),
                                  "has no effect without --use-rs", "pass --use-rs, or drop it")
            return
        lower, upper = self._rs_band()
        if lower > upper:
            raise field_error(ConfigError, "rs_lower_bound", lower,
                              f"exceeds the band's cap {upper} (--rs-upper-bound, default "
                              "--tis-clip)", "pass a lower bound below the upper one")
        try:
            self.rejection_config()
        except LossConfigError as exc:
            raise flag_error(exc, RS_FLAGS) from None
