"""Routing health over training: every layer's max/mean expert load at every log step, and what drives it.

    python -m bench.routing_health --tag 16L experiment=sonic_7b data=local_bpe optim.warmup_steps=20 \\
        train.steps=100 model.num_layers=16

Runs the real trainer (sonic.train.trainer.train) on one process; every argument after the options is
a Hydra override, as for train.py. No evaluation, no checkpoint, a fresh start. Two records:

- the trainer's own log, every log step: loss, lr, aux loss, tokens/s and each layer's max/mean load
  over the whole step (`expert_load_max/<layer>`; 1 = balanced, E/K = every token picks the same K);
- diagnostics at steps 1, 2, 3, 5, 10 and every --diag-every: one extra forward, no grad, eval mode
  (plain top-K), on the step's first micro-batch with the weights and expert bias that step trains
  with. Per layer, of the router's input x: `cos_to_mean` (each row's cosine to the mean row) and
  `mean_share` (|mean x|^2 / mean |x|^2: the share of its energy that every token shares);
  `mean_half_gap` (|mean of the first half of the sequences - mean of the second half| / |mean|) and
  `mean_step_change` (|mean - the mean at the previous diagnostic step| / |mean|): whether the shared
  vector is global and still or per sequence and moving; its cosine to the batch's unigram direction
  (the frequency-weighted mean token embedding, `cos_mean_to_unigram`) and to the previous layer's
  mean (`cos_mean_to_prev`); the logits as the router computes them (routing.input_centring
  included): `logit_common_std` (std over experts of the batch-mean logit: the part every token
  shares), `logit_token_std` (mean over experts of the std over tokens: the part that differs) and
  `logit_range` (mean over tokens of max - min); the expert bias's std and range; the layer's
  unweighted aux loss and max/mean load on that forward; `attn_adds_to_mean` and `ffn_adds_to_mean`:
  the share of the residual stream's mean (after the block) that the block's attention and MoE
  branches added, along that mean: who writes the shared vector.
  Where the imbalance comes from, of the logits + expert bias that pick the top-K on that forward:
  `seq_max_over_mean` (each sequence's own max/mean load, averaged over sequences: above the batch's when
  each sequence sends its tokens to its own experts) and `logit_seq_common_std` (the per-sequence
  `logit_common_std`, averaged); `logit_common_step_cos` (cosine, over experts, of the batch-mean logit
  with the one at the previous diagnostic step: near 1 when the same experts stay favoured, a stable
  offset the bias can track); `logit_expert_std_cv` (the spread over experts of their token std,
  std / mean: a wider expert wins the top-K tail more often) and `router_row_norm_cv` (the same
  spread of the router's weight rows); the hottest expert's rank, from 0 (lowest) to 1 (highest),
  among the experts' mean logit (`hot_common_rank`), token std (`hot_std_rank`) and expert bias
  (`hot_bias_rank`); and of the router's input as the router reads it (the centred input at unit
  RMS under input_centring=prefix, else x at unit RMS): `u_mean_share` and `u_seq_mean_share`
  (mean_share over the batch and per sequence, averaged). Whether the hot expert's load is a few token
  ids (a load that moves as one block, which no bias can split): `hot_top1_id_share` and
  `hot_top10_id_share`, the share of the hot expert's tokens that its 1 and 10 commonest input ids hold,
  beside `top10_id_share`, the 10 commonest ids' share of the batch. Where in the sequence the router
  input's shared part sits: `u_mean_share_head` and `u_mean_share_tail` (u_mean_share over the first
  S/16 positions and over the last S/2); and what other centrings would leave of it (each over x, at unit
  RMS, whatever the router uses): `ema64_mean_share` and `ema512_mean_share` (x minus an exponential
  moving average of the earlier positions with a window of 64 or 512 tokens), and `c_along_mean_share` (the
  share of the prefix-centred input's energy that lies along its prefix mean: how much of what centring keeps
  is the varying amount of the shared vector each token carries); `c_mean_share` (mean_share of the
  prefix-centred input before its rescale to unit RMS: the prefix mean leaves no shared part in it where a
  sequence's statistics do not drift, so a u_mean_share well above it is made by the per-token rescale, which
  shrinks the large tokens and grows the small ones).

`--final-batches N` (0: off): after training, N more batches of the training stream (the ones the run would
have taken next, each a step's train.grad_accum micro-batches) go through the trained model, forward only (no
grad, train mode: routed as training routes them, expert bias included; nothing in the model changes). Per
layer: each batch's max/mean (`per_batch_max_over_mean`, as the trainer logs it), the counts of all N batches
summed (`pooled_max_over_mean`) and each sequence's own max/mean, averaged over the sequences
(`seq_max_over_mean`). It separates the router's imbalance from one batch's topical mix: a router that favours
some experts stays imbalanced pooled over many batches; a mix that differs from batch to batch evens out there.

`--grad-norms`: every step's pre-clip gradient norm (the trainer logs it only at log steps), split by parameter
kind (`layers.*.attn.q_proj.weight`, ...) and by layer (`grad_norms` in the JSON), and the largest steps printed
with the kinds and layers that hold most of them: where a loss spike at the peak learning rate starts.

`--freeze attn.o_proj.weight` (diagnosis only) keeps those parameters at their initial values (zero:
attention then adds nothing to the residual stream).

The diagnostic forward runs the blocks' eager code (not the compiled one), and its time stays out of
the reported throughput: `tokens_per_s_per_gpu` is the median over log intervals after the first that
hold no diagnostic step. `--diag-every 0` turns diagnostics off. Writes
bench/results/<date>-<device>-routing_health[-<tag>].json and prints the per-step table.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from bench.common import compose_config, result_path, write_json
from sonic.routing.losses import picks_per_sequence
from sonic.routing.scores import EPS, prefix_centre
from sonic.train import trainer
from sonic.train.checkpoint import clean_name
from sonic.train.config import Config
from sonic.train.metrics import expert_load

# A fresh run with nothing but training and its log; overrides given on the command line come later and win.
DEFAULTS = ["train.eval_every=0", "train.save_every=0", "train.lm_eval_every=0", "train.resume=none",
            "train.progress=false"]
EARLY_DIAG_STEPS = (1, 2, 3, 5, 10)
TARGET_FROM_STEP = 30  # the targets: from this step on no layer above 4x mean; every layer <= 2x at the end
DIAG_FIELDS = ("max_over_mean", "aux_loss", "cos_to_mean", "mean_share", "mean_half_gap", "mean_step_change",
               "cos_mean_to_unigram", "cos_mean_to_prev",
               "logit_common_std", "logit_token_std", "logit_range", "bias_std", "bias_range", "input_rms",
               "attn_adds_to_mean", "ffn_adds_to_mean",
               "seq_max_over_mean", "logit_seq_common_std", "logit_common_step_cos", "logit_expert_std_cv",
               "router_row_norm_cv", "hot_common_rank", "hot_std_rank", "hot_bias_rank", "u_mean_share",
               "u_seq_mean_share", "hot_top1_id_share", "hot_top10_id_share", "top10_id_share",
               "u_mean_share_head", "u_mean_share_tail", "ema64_mean_share", "ema512_mean_share",
               "c_along_mean_share", "c_mean_share")


def diag_steps(steps: int, every: int) -> list[int]:
    if every == 0:
        return []
    return sorted({s for s in EARLY_DIAG_STEPS if s <= steps} | set(range(every, steps + 1, every)))


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b) / (a.norm() * b.norm()).clamp_min(1e-12)


def _rank(values_E: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Where expert e's value sits among all experts': 0 lowest, 1 highest."""
    return (values_E < values_E[e]).float().sum() / max(values_E.numel() - 1, 1)


