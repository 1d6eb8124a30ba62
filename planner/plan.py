"""The Plan's former import path, kept for code written against it: the plan now lives in the contract the planner
and the runtime share, ``megatrain.plan`` (module ``plan``), and is the same class imported from either path."""
from __future__ import annotations

from megatrain.plan.plan import PLAN_VERSION, Plan, PlanError, SpillBlocks, default_plan, host_device_choices
from megatrain.plan.workload_fingerprint import WorkloadFingerprint

__all__ = ["PLAN_VERSION", "Plan", "PlanError", "SpillBlocks", "WorkloadFingerprint", "default_plan",
           "host_device_choices"]
