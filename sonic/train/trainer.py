"""The training loop, readable top to bottom: set-up, then one optimizer step at a time."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from sonic import compat
from sonic.data import build_loaders, build_tokenizer
from sonic.device import to_device
from sonic.kernels import resolve_backend
from sonic.models import Transformer, param_counts, training_flops
from sonic.models.hf import check_init_config
from sonic.models.loading import complete_checkpoints, load_model
from sonic.parallel import (PreemptionGuard, all_reduce_, build_model, init_distributed, load_full_state_dict,
                            memory_after_init, set_gradient_sync, weights_dtype)
from sonic.train.checkpoint import Checkpointer, check_run_dir
from sonic.train.config import Config, check_resume_config, to_yaml
from sonic.train.guard import NonFiniteGuard
from sonic.train.loggers import MetricLogger
from sonic.train.metrics import expert_load, peak_flops, speed_metrics
from sonic.train.optim import apply_config, build_optimizer, clip_grad_norm, norm_function, set_lr

log = logging.getLogger("sonic")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_precision(cfg: Config, device: torch.device) -> str:
    """train.precision, with auto resolved: bf16 on a GPU, fp32 elsewhere."""
    precision = cfg.train.precision
    return ("bf16" if device.type == "cuda" else "fp32") if precision == "auto" else precision


def autocast_context(cfg: Config, device: torch.device):
    if step_precision(cfg, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@torch.no_grad()
def evaluate(model, val_loader, cfg: Config, device: torch.device) -> float:
    model.eval()  # routing falls back to plain top-K in eval mode
    total = torch.zeros(2, device=device)  # summed loss, target count (a batch may have no targets)
    for i, batch in enumerate(val_loader):
        if i == cfg.train.eval_batches:
            break
        input_ids, doc_ids, labels = model_inputs(batch, cfg, device)
        with autocast_context(cfg, device):
            out = model(input_ids, doc_ids, labels)
        count = (labels != -100).sum().float()
        total += torch.stack([out.loss.float() * count, count])
    model.train()
    all_reduce_(total)
    return (total[0] / total[1].clamp_min(1)).item()


def model_inputs(batch: dict, cfg: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                         torch.Tensor]:
    """(input_ids, doc_ids or None, labels) of a host batch, on `device`, copied without waiting for the GPU
    (`sonic.device.to_device`): each step would otherwise start with the GPU drained and idle while the host
    launches its first kernels."""
    keys = ("input_ids", "doc_ids", "labels") if cfg.train.document_masking else ("input_ids", "labels")
    moved = {k: to_device(batch[k], device) for k in keys}
    return moved["input_ids"], moved.get("doc_ids"), moved["labels"]


@torch.no_grad()
def finite_loss(model, batch, cfg: Config, device: torch.device) -> bool:
    """Whether the model's loss on `batch` is finite on every rank: the weights about to be saved
    are checked with one forward (eval mode, the RNG untouched), so a checkpoint never holds weights
    that a finite step overflowed."""
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast_context(cfg, device):
            out = model(*model_inputs(batch, cfg, device))
    finally:
        model.train()
    return not all_reduce_((~torch.isfinite(out.loss.detach().float())).float().reshape(1)).item()


def drop_metrics_after(path: Path, step: int) -> int:
    """Remove the rows of metrics.jsonl past `step` (a resumed run logs them again); returns how many.
    A row cut short by a kill is dropped too. Rewritten to a temporary file, then renamed."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)

    def kept(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= step and line.endswith("\n")
        except (ValueError, KeyError, TypeError):
            return False

    keep = [line for line in lines if kept(line)]
    if len(keep) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return len(lines) - len(keep)


def suggested_lr(lr: float, weight_rms: float) -> float:
    """A lower optim.lr to recover a diverged run with: a tenth of the smaller of the LR and the
    weights' RMS (AdamW moves each weight by about lr per step), one significant digit, rounded down."""
    x = min(lr, weight_rms) / 10
    unit = 10 ** math.floor(math.log10(x))
    return math.floor(x / unit) * unit


def train(cfg: Config, lm_eval: Callable | None = None) -> list[dict]:
    """Train per `cfg`; return the metrics logged on this rank (one dict per logged step).

    lm_eval(model, tokenizer, tasks, limit, precision) -> {name: value} runs the periodic
    lm-eval tasks; train.py passes eval.run_lm_eval (entry points sit above sonic/).
    """
    t = cfg.train
    compat.check_torch()
    info = init_distributed(cfg.parallel, t.device)
    device = info.device
    run_dir = Path(t.run_dir)
    check_run_dir(run_dir)  # a clear error now rather than at the first save
    seed_everything(t.seed + info.rank)  # per-rank streams (e.g. stochastic rounding)

    # --- model, optimizer, data -------------------------------------------------------
    tokenizer = build_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}; raise model.vocab_size or pick another data.tokenizer")
    ckpt = Checkpointer(run_dir / "checkpoints", keep_last=t.keep_last)
    resume_from = ckpt.find(t.resume)
    if resume_from is not None and (resume_from / "config.yaml").is_file():
        # a ValueError for a change the weights cannot follow; the others are applied, and listed
        changes = check_resume_config((resume_from / "config.yaml").read_text(), cfg, resume_from)
        if changes and info.is_main:
            log.warning("resuming from %s with %d config change(s), applied from here on: %s", resume_from,
                        len(changes), "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    # Built on meta, sharded, then each rank initialises only its shards: no rank holds the full model.
    model = build_model(cfg.model, cfg.parallel, info, seed=t.seed)
    if t.init_from and resume_from is None:
        check_init_config(t.init_from, cfg.model, t.init_from_strict)  # an HF config.json that disagrees with model.*
        load_weights(model, t.init_from)
    init_memory = memory_after_init(model, info)  # logged with the first step
    counts = param_counts(cfg.model)
    # one GPU: bf16 weights (parallel.param_dtype), with fp32 masters in the optimizer if optim.master_weights=fp32
    # (FSDP-2 does its own casting)
    compute_dtype = weights_dtype(cfg.parallel, info, step_precision(cfg, device) == "bf16", t.grad_accum)
    optimizer = build_optimizer(model, cfg.optim, compute_dtype)
    if info.is_main and compute_dtype is not None:
        log.info("weights held in %s with %s (one GPU, parallel.param_dtype, optim.master_weights)",
                 cfg.parallel.param_dtype, "fp32 masters in the optimizer" if optimizer.masters() else
                 "no fp32 masters: stepped in place, rounded stochastically")
    def recovery() -> str:
        newest = complete_checkpoints(ckpt.root)
        where = (f"train.resume=auto resumes from {newest[-1]}, the newest checkpoint" if newest else
                 "no checkpoint was written, so it starts from step 0")
        return (f"To recover, run the same command again with a lower LR, e.g. optim.lr="
                f"{suggested_lr(cfg.optim.lr, start_rms):.0e} ({where}; the LR comes from the config at every "
                f"step, also on a resume), or raise optim.warmup_steps, or check the data")

    guard = NonFiniteGuard(optimizer, t.nonfinite, t.max_consecutive_skips, device, t.max_update_ratio,
                           verbose=info.is_main, recovery=recovery)
    train_loader, val_loader = build_loaders(cfg.data, tokenizer=tokenizer, seq_len=t.seq_len,
                                             micro_batch_size=t.micro_batch_size, rank=info.rank,
                                             world_size=info.world_size, seed=t.seed)

    # --- resume -------------------------------------------------------------------------
    step = 0
    if resume_from is not None:
        extra = ckpt.load(resume_from, model, optimizer)
        apply_config(optimizer, cfg.optim)  # the optimizer's state came with the checkpoint's hyperparameters
        if "loader" in extra:
            train_loader.load_state_dict(extra["loader"])
        if "guard" in extra:
            guard.load_state_dict(extra["guard"])
        step = extra["step"]
        log.info("resumed from %s at step %d (train.resume=none starts afresh)", resume_from, step)
    start_rms = guard.weight_rms()  # of the weights this run starts from: what recovery()'s LR scales with

    def save(step: int, batch) -> bool:
        """Write a checkpoint of the weights after `step` if they are good; returns whether it did.
        Not during a run of skipped steps (the trainer retries at the next step), never of weights
        whose loss on `batch` is not finite; retention keeps the newest checkpoint from before the
        latest run of skips."""
        guard.check()  # a run past train.max_consecutive_skips stops here instead of saving
        if guard.in_streak:
            return False
        if not finite_loss(model, batch, cfg, device):
            raise FloatingPointError(
                f"the weights after step {step} give a non-finite loss: the step's update overflowed them, although "
                f"its own loss and gradient norm were finite (train.max_update_ratio={t.max_update_ratio} did not "
                f"catch it). Not saving them. {recovery()}")
        before_streak = [p for p in complete_checkpoints(ckpt.root) if int(p.name[5:]) < guard.streak_start]
        extra = {"loader": train_loader.state_dict(), "guard": guard.state_dict()}
        path = ckpt.save(step, model, optimizer, extra, to_yaml(cfg), keep=before_streak[-1] if before_streak else None)
        if info.is_main:
            log.info("saved %s", path)
        return True

    # --- logging ------------------------------------------------------------------------
    logger = MetricLogger(cfg.wandb, str(run_dir), asdict(cfg), enabled=info.is_main, resume=resume_from is not None)
    tokens_per_step = t.micro_batch_size * t.seq_len * t.grad_accum  # per rank
    fpt = training_flops(cfg.model, t.seq_len)
    peak = peak_flops(device, t.peak_tflops)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        log.info("model %s: %.3fM params total, %.3fM active; %d rank(s) on %s; kernel backend %s (%s)",
                 cfg.model.name, counts.total / 1e6, counts.active / 1e6, info.world_size, device,
                 resolve_backend(cfg.model.moe.kernel_backend, device, cfg.model.moe.expert_bias),
                 cfg.model.moe.kernel_backend)
    history: list[dict] = []
    metrics_file = run_dir / "metrics.jsonl"
    if info.is_main:
        dropped = drop_metrics_after(metrics_file, step)
        if dropped:
            log.info("dropped %d row(s) of %s past step %d: this run logs them again", dropped, metrics_file, step)
    bar = tqdm(total=t.steps, initial=step, disable=not (t.progress and info.is_main), dynamic_ncols=True)

    # --- the loop -----------------------------------------------------------------------
    model.train()
    bias_update = cfg.model.moe.routing.bias_update_rate > 0
    preempted = pending_save = False  # pending: a save deferred by a run of skipped steps
    with logging_redirect_tqdm(), PreemptionGuard(device) as preemption:
        last_step, last_time = step, time.perf_counter()
        while step < t.steps:
            lr = set_lr(optimizer, cfg.optim, step, t.steps)  # from the config alone, also after a resume
            loss_sum = torch.zeros(4, device=device)  # lm, aux, z, sequence-wise aux losses (summed over micro-batches)
            load_LE = None
            topk_rows = torch.zeros((), device=device)  # rows plain top-K would route (before any rounding)
            for micro in range(t.grad_accum):
                batch = next(train_loader)
                set_gradient_sync(model, micro == t.grad_accum - 1)  # one reduce-scatter per step
                with autocast_context(cfg, device):
                    out = model(*model_inputs(batch, cfg, device))
                loss = out.loss  # the LM head + cross-entropy backend's mean over labelled tokens
                ((loss + out.router_loss) / t.grad_accum).backward()
                if out.routed:
                    aux = torch.stack([r.aux_loss for r in out.routed]).mean()
                    z = torch.stack([r.z_loss for r in out.routed]).mean()
                    seq_aux = torch.stack([r.seq_aux_loss for r in out.routed]).mean()
                    layer_counts = torch.stack([r.counts_E for r in out.routed]).float()
                    load_LE = layer_counts if load_LE is None else load_LE + layer_counts
                    topk_rows += sum(r.topk_counts_E.sum() for r in out.routed)
                else:
                    aux = z = seq_aux = torch.zeros((), device=device)
                loss_sum += torch.stack([loss.detach(), aux, z, seq_aux])
            # over all shards; fused and triton AdamW apply the clip as they read the gradients
            grad_norm, grad_scale = clip_grad_norm(model.parameters(), cfg.optim.grad_clip or float("inf"),
                                                   scale_in_step=guard.fused, norm=norm_function(optimizer))
            # optimizer.step(), unless the loss or norm is non-finite or the update too large (train.nonfinite)
            guard.step(grad_norm, step + 1, loss=loss_sum[0], grad_scale=grad_scale)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)

            is_eval = t.eval_every and (step % t.eval_every == 0 or step == t.steps)
            is_lm_eval = bool(lm_eval and t.lm_eval_every) and (step % t.lm_eval_every == 0 or step == t.steps)
            is_log = step % t.log_every == 0 or step == t.steps or is_eval or is_lm_eval
            if load_LE is not None and (bias_update or is_log):
                all_reduce_(load_LE)  # the whole data-parallel batch's expert load
                if bias_update:
                    _update_expert_bias(model, load_LE)
            if is_log:
                means = (all_reduce_(loss_sum, "mean") / t.grad_accum).tolist()  # waits for the device
                now = time.perf_counter()
                metrics = {"loss": means[0], "aux_loss": means[1], "z_loss": means[2], "seq_aux_loss": means[3],
                           "lr": lr,
                           "grad_norm": grad_norm.item(),
                           **speed_metrics(tokens_per_step * (step - last_step) / (now - last_time),
                                           info.world_size, fpt, peak, device)}
                if load_LE is not None:
                    metrics.update(expert_load(load_LE))
                    # < 1: token rounding / capacity dropped rows; > 1: padded (what the TR arms differ in)
                    metrics["routed_rows_ratio"] = (load_LE.sum() / all_reduce_(topk_rows).clamp_min(1)).item()
                metrics["skipped_steps"] = guard.check()  # non-finite steps so far; raises per train.nonfinite
                if is_eval:
                    metrics["val_loss"] = evaluate(model, val_loader, cfg, device)
                if is_lm_eval:
                    results = lm_eval(model, tokenizer, t.lm_eval_tasks, t.lm_eval_limit, precision=t.precision)
                    metrics.update({f"lm_eval/{k}": v for k, v in results.items()})
                if not history:
                    metrics.update(init_memory)
                logger.log(step, metrics)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
                history.append({"step": step, **metrics})
                if info.is_main:
                    with metrics_file.open("a") as f:
                        f.write(json.dumps({"step": step, **metrics}) + "\n")
                last_step, last_time = step, time.perf_counter()  # evaluation stays out of the throughput
            due = pending_save or (bool(t.save_every) and (step % t.save_every == 0 or step == t.steps))
            saved = due and save(step, batch)
            if due and not saved and not pending_save and info.is_main:
                log.warning("step %d was skipped: its checkpoint waits for the first step that is not", step)
            pending_save = due and not saved
            if preemption.stop_requested():  # a signal on any rank: save, leave, get requeued
                if not saved and not save(step, batch) and info.is_main:
                    log.warning("not saved at step %d: it was skipped; a resume starts from the newest checkpoint",
                                step)
                if info.is_main:
                    log.warning("stopped at step %d on a preemption signal; train.resume=auto continues here", step)
                preempted = True
                break
            if saved:
                last_step, last_time = step, time.perf_counter()
    if pending_save and not preempted and info.is_main:
        log.warning("the run ended in skipped steps: the checkpoint of its last step was not written")
    bar.close()
    logger.close()
    info.shutdown()
    if preempted:
        preemption.hand_on()  # e.g. submitit's handler: requeue the job, then exit
    return history


def load_weights(model: Transformer, path: str) -> None:
    """Copy the weights of a Sonic checkpoint, model file or HF directory into `model` (sharded
    or not): each rank reads them whole into host memory and keeps its own shards."""
    source = load_model(path).model.state_dict()
    target = model.state_dict()  # under FSDP: DTensors of the full shapes
    mismatched = [k for k in target if k not in source or source[k].shape != target[k].shape]
    if mismatched or set(source) - set(target):
        raise ValueError(f"train.init_from={path!r} does not match model={model.cfg.name} (first differing "
                         f"weights: {(mismatched or sorted(set(source) - set(target)))[:3]}); pick the model "
                         f"preset the weights were trained with")
    load_full_state_dict(model, source)


def _update_expert_bias(model, load_LE: torch.Tensor) -> None:
    moe_layers = [m for m in model.modules() if hasattr(m, "update_expert_bias")]
    assert len(moe_layers) == load_LE.shape[0]
    with torch.no_grad():
        for router, counts_E in zip(moe_layers, load_LE):
            router.update_expert_bias(counts_E)