def _mean_share(u_TD: torch.Tensor) -> torch.Tensor:
    return u_TD.mean(0).square().sum() / u_TD.square().sum(-1).mean().clamp_min(1e-12)


def _top_id_share(ids_T: torch.Tensor, vocab: int, n: int, weights_T: torch.Tensor | None = None) -> torch.Tensor:
    """The share of the tokens (those with weight 1 of weights_T; all without) that their n commonest ids hold."""
    counts = torch.bincount(ids_T, weights_T, minlength=vocab).float()
    return counts.topk(min(n, vocab)).values.sum() / counts.sum().clamp_min(1)


def _max_over_mean(counts_XE: torch.Tensor) -> torch.Tensor:
    """Max/mean load over the last dim, as the trainer's `expert_load` defines it (sonic/train/metrics.py)."""
    counts = counts_XE.float()
    return counts.amax(-1) / counts.mean(-1).clamp_min(1e-9)


def _ema_centred(x_BSD: torch.Tensor, window: int) -> torch.Tensor:
    """x_t minus the exponential moving average of x_s, s < t (weights a^(t-1-s), a = 1 - 1/window, normalised
    to sum 1, so position 1 subtracts x_0 as the prefix mean does; position 0 keeps x_0), at unit RMS. In fp64:
    the scan's a^-s stays finite for S/window up to ~700."""
    B, S, D = x_BSD.shape
    a = 1.0 - 1.0 / window
    pos = torch.arange(S, device=x_BSD.device, dtype=torch.float64)
    scaled = x_BSD.double() * a ** -pos[None, :, None]
    weight_sum = (1 - a ** pos) / (1 - a)  # sum_{s<t} a^(t-1-s)
    before = (scaled.cumsum(1) - scaled) * (a ** (pos - 1) / weight_sum.clamp_min(1))[None, :, None]
    c = (x_BSD.double() - before).float()
    return c * torch.rsqrt(c.square().mean(-1, keepdim=True) + EPS)


