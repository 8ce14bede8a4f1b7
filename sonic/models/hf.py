"""Hugging Face interop: Sonic <-> OlmoeForCausalLM / Qwen3MoeForCausalLM (config.json + safetensors).

Why a converter and not a rename: Sonic stores the experts of a layer stacked, with gate and
up rows interleaved (w1_EFD row 2j = gate j, 2j+1 = up j; w2_EDN (E, D, N)). Hugging Face
checkpoints on disk hold one gate_proj / up_proj / down_proj Linear per expert (transformers
5.x fuses them into gate_up_proj = [gate; up] blocks in memory and un-fuses them on save).
Export writes the per-expert form that every transformers version loads; import reads both.

Architecture follows the attention's qk-norm:
  qk_norm full -> olmoe      (q/k norm over all heads at once; head_dim must be dim // num_heads)
  qk_norm head -> qwen3_moe  (per-head q/k norm; GQA, explicit head_dim, first-k dense layers)
Routing in both: softmax over E, top-K of the probabilities, norm_topk_prob renormalises the K.
Sonic's topk_softmax (softmax over the K picked logits) is the same function as softmax_topk
with renormalisation, so it exports as norm_topk_prob=true.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import Tensor

from sonic.kernels.swiglu import deinterleave, interleave
from sonic.models.config import ModelConfig, MoEConfig
from sonic.routing.config import RoutingConfig

log = logging.getLogger("sonic")
ARCHITECTURES = {"olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_ROUTER_STATE = ("ffn.router.balance_residual_E", "ffn.router.balance_pending_E")  # training-only buffers

# Sonic name (after "layers.<i>.") <-> HF name (after "model.layers.<i>."), dense parts only.
_LAYER_RENAMES = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    *[(f"attn.{p}.weight", f"self_attn.{p}.weight")
      for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")],
    ("ffn.router.weight_ED", "mlp.gate.weight"),
    *[(f"ffn.{p}.weight", f"mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")],  # dense layers
]
_TOP_RENAMES = [("embed_tokens.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
                ("lm_head.weight", "lm_head.weight")]


# --------------------------------------------------------------------------- export


def hf_model_type(cfg: ModelConfig) -> str:
    """The HF architecture a Sonic config maps to, or a ValueError naming the field that prevents it."""
    m, r = cfg.moe, cfg.moe.routing
    if cfg.qk_norm == "none":
        raise ValueError("model.qk_norm='none' has no Hugging Face MoE counterpart: OLMoE needs qk_norm=full, "
                         "Qwen3-MoE qk_norm=head")
    if m.expert_bias:
        raise ValueError("model.moe.expert_bias=true: OLMoE and Qwen3-MoE experts have no biases")
    if m.shared_expert_dim:
        raise ValueError(f"model.moe.shared_expert_dim={m.shared_expert_dim}: OLMoE and Qwen3-MoE have no "
                         f"(ungated) shared expert")
    if cfg.embed_scale != 1.0:
        raise ValueError(f"model.embed_scale={cfg.embed_scale}: OLMoE and Qwen3-MoE feed the embedding to the first "
                         f"layer unscaled, so the exported model would compute differently")
    if r.method == "expert_choice":
        raise ValueError("model.moe.routing.method=expert_choice: HF routers are token-choice top-K")
    if r.input_centring != "none":
        raise ValueError(f"model.moe.routing.input_centring={r.input_centring}: HF routers read the hidden state "
                         f"itself, so the exported model would route differently")
    if r.logit_norm != "none":
        raise ValueError(f"model.moe.routing.logit_norm={r.logit_norm}: HF routers pick the top-K of their logits as "
                         f"they are, so the exported model would route differently")
    if r.balance != "none":
        raise ValueError(f"model.moe.routing.balance={r.balance}: HF routers pick the top-K of their logits with no "
                         f"per-batch offset, so the exported model would route differently")
    if cfg.qk_norm == "full":
        if cfg.first_k_dense:
            raise ValueError(f"model.first_k_dense={cfg.first_k_dense}: OLMoE has no dense layers "
                             f"(Qwen3-MoE does: use qk_norm=head)")
        if cfg.head_size * cfg.num_heads != cfg.dim:
            raise ValueError(f"model.head_dim={cfg.head_dim}: OLMoE's full-width q/k norms need "
                             f"head_dim == dim // num_heads = {cfg.dim // cfg.num_heads}")
        return "olmoe"
    return "qwen3_moe"


def to_hf_config(cfg: ModelConfig, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 bos_token_id: int | None = None):
    """The transformers config (OlmoeConfig or Qwen3MoeConfig) of a Sonic model config."""
    from transformers import OlmoeConfig, Qwen3MoeConfig

    model_type, m = hf_model_type(cfg), cfg.moe
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, hidden_act="silu",
                  max_position_embeddings=cfg.max_seq_len, initializer_range=cfg.init_std,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, rope_theta=cfg.rope_theta,
                  attention_bias=False, num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                  norm_topk_prob=m.routing.order == "topk_softmax" or m.routing.renormalize,
                  router_aux_loss_coef=m.routing.aux_loss_coef, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id, bos_token_id=bos_token_id, architectures=[ARCHITECTURES[model_type]])
    if model_type == "olmoe":
        return OlmoeConfig(intermediate_size=m.expert_dim, clip_qkv=None, **common)
    return Qwen3MoeConfig(head_dim=cfg.head_size, moe_intermediate_size=m.expert_dim,
                          intermediate_size=cfg.dense_dim if cfg.first_k_dense else m.expert_dim,
                          mlp_only_layers=list(range(cfg.first_k_dense)), decoder_sparse_step=1,
                          use_sliding_window=False, **common)


def to_hf_state_dict(cfg: ModelConfig, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sonic state dict -> HF per-expert state dict (same values; experts un-stacked, gate/up split)."""
    hf_model_type(cfg)  # refuses what HF cannot represent
    out: dict[str, Tensor] = {}
    for name, t in state_dict.items():
        hf = _rename(name, to_hf=True)
        if hf is not None:
            if not (cfg.tie_embeddings and hf == "lm_head.weight"):
                out[hf] = t
            continue
        layer, rest = _split_layer(name)
        prefix = f"model.layers.{layer}.mlp.experts"
        if rest == "ffn.w1_EFD":
            gate_END, up_END = deinterleave(t)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate_END[e]
                out[f"{prefix}.{e}.up_proj.weight"] = up_END[e]
        elif rest == "ffn.w2_EDN":
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        elif rest == "ffn.router.expert_bias_E":
            if t.abs().max() > 0:
                raise ValueError(f"{name} is nonzero (aux-loss-free balancing, routing.bias_update_rate > 0): HF "
                                 f"routers have no selection bias, so the exported model would route differently")
        elif rest not in _ROUTER_STATE:
            raise ValueError(f"state dict entry {name!r} has no Hugging Face counterpart")
    return {k: v.detach().contiguous() for k, v in out.items()}


