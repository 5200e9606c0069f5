"""The boba PPO algorithm's config: reward shaping, normalisation, advantages, the loss."""

from __future__ import annotations

from dataclasses import dataclass

from areal_mcore.algo.kl import KL_ESTIMATORS
from areal_mcore.algo.normalize import LEVELS as NORM_LEVELS
from areal_mcore.algo.ppo_loss import BEHAV_WEIGHT_MODES, IS_LEVELS, LOSS_AGG_MODES
from areal_mcore.checks import (
    FieldError,
    check_choice,
    check_positive,
    check_unit_interval,
    field_error,
)
from areal_mcore.kernels import KERNEL_CHOICES as KERNELS


@dataclass(kw_only=True)
class NormConfig:
    """Mean/std normalisation of rewards or advantages (``algo.normalize``)."""

    mean_level: str = "batch"
    std_level: str = "batch"
    # Samples per prompt; 'group' levels normalise over contiguous runs of this size.
    # null: rollout.n_samples (ExperimentConfig fills it in and refuses a mismatch).
    group_size: int | None = None
    unbiased_std: bool = False
    eps: float = 1e-5

    def __post_init__(self):
        check_choice("mean_level", self.mean_level, NORM_LEVELS)
        check_choice("std_level", self.std_level, NORM_LEVELS)
        if self.group_size is not None:
            check_positive("group_size", self.group_size)
        check_positive("eps", self.eps, allow_zero=True)

    @property
    def uses_groups(self) -> bool:
        return "group" in (self.mean_level, self.std_level)


