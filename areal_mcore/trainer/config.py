"""The trainers' configs: the RL loop's schedule (``trainer``) and the SFT warm-up (``sft``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_mcore.actor.config import LR_SCHEDULERS
from areal_mcore.checks import check_choice, check_positive, field_error
from areal_mcore.trainer.wandb_log import WandbConfig

TRAINER_MODES = ("sync", "async")
EXISTING_RUN = ("auto", "resume", "overwrite")  # trainer.existing_run


@dataclass(kw_only=True)
class TrainerConfig:
    """The RL loop's schedule."""

    total_steps: int
    batch_size: int  # prompts per step (each sampled rollout.n_samples times)
    save_freq: int = 0  # steps between checkpoints; 0: never
    eval_freq: int = 0  # steps between evaluations on eval_dataset (and before step 1); 0: never
    log_dir: str = "runs"  # the run writes under log_dir/experiment_name
    # What a run does with an earlier run in log_dir/experiment_name (RunDir.
    # earlier_run_refusal): auto resumes one with a checkpoint short of total_steps (a
    # stopped run rerun, a requeued job) and refuses a finished one or stats without a
    # checkpoint; resume goes on from a checkpoint if there is one, else starts afresh with
    # the earlier rows set aside; overwrite moves the earlier run's files to
    # <run>/before-<time>/ and starts afresh. CLI: --resume, --overwrite.
    existing_run: str = "auto"
    max_prompt_tokens: int = 1024  # longer prompts are dropped (and counted)
    # sync: every batch is sampled by the weights it trains; async: rollouts go on during
    # training, at most rollout.max_head_offpolicyness versions behind (pair it with
    # ppo.use_decoupled_loss).
    mode: str = "sync"
    export_freq: int = 0  # steps between HF exports to <run>/hf/step_N; the last step always
    tensorboard: bool = True  # scalars under <run>/tensorboard
    progress: bool = True  # tqdm bar over the steps
    dump_to_file: bool = False  # every rollout as JSONL under <run>/rollouts/
    trace: bool = False  # Chrome trace of the step phases: <run>/trace.json (chrome://tracing)
    # Weights & Biases beside TensorBoard (trainer/wandb_log.py); mode=disabled by default.
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # How long the other ranks wait for rank 0 (its servers' start-up, a whole rollout, an
    # eval) before they give up. These waits run on a gloo group with this timeout: an NCCL
    # collective's watchdog aborts after 10 min (torch's default), shorter than one boba
    # rollout of 8,192 samples up to 27,648 tokens.
    wait_timeout_s: float = 6 * 3600.0
    # The drift alarm (algo/drift.py): every step logs drift/* (the rollout engine's
    # logprobs against the recomputed proximal ones); a step whose mean |Δ logprob| over
    # the tokens the proximal weights' own version sampled exceeds this ends the run (the
    # last finished step checkpointed), naming the step and servers. null: by the dtypes
    # (DRIFT_GAP_BY_PRECISION, docs/training.md says why); drift_alarm=false: off.
    max_rollout_logprob_gap: float | None = None
    drift_alarm: bool = True

    def __post_init__(self):
        check_choice("mode", self.mode, TRAINER_MODES)
        check_choice("existing_run", self.existing_run, EXISTING_RUN)
        check_positive("export_freq", self.export_freq, allow_zero=True)
        check_positive("total_steps", self.total_steps)
        check_positive("batch_size", self.batch_size)
        check_positive("save_freq", self.save_freq, allow_zero=True)
        check_positive("eval_freq", self.eval_freq, allow_zero=True)
        check_positive("max_prompt_tokens", self.max_prompt_tokens)
        check_positive("wait_timeout_s", self.wait_timeout_s)
        if self.max_rollout_logprob_gap is not None:
            check_positive("max_rollout_logprob_gap", self.max_rollout_logprob_gap)


# The drift alarm's default threshold (mean |Δ logprob|, nats) when the actor, the
# servers and the weight sync are all float32, and otherwise. Measured with the same
# weights on both sides: fp32 3e-7 (vLLM, 60 steps) and under 1e-5 (embedded); bf16
# 4e-4 to 1.4e-3 on the tiny run's model, and 0.011-0.041 reported at 4B-671B scale
# (Megatron against vLLM/SGLang, rising to 0.036 over 30 steps on one SGLang run).
DRIFT_GAP_BY_PRECISION = {"float32": 1e-3, "reduced": 0.1}


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised warm-up (``areal-mcore sft``): base model -> HF folder at output_dir."""

    base_model: str  # HF folder to start from
    output_dir: str  # HF folder written at the end (the RL run's model_path)
    steps: int
    batch_size: int
    lr: float | None = None  # None: actor.optimizer.lr (a warm-up from scratch wants more than RL's)
    # None: actor.optimizer.lr_scheduler; the rest of the optimizer is always the actor's
    lr_scheduler: str | None = None
    response_template: str = "The answer is {solution}."

    def __post_init__(self):
        check_positive("steps", self.steps)
        check_positive("batch_size", self.batch_size)
        if self.lr is not None:
            check_positive("lr", self.lr)
        if self.lr_scheduler is not None:
            check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        if "{solution}" not in self.response_template:
            raise field_error("response_template", self.response_template, "must contain {solution}")
