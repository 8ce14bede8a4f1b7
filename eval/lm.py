"""lm-eval model class `sonic`: log-likelihoods and greedy generation from a Sonic model.

Why no attention mask: every batch is right-padded, and attention is causal, so padding only
ever sits after the tokens that are scored. Routing is per token (top-K in eval mode), so pad
tokens cannot change the experts a real token gets either: batched scores equal unbatched ones.

The EOS convention, the same as lm-eval's HF wrapper on an exported model (`lm_eval --model hf`;
tests/eval/test_lm.py checks that both give the same log-likelihoods):
- text is encoded plain: no special token is added to a context, a continuation or a prompt;
- a request with an empty context, and each rolling window's start, is conditioned on EOS alone.
EOS is what precedes every document in training (packing separates documents with it), so it is
the one prefix the model knows; the exported tokenizer names it as its BOS too, which is the token
lm-eval's HF wrapper prefixes (sonic.models.hf.hf_tokenizer). A non-empty context is not prefixed,
because the HF wrapper does not prefix it either.
"""
from __future__ import annotations

import contextlib
import json

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor

from sonic.train.config import PRECISIONS  # the trainer's periodic eval passes train.precision through


@register_model("sonic")
class SonicLM(LM):
    """Either `checkpoint` (anything sonic.models.loading.load_model reads) or an in-memory `model`.

    tokenizer: a Sonic tokenizer object or its data.tokenizer name; default: the one the checkpoint names.
    """

    def __init__(self, checkpoint: str | None = None, model=None, tokenizer=None, batch_size: int | str = 16,
                 device: str | None = None, precision: str = "auto", max_gen_toks: int = 256,
                 kernel_backend: str = "auto", seed: int = 0):
        super().__init__()
        if (checkpoint is None) == (model is None):
            raise ValueError("give the sonic model either checkpoint=<path> or an in-memory model, not both")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        origin = "the in-memory model"
        self.checkpoint_path, self.checkpoint_step = None, None  # what was evaluated (results.json names them)
        if checkpoint is not None:
            from sonic.models.loading import load_model

            loaded = load_model(checkpoint, device=_device(device), kernel_backend=kernel_backend)
            model, origin = loaded.model, f"checkpoint {loaded.path}"
            self.checkpoint_path, self.checkpoint_step = str(loaded.path), loaded.step
            tokenizer = loaded.tokenizer if tokenizer is None else tokenizer
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = _tokenizer(tokenizer, origin)
        self.model, self.tokenizer = model.eval(), tokenizer
        self._device = next(model.parameters()).device
        self.max_length = model.cfg.max_seq_len
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                             f"{model.cfg.vocab_size}; pass the tokenizer the model was trained with")
        self.eos = int(tokenizer.eos_token_id)
        self.pad = self.eos if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)
        use_bf16 = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext
        self._generator = torch.Generator(device=self.device).manual_seed(seed)

    # --- lm-eval API --------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name", type(self.tokenizer).__name__)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self._score(pairs)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p over each whole text, in disjoint windows of at most max_seq_len tokens."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            tokens = self.tokenizer.encode(req.args[0])
            for w in get_rolling_token_windows(tokens, self.eos, self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with do_sample, temperature) decoding until a stop string, EOS or max_gen_toks."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # requests with equal generation settings share batches
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            order = sorted(members, key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                contexts = [self.tokenizer.encode(requests[i].args[0]) or [self.eos] for i in batch]
                for i, text in zip(batch, self._generate(contexts, max_new, until, temperature)):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    # --- scoring ------------------------------------------------------------------------

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokens, as lm-eval's HFLM splits them: trailing context spaces move to
        the continuation; an empty context becomes EOS (unless the continuation itself starts with EOS)."""
        if not context:
            tokens = self.tokenizer.encode(continuation)
            return ([self.eos], tokens) if tokens[:1] != [self.eos] else (tokens[:1], tokens[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        n_context = len(self.tokenizer.encode(context))
        return whole[:n_context], whole[n_context:]

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> Tensor:
        """log-softmax (fp32) of the model on right-padded rows: (B, S, V)."""
        S = max(len(r) for r in rows)
        ids = torch.full((len(rows), S), self.pad, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        with self._autocast():
            logits = self.model(ids.to(self.device)).logits_BSV
        return F.log_softmax(logits.float(), dim=-1)

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), whether greedy decoding yields it) per pair, batched."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            wholes = []
            for i in batch:
                context, continuation = pairs[i]
                if not continuation:
                    raise ValueError("lm-eval asked for the log-likelihood of an empty continuation")
                if len(continuation) > self.max_length:
                    raise ValueError(f"a continuation of {len(continuation)} tokens exceeds model.max_seq_len="
                                     f"{self.max_length}")
                wholes.append((context + continuation)[-(self.max_length + 1):])  # left-truncate the context
            logprobs = self._logprobs([w[:-1] for w in wholes])
            for b, (i, whole) in enumerate(zip(batch, wholes)):
                n = len(pairs[i][1])
                target = torch.tensor(whole[-n:], device=logprobs.device)
                lp = logprobs[b, len(whole) - 1 - n:len(whole) - 1]
                results[i] = (lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all()))
        return results

    @torch.no_grad()
    def _generate(self, contexts: list[list[int]], max_new: int, until: list[str], temperature: float) -> list[str]:
        keep = max(1, self.max_length - max_new)
        rows = [c[-keep:] for c in contexts]
        prompt_len = [len(r) for r in rows]
        done = [False] * len(rows)
        for _ in range(max_new):
            active = [b for b in range(len(rows)) if not done[b] and len(rows[b]) < self.max_length]
            if not active:
                break
            logprobs = self._logprobs([rows[b] for b in active])
            last = torch.stack([logprobs[j, len(rows[b]) - 1] for j, b in enumerate(active)])
            if temperature > 0:
                nxt = torch.multinomial((last / temperature).softmax(-1), 1, generator=self._generator)[:, 0]
            else:
                nxt = last.argmax(-1)
            for b, token in zip(active, nxt.tolist()):
                rows[b].append(token)
                text = self.tokenizer.decode(rows[b][prompt_len[b]:])
                done[b] = token == self.eos or any(s in text for s in until)
        outputs = []
        for b, row in enumerate(rows):
            generated = row[prompt_len[b]:]
            text = self.tokenizer.decode(generated[:-1] if generated and generated[-1] == self.eos else generated)
            for s in until:
                text = text.split(s)[0]
            outputs.append(text)
        return outputs


def _positive_int(name: str, value) -> int:
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a positive integer ('auto' is not supported)") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    return value


def _device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _tokenizer(name: str | None, origin):
    from sonic.data import DataConfig, build_tokenizer

    if name is None:
        raise ValueError(f"{origin} names no tokenizer (a Hugging Face directory without tokenizer files?); "
                         f"pass tokenizer=<name or directory>")
    return build_tokenizer(DataConfig(tokenizer=name))
