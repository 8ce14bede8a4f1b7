"""Routing ops that torch.compile can trace into: one computation as two torch.library ops of one schema.

  sonic::<name>         a custom op: opaque to torch.compile, cheap to dispatch in eager
  sonic::<name>_traced  a triton_op: torch.compile traces its body, so inductor launches the Triton kernels in it
                        (through sonic.kernels.triton.launch) from its own generated code, with no custom-op dispatch
                        around them and no pass through Triton's launcher

The routing kernels are small: at sonic_7b's shape a few microseconds of GPU time each, where a custom op's dispatch
and Triton's launcher cost the host tens of microseconds, so issuing a compiled MoE block took the host about as long
as the GPU took to run it (bench/results/2026-11-26-h200-block_ab-traced.json: the old custom ops against these,
compiled block, cute experts; equal checksums and shorter host times; the README's block_ab_traced table has the
GPU times). A GPU-bound step, such as the
40-layer trainer's, hides the host's time; a smaller model or a step that waits on the host does not. Eager calls
keep the custom op, whose dispatch is the cheaper of the two there. An implementation in torch ops stays opaque
under torch.compile as well (`traced=False`): inductor's partitioner would regroup it, and could keep what the op's
own backward recomputes (the router's centred input, T x D).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch


class DualOp:
    def __init__(self, name: str, fn: Callable, fake: Callable, traced_backward: bool = True):
        """fn: the implementation, type-annotated as a custom op's; fake: its shapes under fake tensors (the traced
        op's fake is fn itself, as for every triton_op). traced_backward: whether the traced op's backward is the
        traced backward op (else the custom one, opaque under torch.compile). It is in the traced op's name:
        torch.compile's caches know an op by its name, so an op whose autograd changes needs a new one."""
        self.traced_backward = traced_backward
        self.opaque = torch.library.custom_op(f"sonic::{name}", fn, mutates_args=())
        self.opaque.register_fake(fake)
        suffix = "_traced" if traced_backward else "_traced_forward"
        self.traced = torch.library.triton_op(f"sonic::{name}{suffix}", fn, mutates_args=())

    def __call__(self, *args, traced: bool = False):
        """The traced op where `traced` (fn launches its kernels through sonic.kernels.triton.launch) and
        torch.compile is tracing the call; the custom op otherwise."""
        return (self.traced if traced and torch.compiler.is_compiling() else self.opaque)(*args)

    def register_autograd(self, backward: Callable, setup_context: Callable, backward_op: DualOp) -> None:
        """backward(op, ctx, *grads), with op the matching one of backward_op's: the custom op's backward calls
        the custom backward op, the traced op's the traced one (the custom one where not traced_backward), so the
        backward follows the forward's choice."""
        traced_bwd = backward_op.traced if self.traced_backward else backward_op.opaque
        for op, bwd in ((self.opaque, backward_op.opaque), (self.traced, traced_bwd)):
            op.register_autograd(functools.partial(backward, bwd), setup_context=setup_context)
