"""Routing: router scores -> RoutingPlan (top-K, token rounding, expert choice) and losses."""
from sonic.routing.config import RoutingConfig
from sonic.routing.expert_choice import expert_capacity, expert_choice_plan
from sonic.routing.losses import switch_aux_loss, z_loss
from sonic.routing.backends import ROUTING_BACKENDS, routing_backend
from sonic.routing.plan import RoutingPlan, TopK, build_plan, plan_from_topk
from sonic.routing.router import Router, RouterOutput
from sonic.routing.token_choice import count_per_expert, select_topk
from sonic.routing.token_rounding import round_counts, token_rounding_plan

__all__ = ["ROUTING_BACKENDS", "RoutingConfig", "RoutingPlan", "TopK", "routing_backend", "build_plan",
           "plan_from_topk", "Router", "RouterOutput", "select_topk", "count_per_expert", "round_counts",
           "token_rounding_plan", "expert_capacity", "expert_choice_plan", "switch_aux_loss", "z_loss"]