@dataclass(kw_only=True)
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment (``algo.overlong_penalty``): 0 up to
    ``max_new_tokens - buffer_len`` response tokens, then linear down to ``-penalty_factor``
    at ``max_new_tokens``; added to the raw reward before bias and scaling."""

    buffer_len: int
    penalty_factor: float = 1.0
    # null: rollout.max_new_tokens (ExperimentConfig fills it in and refuses a mismatch).
    max_new_tokens: int | None = None

    def __post_init__(self):
        check_positive("buffer_len", self.buffer_len)
        check_positive("penalty_factor", self.penalty_factor, allow_zero=True)
        if self.max_new_tokens is not None:
            check_positive("max_new_tokens", self.max_new_tokens)
            if self.buffer_len > self.max_new_tokens:
                raise field_error("buffer_len", self.buffer_len,
                                  f"must be <= max_new_tokens={self.max_new_tokens} (the penalty starts "
                                  "buffer_len tokens before the length limit)")


PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics", "reuse_train_logp")
KL_IN = ("loss", "reward")


@dataclass(kw_only=True)
class PPOConfig:
    """The boba PPO algorithm: reward shaping, advantages and the clipped actor loss."""

    ppo_n_minibatches: int = 1
    eps_clip: float = 0.2
    # Asymmetric upper clip (DAPO "clip-higher"); None means eps_clip.
    eps_clip_high: float | None = None
    # Dual clip for negative advantages (Ye et al. 2020); None disables; must be > 1.
    c_clip: float | None = None
    use_decoupled_loss: bool = False
    # Tokens whose behaviour weight exp(prox - behave) exceeds this (or is not finite)
    # are dropped from the loss and counted (train/behav_dropped_ratio).
    behav_imp_weight_cap: float | None = None
    # recompute: a forward pass before training; loglinear: AReaL's interpolation between
    # the behaviour and current logprobs (needs use_decoupled_loss: it *is* the proximal
    # of the decoupled loss, and without it nothing corrects for the behaviour policy);
    # metrics: recompute, and log how far loglinear would be from it (train/loglinear_gap_*);
    # reuse_train_logp: the training forward's own detached logprobs (no extra forward; the
    # behaviour weight then corrects all the staleness). The last three need the decoupled loss.
    prox_logp_method: str = "recompute"
    # The loss menu (docs/algorithm.md#loss-options; formulas: algo.ppo_actor_loss). Each
    # default is boba's loss. token-mean | seq-mean-token-mean | seq-mean-token-sum |
    # seq-mean-token-sum-norm (Dr.GRPO: per-sequence token sums / loss_norm_tokens).
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm's constant; null: rollout.max_new_tokens (ExperimentConfig).
    loss_norm_tokens: int | None = None
    # token, or sequence (GSPO: one length-normalised ratio per sequence, clipped as one).
    importance_sampling_level: str = "token"
    # The behaviour weight per token, or one per sequence (product over its loss tokens).
    behav_imp_weight_level: str = "token"
    # Above behav_imp_weight_cap: mask (MIS: drop) or truncate (TIS: min(weight, cap)).
    behav_imp_weight_mode: str = "mask"
    discount: float = 1.0
    gae_lambda: float = 1.0
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    reward_norm: NormConfig | None = None
    adv_norm: NormConfig | None = None
    # GAE (kernels/gae.py): "auto" is Triton on GPU with triton installed, torch otherwise.
    gae_kernel: str = "auto"
    # DAPO (arXiv 2503.14476): soft overlong punishment added to the raw reward (null: off),
    # and overlong filtering: samples the server cut at the length limit (finish_reason
    # length) leave the loss and its token count.
    overlong_penalty: OverlongPenaltyConfig | None = None
    mask_truncated_samples: bool = False
    # Entropy bonus: loss -= entropy_coef * agg(H) with θ's entropy from the fused logprob
    # kernel, aggregated as loss_agg_mode (docs/algorithm.md#regularisers). 0: off.
    entropy_coef: float = 0.0
    # KL to a frozen reference model (0: off, nothing loaded): its weights from
    # ref_model_path (null: model_path, the initial policy), sharded like the actor.
    kl_coef: float = 0.0
    ref_model_path: str | None = None
    # k1 | k2 | k3 (algo/kl.py; k3 is GRPO's): the per-token estimate of KL(π‖π_ref).
    kl_estimator: str = "k3"
    # loss: + kl_coef * agg(k(θ, ref)) with gradient (GRPO); reward: - kl_coef * k(prox, ref)
    # on each response token's reward before GAE, no gradient (InstructGPT, verl's
    # use_kl_in_reward); reward needs the recomputed proximal logprobs.
    kl_in: str = "loss"

    def __post_init__(self):
        check_positive("ppo_n_minibatches", self.ppo_n_minibatches)
        check_positive("eps_clip", self.eps_clip)
        if self.eps_clip_high is not None:
            check_positive("eps_clip_high", self.eps_clip_high)
        if self.c_clip is not None and self.c_clip <= 1.0:
            raise field_error("c_clip", self.c_clip, "must be > 1 (or null to disable)")
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1.0:
            raise field_error("behav_imp_weight_cap", self.behav_imp_weight_cap, "must be > 1 (or null)")
        check_choice("prox_logp_method", self.prox_logp_method, PROX_LOGP_METHODS)
        if self.prox_logp_method == "loglinear" and not self.use_decoupled_loss:
            raise FieldError(
                "prox_logp_method", "='loglinear' needs use_decoupled_loss=true: the interpolated "
                "proximal policy stands in for the recomputed one of the decoupled loss; without "
                "the behaviour weight the loss trains against an interpolation with no correction "
                "for the policy that sampled the tokens (use prox_logp_method=recompute)"
            )
        if self.prox_logp_method == "metrics" and not self.use_decoupled_loss:
            raise FieldError(
                "prox_logp_method", "='metrics' needs use_decoupled_loss=true: it measures the "
                "log-linear proximal of the decoupled loss, which does not exist without it "
                "(use prox_logp_method=recompute)")
        if self.prox_logp_method == "reuse_train_logp" and not self.use_decoupled_loss:
            raise FieldError(
                "prox_logp_method", "='reuse_train_logp' needs use_decoupled_loss=true: the proximal "
                "policy becomes θ itself (ratio 1), so only the behaviour weight corrects for the "
                "policy that sampled the tokens (use prox_logp_method=recompute)")
        self._check_loss_options()
        if self.adv_norm is not None and self.adv_norm.uses_groups:
            key = "mean_level" if self.adv_norm.mean_level == "group" else "std_level"
            raise FieldError(
                f"adv_norm.{key}", "='group' is not supported: advantages are per token; normalise "
                "rewards per group with reward_norm and advantages with 'batch' or 'none'"
            )
        check_choice("gae_kernel", self.gae_kernel, KERNELS)
        for key in ("discount", "gae_lambda"):
            check_unit_interval(key, getattr(self, key))
        check_positive("reward_clip", self.reward_clip)
        self._check_regularisers()

    def _check_loss_options(self) -> None:
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
        check_choice("behav_imp_weight_level", self.behav_imp_weight_level, IS_LEVELS)
        check_choice("behav_imp_weight_mode", self.behav_imp_weight_mode, BEHAV_WEIGHT_MODES)
        if self.loss_norm_tokens is not None:
            check_positive("loss_norm_tokens", self.loss_norm_tokens)
            if self.loss_agg_mode != "seq-mean-token-sum-norm":
                raise field_error("loss_norm_tokens", self.loss_norm_tokens, "is used only by "
                                  "loss_agg_mode=seq-mean-token-sum-norm (Dr.GRPO's constant); set that "
                                  f"mode or loss_norm_tokens=null (loss_agg_mode is {self.loss_agg_mode!r})")
        # The behaviour weight exists only in the decoupled loss: an option shaping it
        # would silently do nothing without it.
        for key, default in (("behav_imp_weight_level", "token"), ("behav_imp_weight_mode", "mask")):
            value = getattr(self, key)
            if value != default and not self.use_decoupled_loss:
                raise field_error(key, value, "needs use_decoupled_loss=true: without it there is no "
                                  "behaviour weight exp(prox - behave) to shape")
        if self.behav_imp_weight_mode == "truncate" and self.behav_imp_weight_cap is None:
            raise field_error("behav_imp_weight_mode", "truncate", "needs behav_imp_weight_cap: TIS "
                              "truncates the weight at that cap (min(weight, cap))")
        if self.behav_imp_weight_level == "sequence" and self.behav_imp_weight_cap is None:
            # A product of thousands of token weights is unbounded: exp(±100s) is common.
            raise field_error("behav_imp_weight_level", "sequence", "needs behav_imp_weight_cap: a "
                              "sequence's weight is the product of its tokens' weights and without a "
                              "cap (mask or truncate) one sequence can dominate the batch")

    def _check_regularisers(self) -> None:
        check_positive("entropy_coef", self.entropy_coef, allow_zero=True)
        check_positive("kl_coef", self.kl_coef, allow_zero=True)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("kl_in", self.kl_in, KL_IN)
        if self.ref_model_path is not None and not self.kl_coef:
            raise field_error("ref_model_path", self.ref_model_path, "is loaded only with kl_coef > 0; "
                              "set kl_coef or ref_model_path=null")
        if self.kl_coef and self.kl_in == "reward" and not self.recomputes_prox:
            raise field_error("kl_in", "reward", "needs prox_logp_method recompute or metrics (it is "
                              f"{self.prox_logp_method!r}): the reward penalty is the KL of the recomputed "
                              "proximal policy, known before the advantages; or use kl_in=loss")

    @property
    def recomputes_prox(self) -> bool:
        """Whether the method runs the proximal forward pass before the update (recompute,
        metrics): what the drift alarm and the reward-side KL need."""
        return self.prox_logp_method in ("recompute", "metrics")

    @property
    def uses_reference(self) -> bool:
        """Whether a reference model is loaded (``kl_coef`` > 0)."""
        return self.kl_coef > 0
