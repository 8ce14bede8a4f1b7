"""SonicLM against direct scoring with the model: log-likelihoods, rolling windows, generation, batching."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from eval.lm import SonicLM  # noqa: E402
from sonic.data.tokenizer import ByteTokenizer  # noqa: E402
from tests.eval.conftest import save_checkpoint, tiny_config, tiny_model  # noqa: E402

TOK = ByteTokenizer()
PAIRS = [("Kit is a red fox. When Kit is happy, the fox", " barks"),
         ("Q: What is 2 plus 3? A: 2 plus 3 is ", "5"),  # trailing space moves to the continuation
         ("A", " much longer continuation than its context"),
         ("Worksheet 12.\n7 x 6 =", " 42")]


def requests(kind, args_list):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(args_list)]


def direct_logprob(model, context: str, continuation: str) -> float:
    """log p(continuation | context) summed over its bytes, one unpadded sequence at a time; an empty
    context is EOS (eval/lm.py's convention, lm-eval's own)."""
    ctx, cont = TOK.encode(context) or [TOK.eos_token_id], TOK.encode(continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logprobs = F.log_softmax(model(ids[:, :-1]).logits_BSV.float(), -1)[0]
    return sum(logprobs[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_config(max_seq_len=64), seed=3)


def test_loglikelihood_equals_direct_scoring_in_any_batch_size(model):
    # lm-eval convention (as its HFLM): trailing context whitespace is scored as part of the continuation;
    # an empty context is EOS
    pairs = PAIRS + [("", "Nell lives in the pond.")]
    expected = [direct_logprob(model, c.rstrip(), c[len(c.rstrip()):] + x) for c, x in pairs]
    assert len({round(e, 3) for e in expected}) == len(expected)  # distinct values: order mix-ups would show
    for batch_size in (1, 3, 8):
        lm = SonicLM(model=model, tokenizer=TOK, batch_size=batch_size)
        got = lm.loglikelihood(requests("loglikelihood", pairs))
        assert [g[0] for g in got] == pytest.approx(expected, rel=1e-6, abs=1e-4)  # fp32 sums


def test_is_greedy_flags_the_argmax_continuation(model):
    printable = AsciiOnly(model)
    lm = SonicLM(model=printable, tokenizer=TOK)
    context = "Tilly is a brown rabbit."
    greedy = TOK.decode(manual_greedy(printable, context, 4))
    other = chr(ord(greedy[0]) + 1) + greedy[1:]
    (_, is_greedy), (_, other_greedy) = lm.loglikelihood(requests("loglikelihood", [(context, greedy),
                                                                                    (context, other)]))
    assert is_greedy and not other_greedy


def test_loglikelihood_rolling_scores_every_token_once_within_max_seq_len(model):
    lm = SonicLM(model=model, tokenizer=TOK, batch_size=2)
    short, long = "Nell lives in the pond.", "The town of Cress stands on the river Ure. " * 4  # 172 bytes > 64
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(short,), (long,)]))
    assert got[0] == pytest.approx(direct_logprob(model, "", short), rel=1e-6, abs=1e-4)  # fp32 sums of ~-30 terms
    # Independent reference: token j is predicted from at most max_seq_len inputs ending right before it,
    # in disjoint windows of max_seq_len predictions (the first window starts with EOS).
    tokens, L = TOK.encode(long), model.cfg.max_seq_len
    full = [TOK.eos_token_id] + tokens
    total = 0.0
    for start in range(0, len(tokens), L):
        end = min(start + L, len(tokens))  # predict tokens[start:end] (full[start + 1:end + 1])
        inputs = full[max(0, end - L):end]
        with torch.no_grad():
            lp = F.log_softmax(model(torch.tensor([inputs])).logits_BSV.float(), -1)[0]
        offset = max(0, end - L)
        total += sum(lp[j - offset, full[j + 1]].item() for j in range(start, end))
    assert got[1] == pytest.approx(total, abs=1e-3)


class AsciiOnly(torch.nn.Module):
    """Masks every non-printable-ASCII token, so greedy text round-trips through the byte tokenizer."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.cfg = model, model.cfg
        ids = torch.arange(model.cfg.vocab_size)
        self.register_buffer("blocked_V", (ids < 3 + 32) | (ids >= 3 + 127))

    def forward(self, ids):
        out = self.inner(ids)
        return dataclasses.replace(out, logits_BSV=out.logits_BSV.masked_fill(self.blocked_V, -1e9))