def export_hf(model_or_state: torch.nn.Module | dict[str, Tensor], cfg: ModelConfig, out_dir: str | Path,
              tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors (+ the tokenizer, if given) that transformers loads."""
    from safetensors.torch import save_file

    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    eos = getattr(tokenizer, "eos_token_id", None)  # also the BOS: see hf_tokenizer
    hf_config = to_hf_config(cfg, eos_token_id=eos, pad_token_id=getattr(tokenizer, "pad_token_id", None),
                             bos_token_id=eos)
    tensors = to_hf_state_dict(cfg, state)
    dtype = dtype or next(iter(tensors.values())).dtype
    tensors = {k: (v.to("cpu", dtype) if v.is_floating_point() else v.cpu()).contiguous() for k, v in tensors.items()}
    hf_config.dtype = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


# GPT-2's byte -> printable character table (tokenizers' ByteLevel alphabet): the byte tokenizer's
# vocabulary as a fast tokenizer, byte b -> id b + 3 like Sonic's ByteTokenizer (ByT5's id layout).
def _byte_chars() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def _byte_tokenizer():
    """Sonic's byte tokenizer as a transformers fast tokenizer: the same ids, and no special tokens added.

    Not ByT5Tokenizer: its encode appends </s> to every text, and lm-eval's HF wrapper encodes with
    the tokenizer's defaults, so every context and continuation it scored ended in a stray </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<pad>": 0, "</s>": 1, "<unk>": 2}  # ByteTokenizer's pad, eos, unk
    vocab = {**specials, **{c: b + len(specials) for b, c in _byte_chars().items()}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def hf_tokenizer(tokenizer):
    """The transformers tokenizer an export ships: it encodes text exactly as Sonic's `encode` does.

    Sonic never adds special tokens to text (packing inserts EOS between documents itself) and reads
    "</s>" in a text as characters, so the exported tokenizer's plain `encode(text)`, which is what
    lm-eval's HF wrapper and most users call, must do the same: no BOS/EOS added, special tokens split.
    Its BOS is set to the EOS token, because EOS is what precedes a document in training: lm-eval
    conditions an empty context on BOS, so both evaluators prefix the same token (eval/lm.py)."""
    import copy

    if getattr(tokenizer, "hf", None) is not None:
        hf = copy.deepcopy(tokenizer.hf)
    elif getattr(tokenizer, "name", None) == "byte":
        hf = _byte_tokenizer()
    else:
        raise ValueError(f"export_hf(tokenizer={type(tokenizer).__name__}): pass a Sonic tokenizer "
                         f"(sonic.data.build_tokenizer), which knows how the run encoded its text")
    for flag in ("add_bos_token", "add_eos_token"):  # Llama-style tokenizers rebuild their post-processor from these
        if getattr(hf, flag, False):
            setattr(hf, flag, False)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        backend.post_processor = None  # e.g. a TemplateProcessing that wraps every text in <s> ... </s>
    hf.split_special_tokens = True
    hf.init_kwargs["split_special_tokens"] = True  # what save_pretrained writes
    hf.bos_token = hf.eos_token
    return hf


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Write hf_tokenizer(tokenizer) and check that the saved files load and encode text as Sonic does."""
    from transformers import AutoTokenizer

    hf_tokenizer(tokenizer).save_pretrained(str(out_dir))
    reloaded = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    probe = "Kit is a red fox. </s> 7 x 6 = 42\n"
    if reloaded.encode(probe) != list(tokenizer.encode(probe)) or reloaded.bos_token_id != tokenizer.eos_token_id:
        raise ValueError(f"the tokenizer written to {out_dir} encodes text differently from the run's tokenizer "
                         f"(it adds or parses special tokens: {reloaded.encode(probe)[:8]}... vs "
                         f"{list(tokenizer.encode(probe))[:8]}...); export with --tokenizer naming a plain tokenizer")


# --------------------------------------------------------------------------- import


def from_hf_config(hf_config, name: str | None = None) -> ModelConfig:
    """Sonic ModelConfig of an OLMoE / Qwen3-MoE transformers config (a ValueError names what does not map)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json model_type={model_type!r}: only {', '.join(ARCHITECTURES)} can be imported")
    c = hf_config

    def refuse(field: str, why: str):
        raise ValueError(f"{model_type} config.json {field}={getattr(c, field, None)!r}: {why}")

    if getattr(c, "hidden_act", "silu") != "silu":
        refuse("hidden_act", "Sonic experts are SwiGLU (silu)")
    if getattr(c, "attention_bias", False):
        refuse("attention_bias", "Sonic attention projections have no biases")
    if getattr(c, "clip_qkv", None) is not None:
        refuse("clip_qkv", "Sonic attention does not clip q/k/v")
    if getattr(c, "use_sliding_window", False):
        refuse("use_sliding_window", "Sonic attention is full causal")
    rope_theta, rope_type = _rope(c)
    if rope_type != "default":
        refuse("rope_parameters", f"rope_type={rope_type!r} (RoPE scaling) is not implemented; only 'default'")
    head_dim = c.hidden_size // c.num_attention_heads
    first_k_dense, dense_dim, expert_dim = 0, 0, c.intermediate_size
    if model_type == "qwen3_moe":
        head_dim = getattr(c, "head_dim", None) or head_dim
        expert_dim = c.moe_intermediate_size
        dense = [i for i in range(c.num_hidden_layers)
                 if i in (c.mlp_only_layers or []) or c.num_experts == 0 or (i + 1) % c.decoder_sparse_step]
        if dense != list(range(len(dense))):
            refuse("mlp_only_layers", f"dense layers {dense} are not the first k layers (Sonic's first_k_dense)")
        first_k_dense, dense_dim = len(dense), c.intermediate_size if dense else 0
    elif head_dim * c.num_attention_heads != c.hidden_size:
        refuse("hidden_size", f"must be divisible by num_attention_heads={c.num_attention_heads}")
    norm_topk = bool(getattr(c, "norm_topk_prob", False))
    routing = RoutingConfig(order="softmax_topk", renormalize=norm_topk,
                            aux_loss_coef=float(getattr(c, "router_aux_loss_coef", 0.01)))
    moe = MoEConfig(num_experts=c.num_experts, top_k=c.num_experts_per_tok, expert_dim=expert_dim, routing=routing)
    return ModelConfig(
        name=name or model_type, vocab_size=c.vocab_size, dim=c.hidden_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=None if head_dim * c.num_attention_heads == c.hidden_size else head_dim,
        max_seq_len=c.max_position_embeddings, rope_theta=float(rope_theta),
        qk_norm="full" if model_type == "olmoe" else "head", norm_eps=float(c.rms_norm_eps),
        tie_embeddings=bool(c.tie_word_embeddings), first_k_dense=first_k_dense, dense_dim=dense_dim,
        init_std=float(getattr(c, "initializer_range", 0.02)), moe=moe)


def from_hf_state_dict(cfg: ModelConfig, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF state dict (per-expert or fused gate_up_proj) -> a complete Sonic state dict for `cfg`."""
    out: dict[str, Tensor] = {}
    experts: dict[tuple[int, str], dict[int, Tensor]] = {}  # (layer, gate/up/down) -> expert -> weight
    fused: dict[tuple[int, str], Tensor] = {}
    for name, t in hf_state.items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue  # tied: the embedding is the head
        sonic = _rename(name, to_hf=False)
        if sonic is not None:
            out[sonic] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
                         r"|(gate_up_proj|down_proj))", name)
        if m is None:
            raise ValueError(f"Hugging Face weight {name!r} has no Sonic counterpart")
        layer = int(m.group(1))
        if m.group(2) is not None:
            experts.setdefault((layer, m.group(3)), {})[int(m.group(2))] = t
        else:
            fused[(layer, m.group(4))] = t
    E, N = cfg.moe.num_experts, cfg.moe.expert_dim
    for layer in range(cfg.first_k_dense, cfg.num_layers):
        if (layer, "gate_up_proj") in fused:
            gate_up = fused[(layer, "gate_up_proj")]
            gate_END, up_END, down_EDN = gate_up[:, :N], gate_up[:, N:], fused.get((layer, "down_proj"))
        else:
            gate_END, up_END, down_EDN = (_stack(experts, layer, p, E) for p in ("gate_proj", "up_proj", "down_proj"))
        if down_EDN is None:
            raise ValueError(f"model.layers.{layer}.mlp.experts.down_proj is missing")
        out[f"layers.{layer}.ffn.w1_EFD"] = interleave(gate_END, up_END)
        out[f"layers.{layer}.ffn.w2_EDN"] = down_EDN
        out[f"layers.{layer}.ffn.router.expert_bias_E"] = torch.zeros(E, dtype=torch.float32)
        for buf in _ROUTER_STATE:
            out[f"layers.{layer}.{buf}"] = torch.zeros(E, dtype=torch.int64)
    return out


def import_hf(path: str | Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read a local HF OLMoE / Qwen3-MoE directory into a Sonic config and state dict."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    cfg = from_hf_config(hf_config, name=path.name)
    return cfg, from_hf_state_dict(cfg, read_safetensors_dir(path))


# Sonic field -> the config.json key it comes from: the fields that change what the model computes
# (shapes, RoPE, norms, routing). Weight shapes are checked again on load; rope_theta, norm_eps,
# top_k and the gate normalisation show in no shape, so a mismatch would load silently.
_COMPUTE_FIELDS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_size": "head_dim",
    "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "qk_norm": "model_type",
    "tie_embeddings": "tie_word_embeddings", "first_k_dense": "mlp_only_layers", "dense_dim": "intermediate_size",
    "moe.num_experts": "num_experts", "moe.top_k": "num_experts_per_tok",
    "moe.expert_dim": "moe_intermediate_size or intermediate_size",
    "moe.shared_expert_dim": "HF MoE models have no shared expert", "moe.expert_bias": "HF experts have no biases",
    "moe.routing.norm_topk_prob": "norm_topk_prob",
}


def _compute_value(cfg: ModelConfig, field: str):
    if field == "moe.routing.norm_topk_prob":  # Sonic's two gate orders, as the one HF flag they amount to
        r = cfg.moe.routing
        return r.order == "topk_softmax" or r.renormalize
    if field == "dense_dim" and not cfg.first_k_dense:
        return 0  # unused without dense layers
    value = cfg
    for part in field.split("."):
        value = getattr(value, part)
    return value


def hf_config_mismatches(path: str | Path, cfg: ModelConfig) -> list[str]:
    """Each config.json field of the HF directory `path` that changes the computation and differs from
    `cfg` (model.*), as "model.<field>=<ours> but config.json (<key>) gives <theirs>"; [] for a non-HF path."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        return []  # a Sonic checkpoint or file: its weights come with their own config
    theirs = from_hf_config(AutoConfig.from_pretrained(str(path), local_files_only=True))
    out = []
    for field, key in _COMPUTE_FIELDS.items():
        ours_v, theirs_v = _compute_value(cfg, field), _compute_value(theirs, field)
        if ours_v != theirs_v:
            name = ("model.moe.routing.order/renormalize (K gates renormalised)"
                    if field == "moe.routing.norm_topk_prob" else f"model.{field}")
            out.append(f"{name}={ours_v!r} but config.json ({key}) gives {theirs_v!r}")
    return out


def check_init_config(path: str | Path, cfg: ModelConfig, strict: bool = True) -> None:
    """train.init_from=<HF dir>: refuse (strict) or warn about config.json fields that differ from model.*."""
    mismatches = hf_config_mismatches(path, cfg)
    if not mismatches:
        return
    message = (f"train.init_from={str(path)!r}: its config.json differs from model={cfg.name} in fields that change "
               f"the computation:\n  " + "\n  ".join(mismatches) + "\nset those model.* fields to the config.json "
               f"values, or train.init_from_strict=false to load the weights anyway")
    if strict:
        raise ValueError(message)
    log.warning("%s (train.init_from_strict=false: loading anyway)", message.split("\nset those")[0])


def read_safetensors_dir(path: Path) -> dict[str, Tensor]:
    """All tensors of model.safetensors or of the shards listed in model.safetensors.index.json."""
    from safetensors.torch import load_file

    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        raise ValueError(f"{path} holds no model.safetensors or model.safetensors.index.json; convert .bin weights "
                         f"with transformers' save_pretrained(safe_serialization=True) first")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


# --------------------------------------------------------------------------- helpers


def _rope(c) -> tuple[float, str]:
    """(theta, type) from transformers 5 `rope_parameters` or 4.x `rope_theta` / `rope_scaling`."""
    params = getattr(c, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"], params.get("rope_type", "default")
    scaling = getattr(c, "rope_scaling", None) or {}
    return getattr(c, "rope_theta", 10000.0), scaling.get("rope_type", scaling.get("type", "default"))


def _split_layer(name: str) -> tuple[int, str]:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None:
        raise ValueError(f"state dict entry {name!r} has no Hugging Face counterpart")
    return int(m.group(1)), m.group(2)


def _rename(name: str, to_hf: bool) -> str | None:
    """Name of a dense (non-expert) weight on the other side, or None for expert / router-state entries."""
    src, dst = (0, 1) if to_hf else (1, 0)
    for pair in _TOP_RENAMES:
        if name == pair[src]:
            return pair[dst]
    layer_prefix = r"layers\.(\d+)\." if to_hf else r"model\.layers\.(\d+)\."
    m = re.fullmatch(layer_prefix + r"(.+)", name)
    if m is None:
        return None
    for pair in _LAYER_RENAMES:
        if m.group(2) == pair[src]:
            return ("model.layers." if to_hf else "layers.") + f"{m.group(1)}.{pair[dst]}"
    return None


def _stack(experts: dict, layer: int, proj: str, num_experts: int) -> Tensor:
    found = experts.get((layer, proj), {})
    missing = sorted(set(range(num_experts)) - set(found))
    if missing:
        raise ValueError(f"model.layers.{layer}.mlp.experts.<e>.{proj}.weight is missing for experts {missing}")
    return torch.stack([found[e] for e in range(num_experts)])
