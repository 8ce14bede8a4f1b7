"""Routing: router scores -> RoutingPlan (top-K, token rounding, expert choice) and losses."""
from sonic.routing.config import RoutingConfig
from sonic.routing.plan import RoutingPlan, build_plan, plan_from_topk
from sonic.routing.router import Router, RouterOutput

__all__ = ["RoutingConfig", "RoutingPlan", "build_plan", "plan_from_topk", "Router", "RouterOutput"]