def manual_greedy(model, context: str, steps: int) -> list[int]:
    ids = TOK.encode(context)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(model(torch.tensor([ids])).logits_BSV[0, -1].argmax().item())
    return ids[-steps:]


def test_generate_until_is_greedy_batched_and_stops_at_until(model):
    printable = AsciiOnly(model)
    contexts = ["Every morning Pip eats", "Q: Where does the owl live? A: The owl lives in the old"]
    lm = SonicLM(model=printable, tokenizer=TOK, batch_size=2)
    got = lm.generate_until(requests("generate_until", [(c, {"until": [], "max_gen_toks": 6}) for c in contexts]))
    assert got == [TOK.decode(manual_greedy(printable, c, 6)) for c in contexts]
    stop = got[0][2:4]
    cut = lm.generate_until(requests("generate_until", [(contexts[0], {"until": [stop], "max_gen_toks": 6}),
                                                        (contexts[1], {"until": [stop], "max_gen_toks": 6})]))
    assert cut[0] == got[0].split(stop)[0] and len(cut[0]) <= 2
    assert cut[1] == got[1].split(stop)[0]


def test_rejects_a_tokenizer_larger_than_the_vocab():
    model = tiny_model(tiny_config()).eval()
    model.cfg.vocab_size = 100  # pretend the model was built for a smaller vocab
    with pytest.raises(ValueError, match="tokenizer has 259 tokens"):
        SonicLM(model=model, tokenizer=TOK)


def test_rejects_unusable_arguments(model):
    with pytest.raises(ValueError, match="either checkpoint"):
        SonicLM()
    with pytest.raises(ValueError, match="batch_size"):
        SonicLM(model=model, tokenizer=TOK, batch_size="auto")
    with pytest.raises(ValueError, match="precision"):
        SonicLM(model=model, tokenizer=TOK, precision="fp8")


@pytest.mark.slow
def test_python_m_eval_and_lm_eval_hf_on_the_export_agree(tmp_path, monkeypatch):
    """`python -m eval` on a checkpoint and `lm_eval --model hf` on its export give the same accuracy and the
    same log-likelihood for every request: one tokenization (nothing appended) and one EOS convention."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from eval.__main__ import run, to_eval_config
    from scripts import export_hf

    model = tiny_model(tiny_config(), seed=5)
    with torch.no_grad():  # attention that matters (o_proj starts at zero), so a stray or missing EOS shows
        for layer in model.layers:
            layer.attn.o_proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(6))
    step_dir = save_checkpoint(model, tmp_path / "run")
    run_dir, hf_dir, root = tmp_path / "run", tmp_path / "hf", Path(__file__).resolve().parents[2]
    monkeypatch.setattr(sys, "argv", ["export_hf.py", str(run_dir), str(hf_dir)])
    export_hf.main()
    limit = 20
    ours = run(to_eval_config({"checkpoint": str(run_dir), "limit": limit, "output_dir": str(tmp_path / "sonic"),
                               "kernel_backend": "reference", "bootstrap_iters": 0}))
    ours = json.loads(ours.read_text())
    assert ours["meta"]["step"] == 7 and ours["meta"]["evaluated"] == str(step_dir)

    subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hf_dir},dtype=float32",
                    "--tasks", "sonic_world", "--include_path", "eval/tasks", "--limit", str(limit), "--device", "cpu",
                    "--batch_size", "8", "--log_samples", "--output_path", str(tmp_path / "hf_out")],
                   cwd=root, check=True, capture_output=True, text=True, timeout=600)
    [results] = (tmp_path / "hf_out").glob("*/results_*.json")
    [samples] = (tmp_path / "hf_out").glob("*/samples_sonic_world_*.jsonl")
    theirs = json.loads(results.read_text())["results"]["sonic_world"]
    for metric in ("acc", "acc_norm"):
        assert ours["results"]["sonic_world"][f"{metric},none"] == theirs[f"{metric},none"]

    args, hf_scores = [], []
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        args += [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        hf_scores += [(float(ll), greedy == "True") for [[ll, greedy]] in sample["resps"]]
    assert len(args) == 4 * limit
    sonic = SonicLM(checkpoint=str(run_dir), kernel_backend="reference", batch_size=8)
    sonic_scores = sonic.loglikelihood(requests("loglikelihood", args))
    assert [g for _, g in sonic_scores] == [g for _, g in hf_scores]
    assert [ll for ll, _ in sonic_scores] == pytest.approx([ll for ll, _ in hf_scores], rel=0, abs=1e-4)
