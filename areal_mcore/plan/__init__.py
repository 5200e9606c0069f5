"""Memory planner: will a config fit in GPU memory, and if not, what would make it fit."""

from areal_mcore.plan.config import GPUS_GB, PlanConfig
from areal_mcore.plan.memory import RankPlan, ServerShape, TrainerShape, server_plan, trainer_plan
from areal_mcore.plan.planner import Plan, make_plan
from areal_mcore.plan.report import format_table, refusal, to_json

__all__ = ["GPUS_GB", "Plan", "PlanConfig", "RankPlan", "ServerShape", "TrainerShape", "format_table",
           "make_plan", "refusal", "server_plan", "to_json", "trainer_plan"]