def _layer_stats(block, seen: dict, out_BSD: torch.Tensor, ids_T: torch.Tensor, vocab: int, unigram_D: torch.Tensor,
                 prev_layer: dict | None, prev_step: dict | None) -> tuple[torch.Tensor, dict]:
    """One MoE block's DIAG_FIELDS as a tensor (no host sync), and what the next layer and the next
    diagnostic step compare with (the router input's mean row, the batch-mean logits)."""
    router = block.ffn.router
    x_TD, routed = seen["router"]
    B, S, D = out_BSD.shape
    x = x_TD.float()
    mean_D = x.mean(0)
    nan = torch.full((), float("nan"), device=x.device)
    # how much the mean differs between the batch's two halves of sequences, and since the last diagnostic step
    halves = x.view(B, S, D)[: B // 2 * 2].view(2, -1, D).mean(1) if B >= 2 else None
    half_gap = (halves[0] - halves[1]).norm() / mean_D.norm().clamp_min(1e-12) if halves is not None else nan
    step_change = ((mean_D - prev_step["mean_D"]).norm() / mean_D.norm().clamp_min(1e-12)
                   if prev_step is not None else nan)
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    unit_mean = unit.mean(0)
    cos_to_mean = (unit @ (unit_mean / unit_mean.norm().clamp_min(1e-12))).mean()
    mean_share = _mean_share(x)
    weight_ED = router.weight_ED.float()
    logits_TE = router.logits(x_TD.float(), S).float()  # as the router computes them
    counts = routed.topk_counts_E.float()
    bias = router.expert_bias_E.float()
    # what each branch adds to the mean of the residual stream, along that mean, as a share of it
    resid_mean_D = out_BSD.float().flatten(0, 1).mean(0)
    unit_resid = resid_mean_D / resid_mean_D.norm().clamp_min(1e-12)
    adds = [seen[b].float().flatten(0, 1).mean(0) @ unit_resid / resid_mean_D.norm().clamp_min(1e-12)
            for b in ("attn", "ffn")]
    # where the imbalance comes from: per-sequence loads and shared logits, the favoured experts over steps
    E = logits_TE.shape[1]
    picks_TK = (logits_TE + bias).topk(router.top_k, dim=-1).indices
    seq_counts_BE = picks_per_sequence(picks_TK, S, E, torch.float32)
    seq_max_over_mean = _max_over_mean(seq_counts_BE).mean()
    logit_seq_common = logits_TE.view(B, S, E).mean(1).std(-1, unbiased=False).mean()
    common_E = logits_TE.mean(0)
    centred_common_E = common_E - common_E.mean()
    common_step_cos = (_cos(centred_common_E, prev_step["common_E"] - prev_step["common_E"].mean())
                       if prev_step is not None else nan)
    std_E = logits_TE.std(0, unbiased=False)
    row_norm_E = weight_ED.norm(dim=-1)
    hot = counts.argmax()
    c_TD, c_ms_T = prefix_centre(x, S)
    m_TD = x - c_TD  # the prefix means
    along = ((c_TD * m_TD).sum(-1).square() / ((m_TD * m_TD).sum(-1) * (c_TD * c_TD).sum(-1)).clamp_min(1e-30)).mean()
    u_by_centring = {"none": x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS),
                     "prefix": c_TD * torch.rsqrt(c_ms_T + EPS).unsqueeze(-1)}
    u_TD = u_by_centring[router.cfg.input_centring]
    u_BSD = u_TD.view(B, S, D)
    u_seq_mean_share = torch.stack([_mean_share(u) for u in u_BSD]).mean()
    head, tail = u_BSD[:, : max(S // 16, 1)].flatten(0, 1), u_BSD[:, S // 2:].flatten(0, 1)
    ema = [_mean_share(_ema_centred(x.view(B, S, D), w).flatten(0, 1)) for w in (64, 512)]
    to_hot_T = (picks_TK == hot).any(-1).float()
    row = torch.stack([counts.max() / counts.mean(), routed.aux_loss.float(), cos_to_mean, mean_share,
                       half_gap, step_change, _cos(mean_D, unigram_D),
                       _cos(mean_D, prev_layer["mean_D"]) if prev_layer is not None else nan,
                       common_E.std(unbiased=False), std_E.mean(),
                       (logits_TE.amax(-1) - logits_TE.amin(-1)).mean(), bias.std(unbiased=False),
                       bias.max() - bias.min(), x.square().mean().sqrt(), *adds,
                       seq_max_over_mean, logit_seq_common, common_step_cos, std_E.std(unbiased=False) / std_E.mean(),
                       row_norm_E.std(unbiased=False) / row_norm_E.mean(), _rank(common_E, hot), _rank(std_E, hot),
                       _rank(bias, hot), _mean_share(u_TD), u_seq_mean_share, _top_id_share(ids_T, vocab, 1, to_hot_T),
                       _top_id_share(ids_T, vocab, 10, to_hot_T), _top_id_share(ids_T, vocab, 10),
                       _mean_share(head), _mean_share(tail), *ema, along, _mean_share(c_TD)])
    return row, {"mean_D": mean_D, "common_E": common_E}


@torch.no_grad()
def diagnose(model, input_ids_BS: torch.Tensor, doc_ids_BS: torch.Tensor | None,
             prev_step: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """DIAG_FIELDS of every MoE layer for one batch (an eager forward in eval mode, no grad), and each
    layer's state that the next diagnostic step compares with (pass it back as prev_step then)."""
    rows, states = [], []
    ids_T = input_ids_BS.reshape(-1)
    unigram_V = torch.bincount(ids_T, minlength=model.cfg.vocab_size).float()
    unigram_D = unigram_V @ model.embed_tokens.weight.float() / unigram_V.sum()
    seen: dict = {}
    blocks = [getattr(layer, "_checkpoint_wrapped_module", layer) for layer in model.layers]
    handles = []
    for block in blocks:
        handles.append(block.attn.register_forward_hook(lambda m, a, out: seen.__setitem__("attn", out)))
        if block.is_moe:
            handles.append(block.ffn.register_forward_hook(lambda m, a, out: seen.__setitem__("ffn", out[0])))
            handles.append(block.ffn.router.register_forward_hook(
                lambda m, a, out: seen.__setitem__("router", (a[0], out))))
    was_training = model.training
    model.eval()
    try:  # Transformer.forward's loop, calling each block's eager forward (blocks may be compiled)
        S = input_ids_BS.shape[1]
        mask = model.attn_core.mask(doc_ids_BS, S, input_ids_BS.device)
        x = model.embed(input_ids_BS)
        for block in blocks:
            x, _ = block.forward(x, model.rotary, mask)
            if block.is_moe:
                row, state = _layer_stats(block, seen, x, ids_T, model.cfg.vocab_size, unigram_D,
                                          states[-1] if states else None,
                                          prev_step[len(states)] if prev_step else None)
                rows.append(row)
                states.append(state)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    values = torch.stack(rows).tolist()
    return [{"layer": i, **dict(zip(DIAG_FIELDS, v))} for i, v in enumerate(values)], states


class DiagnosticsHook:
    """A forward pre-hook on the model: on the first micro-batch of each diagnostic step, runs
    `diagnose` on that batch and records it with its wall time (kept out of the throughput)."""

    def __init__(self, steps: list[int], grad_accum: int):
        self.steps, self.grad_accum = set(steps), grad_accum
        self.calls = 0
        self.records: list[dict] = []
        self.state: list[dict] | None = None  # each layer's state at the last diagnostic step

    def __call__(self, model, args):
        if not model.training:
            return
        step, micro = divmod(self.calls, self.grad_accum)
        self.calls += 1
        if micro or step + 1 not in self.steps:
            return
        ids, doc_ids = args[0], args[1] if len(args) > 1 else None
        sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
        sync()  # the step's queued work is not the diagnostics' time
        start = time.perf_counter()
        layers, self.state = diagnose(model, ids, doc_ids, self.state)
        sync()
        seconds = time.perf_counter() - start
        self.records.append({"step": step + 1, "seconds": seconds, "layers": layers})


def param_kind(name: str) -> tuple[str, int | None]:
    """A parameter's kind, its name with the layer index starred (`layers.*.attn.q_proj.weight`), and its layer
    (None outside the layers); the prefixes activation checkpointing and torch.compile add are dropped, as the
    checkpoint's names drop them."""
    parts = clean_name(name).split(".")
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
        return ".".join(["layers", "*", *parts[2:]]), int(parts[1])
    return ".".join(parts), None


class GradNorms:
    """Every step's pre-clip gradient norm per parameter (`--grad-norms`), summed by kind and by layer at the end.

    The trainer logs the total alone, at log steps: a spike between them, and where it sits, stays unseen. This
    wraps the trainer's clip, so the norms are of the gradients it clips, before clipping; they stay on the device
    until the run ends (no host sync per step)."""

    def __init__(self):
        self.names: list[str] = []
        self.index: dict[int, int] = {}  # id(parameter) -> its place in self.names
        self.rows: list[torch.Tensor] = []  # per step: each parameter's squared norm, in self.names' order

    def watch(self, model) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.index = {id(p): i for i, (_, p) in enumerate(named)}

    def wrap(self, clip):
        def clip_and_record(params, *args, **kwargs):
            params = [p for p in params if p.grad is not None]
            sq = torch.zeros(len(self.names), device=params[0].grad.device)
            idx = torch.tensor([self.index[id(p)] for p in params], device=sq.device)
            norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params]  # one process: unsharded
            self.rows.append(sq.index_add_(0, idx, torch.stack(norms).square()))
            return clip(params, *args, **kwargs)
        return clip_and_record

    def result(self) -> dict:
        """Per step (1 to N): the total, each kind's norm and each layer's, over that kind's or layer's parameters."""
        if not self.rows:
            return {}
        sq_NP = torch.stack(self.rows).cpu().double()
        kinds, layers = zip(*(param_kind(n) for n in self.names))

        def norms(keys) -> dict:
            return {k: sq_NP[:, [i for i, x in enumerate(keys) if x == k]].sum(1).sqrt().tolist()
                    for k in dict.fromkeys(keys) if k is not None}

        by_layer = norms(layers)
        return {"total": sq_NP.sum(1).sqrt().tolist(), "by_kind": norms(kinds),
                "by_layer": [by_layer[i] for i in sorted(by_layer)]}


def print_grad_norms(grads: dict, top: int = 5) -> None:
    """The `top` steps of the largest total norm, each with the kinds and layers that hold most of its square."""
    if not grads:
        return
    total = grads["total"]
    print(f"pre-clip gradient norm, median over steps {statistics.median(total):.3g}; the {top} largest, "
          "with the kinds and layers that hold most of each one's square:")
    for n in sorted(range(len(total)), key=total.__getitem__, reverse=True)[:top]:
        sq = max(total[n] ** 2, 1e-30)
        kinds = sorted(grads["by_kind"].items(), key=lambda kv: -kv[1][n])[:3]
        layers = sorted(enumerate(grads["by_layer"]), key=lambda iv: -iv[1][n])[:3]
        print(f"  step {n + 1:4d}  {total[n]:10.4g}  " + ", ".join(f"{k} {v[n] ** 2 / sq:.0%}" for k, v in kinds)
              + "  |  " + ", ".join(f"layer {i} {v[n] ** 2 / sq:.0%}" for i, v in layers))


def routed_per_sequence(routed, seq_len: int) -> torch.Tensor:
    """(B, E) int64: the routed rows of each sequence per expert, read off the layer's plan (so under any routing
    method the rows the trainer's `counts_E` counts; padding rows, expert E, left out). Sums over B to counts_E."""
    plan = routed.plan
    E = plan.num_experts
    B = plan.num_tokens // seq_len
    expert_R = plan.expert_idx_R.long()
    live_R = expert_R < E
    flat_R = torch.where(live_R, plan.token_idx_R.long() // seq_len * E + expert_R, 0)
    counts = torch.zeros(B * E, dtype=torch.int64, device=expert_R.device)
    return counts.scatter_add_(0, flat_R, live_R.long()).view(B, E)


@torch.no_grad()
def final_batches(model, train_loader, cfg: Config, n: int) -> dict:
    """Route `n` more batches of `train_loader` (the trainer's own loader, after training: the batches it would
    have drawn next; a batch is a step's train.grad_accum micro-batches, its counts summed as the trainer's log
    sums them) through `model`, forward only: each batch's, the pooled and the per-sequence max/mean per layer.

    Train mode, not eval: routing.method=token_rounding rounds the counts only in training (eval routes plain
    top-K), and the trainer logs the rounded rows. Training's forward changes nothing that the trainer does not
    change itself (the expert bias moves in trainer._update_expert_bias, after the optimizer step), except token
    rounding's balance buffers and, under rounding_mode=stochastic, the RNG: every buffer is restored after and
    the RNG forked, so the model leaves as it came. No grad: no parameter, gradient or optimizer state moves."""
    device = next(model.parameters()).device
    accum, S = cfg.train.grad_accum, cfg.train.seq_len
    skipped = train_loader.consumed
    buffers = [(b, b.clone()) for b in model.buffers()]
    was_training = model.training
    per_batch, seq_ratios, losses = [], [], []
    model.train()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for _ in range(n):
                counts_LE, loss = None, 0.0
                for _micro in range(accum):
                    batch = next(train_loader)
                    with trainer.autocast_context(cfg, device):
                        out = model(*trainer.model_inputs(batch, cfg, device))
                    layer_LE = torch.stack([r.counts_E for r in out.routed]).long()
                    seq_LBE = torch.stack([routed_per_sequence(r, S) for r in out.routed])
                    if not torch.equal(seq_LBE.sum(1), layer_LE):
                        raise AssertionError("the per-sequence routed rows do not sum to the layer's counts_E")
                    seq_ratios.append(_max_over_mean(seq_LBE))  # (L, B)
                    counts_LE = layer_LE if counts_LE is None else counts_LE + layer_LE
                    loss += out.loss.float().item() / accum
                per_batch.append(counts_LE)
                losses.append(loss)
    finally:
        model.train(was_training)
        for b, saved in buffers:
            b.copy_(saved)
    pooled_LE = torch.stack(per_batch).sum(0)
    num_layers = pooled_LE.shape[0]

    def ratios(counts_LE: torch.Tensor) -> list[float]:  # the trainer's own function, as it logs each step
        loads = expert_load(counts_LE)
        return [loads[f"expert_load_max/{i}"] for i in range(num_layers)]

    per_batch_ratio = [ratios(c) for c in per_batch]
    pooled = ratios(pooled_LE)
    return {
        "batches": n, "micro_batches_per_batch": accum, "skipped_micro_batches": skipped,
        "tokens_per_batch": accum * cfg.train.micro_batch_size * S,
        "per_batch_max_over_mean": per_batch_ratio,
        "pooled_max_over_mean": pooled,
        "seq_max_over_mean": torch.cat(seq_ratios, dim=1).mean(1).tolist(),
        "per_batch_worst": [max(r) for r in per_batch_ratio],
        "pooled_worst": max(pooled),
        "layers_over_2x_pooled": sum(v > 2.0 for v in pooled),
        "layers_over_2x_per_batch": [sum(v > 2.0 for v in r) for r in per_batch_ratio],
        "per_batch_loss": losses,
        "counts": [c.tolist() for c in per_batch],  # [batch][layer][expert]: routed rows
    }


def summarize(history: list[dict], diags: list[dict], num_layers: int, e_over_k: float) -> dict:
    """The issue's targets, read off the trainer's log."""
    loads = {h["step"]: [h[f"expert_load_max/{i}"] for i in range(num_layers)] for h in history}
    last = history[-1]
    before = [max(v) for s, v in loads.items() if s < TARGET_FROM_STEP]
    after = [max(v) for s, v in loads.items() if s >= TARGET_FROM_STEP]
    late_losses = [h["loss"] for h in history if h["step"] >= TARGET_FROM_STEP]
    diag_steps_set = {d["step"] for d in diags}
    clean = [h["tokens_per_s_per_gpu"] for prev, h in zip(history, history[1:])
             if not any(prev["step"] < s <= h["step"] for s in diag_steps_set)]
    return {
        "E/K": e_over_k,
        f"worst_max_over_mean_before_step_{TARGET_FROM_STEP}": max(before) if before else None,
        f"worst_max_over_mean_from_step_{TARGET_FROM_STEP}": max(after) if after else None,
        f"no_layer_over_4x_from_step_{TARGET_FROM_STEP}": bool(after) and max(after) <= 4.0,
        "last_step": last["step"],
        "worst_max_over_mean_at_last_step": max(loads[last["step"]]),
        "layers_over_2x_at_last_step": sum(v > 2.0 for v in loads[last["step"]]),
        "every_layer_le_2x_at_last_step": max(loads[last["step"]]) <= 2.0,
        "loss_at_last_step": last["loss"],
        f"loss_mean_from_step_{TARGET_FROM_STEP}": statistics.fmean(late_losses) if late_losses else None,  # less noisy
        "tokens_per_s_per_gpu": statistics.median(clean) if clean else None,
        "tokens_per_s_per_gpu_intervals": len(clean),
        "mem_peak_gib": max((h["mem_peak_gib"] for h in history if "mem_peak_gib" in h), default=None),
    }


def print_table(history: list[dict], num_layers: int, e_over_k: float) -> None:
    print(f"{'step':>5} {'lr':>9} {'loss':>7} {'aux':>6} {'>2x':>4} {'>4x':>4} {'>8x':>4} {'worst':>6}"
          f"  (E/K = {e_over_k:g}, {num_layers} layers)")
    for h in history:
        v = [h[f"expert_load_max/{i}"] for i in range(num_layers)]
        print(f"{h['step']:5d} {h['lr']:9.2e} {h['loss']:7.3f} {h['aux_loss']:6.3f} {sum(x > 2 for x in v):4d} "
              f"{sum(x > 4 for x in v):4d} {sum(x > 8 for x in v):4d} {max(v):6.2f}")


def print_diagnostics(diags: list[dict]) -> None:
    if not diags:
        return
    print(f"{'step':>5} {'layer':>5} " + " ".join(f"{k[:12]:>12}" for k in DIAG_FIELDS))
    for d in diags:
        n = len(d["layers"])
        for row in (d["layers"][0], d["layers"][n // 2], d["layers"][-1]):
            print(f"{d['step']:5d} {row['layer']:5d} " + " ".join(f"{row[k]:12.4g}" for k in DIAG_FIELDS))


def print_final_batches(final: dict | None) -> None:
    if not final:
        return
    print(f"final batches: {final['batches']} after training, {final['tokens_per_batch']} tokens each; per layer, "
          "max/mean of each batch (worst over batches), pooled over all, per sequence (mean over sequences)")
    print(f"{'layer':>5} {'batch_mean':>10} {'batch_worst':>11} {'pooled':>7} {'seq':>7}")
    per_batch = list(zip(*final["per_batch_max_over_mean"]))  # [layer][batch]
    for i, (batches, pooled, seq) in enumerate(zip(per_batch, final["pooled_max_over_mean"],
                                                   final["seq_max_over_mean"])):
        print(f"{i:5d} {statistics.fmean(batches):10.2f} {max(batches):11.2f} {pooled:7.2f} {seq:7.2f}")
    print(f"layers over 2x: pooled {final['layers_over_2x_pooled']}, per batch {final['layers_over_2x_per_batch']}; "
          f"worst: pooled {final['pooled_worst']:.2f}, per batch {[round(v, 2) for v in final['per_batch_worst']]}")


def run(cfg: Config, diag_every: int, freeze: tuple[str, ...] = (), final: int = 0,
        grads: GradNorms | None = None) -> tuple[list[dict], list[dict], dict | None]:
    """train(cfg) with the diagnostics hook on the model it builds, and the parameters whose names end
    with one of `freeze` kept at their initial values; then, when `final` > 0, `final_batches` of that model
    on the next `final` batches of the trainer's own training loader; (trainer history, diagnostics, final).
    `grads`, where given, records every step's gradient norms (GradNorms)."""
    hook = DiagnosticsHook(diag_steps(cfg.train.steps, diag_every), cfg.train.grad_accum)
    build, loaders = trainer.build_model, trainer.build_loaders
    built: dict = {}

    def build_and_hook(*args, **kwargs):
        model = build(*args, **kwargs)
        frozen = [p.requires_grad_(False) for name, p in model.named_parameters() if name.endswith(freeze)]
        if freeze and not frozen:
            raise ValueError(f"--freeze {' '.join(freeze)}: no parameter name ends with it (e.g. attn.o_proj.weight)")
        if hook.steps:
            built["hook"] = model.register_forward_pre_hook(hook)
        if grads is not None:
            grads.watch(model)
        built["model"] = model
        return model

    def build_and_keep_loaders(*args, **kwargs):
        built["train_loader"], val_loader = loaders(*args, **kwargs)
        return built["train_loader"], val_loader

    clip = trainer.clip_grad_norm if grads is None else grads.wrap(trainer.clip_grad_norm)
    with (mock.patch.object(trainer, "build_model", build_and_hook),
          mock.patch.object(trainer, "build_loaders", build_and_keep_loaders),
          mock.patch.object(trainer, "clip_grad_norm", clip)):
        history = trainer.train(cfg)
    if not final:
        return history, hook.records, None
    if "hook" in built:
        built["hook"].remove()  # the final batches are no training step
    return history, hook.records, final_batches(built["model"], built["train_loader"], cfg, final)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    ap.add_argument("--diag-every", type=int, default=20,
                    help="diagnostics every N steps (and at 1, 2, 3, 5, 10); 0: off")
    ap.add_argument("--json", default=None,
                    help="result path (default bench/results/<date>-<device>-routing_health[-tag].json)")
    ap.add_argument("--run-dir", default=None,
                    help="the trainer's run directory (default: a temporary one, removed after)")
    ap.add_argument("--freeze", action="append", default=[], metavar="SUFFIX",
                    help="diagnosis only: keep the parameters whose names end with SUFFIX at their initial values "
                         "(e.g. attn.o_proj.weight: attention adds nothing to the residual stream); repeatable")
    ap.add_argument("--final-batches", type=int, default=0, metavar="N",
                    help="after training, route N more batches of the training stream through the trained model "
                         "(forward only) and record each batch's, the pooled and the per-sequence max/mean load; "
                         "0: off")
    ap.add_argument("--grad-norms", action="store_true",
                    help="record every step's pre-clip gradient norm by parameter kind and by layer (`grad_norms` in "
                         "the JSON) and print the largest steps' sources; off by default (it adds a norm per step)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = ap.parse_args(argv)
    if args.diag_every < 0:
        raise ValueError(f"--diag-every {args.diag_every} must be >= 0 (0 turns diagnostics off)")
    if args.final_batches < 0:
        raise ValueError(f"--final-batches {args.final_batches} must be >= 0 (the number of batches to route after "
                         "training; 0 turns it off)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("bench.routing_health runs on one process (the issue's runs are one GPU); "
                         "run it without torchrun")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.ExitStack() as stack:
        run_dir = args.run_dir or stack.enter_context(tempfile.TemporaryDirectory())
        cfg = compose_config([*DEFAULTS, f"train.run_dir={run_dir}", *args.overrides])
        grads = GradNorms() if args.grad_norms else None
        history, diags, final = run(cfg, args.diag_every, tuple(args.freeze), args.final_batches, grads)
    moe = cfg.model.moe
    num_moe = cfg.model.num_layers - cfg.model.first_k_dense
    e_over_k = moe.num_experts / moe.top_k
    summary = summarize(history, diags, num_moe, e_over_k)
    print_table(history, num_moe, e_over_k)
    print_diagnostics(diags)
    print_final_batches(final)
    grad_norms = grads.result() if grads else None
    print_grad_norms(grad_norms)
    steps = [{"step": h["step"], "lr": h["lr"], "loss": h["loss"], "aux_loss": h["aux_loss"], "z_loss": h["z_loss"],
              "grad_norm": h["grad_norm"], "tokens_per_s_per_gpu": h["tokens_per_s_per_gpu"],
              "max_over_mean": [h[f"expert_load_max/{i}"] for i in range(num_moe)],
              "cv": [h[f"expert_load_cv/{i}"] for i in range(num_moe)]} for h in history]
    what = "routing_health" + (f"-{args.tag}" if args.tag else "")
    path = write_json(result_path(what, args.json), {
        "overrides": args.overrides, "frozen": args.freeze, "model": cfg.model.name, "num_layers": cfg.model.num_layers,
        "routing": vars(moe.routing), "micro_batch": [cfg.train.micro_batch_size, cfg.train.seq_len],
        "summary": summary, "steps": steps, "diagnostics": diags, "final_batches": final,
        "grad_norms": grad_norms})
    for k, v in summary.items():
        print(f"{k:>40}: {v}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
