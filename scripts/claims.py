"""The performance claims of README.md and docs/: tables rendered from committed result files, and checked.

  python -m scripts.claims            # re-render every claims block from bench/results/
  python -m scripts.claims --check    # exit 1, naming each problem, if a block or a cited file is wrong

A claims block is a table between two markers in a markdown file:

  <!-- claims:e2e_40l -->
  ...rendered from TABLES["e2e_40l"]: one row per result record, its GPU, date, commit and a numbered note...
  <!-- /claims:e2e_40l -->

Each table is declared below (TABLES): which file each row reads, which record of it (a filter on its
fields), and which fields the columns show. Each row names its GPU, date and commit, and its numbered note
below the table gives the file, the records, the commit and the command that produced them. A number in a block is a field
of the cited record, or a declared function of that record's fields (B tokens/day from tokens/s, a ratio of
two fields of one record or of two records of one file, causal MFU from the full-attention MFU).

--check fails when:
- a block differs from what its result files give now: a number not in the file it cites, a hand edit;
- a cited commit is not in the git history (`git cat-file -e`);
- a cited result file has no command, or is not committed;
- a table is declared but placed nowhere, or a block names no declared table;
- prose outside the blocks, in the sections that carry claims (CLAIM_SECTIONS), types a performance figure
  (a %, a ratio, TFLOPS, tokens/s, B/day, GiB, MiB, ms): prose cites the rows instead.

Provenance: a result file that records the commit it measured, and whose commit is in the history, cites it.
A file with no commit, or with one that is not in the history (rewritten before merging), cites the commit
that added the file to the repository, and its note says so: so commit a new result file first, then render.

Adding a table: declare it in TABLES, put its two markers where it belongs, run `python -m scripts.claims`.
"""
from __future__ import annotations

import argparse
import json
import re
import runpy
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/performance.md", "docs/reproduction.md", "docs/routing.md")
# (file, heading): prose there may not type a performance figure (None: the whole file).
CLAIM_SECTIONS = (("README.md", "## Training throughput"), ("README.md", "## Kernels and benchmarks"),
                  ("docs/performance.md", None), ("docs/reproduction.md", None))
PAPER_SOURCE = "scripts/repro/paper.py"  # the published numbers, each citing the paper; not a result file
BLOCK = re.compile(r"<!-- claims:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /claims:(?P=name) -->", re.S)
FIGURE = re.compile(  # a number or a range with a unit; "1.16×" is a ratio, "6 × N" and "2×H200" are not
    r"(?<![\w.])\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?"
    r"(?:×(?![A-Za-z0-9])(?!\s*\d)|\s?(?:%|k\b|TFLOPS|TFLOP/s|TF\b|tokens/s|B(?: tokens)?(?:/GPU)?/day|GiB|MiB|ms\b))")


class ClaimError(ValueError):
    """A table that cannot be rendered honestly from its files (a missing field, command or commit)."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Record:
    """One record of a result file, with the file around it (commands, dates and devices often live there)."""

    file: str  # relative to the repository root
    payload: dict  # the whole file
    data: dict  # the record (the payload itself when the file is one record)
    where: tuple  # the filter that picked it, for the note

    def get(self, path: str, default=None):
        """A dotted field of the record, else of the file (e.g. 'backends.cute.fwdbwd_tf', 'command')."""
        for source in (self.data, self.payload):
            value = _dig(source, path)
            if value is not None:
                return value
        return default

    def need(self, path: str):
        value = self.get(path)
        if value is None:
            raise ClaimError(f"{self.file} {self.label()}: no field {path!r}")
        return value

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.where) or "(the whole file)"

    def command_arg(self, key: str) -> str | None:
        """The last `key=value` override of the record's command (Hydra applies the last one)."""
        found = re.findall(rf"(?:^|\s){re.escape(key)}=(\S+)", self.get("command") or "")
        return found[-1] if found else None


def _dig(source, path: str):
    for part in path.split("."):
        if isinstance(source, dict) and part in source:
            source = source[part]
        elif isinstance(source, list) and part.isdigit() and int(part) < len(source):
            source = source[int(part)]
        else:
            return None
    return source


def load(root: Path, file: str) -> dict:
    """A result file as a dict: JSON; JSON lines as {'records': [...]}; the paper's module as its constants."""
    path = root / file
    if not path.is_file():
        raise ClaimError(f"{file} does not exist")
    if file == PAPER_SOURCE:
        return {k: v for k, v in runpy.run_path(str(path)).items() if k.isupper()}
    if path.suffix == ".jsonl":
        return {"records": [json.loads(line) for line in path.read_text().splitlines() if line.strip()]}
    return json.loads(path.read_text())


def select(root: Path, file: str, records: str, where: dict) -> Record:
    """The one record of `file` (under `records`, a list or a dict keyed by name) whose fields match `where`."""
    payload = load(root, file)
    if not where:
        return Record(file, payload, payload, ())
    container = _dig(payload, records)
    if isinstance(container, dict):
        container = [{"name": key, **value} for key, value in container.items()]
    if not isinstance(container, list):
        raise ClaimError(f"{file}: no record list {records!r}")
    found = [r for r in container if all(_dig(r, k) == v for k, v in where.items())]
    if len(found) != 1:
        raise ClaimError(f"{file}: {len(found)} records under {records!r} match {where} (the spec needs exactly one)")
    return Record(file, payload, found[0], tuple(where.items()))


# --------------------------------------------------------------------------- columns


@dataclass(frozen=True)
class Where:
    """Where a cell is rendered: the repository, the table row, and the previous row's record."""

    root: Path
    row: Row
    above: Record | None


@dataclass(frozen=True)
class Field:
    """A number of the record: value x scale, `digits` decimals, then `suffix`."""

    header: str
    path: str
    scale: float = 1.0
    digits: int = 1
    suffix: str = ""
    missing: str | None = None  # what an absent value reads as (None: it is an error)

    def cell(self, rec: Record, at: Where) -> str:
        if self.missing is not None and rec.get(self.path) is None:
            return self.missing
        return f"{rec.need(self.path) * self.scale:.{self.digits}f}{self.suffix}"


ABOVE = {"_": "the row above"}  # Ratio.den_where: the record of the table's previous row


@dataclass(frozen=True)
class Ratio:
    """num / den: both fields of the row's record, or den of another record of the same file (den_where, and
    the row's own values of the fields den_same: e.g. the torchtitan row of the same commit), or of the previous
    row's record (den_where=ABOVE)."""

    header: str
    num: str
    den: str
    den_where: dict | None = None
    digits: int = 2
    den_same: tuple[str, ...] = ()

    def cell(self, rec: Record, at: Where) -> str:
        if self.den_where is ABOVE:
            other = at.above or rec  # the first row is its own base
        elif self.den_where is not None:
            where = {**self.den_where, **{key: rec.get(key) for key in self.den_same}}
            other = select(at.root, at.row.file, at.row.records, where)
        else:
            other = rec
        return f"{rec.need(self.num) / other.need(self.den):.{self.digits}f}×"


@dataclass(frozen=True)
class KernelMs:
    """The milliseconds of a profiled step's kernels (a record's `kernels`: name, ms) whose name matches `pattern`;
    `rest=True`: the step's time (`step`) less every kernel that matches it."""

    header: str
    pattern: str
    rest: bool = False
    step: str = "step_ms"
    digits: int = 1

    def cell(self, rec: Record, at: Where) -> str:
        ms = sum(k["ms"] for k in rec.need("kernels") if re.search(self.pattern, k["name"]))
        return f"{rec.need(self.step) - ms if self.rest else ms:.{self.digits}f}"


@dataclass(frozen=True)
class Count:
    """How many values of a list field are <= `at_most` (e.g. layers whose max/mean load is at most 2)."""

    header: str
    path: str
    at_most: float

    def cell(self, rec: Record, at: Where) -> str:
        values = rec.need(self.path)
        return f"{sum(v <= self.at_most for v in values)} / {len(values)}"


@dataclass(frozen=True)
class Largest:
    """The largest value of a list field, or its median (median=True)."""

    header: str
    path: str
    digits: int = 2
    median: bool = False
    missing: str | None = None  # what an absent list reads as (None: it is an error)

    def cell(self, rec: Record, at: Where) -> str:
        if self.missing is not None and rec.get(self.path) is None:
            return self.missing
        values = rec.need(self.path)
        value = statistics.median(values) if self.median else max(values)
        return f"{value:.{self.digits}f}"


@dataclass(frozen=True)
class Text:
    """A field shown as it is (a step range, a backend name), or `key=` overrides of the command (args)."""

    header: str
    path: str = ""
    args: tuple = ()
    sep: str = " × "

    def cell(self, rec: Record, at: Where) -> str:
        values = [rec.command_arg(a) for a in self.args] if self.args else [rec.get(self.path)]
        if None in values:
            raise ClaimError(f"{rec.file} {rec.label()}: no {self.args or self.path!r}")
        return self.sep.join(str(v) for v in values)


@dataclass(frozen=True)
class CausalMfu:
    """MFU with the attention a causal mask needs (sonic.models.TrainingFlops.causal): the record's
    `mfu_causal`, or, for files written before it was logged, its full-attention `mfu` x causal / full
    FLOPs per token of the model it ran (preset, layers and sequence length from the record or its command)."""

    header: str = "MFU"
    path: str = "mfu"

    def cell(self, rec: Record, at: Where) -> str:
        causal = rec.get(self.path + "_causal")
        if causal is None:
            causal = rec.need(self.path) * causal_share(*model_shape(rec))
        return f"{100 * causal:.1f}%"


def model_shape(rec: Record) -> tuple[str, int, int]:
    """(preset, layers, seq_len) of the model a record measured."""
    preset = next((m for m in (rec.data.get("model"), rec.payload.get("model")) if isinstance(m, str)), None)
    preset = preset or rec.command_arg("model") or rec.command_arg("experiment")
    layers = rec.get("layers") or rec.get("num_layers") or rec.command_arg("model.num_layers")
    seq = rec.get("seq_len") or rec.get("batch.1") or rec.command_arg("train.seq_len")
    if not (preset and layers and seq):
        raise ClaimError(f"{rec.file} {rec.label()}: the model preset, layers or seq_len is not recorded, so its "
                         f"causal MFU cannot be derived (got {preset}, {layers}, {seq})")
    return preset, int(layers), int(seq)


@lru_cache(maxsize=None)
def causal_share(preset: str, layers: int, seq_len: int) -> float:
    from sonic.models import training_flops  # noqa: PLC0415 - keeps --help light
    from sonic.models.presets import load_preset  # noqa: PLC0415

    flops = training_flops(load_preset(preset, num_layers=layers), seq_len)
    return flops.causal / flops.full


# --------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Row:
    label: str
    file: str
    where: dict = field(default_factory=dict)  # {} = the file is the record
    records: str = "records"  # where the file keeps its records


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple
    rows: tuple
    first: str = "run"  # the label column's header
    caption: str = ""  # one line above the table (no figures: those belong in cells)


ROUTING_COLUMNS = (Field("worst max/mean, steps 30-100", "summary.worst_max_over_mean_from_step_30", digits=2),
                   Field("worst max/mean, step 100", "summary.worst_max_over_mean_at_last_step", digits=2),
                   Field("layers over 2×, step 100", "summary.layers_over_2x_at_last_step", digits=0),
                   Field("loss, step 100", "summary.loss_at_last_step", digits=2),
                   Field("k tokens/s", "summary.tokens_per_s_per_gpu", 1e-3, missing="–"))
# the same with the mean loss over steps 30-100 before the throughput (a single step's loss is noisy)
ROUTING_MEAN_LOSS_COLUMNS = (*ROUTING_COLUMNS[:4],
                             Field("mean loss, steps 30-100", "summary.loss_mean_from_step_30", digits=2),
                             ROUTING_COLUMNS[4])


def sweep_columns(*configs: str) -> tuple[Field, ...]:
    """A bench/cute_gemm.py sweep record's columns: each config's ms ("–" where it did not run), then cuBLAS's."""
    return (*(Field(f"{c} ms", f"sweep_ms.{c}", digits=3, missing="–") for c in configs),
            Field("cuBLAS ms", "cublas_ms", digits=3))


def table_9b_block_rows(file: str) -> tuple[Row, ...]:
    """A full bench.moe_block table's rows: Table 9b's twelve configs, each on cute and triton, compiled."""
    return tuple(Row(f"{config}, {backend}+compile", file, {"config": config, "backend": f"{backend}+compile"})
                 for config in ("1.4B", "1.4B-E64", "1.4B-E32", "7B", "7B-E64", "7B-E32", "30B-E256", "30B",
                                "30B-E64", "120B-E256", "120B", "120B-E64")
                 for backend in ("cute", "triton"))


def store_ab_rows(file: str) -> tuple[Row, ...]:
    """The rows of a down/dX~ store-epilogue A/B (a "rows" list keyed by shape and kernel), four shapes x both."""
    return tuple(Row(f"{name}, {kernel}", file, {"shape": shape, "kernel": kernel}, "rows")
                 for name, shape in (("30B", "30b"), ("Qwen3-Next", "qwen3next"), ("7B", "7b"), ("OLMoE", "olmoe"))
                 for kernel in ("down", "dx"))


def e2e(label: str, file: str, run: str) -> Row:
    return Row(label, f"bench/results/{file}", {"run": run})


def tr_jobs(label: str, cute_file: str, triton_file: str) -> tuple[Row, ...]:
    """A cute job's top-K and token-rounding rows, then the same two from the triton job beside it."""
    return (e2e(label, cute_file, "cute_40L"),
            e2e("the same job, `routing=token_rounding`", cute_file, "cute_token_rounding_40L"),
            e2e("the same two on triton: top-K", triton_file, "triton_40L"),
            e2e("triton, `routing=token_rounding`", triton_file, "triton_token_rounding_40L"))


E2E_40L, E2E_40L_MB8 = "2026-11-23-2xh200-e2e-40L.json", "2026-11-23-2xh200-e2e-40L-mb8-noreshard.json"
E2E_1X = "2026-11-24-1xh200-e2e-40L.json"
E2E_1X_CENTRING, E2E_1X_TR = "2026-11-24-1xh200-e2e-40L-centring.json", "2026-11-24-1xh200-e2e-40L-tr.json"
E2E_1X_TR_PADDED, E2E_1X_TR_OP = "2026-11-24-1xh200-e2e-40L-tr-padded.json", "2026-11-24-1xh200-e2e-40L-tr-op.json"
E2E_1X_FA4, E2E_1X_FA4_2 = "2026-11-29-1xh200-e2e-40L-fa4.json", "2026-11-29-1xh200-e2e-40L-fa4-2.json"
E2E_1X_H100 = "2026-12-06-1xh100-e2e-40L.json"
E2E_1X_TR_OP_TRITON = "2026-11-24-1xh200-e2e-40L-tr-op-triton.json"
E2E_1X_TR_GRAPH, E2E_1X_TR_GRAPH_TRITON = ("2026-11-24-1xh200-e2e-40L-tr-graph.json",
                                          "2026-11-24-1xh200-e2e-40L-tr-graph-triton.json")
E2E_1X_TR_EAGER, E2E_1X_TR_EAGER_TRITON = ("2026-11-24-1xh200-e2e-40L-tr-fused-eager.json",
                                          "2026-11-24-1xh200-e2e-40L-tr-fused-eager-triton.json")
E2E_1X_TR_FUSED, E2E_1X_TR_FUSED_TRITON = ("2026-11-24-1xh200-e2e-40L-tr-fused.json",
                                          "2026-11-24-1xh200-e2e-40L-tr-fused-triton.json")
E2E_1X_ADAMW, E2E_1X_ADAMW_TRITON = ("2026-11-24-1xh200-e2e-40L-adamw1pass.json",
                                    "2026-11-24-1xh200-e2e-40L-adamw1pass-triton.json")
E2E_1X_CE_TRITON = "2026-11-24-1xh200-e2e-40L-ce-triton.json"
E2E_1X_CLUSTERS = "2026-11-25-1xh200-e2e-40L.json"
E2E_1X_CENTRING_BEFORE, E2E_1X_CENTRING_FUSED = ("2026-11-25-1xh200-e2e-40L-centring-before.json",
                                                 "2026-11-25-1xh200-e2e-40L-centring-fused.json")
E2E_1X_WEIGHTS = {f"{dtype}-{n}": f"2026-11-25-1xh200-e2e-40L-{dtype}weights-{n}.json" for dtype in ("fp32", "bf16")
                  for n in (1, 2)}
E2E_1X_GRAPHS = {f"{kind}-{n}": f"2026-11-25-1xh200-e2e-40L-{kind}-{n}.json" for kind in ("onegraph", "fivegraphs")
                 for n in (1, 2)}
E2E_1X_MOMENTS = {n: f"2026-11-25-1xh200-e2e-40L-moments-{n}.json" for n in (1, 2)}
E2E_1X_LAUNCHES = {f"{when}-{n}": f"2026-11-25-1xh200-e2e-40L-launches-{when}-{n}.json" for when in ("before", "after")
                   for n in (1, 2)}
E2E_1X_DEFAULT_MOMENTS = {f"{bits}-{n}": f"2026-11-25-1xh200-e2e-40L-moments-{bits}-{n}.json"
                          for bits in ("philox", "hash") for n in (1, 2, 3, 4)}
E2E_1X_TRITON_E3BA90E = "2026-11-25-1xh200-e2e-40L-triton-e3ba90e.json"
E2E_1X_NOMASTER = {n: f"2026-11-25-1xh200-e2e-40L-nomaster-{n}.json" for n in (1, 2)}
E2E_1X_TRITON_8F1B5EB = "2026-11-25-1xh200-e2e-40L-triton-8f1b5eb.json"
E2E_1X_GRADNORM = "2026-11-25-1xh200-e2e-40L-gradnorm.json"
E2E_1X_LOGITNORM = "2026-11-25-1xh200-e2e-40L-logitnorm.json"
E2E_1X_CONSTSCALE = "2026-11-25-1xh200-e2e-40L-constscale-1.json"
E2E_1X_DIRECT = "2026-11-26-1xh200-e2e-40L.json"
E2E_1X_DIRECT_AB = ("2026-11-26-1xh200-e2e-40L-ab-cd4c642.json", "2026-11-26-1xh200-e2e-40L-ab-bdae4e5.json")
E2E_1X_TR_GRAM = "2026-11-26-1xh200-e2e-40L-tr.json"
E2E_1X_TR_ROUTE = "2026-11-26-1xh200-e2e-40L-tr-7ff3caa.json"
E2E_1X_EXACTGRAD = "2026-11-25-1xh200-e2e-40L-exactgrad-2.json"
CENTRING_GRAD = {"exact": "bench/results/2026-11-25-h200-centring-exactgrad.json",
                 "constant": "bench/results/2026-11-25-h200-centring-constscale.json"}
PEER_TITAN_H100 = "bench/results/2026-11-25-h100-peer_titan.jsonl"
PEER_TITAN_H200 = "bench/results/2026-11-28-h200-peer_titan.jsonl"
PEER_TITAN_H100_NOW = "bench/results/2026-12-06-h100-peer_titan.jsonl"
# bench.peer_titan --kernels: kernel names by what they do, on either side
PEER_OPTIMIZER = "multi_tensor_apply_kernel"
PEER_SOFTMAX = "cunn_SoftMax"
PEER_COPIES = "bfloat16_copy_kernel|Memcpy DtoD|chunk_cat_cuda_kernel|direct_copy_kernel|FillFunctor"
PEER_ATTENTION = "flash_attn|flex_attention"
PEER_EXPERTS = "GroupedGemm|GatherSum|GroupProblemShape|index_put|indexing_backward|scatter_add"
PROFILE_40L = "bench/results/2026-11-25-h200-trainer_profile.json"
PROFILE_40L_NOW = "bench/results/2026-11-25-h200-trainer_profile-c0ef921.json"
E2E_COLUMNS = (
    Text("micro-batch × seq", args=("train.micro_batch_size", "train.seq_len")),
    Text("steps (averaged)", "steps_averaged"),
    Field("k tokens/s/GPU", "tokens_per_s_per_gpu", 1e-3), Field("B tokens/GPU/day", "btokens_per_gpu_day", digits=2),
    CausalMfu("MFU"), Field("MFU, full attention", "mfu", 100, suffix="%"), Field("peak GiB", "peak_mem_gib"))
LAYER_7B = {"config": "7B"}
BLOCK_COLUMNS = (
    Field("f+b TFLOPS", "fb_tflops", digits=0), Field("official f+b TFLOPS", "official_fb_tflops", digits=0),
    Field("× f+b", "ratio_fb", digits=2, suffix="×"),
    Field("× f+b, best rounds", "best_ratio_fb", digits=2, suffix="×"),
    Field("× fwd", "ratio_fwd", digits=2, suffix="×"), Field("× bwd", "ratio_bwd", digits=2, suffix="×"),
    Field("held MiB", "held_mib", digits=0), Field("official held MiB", "official_held_mib", digits=0),
    Field("load max/mean", "load_max_over_mean", digits=2, missing="–"))  # recorded from adb5466

TABLES = (
    Table("paper_e2e", rows=(Row("the paper: SonicMoE, lm-engine, FSDP-2", PAPER_SOURCE, {"name": "sonicmoe"},
                                 "E2E"),),
          columns=(Field("GPUs", "gpus", digits=0), Field("B tokens/GPU/day", "btokens_per_gpu_day", digits=2),
                   Field("B tokens/day (job)", "btokens_per_day", digits=0)),
          first="source", caption="The 40-layer 7B model at micro-batch 4 × 4096 tokens per GPU, on H100s."),
    Table("e2e_40l", columns=E2E_COLUMNS, caption="The 40-layer `sonic_7b`, real trainer, FSDP-2, offline BPE "
          "text (`data=local_bpe`); steady-state means over the steps named (the warm-up steps before them are "
          "left out).", rows=(
              e2e("recipe (defaults)", E2E_40L, "triton_40L"),
              e2e("+ `parallel.reshard_after_forward=false`", E2E_40L, "triton_noreshard_40L"),
              e2e("+ `train.micro_batch_size=8`", E2E_40L, "triton_mb8_40L"),
              e2e("+ both", E2E_40L_MB8, "triton_mb8_noreshard_40L"),
              e2e("recipe, `model.moe.kernel_backend=grouped_mm` (our torch._grouped_mm backend)", E2E_40L,
                  "grouped_mm_40L"),
              e2e("recipe, one GPU, `kernel_backend=cute`, router input centred", E2E_1X, "cute_40L"),
              e2e("recipe, one GPU, `kernel_backend=triton`, router input centred", E2E_1X, "triton_40L"),
              e2e("recipe, one GPU, cute, centring as one op (fused scan, nothing kept)", E2E_1X_CENTRING,
                  "cute_40L"),
              e2e("the same job, router reads x (`routing.input_centring=none`)", E2E_1X_CENTRING,
                  "cute_centring_none_40L"),
              e2e("recipe, one GPU, cute, top-K (a later job)", E2E_1X_TR, "cute_40L"),
              e2e("the same job, `routing=token_rounding`", E2E_1X_TR, "cute_token_rounding_40L"),
              e2e("recipe, one GPU, cute, top-K (token rounding's plan padded to a bound: no host sync)",
                  E2E_1X_TR_PADDED, "cute_40L"),
              e2e("the same job, `routing=token_rounding` (its selection still breaks the compiled graph)",
                  E2E_1X_TR_PADDED, "cute_token_rounding_40L"),
              *tr_jobs("recipe, one GPU, cute, top-K (token rounding's selection one custom op: one graph)",
                       E2E_1X_TR_OP, E2E_1X_TR_OP_TRITON),
              *tr_jobs("recipe, one GPU, cute, top-K (token rounding's selection replayed as a CUDA graph)",
                       E2E_1X_TR_GRAPH, E2E_1X_TR_GRAPH_TRITON),
              *tr_jobs("recipe, one GPU, cute, top-K (token rounding's selection in Triton kernels, eager)",
                       E2E_1X_TR_EAGER, E2E_1X_TR_EAGER_TRITON),
              *tr_jobs("recipe, one GPU, cute, top-K (the Triton selection replayed as a CUDA graph)",
                       E2E_1X_TR_FUSED, E2E_1X_TR_FUSED_TRITON),
              *tr_jobs("recipe, one GPU, cute, top-K (AdamW in one Triton pass with the clip in it; the head's "
                       "gradient summed in the GEMM)", E2E_1X_ADAMW, E2E_1X_ADAMW_TRITON),
              e2e("recipe, one GPU, triton, top-K (the loss's CE in one Triton program per row)", E2E_1X_CE_TRITON,
                  "triton_40L"),
              e2e("the same job, `routing=token_rounding`", E2E_1X_CE_TRITON, "triton_token_rounding_40L"),
              e2e("recipe, one GPU, cute, top-K (the down and dX~ GEMMs in 2-CTA clusters, 192-wide tiles)",
                  E2E_1X_CLUSTERS, "cute_40L"),
              e2e("recipe, one GPU, cute, top-K, `d2e2b85`'s sonic/ (on another machine than the row above)",
                  E2E_1X_CENTRING_BEFORE, "cute_40L"),
              e2e("the same call and machine, the router's centred logits fused (c never in memory)",
                  E2E_1X_CENTRING_FUSED, "cute_40L"),
              e2e("recipe, one GPU, cute, top-K, fp32 weights under autocast (`7e1700a`'s sonic/; first of four runs "
                  "in one call, on one machine)", E2E_1X_WEIGHTS["fp32-1"], "cute_40L"),
              e2e("bf16 weights with fp32 masters in AdamW (second run)", E2E_1X_WEIGHTS["bf16-1"], "cute_40L"),
              e2e("fp32 weights again (third run)", E2E_1X_WEIGHTS["fp32-2"], "cute_40L"),
              e2e("bf16 weights again (fourth run)", E2E_1X_WEIGHTS["bf16-2"], "cute_40L"),
              e2e("recipe, one GPU, cute, top-K, each block one compiled graph (the cute experts no longer check "
                  "their availability per call; first of four runs in one call, on one machine)",
                  E2E_1X_GRAPHS["onegraph-1"], "cute_40L"),
              e2e("five graphs per block, as before (`c2295dd`'s sonic/; second run)", E2E_1X_GRAPHS["fivegraphs-1"],
                  "cute_40L"),
              e2e("one graph again (third run)", E2E_1X_GRAPHS["onegraph-2"], "cute_40L"),
              e2e("five graphs again (fourth run)", E2E_1X_GRAPHS["fivegraphs-2"], "cute_40L"),
              e2e("recipe, one GPU, cute, top-K (fp32 AdamW moments, the default then; first of four runs in one "
                  "call, on one machine)", E2E_1X_MOMENTS[1], "cute_40L"),
              e2e("`optim.moment_dtype=bf16`: both moments in bf16, stochastically rounded (second run)",
                  E2E_1X_MOMENTS[1], "cute_bf16moments_40L"),
              e2e("fp32 moments again (third run)", E2E_1X_MOMENTS[2], "cute_40L"),
              e2e("bf16 moments again (fourth run)", E2E_1X_MOMENTS[2], "cute_bf16moments_40L"),
              e2e("recipe, one GPU, cute, top-K, `2544a37`'s sonic/ (first of four runs in two calls, on one machine)",
                  E2E_1X_LAUNCHES["before-1"], "cute_40L"),
              e2e("AdamW in one launch per param group, batches copied without a sync, q/k/v and the shared "
                  "expert's gate/up each one GEMM (`eaccba7`; second run)", E2E_1X_LAUNCHES["after-1"], "cute_40L"),
              e2e("`eaccba7` again (third run, the next call)", E2E_1X_LAUNCHES["after-2"], "cute_40L"),
              e2e("`2544a37` again (fourth run)", E2E_1X_LAUNCHES["before-2"], "cute_40L"),
              e2e("recipe, one GPU, cute, top-K, bf16 AdamW moments by default (`optim.moment_dtype=auto`), rounded "
                  "with Philox's bits (`e3ba90e`; first of four runs in one call, on one machine)",
                  E2E_1X_DEFAULT_MOMENTS["philox-1"], "cute_40L"),
              e2e("`d48eabb`'s sonic/: fp32 moments, the default before (second run)",
                  E2E_1X_DEFAULT_MOMENTS["philox-2"], "cute_40L"),
              e2e("`d48eabb` again (third run)", E2E_1X_DEFAULT_MOMENTS["philox-3"], "cute_40L"),
              e2e("`e3ba90e` again (fourth run)", E2E_1X_DEFAULT_MOMENTS["philox-4"], "cute_40L"),
              e2e("the same four on the next machine, the rounding bits a murmur3 hash of the offset and step "
                  "(`82ccd31`; first run)", E2E_1X_DEFAULT_MOMENTS["hash-1"], "cute_40L"),
              e2e("`d48eabb` (second run)", E2E_1X_DEFAULT_MOMENTS["hash-2"], "cute_40L"),
              e2e("`d48eabb` again (third run)", E2E_1X_DEFAULT_MOMENTS["hash-3"], "cute_40L"),
              e2e("`82ccd31` again (fourth run)", E2E_1X_DEFAULT_MOMENTS["hash-4"], "cute_40L"),
              e2e("`model.moe.kernel_backend=triton` at `e3ba90e` (the call of the Philox rows, after them)",
                  E2E_1X_TRITON_E3BA90E, "triton_40L"),
              e2e("recipe, one GPU, cute, top-K, bf16 weights stepped in place without fp32 masters by default "
                  "(`optim.master_weights=none`, `8f1b5eb`; first of four runs in one call, on one machine)",
                  E2E_1X_NOMASTER[1], "cute_40L"),
              e2e("`optim.master_weights=fp32`: fp32 masters, the default before (second run)", E2E_1X_NOMASTER[1],
                  "cute_masters_40L"),
              e2e("no masters again (third run)", E2E_1X_NOMASTER[2], "cute_40L"),
              e2e("fp32 masters again (fourth run)", E2E_1X_NOMASTER[2], "cute_masters_40L"),
              e2e("`model.moe.kernel_backend=triton` at `8f1b5eb` (the same machine, after the smoke)",
                  E2E_1X_TRITON_8F1B5EB, "triton_40L"),
              e2e("recipe, one GPU, cute, top-K, the clip's gradient norm in one Triton launch by default "
                  "(`optim.grad_norm=auto`, `8c48750`; one job, this run first)", E2E_1X_GRADNORM, "cute_40L"),
              e2e("`optim.grad_norm=torch`: torch's multi-tensor norm, as before (the same job, second)",
                  E2E_1X_GRADNORM, "cute_torchnorm_40L"),
              e2e("recipe, one GPU, cute, top-K, without `routing.logit_norm` (the preset before; `f1f6e93`; one "
                  "job, this run first)", E2E_1X_LOGITNORM, "cute_40L"),
              e2e("`model.moe.routing.logit_norm=prefix`, the default since (the same job, second)", E2E_1X_LOGITNORM,
                  "cute_logitnorm_40L"),
              e2e("the default, the centring's rescale a constant to autograd (`00fca7f`; one call on another "
                  "machine, this run first)", E2E_1X_CONSTSCALE, "cute_40L"),
              e2e("the same configs on `f1f6e93`'s sonic/: the exact gradient (the same call, second, its own "
                  "compile cache)", E2E_1X_EXACTGRAD, "cute_40L"),
              e2e("recipe, one GPU, cute, top-K, every expert kernel but dH storing its tiles from registers "
                  "(`bdae4e5`; `scripts.repro.e2e_throughput --run --backends cute,triton --steps 50`, one job, this "
                  "run first)", E2E_1X_DIRECT, "cute_40L"),
              e2e("the same job on triton (second)", E2E_1X_DIRECT, "triton_40L"),
              e2e("cute at `cd4c642` (only down and dX~ storing from registers; the next call on the same machine, "
                  "first)", E2E_1X_DIRECT_AB[0], "cute_40L"),
              e2e("cute at `bdae4e5` again (the same call, second)", E2E_1X_DIRECT_AB[1], "cute_40L"),
              e2e("cute at `406e0d3` (the Gram centring kernel; another machine, first)", E2E_1X_TR_GRAM, "cute_40L"),
              e2e("the same job with `routing=token_rounding` (second)", E2E_1X_TR_GRAM, "cute_tr_40L"),
              e2e("cute at `7ff3caa` (token rounding routed in one op; first)", E2E_1X_TR_ROUTE, "cute_40L"),
              e2e("the same job with `routing=token_rounding` (second)", E2E_1X_TR_ROUTE, "cute_tr_40L"),
              e2e("triton at `d4ef3ca` (the TMA expert kernels; one call, first)",
                  "2026-11-26-1xh200-e2e-40L-triton-d4ef3ca.json", "triton_40L"),
              e2e("triton at `f8ef199` (the tree before them, from a git archive; the same call, second)",
                  "2026-11-26-1xh200-e2e-40L-triton-f8ef199.json", "triton_40L"),
              e2e("triton at `3ddb28a` (dW1/dW2 by TMA, dH as one dot; one machine, after the block benches)",
                  "2026-11-28-1xh200-e2e-40L-triton-3ddb28a.json", "triton_40L"),
              e2e("cute at `3ddb28a` (the default backend; the same machine, next call)",
                  "2026-11-28-1xh200-e2e-40L-cute-3ddb28a.json", "cute_40L"),
              e2e("triton at `07c12f9` (dH's H slab prefetched into L2, 5 stages; another machine)",
                  "2026-11-28-1xh200-e2e-40L-triton-07c12f9.json", "triton_40L"),
              e2e("cute at `f0f7fa9`, attention by FlashAttention-4 (`model.attention_backend=auto` takes it where "
                  "it can run; one job, this run first)", E2E_1X_FA4, "cute_40L"),
              e2e("the same job, `model.attention_backend=sdpa` (cuDNN's kernel, what auto took before; second)",
                  E2E_1X_FA4, "cute_sdpa_40L"),
              e2e("the default again (the next job on the same machine, after the smoke; first)", E2E_1X_FA4_2,
                  "cute_40L"),
              e2e("`model.attention_backend=sdpa` (second)", E2E_1X_FA4_2, "cute_sdpa_40L"),
              e2e("`model.attention_backend=fa4`, named (third)", E2E_1X_FA4_2, "cute_fa4_40L"),
              e2e("the preset since #30 (unscaled FFN output init, embedding ×8), one H100, cute (one job, first)",
                  E2E_1X_H100, "cute_40L"),
              e2e("the same job, triton (second)", E2E_1X_H100, "triton_40L"))),
    Table("attention", first="core", caption="Causal attention alone at `sonic_7b`'s shape (micro-batch 4 x 4096 "
          "tokens, 24 heads of 64, bf16), each core as the model builds it (`python -m bench.attention`, one H200 at "
          "`f0f7fa9`, then one H100 at `cf802c2`; do_bench medians of five interleaved rounds; TFLOPS count causal "
          "attention). The error is the relative error of dQ against fp32 SDPA on two heads.",
          rows=tuple(Row(f"{core}, {gpu}", f"bench/results/{file}-attention.json", {"core": core})
                     for gpu, file in (("H200", "2026-11-29-h200"), ("H100", "2026-12-05-h100"))
                     for core in ("sdpa", "flex", "fa4")),
          columns=(Field("fwd ms", "fwd_ms", digits=3), Field("f+b ms", "fb_ms", digits=3),
                   Field("bwd ms", "bwd_ms", digits=3), Field("fwd TFLOPS", "fwd_tflops", digits=0),
                   Field("f+b TFLOPS", "fb_tflops", digits=0), Field("f+b, × sdpa's time", "fb_over_sdpa", digits=3),
                   Field("dQ error ×1e3", "rel_err.dq", 1e3, digits=1),
                   Field("first call s", "first_call_s", digits=1))),
    Table("peer_titan", first="model", columns=(
        Field("step ms, median", "step_ms"), Field("step ms, best", "step_ms_best"),
        Field("k tokens/s", "tokens_per_s", 1e-3), Ratio("× torchtitan, tokens/s", "tokens_per_s", "tokens_per_s",
                                                        den_where={"which": "titan"}, den_same=("commit",)),
        Field("peak GiB", "peak_gib"), Text("like for like", "like_for_like")),
          caption="The training-step peer, like for like (`bench.peer_titan`): `sonic_7b`'s dims cut to 8 layers, "
          "shared expert off, micro-batch 4 × 4096 of local BPE text, per-block compile, one-rank FSDP-2, torch's "
          "fused AdamW and fp32 cross-entropy on both sides, each side in its own process, both sides of a pair on "
          "one machine: one H100 (`041cf91`), then one H200 (`e416fb3`, one call), then one H100 again (`e79298a`, one "
          "call of `bash bench/gpu.sh peer`, with the CuTe DSL bundle and the flash-attn-4 wheel carried, so "
          "Sonic's auto attention could take FlashAttention-4, as the same machine's GPU tests ran it; that row "
          "predates the harness's `attention` field), then a fresh H100 (`bbe49f1`, one call: the pair with one "
          "profiled step each, then Sonic twice more with one lever undone by `--set`); × is Sonic's median "
          "tokens/s over torchtitan's of the same commit.", rows=(
              Row("Sonic (cute experts)", PEER_TITAN_H100, {"which": "sonic"}),
              Row("torchtitan 0.3.0 Qwen3-MoE (grouped_mm experts, flex attention)", PEER_TITAN_H100,
                  {"which": "titan"}),
              Row("Sonic (cute experts), H200", PEER_TITAN_H200, {"which": "sonic"}),
              Row("torchtitan 0.3.0 Qwen3-MoE, H200", PEER_TITAN_H200, {"which": "titan"}),
              Row("Sonic (cute experts), H100, `e79298a`", PEER_TITAN_H100_NOW,
                  {"which": "sonic", "commit": "e79298a"}),
              Row("torchtitan 0.3.0 Qwen3-MoE, H100, `e79298a`", PEER_TITAN_H100_NOW,
                  {"which": "titan", "commit": "e79298a"}),
              Row("Sonic (cute experts, FlashAttention-4), H100, `bbe49f1`", PEER_TITAN_H100_NOW,
                  {"which": "sonic", "commit": "bbe49f1", "sets": []}),
              Row("torchtitan 0.3.0 Qwen3-MoE, H100, `bbe49f1`", PEER_TITAN_H100_NOW,
                  {"which": "titan", "commit": "bbe49f1"}),
              Row("Sonic, router reads x (no prefix centring, no logit norm)", PEER_TITAN_H100_NOW,
                  {"which": "sonic", "commit": "bbe49f1", "sets": ["moe.routing.logit_norm=none",
                                                                    "moe.routing.input_centring=none"]}),
              Row("Sonic, `attention_backend=sdpa` (cuDNN)", PEER_TITAN_H100_NOW,
                  {"which": "sonic", "commit": "bbe49f1", "sets": ["attention_backend=sdpa"]}))),
    Table("peer_titan_depth", first="side, layers", columns=(
        Field("step ms, median", "step_ms"), Field("step ms, best", "step_ms_best"),
        Field("k tokens/s", "tokens_per_s", 1e-3),
        Ratio("× torchtitan, tokens/s", "tokens_per_s", "tokens_per_s", den_where={"which": "titan"},
              den_same=("commit", "layers")),
        Field("peak GiB", "peak_gib")),
          caption="The same pair cut to 4, 8 and 12 layers (12: the most that fits torchtitan's side on one H100), "
          "one call at `70277cd` on a fresh H100, torchtitan first at each depth; × is against torchtitan at the same "
          "depth and commit.", rows=tuple(
              Row(f"{side}, {layers} layers", PEER_TITAN_H100_NOW, {"which": which, "commit": "70277cd",
                                                                    "layers": layers})
              for layers in (4, 8, 12) for side, which in (("torchtitan 0.3.0", "titan"), ("Sonic", "sonic")))),
    Table("peer_titan_host", first="run", columns=(
        Field("step ms, median", "step_ms"), Field("step ms, best", "step_ms_best"),
        Ratio("× torchtitan, tokens/s", "tokens_per_s", "tokens_per_s", den_where={"which": "titan"},
              den_same=("commit",)),
        Field("host issue ms", "host.issue_ms"), Field("wall ms", "host.wall_ms"),
        Field("device mallocs per step", "host.device_mallocs_and_frees", digits=0)),
          caption="The 8-layer pair with `--host 5 --steps 20` (`f1ea8bf`, one call on a fresh H100: Sonic, "
          "torchtitan, Sonic): after the timed steps, five more, each timed on the host from the step's start (its "
          "batch fetched and copied first) to the return of `optimizer.zero_grad` (issue) and to the GPU's end "
          "(wall); the medians.", rows=(
              Row("Sonic, first", PEER_TITAN_H100_NOW, {"which": "sonic", "commit": "f1ea8bf", "step_ms": 144.4}),
              Row("torchtitan 0.3.0", PEER_TITAN_H100_NOW, {"which": "titan", "commit": "f1ea8bf"}),
              Row("Sonic, again (after torchtitan)", PEER_TITAN_H100_NOW,
                  {"which": "sonic", "commit": "f1ea8bf", "step_ms": 146.3}))),
    Table("peer_titan_split", first="side", columns=(
        Field("step ms", "step_ms"),
        KernelMs("AdamW and the clip (multi-tensor kernels)", PEER_OPTIMIZER),
        KernelMs("the loss's fp32 softmax", PEER_SOFTMAX),
        KernelMs("casts and copies (FSDP's gathers and reductions, the logits' fp32 copy)", PEER_COPIES),
        KernelMs("attention", PEER_ATTENTION),
        KernelMs("experts (GEMMs, gathers, dispatch scatters)", PEER_EXPERTS),
        KernelMs("the rest: dense GEMMs (LM head included), norms, routing, small kernels", "|".join(
            (PEER_OPTIMIZER, PEER_SOFTMAX, PEER_COPIES, PEER_ATTENTION, PEER_EXPERTS)), rest=True)),
          caption="Where each side's step goes: the `bbe49f1` pair above, one profiled step each (`--kernels 45`: "
          "the step's 45 slowest kernels, grouped by name; what they leave out is in the last column, which is the "
          "median step less the profiled step's groups before it). The first three groups are the harness's, alike "
          "on both sides (the same parameters, optimizer and loss).", rows=(
              Row("Sonic", PEER_TITAN_H100_NOW, {"which": "sonic", "commit": "bbe49f1", "sets": []}),
              Row("torchtitan 0.3.0", PEER_TITAN_H100_NOW, {"which": "titan", "commit": "bbe49f1"}))),
    Table("routing_40l", columns=(Text("steps", "steps"), Largest("worst max/mean load, last step",
                                                                  "max_load_over_mean"),
                                  Count("layers ≤ 2", "max_load_over_mean", 2)),
          caption="Each layer's max/mean expert load at the last logged step of the 40-layer runs above.", rows=(
              e2e("recipe (defaults)", E2E_40L, "triton_40L"),
              e2e("micro-batch 8, no reshard", E2E_40L_MB8, "triton_mb8_noreshard_40L"),
              e2e("one GPU, cute, router input centred", E2E_1X, "cute_40L"),
              e2e("one GPU, triton, router input centred", E2E_1X, "triton_40L"),
              e2e("one GPU, cute, centring as one op", E2E_1X_CENTRING, "cute_40L"),
              e2e("one GPU, cute, router reads x", E2E_1X_CENTRING, "cute_centring_none_40L"),
              e2e("one GPU, cute, token rounding", E2E_1X_TR, "cute_token_rounding_40L"),
              e2e("one H100, cute, the preset since #30", E2E_1X_H100, "cute_40L"),
              e2e("one H100, triton, the preset since #30", E2E_1X_H100, "triton_40L"))),
    Table("routing_gpu", first="run", caption="`sonic_7b` on offline BPE text, micro-batch 4 × 4096, one H200 "
          "(the last row: one H100): "
          "the learning rate peaks at step 20 (`optim.warmup_steps=20`) and the run goes to step 100 "
          "(`bash bench/gpu.sh routing`, `bench.routing_health`). The token-rounding row ran before `e83d8c1`, "
          "which took most of its routing time out (its speed here is not token rounding's now). The rows with "
          "a bias rule ran later, with the centring as one op; their first row is the same config again. The rows "
          "after them ran with diagnostics every 10 steps, which leave no clean interval to time (no k tokens/s).",
          rows=tuple(
              Row(label, f"bench/results/2026-11-24-h200-routing_health-{tag}.json") for label, tag in (
                  ("16 layers, router reads x", "16L-none"), ("16 layers, input centred", "16L-prefix"),
                  ("16 layers, input centred, token rounding", "16L-prefix-tr"),
                  ("40 layers, router reads x", "40L-none"), ("40 layers, input centred", "40L-prefix"),
                  ("16 layers, input centred (later commit)", "16L-topk-prefix"),
                  *((f"16 layers, input centred, proportional bias rule at {rate}",
                     f"16L-topk-prefix-bias_update_ruleproportional-bias_update_rate{rate}")
                    for rate in ("0.05", "0.1", "0.2")),
                  ("16 layers, input centred, diagnostics every 10 steps", "16L-topk-prefix-at1170b58"),
                  ("16 layers, input centred, diagnostics every 10 steps, again", "16L-topk-prefix-ataf6b6df"),
                  ("16 layers, input centred, sign bias rule at 0.05", "16L-topk-prefix-bias_update_rate0.05"),
                  ("16 layers, input centred, aux loss 0.03", "16L-topk-prefix-aux_loss_coef0.03"),
                  ("16 layers, input centred, aux loss 0.1", "16L-topk-prefix-aux_loss_coef0.1"),
                  ("16 layers, router reads x, aux loss 0.1", "16L-topk-none-aux_loss_coef0.1"),
                  ("16 layers, input centred, sequence-wise aux loss 0.01", "16L-topk-prefix-seq_aux_loss_coef0.01"),
                  ("16 layers, centred input projected off its prefix mean (dropped)", "16L-topk-prefix_project"),
                  ("the same, token rounding", "16L-token_rounding-prefix_project"))) + (
              Row("16 layers, the centring and unit rescale applied twice (dropped)",
                  "bench/results/2026-11-24-h100-routing_health-16L-topk-prefix_twice.json"),),
          columns=ROUTING_COLUMNS),
    Table("routing_balance", first="run", caption="The same runs with `routing.balance=sinkhorn` (a per-expert "
          "selection offset solved on each batch), on one H200; the first three rows ran one after another in one "
          "call, the fourth in the next, on a fresh machine, the last two together in a later call (the same "
          "sonic/ tree).",
          rows=tuple(Row(label, f"bench/results/2026-11-2{file}.json") for label, file in (
              ("16 layers, input centred, balance none (today's preset)",
               "5-h200-routing_health-16L-topk-prefix-balancenone"),
              ("16 layers, input centred, Sinkhorn balance", "5-h200-routing_health-16L-topk-prefix-balancesinkhorn"),
              ("16 layers, router reads x, Sinkhorn balance", "5-h200-routing_health-16L-topk-none-balancesinkhorn"),
              ("40 layers, router reads x, Sinkhorn balance", "5-h200-routing_health-40L-topk-none-balancesinkhorn"),
              ("40 layers, input centred, balance none (today's preset)",
               "5-h200-routing_health-40L-topk-prefix-balancenone"),
              ("40 layers, input centred, Sinkhorn balance",
               "5-h200-routing_health-40L-topk-prefix-balancesinkhorn"))),
          columns=ROUTING_COLUMNS),
    Table("routing_logit_norm", first="run", caption="`sonic_7b` at the peak learning rate as above (one H200, "
          "`data=local_bpe`, `optim.warmup_steps=20`, 100 steps, triton, top-K, input centred): each expert's logits "
          "standardised over the earlier positions (`routing.logit_norm=prefix`, `8b5cc69`, 16 then 40 layers in two "
          "calls on one machine) beside today's preset from the table above (earlier commits, other machines), and the "
          "preset with the router's weights frozen at their initial values (`--freeze router.weight_ED`, `8c48750`, "
          "a diagnosis).",
          rows=tuple(Row(label, f"bench/results/2026-11-25-h200-routing_health-{file}.json") for label, file in (
              ("16 layers, today's preset (input centred)", "16L-topk-prefix-balancenone"),
              ("16 layers, logits standardised per expert", "16L-topk-prefix-logit_normprefix"),
              ("40 layers, today's preset (input centred)", "40L-topk-prefix-balancenone"),
              ("40 layers, logits standardised per expert", "40L-topk-prefix-logit_normprefix"),
              ("16 layers, today's preset, router weights frozen (diagnosis)", "16L-topk-prefix-freeze_router"))),
          columns=ROUTING_COLUMNS),
    Table("routing_default", first="run", caption="The same runs (one H200, triton), `routing.logit_norm=prefix` "
          "with and without the rest: the same config run again on the same routing code (`8b5cc69` and `f1f6e93` "
          "differ only in tests), with the centring's rescale a constant to autograd (`00fca7f`), with token "
          "rounding, without the input centring, and with the centring done on the logits without its rescale (a "
          "scratch wrapper: each file's `scratch_note` says what it changed). The rows from `f1f6e93` and `00fca7f` "
          "ran in five calls on two machines.",
          rows=tuple(Row(label, f"bench/results/2026-11-25-h200-routing_health-{file}.json") for label, file in (
              ("16 layers, input centred, logit norm (the first run above)", "16L-topk-prefix-logit_normprefix"),
              ("16 layers, the same again", "16L-topk-prefix-logit_normprefix-rerun"),
              ("16 layers, the rescale constant to autograd", "16L-topk-prefix-logit_normprefix-constscale"),
              ("16 layers, the rescale constant to autograd, again",
               "16L-topk-prefix-logit_normprefix-constscale-rerun"),
              ("40 layers, input centred, logit norm (the first run above)", "40L-topk-prefix-logit_normprefix"),
              ("40 layers, the same again", "40L-topk-prefix-logit_normprefix-rerun"),
              ("40 layers, the rescale constant to autograd", "40L-topk-prefix-logit_normprefix-constscale"),
              ("16 layers, input centred, logit norm, token rounding", "16L-token_rounding-prefix-logit_normprefix"),
              ("40 layers, input centred, logit norm, token rounding", "40L-token_rounding-prefix-logit_normprefix"),
              ("16 layers, router reads x, logit norm", "16L-topk-none-logit_normprefix"),
              ("16 layers, router reads x, logit norm, token rounding", "16L-token_rounding-none-logit_normprefix"),
              ("40 layers, router reads x, logit norm", "40L-topk-none-logit_normprefix"),
              ("16 layers, centred logits without the rescale, logit norm (scratch)",
               "16L-topk-prefix_logits-logit_normprefix"),
              ("40 layers, the same (scratch)", "40L-topk-prefix_logits-logit_normprefix"),
              ("40 layers, the same, token rounding (scratch)", "40L-token_rounding-prefix_logits-logit_normprefix"))),
          columns=ROUTING_MEAN_LOSS_COLUMNS),
    Table("routing_w50", first="run", caption="Issue #25's routing run: the 40-layer `sonic_7b` on the local BPE "
          "text with `optim.warmup_steps=50` (the peak learning rate at step 50, the cosine down to its floor at step "
          "100), "
          "(`bash bench/gpu.sh routing` with `ROUTING_LAYERS=40 ROUTING_WARMUP=50`), one H200: before the logit norm "
          "(`d48eabb`, cute kernels), and with the preset as it is now (`c1cbe12`, triton kernels; the routing "
          "computes the same either way), and the preset again on cute (`bdae4e5`, another machine).",
          rows=(Row("input centred (the preset before)",
                    "bench/results/2026-11-25-h200-routing_health-40L-topk-prefix-w50-cute.json"),
                Row("input centred, logit norm (the preset now)",
                    "bench/results/2026-11-25-h200-routing_health-40L-topk-prefix-logit_normprefix-w50.json"),
                Row("the preset, cute kernels (`bdae4e5`, after the e2e jobs on the same machine)",
                    "bench/results/2026-11-26-h200-routing_health-40L-topk-prefix-w50-cute.json")),
          columns=ROUTING_MEAN_LOSS_COLUMNS),
    Table("routing_bias_rate", first="run", caption="Balance levers with the logit norm on: the 40-layer "
          "`sonic_7b` at issue #30's peak learning rate (`data=local_bpe`, `optim.warmup_steps=20`, 100 steps, "
          "triton, top-K, input centred, logit norm), the preset beside three times its expert-bias rate (`bash "
          "bench/gpu.sh routing` with `ROUTING_LAYERS=40 ROUTING_ARMS=topk-prefix+bias_update_rate=0.03`, "
          "`922a9e2`), DeepSeek-V3's sequence-wise balance loss at 0.01 and three times the global aux loss "
          "(`ROUTING_ARMS=\"topk-prefix+seq_aux_loss_coef=0.01 topk-prefix+aux_loss_coef=0.03\"`, `46a1832`, one "
          "call), one H200 each.",
          rows=(Row("bias rate 0.01 (the preset)",
                    "bench/results/2026-11-25-h200-routing_health-40L-topk-prefix-logit_normprefix.json"),
                Row("bias rate 0.01 (the preset), again",
                    "bench/results/2026-11-25-h200-routing_health-40L-topk-prefix-logit_normprefix-rerun.json"),
                Row("bias rate 0.03",
                    "bench/results/2026-11-26-h200-routing_health-40L-topk-prefix-bias_update_rate0.03.json"),
                Row("sequence-wise balance loss 0.01",
                    "bench/results/2026-11-26-h200-routing_health-40L-topk-prefix-seq_aux_loss_coef0.01.json"),
                Row("aux loss 0.03",
                    "bench/results/2026-11-26-h200-routing_health-40L-topk-prefix-aux_loss_coef0.03.json")),
          columns=ROUTING_MEAN_LOSS_COLUMNS),
    Table("routing_final", first="run", caption="Issue #30's 40-layer runs again (one H200, `data=local_bpe`, "
          "`optim.warmup_steps=20`, 100 steps, triton, top-K, the preset), each then routing the next 16 batches of "
          "its training stream through the trained model (`python -m bench.routing_health --final-batches 16`, "
          "`ac27f0c`, one machine): the step-100 columns are one batch's, as before; the pooled columns sum the "
          "16 batches' counts.",
          rows=(Row("the preset", "bench/results/2026-11-26-h200-routing_health-40L-topk-final16.json"),
                Row("sequence-wise balance loss 0.01",
                    "bench/results/2026-11-26-h200-routing_health-40L-topk-seq_aux_loss_coef0.01-final16.json"),
                Row("sequence-wise balance loss 0.03",
                    "bench/results/2026-11-26-h200-routing_health-40L-topk-seq_aux_loss_coef0.03-final16.json")),
          columns=(*ROUTING_MEAN_LOSS_COLUMNS[:5],
                   Field("worst max/mean, 16 batches pooled", "final_batches.pooled_worst", digits=2),
                   Field("layers over 2×, pooled", "final_batches.layers_over_2x_pooled", digits=0),
                   ROUTING_MEAN_LOSS_COLUMNS[5])),
    Table("routing_stream", first="run", caption="Issue #30's runs with a larger residual stream under the first "
          "blocks (one H100, `data=local_bpe`, `optim.warmup_steps=20`, 100 steps, triton, input centred, logit norm, "
          "`bench.routing_health --grad-norms`): the preset as it was (`5fd5cdc`), then OLMo 2's unscaled FFN down "
          "projections (`model.ffn_out_init=unscaled`), then those and the embedding ×8 into the first block "
          "(`model.embed_scale=8`, the preset now), top-K and token rounding (`3594ba1`, one machine, three calls of "
          "`bash bench/gpu.sh routing`, `ROUTING_ARGS=--grad-norms`). The last row is issue #25's warm-up-50 run of "
          "the preset now on cute kernels (`ROUTING_LAYERS=40 ROUTING_WARMUP=50 ROUTING_BACKEND=cute`, no gradient "
          "norms). The gradient norms are the pre-clip global norm at every step.",
          rows=tuple(Row(f"{layers} layers, {label}",
                         f"bench/results/2026-12-06-h100-routing_health-{layers}L-{tag}.json")
                     for layers in (16, 40)
                     for label, tag in (("the preset before", "topk-prefix"),
                                        ("unscaled FFN outputs", "topk-prefix-ffn_out_initunscaled"),
                                        ("unscaled FFN outputs, embedding ×8 (the preset now)",
                                         "topk-prefix-ffn_out_initunscaled-embed_scale8"),
                                        ("the preset now, token rounding",
                                         "token_rounding-prefix-ffn_out_initunscaled-embed_scale8")))
          + (Row("40 layers, the preset now, peak at step 50, cute",
                 "bench/results/2026-12-06-h100-routing_health-40L-topk-prefix-ffn_out_initunscaled-embed_scale8"
                 "-w50-cute.json"),),
          columns=(*ROUTING_MEAN_LOSS_COLUMNS[:5],
                   Largest("largest gradient norm", "grad_norms.total", digits=0, missing="–"),
                   Largest("median gradient norm", "grad_norms.total", median=True, missing="–"),
                   ROUTING_MEAN_LOSS_COLUMNS[5])),
    Table("centring_grad", first="shape (T × D × E), gradient", caption="The router's prefix-centred logits alone "
          "(`python -m bench.centring`, one H200, one call: `f1f6e93`'s kernels, then `00fca7f`'s): the fused "
          "Triton path forward and backward, beside the plain linear router's, in ms per call (do_bench median); "
          "the error is the larger relative error of the logits and dx against the fp64 definition.",
          rows=tuple(Row(f"{T} × {D} × {E}, {grad}", CENTRING_GRAD[grad], {"T": T, "D": D, "E": E}, "rows")
                     for T, D, E in ((16384, 1536, 128), (32768, 4096, 128), (32768, 2048, 64))
                     for grad in ("exact", "constant")),
          columns=(Field("fwd ms", "configs.0.fwd", digits=3), Field("bwd ms", "configs.0.bwd", digits=3),
                   Field("linear fwd ms", "linear_fwd", digits=3), Field("linear bwd ms", "linear_bwd", digits=3),
                   Field("error ×1e3", "configs.0.err", 1e3, digits=1))),
    Table("block_h200_triton_tma", first="config, backend, commit", caption="The triton backend's block after its "
          "TMA kernels (the down-projection and dX~ with both operands by TMA, persistent, `2837c0a`; the "
          "up-projection's W1 by TMA too, `d4ef3ca`; dW1 and dW2 with their contiguous operand by TMA, `c2c51c4`; dH as "
          "one 128-wide dot per tile, its epilogue by column quarters, `3ddb28a`; dH's H slab prefetched into L2 and 5 "
          "stages, `e416fb3`; dW1 in 256 x 128 tiles of 32-row steps at 7 stages, `2fef210`, run at `03559dc`, the same "
          "sonic/), interleaved with the official layer as above, seven rounds, one H200 each (`bash bench/gpu.sh block` with "
          "`BLOCK_ARGS=\"--configs 30B,7B,120B --backends triton --compile only --rounds 7\"`, the official layer's "
          "autotune cache carried in; at `c2c51c4` two calls on one machine, 30B and 120B with a cold cache, then "
          "7B; at `3ddb28a` likewise, the cache carried in; at `e416fb3` and `03559dc` the three in one call), beside the `c9ddd54` table's triton rows (before them). The official layer's f+b TFLOPS column "
          "moves between calls and the × with it; Sonic's own f+b TFLOPS column is the steadier reading.",
          rows=tuple(Row(f"{config}, triton+compile, {commit}", file, {"config": config, "backend": "triton+compile"})
                     for config in ("7B", "30B", "120B")
                     for commit, file in (("c9ddd54", "bench/results/2026-11-26-h200-moe_block.json"),
                                          ("2837c0a", "bench/results/2026-11-26-h200-moe_block-triton-tma-2837c0a.json"),
                                          ("d4ef3ca", "bench/results/2026-11-26-h200-moe_block-triton-tma.json"),
                                          ("c2c51c4", "bench/results/2026-11-28-h200-moe_block-triton-dwtma"
                                                      + ("-7B.json" if config == "7B" else ".json")),
                                          ("3ddb28a", "bench/results/2026-11-28-h200-moe_block-triton-dh1dot"
                                                      + ("-7B.json" if config == "7B" else ".json")),
                                          ("e416fb3", "bench/results/2026-11-28-h200-moe_block-triton-dhpf.json"),
                                          ("03559dc", "bench/results/2026-11-28-h200-moe_block-triton-dw1.json"))
                     if config == "30B" or commit != "2837c0a"),
          columns=BLOCK_COLUMNS),
    Table("block_h200_cute_dh", first="config, backend, commit", caption="The cute backend's block after dH's "
          "register-direct store (`b5b0154`: DirectDSwiGLUEpilogue, dH alone 0.955 of the staged time at 30B and 0.934 "
          "at 7B, `bench/results/2026-11-28-h200-cute-dh-direct-ab.json`), interleaved with the official layer as "
          "above, seven rounds, one H200, one call with the official layer's autotune cache carried in (`bash "
          "bench/gpu.sh block` with `BLOCK_ARGS=\"--configs 30B,120B,7B --backends cute --compile only --rounds 7\"`), "
          "beside the `c9ddd54` table's cute rows (before it). In this call the official layer's 7B f+b ran at "
          "244 TFLOPS, against 337-386 in the other calls of these tables: its 7B × reads that slow official run; "
          "Sonic's own f+b TFLOPS column is the steadier reading.",
          rows=tuple(Row(f"{config}, cute+compile, {commit}", file, {"config": config, "backend": "cute+compile"})
                     for config in ("7B", "30B", "120B")
                     for commit, file in (("c9ddd54", "bench/results/2026-11-26-h200-moe_block.json"),
                                          ("b5b0154", "bench/results/2026-11-28-h200-moe_block-cute-dhdirect.json"))),
          columns=BLOCK_COLUMNS),
    Table("cute_vs_official", first="shape, kernel", caption="Each cute kernel against the official layer's own "
          "kernel for the same product (its custom ops as its layer calls them, QuACK's autotuned configs), on the "
          "same tensors and top-K routing from random logits, outputs checked against ours first (`python "
          "bench/cute_gemm.py --shape S --official [--energy]`, one H200, 6226a76's sonic/). ms are do_bench "
          "medians; held ms, each kernel back to back for a second at the GPU's power cap (`--energy`), where "
          "both sides run below their maximum clock.",
          rows=tuple(Row(f"{name}, {kernel}", f"bench/results/2026-11-29-h200-cute_gemm-{file}.json",
                         {"kernel": kernel}, "rows")
                     for name, file in (("30B", "30b-official-energy"), ("7B", "7b-official-energy"),
                                        ("sparse E 256", "sparse-e256-official"), ("Qwen3-Next", "qwen3next-official"))
                     for kernel in ("up", "down", "dh", "dx", "dw1", "dw2")),
          columns=(Field("ms", "ms", digits=3), Field("official ms", "official_ms", digits=3),
                   Ratio("official ÷ ours", "official_ms", "ms", digits=3),
                   Field("held ms", "held.ms", digits=3, missing="–"),
                   Field("official held ms", "official_held.ms", digits=3, missing="–"))),
    Table("cute_vs_official_chain", first="shape", caption="The six kernels back to back, as one f+b runs them, "
          "held for a second at the power cap (`--energy --official`, the same runs as above): ms per f+b, joules "
          "per TFLOP and the median sampled SM clock; ours ran before and after the official kernels.",
          rows=tuple(Row(name, f"bench/results/2026-11-29-h200-cute_gemm-{file}.json")
                     for name, file in (("30B", "30b-official-energy"), ("7B", "7b-official-energy"))),
          columns=(Field("ours ms", "chain.ours.ms", digits=3), Field("official ms", "chain.official.ms", digits=3),
                   Field("ours again ms", "chain.ours_again.ms", digits=3),
                   Ratio("official ÷ ours", "chain.official.ms", "chain.ours.ms", digits=3),
                   Field("ours J/TFLOP", "chain.ours.joules_per_tflop", digits=2),
                   Field("official J/TFLOP", "chain.official.joules_per_tflop", digits=2),
                   Field("ours MHz", "chain.ours.sm_mhz_median", digits=0),
                   Field("official MHz", "chain.official.sm_mhz_median", digits=0))),
    Table("cute_few_rows", first="shape (T, d, n, E, K)", caption="The few-rows defaults (`3da7b13`: at most 512 "
          "routed rows per expert, down `pp128c2` and dX~ `co256c2`) against the defaults before them, in one process "
          "on one H200: the experts' f+b on the token-rounding sweep's shapes and plans as `bench.moe_layer "
          "--sparse-sweep` builds them, five rounds alternating the two, medians (a scratch A/B, its script in the "
          "file). × is the time before over the time with them.",
          rows=tuple(Row(str(tuple(shape)), "bench/results/2026-11-29-h200-cute-fewrows-ab.json", {"shape": shape})
                     for shape in ([16384, 4096, 1024, 256, 4], [16384, 4096, 512, 512, 8])),
          columns=(Field("rounded over top-K, before", "speedup_fwdbwd.before", digits=3, suffix="×"),
                   Field("rounded over top-K, few-rows", "speedup_fwdbwd.few_rows", digits=3, suffix="×"),
                   Field("× top-K f+b", "few_rows_over_before_fwdbwd.topk", digits=3, suffix="×"),
                   Field("× rounded f+b", "few_rows_over_before_fwdbwd.rounded", digits=3, suffix="×"))),
    Table("block_h200_all", first="config, backend", caption="All twelve Table 9b configs: the MoE block as "
          "`sonic_7b` builds it (router with its input centring and logit norm, routing, experts, combine; bf16 "
          "autocast, compiled as the trainer runs it) on both kernel backends, each interleaved with the official "
          "sonic-moe 0.1.2.post1 layer (router included) and the batched-GEMM floor in one process, seven rounds, one "
          "H200 (`bash bench/gpu.sh block` with `BLOCK_ARGS=\"--backends cute,triton --compile only --resume\"`, "
          "`e216b1b`, three calls resuming one file, the official layer's autotune cache carried between them). × is "
          "Sonic over official, from the medians and from each side's best round. The floor is the experts' six "
          "products as `torch.bmm` at even routing (no gather, fused epilogue, router, routing or gather-sum: the "
          "paper's cuBLAS batched-GEMM bound); `of floor` is its ms over the block's, `bound ×` the official layer's "
          "ms over its: the most any block could show in the × f+b column.",
          rows=table_9b_block_rows("bench/results/2026-11-29-h200-moe_block.json"),
          columns=(*BLOCK_COLUMNS[:6], Field("of floor, f+b", "of_floor_fb", digits=2),
                   Field("bound × f+b", "bound_fb", digits=2, suffix="×"), *BLOCK_COLUMNS[6:])),
    Table("block_h200_c9ddd54", first="config, backend", caption="The same table at `c9ddd54` (2026-11-26), before "
          "the kernel changes since (three calls resuming one file, as above; no floor then).",
          rows=table_9b_block_rows("bench/results/2026-11-26-h200-moe_block.json"),
          columns=BLOCK_COLUMNS),
    Table("block_h200", first="config, backend", caption="The MoE block as `sonic_7b` builds it (router with "
          "its input centring, routing, experts, combine; bf16 autocast) at Table 9b shapes vs the official "
          "sonic-moe 0.1.2.post1 layer (router included), one H200, one process, seven interleaved rounds "
          "(`bench.moe_block`); × is Sonic over official, from the medians and from each side's best round. "
          "`+compile` is the block as the trainer runs it (`torch.compile`). The first two rows: the router's centring "
          "forward in one kernel of products of x (its Gram matrix, x against the carry, x Wᵀ) with no centred c "
          "(`326c410`), one call, the official layer's 30B autotune cache carried. The fifth row: down and dX~ "
          "store their "
          "tiles from registers (`e75afe2`), one call, the official layer without its autotune cache. The two before it: "
          "up, dW1 and dW2 store from registers too (`922a9e2`), one call, the official layer without its cache. The "
          "next four "
          "rows: above 128 experts "
          "the centring's forward by linearity (chunk sums, an rstd kernel, z = x Wᵀ in cuBLAS, the logits per "
          "chunk), the select kernel's top-K by sorting from K 16, the chunk sums in 128-wide blocks (`b1ca924`), "
          "two calls on one machine; the official 7B rounds ran faster there than in the next five rows' calls "
          "(its f+b TFLOPS column), so the 7B × moved with the official layer, not with Sonic. The next two: the same "
          "tree (`adb5466`'s bench), the block as the `olmoe_1b_7b` and `qwen3_30b_a3b` presets build it (`--model`): "
          "their routers read the hidden state as Hugging Face's do (no centring, no logit norm), the official "
          "layer's routing work. The next five: the "
          "logit norm as "
          "one op that keeps no T × E scale for its backward (`5b59ff0`), three calls on one machine. The next two: "
          "the down and dX~ "
          "kernels over a reduction longer than 512 (dX~ at 30B, both at OLMoE) in 128-wide ping-pong CTA pairs "
          "(`6b61004`; 256-wide cooperative ones before). The next two: the gather-sums in "
          "column slices of 4 (weighted) and 2 (unweighted) chunks per lane (`f2d5512`); the next two: the dW1 kernel "
          "in 256-row tiles, both gather-sums in slices of 4 (`7ede030`); only two configs, as the official layer's "
          "first call costs minutes per config. The next row: the centring's rescale "
          "a constant to autograd, its backward a scan and two GEMMs (`00fca7f`, `routing.logit_norm=prefix` on; one "
          "config). The next three rows: the block one "
          "compiled graph (`6dc2dbb`; before, the cute experts broke it at a per-call availability check). The next "
          "three: the router's centred logits fused (`183cc8b`), on a machine where the 7B block was host-bound (both sides 5.3–7.4 ms "
          "per f+b, 3.5–4.4 ms in the other calls): its × is no kernel comparison. The next three: the down and dx "
          "kernels in 2-CTA clusters that multicast A, 192-wide ping-pong tiles (`db876d6`); the next six: before, "
          "the centring as one op; in the older rows the bench handed the block a 2-D input, so the "
          "centring read sequences of d tokens, not 4096 (the same work per token; fixed in `c2f35fb`).",
          rows=tuple(Row(f"{config}, cute+compile", "bench/results/2026-11-26-h200-moe_block-compiled-gram.json",
                         {"config": config, "backend": "cute+compile"}) for config in ("30B", "7B")) + tuple(
              Row(f"{config}, cute+compile", "bench/results/2026-11-26-h200-moe_block-compiled-direct-swiglu.json",
                         {"config": config, "backend": "cute+compile"}) for config in ("30B", "Qwen3-Next")) + (
              Row("30B, cute+compile", "bench/results/2026-11-26-h200-moe_block-compiled-direct-store.json",
                  {"config": "30B", "backend": "cute+compile"}),) + tuple(
              Row(f"{config}, cute+compile",
                         f"bench/results/2026-11-25-h200-moe_block-compiled-centring-v2{suffix}.json",
                         {"config": config, "backend": "cute+compile"})
                     for config, suffix in (("Qwen3-Next", ""), ("30B", ""), ("OLMoE", "-7b-olmoe"),
                                            ("7B", "-7b-olmoe"))) + tuple(
              Row(f"{config}, {preset} routing, cute+compile",
                  f"bench/results/2026-11-25-h200-moe_block-compiled-{file}-preset.json",
                  {"config": config, "backend": "cute+compile"})
              for config, preset, file in (("OLMoE", "olmoe_1b_7b", "olmoe"),
                                           ("Qwen3-Next", "qwen3_30b_a3b", "qwen3next-qwen3"))) + tuple(
              Row(f"{config}, cute+compile",
                         f"bench/results/2026-11-25-h200-moe_block-compiled-lnop{suffix}.json",
                         {"config": config, "backend": "cute+compile"})
                     for config, suffix in (("7B", "-7b"), ("1.4B", "-1.4b-qwen3next"), ("30B", ""), ("OLMoE", ""),
                                            ("Qwen3-Next", "-1.4b-qwen3next"))) + tuple(
              Row(f"{config}, cute+compile", "bench/results/2026-11-25-h200-moe_block-compiled-pp128c2.json",
                  {"config": config, "backend": "cute+compile"}) for config in ("30B", "OLMoE")) + tuple(
              Row(f"{config}, cute+compile", f"bench/results/2026-11-25-h200-moe_block-compiled-{suffix}.json",
                  {"config": config, "backend": "cute+compile"})
              for suffix in ("gathersum", "dw1m256") for config in ("30B", "7B")) + (
              Row("30B, cute+compile", "bench/results/2026-11-25-h200-moe_block-compiled-constscale.json",
                  {"config": "30B", "backend": "cute+compile"}),) + tuple(
              Row(f"{config}, cute+compile", f"bench/results/2026-11-25-h200-moe_block-compiled{suffix}.json",
                  {"config": config, "backend": "cute+compile"})
              for suffix in ("-onegraph", "-centring", "") for config in ("7B", "30B", "OLMoE")) + tuple(
              Row(f"{config}, {backend}", f"bench/results/2026-11-24-h200-moe_block-{file}.json",
                  {"config": config, "backend": backend})
              for config, file, backend in (
                  *((config, "compiled", backend) for config in ("7B", "30B", "OLMoE")
                    for backend in ("cute+compile", "triton+compile")),
                  ("7B", "7b", "cute+compile"), ("7B", "7b", "triton+compile"), ("7B", "7b", "cute"),
                  ("7B", "7b", "triton"), ("30B", "30b-olmoe", "cute+compile"), ("30B", "30b-olmoe", "cute"),
                  ("OLMoE", "30b-olmoe", "cute+compile"), ("OLMoE", "30b-olmoe", "cute"))),
          columns=BLOCK_COLUMNS),
    Table("cute_m256", first="shape, kernel", caption="256 x 128 cooperative tiles (`m256`) against each kernel's "
          "config before, in ms (`python bench/cute_gemm.py --sweep ...`, one H200, `467f5ff`, do_bench medians, "
          "uniform top-K routing from random logits: a kernel diagnostic). dW1 gathers X as its B operand, and a "
          "128-wide B tile gathers half the rows per MMA; down and dX~ lose. dW1 now defaults to `co128m256`.",
          rows=tuple(Row(f"{name}, {kernel}", f"bench/results/2026-11-25-h200-cute-sweep-{file}-m256.json",
                         {"kernel": kernel}, "rows")
                     for name, file in (("30B", "30b"), ("7B", "7b")) for kernel in ("dw1", "down", "dx")),
          columns=sweep_columns("co256", "pp192c2", "co256c2", "co128m256", "co128m256c2")),
    Table("cute_long_k", first="shape, kernel", caption="The down and dX~ kernels' tile configs in ms, three "
          "rounds each in a rotated order, medians (`python bench/cute_gemm.py --rounds 3 --sweep ...`, one H200, "
          "`7090159`'s kernels, do_bench, uniform top-K routing from random logits: a kernel diagnostic). The "
          "reduction is n for down and 2n for dX~; over more than 512 the 128-wide ping-pong pairs (`pp128c2`) are "
          "the fastest and now the default there (`6b61004`), where 256-wide cooperative pairs (`co256c2`) ran "
          "before; up to 512, `pp192c2` stays.",
          rows=tuple(Row(f"{name}, {kernel}", f"bench/results/2026-11-25-h200-cute-sweep-{file}.json",
                         {"kernel": kernel}, "rows")
                     for name, file, kernel in (
                         ("30B (2n 1024)", "30b-dx-dh", "dx"), ("30B (n 512)", "30b-down", "down"),
                         ("OLMoE (2n 2048)", "olmoe-dx-dh", "dx"), ("OLMoE (n 1024)", "olmoe-down", "down"),
                         ("7B-E64 (2n 1024)", "7b-n512-down-dx", "dx"), ("7B-E64 (n 512)", "7b-n512-down-dx", "down"),
                         ("1.4B (2n 512)", "1.4b-down-dx", "dx"), ("7B (2n 512)", "7b-dx-dh", "dx"))),
          columns=sweep_columns("co256c2", "pp192c2", "pp128c2", "pp192")),
    Table("cute_store", first="shape, kernel", caption="The down and dX~ kernels storing their tiles from "
          "registers (`DirectStoreEpilogue`, `e75afe2`) against the staged store before, in ms: each kernel's default "
          "config, three rounds alternating the order, do_bench medians, uniform top-K routing from random logits, "
          "one H200, one process (a scratch A/B, its script in the file); the two outputs were bit-identical in "
          "every row (the file's `identical`).",
          rows=store_ab_rows("bench/results/2026-11-26-h200-cute-direct-store-ab.json"),
          columns=(Field("staged ms", "staged_ms", digits=3), Field("direct ms", "direct_ms", digits=3),
                   Ratio("direct ÷ staged", "direct_ms", "staged_ms"))),
    Table("cute_store_up", first="shape, kernel", caption="The up-projection (H and A, `DirectSwiGLUEpilogue`), dW1 "
          "and dW2 storing from registers (`922a9e2`) against the staged store, in ms: each kernel's default config "
          "and the same with a trailing `s` (staged), `python bench/cute_gemm.py --only up,dw1,dw2 --rounds 3 --sweep "
          "...` (three rounds alternating the order, do_bench medians, uniform top-K routing from random logits), one "
          "H200, one process. The GPU tests compare the two stores bit for bit (`test_direct_and_staged_stores_write_"
          "the_same_bits`).",
          rows=tuple(Row(f"{name}, {kernel}", f"bench/results/2026-11-26-h200-cute-direct-swiglu-ab-{shape}.json",
                         {"kernel": kernel}, "rows")
                     for name, shape in (("30B", "30b"), ("Qwen3-Next", "qwen3next"))
                     for kernel in ("up", "dw1", "dw2")),
          columns=sweep_columns("co256s", "co256", "co128m256s", "co128m256")),
    Table("cute_store_diag", first="shape, config", caption="Where the down-projection's time went before "
          "(a scratch diagnostic on one H200, `f5912f0`'s kernels, its script in the file; ms, three rotated rounds, "
          "do_bench medians): its staged store epilogue, the same with packed 32-bit staging stores, the staging "
          "without the global copy-out, and no epilogue but one predicated store that keeps the accumulator live. "
          "The copy-out, not the staging, was the cost: the direct store above removes its shared-memory round trip.",
          rows=tuple(Row(f"{name}, {cfg}", "bench/results/2026-11-26-h200-down-epilogue-diag.json",
                         {"shape": shape, "config": cfg}, "rows")
                     for name, shape, cfg in (("30B", "30b", "pp192c2"), ("Qwen3-Next", "qwen3next", "pp192c2"),
                                              ("Qwen3-Next", "qwen3next", "pp128c2"))),
          columns=(Field("staged ms", "staged_ms", digits=3), Field("packed staging ms", "packed_staging_ms", digits=3),
                   Field("no global store ms", "no_global_store_ms", digits=3),
                   Field("no epilogue ms", "no_epilogue_ms", digits=3))),
    Table("cute_store_tma", first="shape, kernel", caption="Tried and dropped: whole tiles stored by TMA bulk copies "
          "from two swizzled staging buffers per warpgroup (partial tiles kept the thread stores), against the "
          "staged thread store, in ms (the same A/B, `f5912f0` plus that epilogue, its text in the file). "
          "Bit-identical and slower everywhere: before a buffer is restaged, its store must have read it, and the "
          "store waits behind the mainloop's queued TMA loads.",
          rows=store_ab_rows("bench/results/2026-11-26-h200-cute-tma-store-ab.json"),
          columns=(Field("staged ms", "staged_ms", digits=3), Field("TMA store ms", "tma_ms", digits=3),
                   Ratio("TMA ÷ staged", "tma_ms", "staged_ms"))),
    Table("cute_widths", first="shape, kernel", caption="Down-projection tile widths in ms before the direct store, "
          "the official layer's kind (160, 176: widths that are not multiples of 64, possible since `e75afe2`) "
          "among them (`python bench/cute_gemm.py --only down --rounds 3 --sweep ...`, one H200, staged store, "
          "uniform top-K routing from random logits: a kernel diagnostic). Neither new width won; at Qwen3-Next the "
          "128-wide pairs ran ahead of the default, which the block has not confirmed, so the default stays.",
          rows=tuple(Row(f"{name}, down", "bench/results/2026-11-26-h200-cute-sweep-down-widths.json",
                         {"kernel": "down"}, f"sweeps.{key}.rows")
                     for name, key in (("Qwen3-Next", "qwen3next"), ("30B", "30b"))),
          columns=sweep_columns("pp192c2", "pp176c2", "pp160c2", "pp128c2")),
    Table("block_ab_traced", first="tree, config, round", caption="The compiled MoE block (cute experts) from two "
          "trees, one process per tree and round (`python -m bench.block_ab`, one H200, the official layer not run): "
          "`162e72c`, whose routing ops were custom ops, and `3a3201e`, whose triton routing ops torch.compile "
          "traces (`sonic/ops.py`). do_bench medians; the host's time to issue one call, compiled and eager (the "
          "device idle before and after); the output's checksum, equal in every row.",
          rows=tuple(Row(f"{tag.split('-')[0]} `{tag.split('-')[1]}`, {config}, {r + 1}",
                         "bench/results/2026-11-26-h200-block_ab-traced.json", {"name": config},
                         f"rounds.{r}.{tag}.configs")
                     for r in (0, 1) for config in ("7B", "30B") for tag in ("main-162e72c", "traced-3a3201e")),
          columns=(Field("fwd ms", "fwd_ms", digits=3), Field("f+b ms", "fb_ms", digits=3),
                   Field("issue fwd ms", "issue_ms.fwd", digits=2), Field("issue f+b ms", "issue_ms.fb", digits=2),
                   Field("eager issue fwd ms", "eager_issue_ms.fwd", digits=2),
                   Field("eager issue f+b ms", "eager_issue_ms.fb", digits=2),
                   Field("output sum", "check.out_sum", digits=3))),
    Table("triton_dh_ab", first="config, tree", caption="The triton backend's dH product (dA' = dO W2_e with its "
          "dSwiGLU epilogue) from two trees, one call on one H200 (`python -m bench.triton_gemm_ab --configs "
          "30B,7B,120B --products dh`, run in each tree): `ee34cfc`, two 64-wide dots per 128 x 128 tile, one per "
          "epilogue half; `3ddb28a`, one 128-wide dot, the epilogue on column quarters of the accumulator. Each "
          "tree's default tile (128 x 128 x 64, 8 warps, 4 stages); the error is against a torch product of the "
          "same bf16 operands.",
          rows=tuple(Row(f"{config}, {tree}", f"bench/results/2026-11-28-h200-triton_gemm_ab-dh-{tree}.json",
                         {"config": config, "tile": "Config(bm=128, bn=128, bk=64, warps=8, stages=4)"})
                     for config in ("7B", "30B", "120B") for tree in ("ee34cfc", "3ddb28a")),
          columns=(Field("ms", "ms", digits=3), Field("TFLOPS", "tflops", digits=0),
                   Field("max error", "max_err", digits=4))),
    Table("block_ab_triton_dh", first="tree, config, round", caption="The compiled MoE block on the triton "
          "backend from two trees, one process per tree and round, alternating (`python -m bench.block_ab --tree "
          "old=<ee34cfc> --tree new=. --configs 30B,7B --backend triton --rounds 2`, one H200, the call after the "
          "dH A/B above): `ee34cfc` and `3ddb28a` differ in dH only. do_bench medians; the output's checksum, equal "
          "in every row.",
          rows=tuple(Row(f"{tag} `{tree}`, {config}, {r + 1}",
                         "bench/results/2026-11-28-h200-block_ab-triton-3ddb28a.json", {"name": config},
                         f"rounds.{r}.{tag}.configs")
                     for r in (0, 1) for config in ("7B", "30B")
                     for tag, tree in (("old", "ee34cfc"), ("new", "3ddb28a"))),
          columns=(Field("fwd ms", "fwd_ms", digits=3), Field("f+b ms", "fb_ms", digits=3),
                   Field("output sum", "check.out_sum", digits=3))),
    Table("gather_sum", first="shape, sum", caption="The cute gather-sum by the 16-byte chunks a lane holds per "
          "column slice (`python -m bench.gather_sum`, one H200, `a521b6d`, do_bench medians with L2 flushed, seven "
          "interleaved rounds): 16 keeps a 4096-wide row whole, as the kernel did before. Weighted is the forward's "
          "O (scores times Y rows), unweighted the backward's dX. The default (`aggregate.default_max_per_lane`) is "
          "the fastest column of each row.",
          rows=tuple(Row(f"{config}, {'weighted' if w else 'unweighted'}",
                         "bench/results/2026-11-25-h200-gather_sum.json", {"config": config, "weighted": w})
                     for config in ("7B", "30B", "OLMoE", "1.4B") for w in (True, False)),
          columns=(*(Field(f"{c} per lane, ms", f"median_ms.{c}", digits=3) for c in (2, 4, 8, 16)),
                   Field("fastest", "fastest_cap", digits=0))),
    Table("block_h100", first="config, backend", caption="The same block and official layer on one H100, "
          "compiled as the trainer runs it (`bash bench/gpu.sh block`, the official layer's autotune results "
          "kept per GPU kind). The first two rows: `1c4a4d6` (`sonic/` as at `326c410`), with everything since "
          "`6b61004`: every expert kernel but dH storing its tiles from registers, the router's centring forward in "
          "one kernel of products of x; one call, the official layer tuning both configs in it. The next three "
          "rows: `6b61004`, with everything since (the dW1 kernel in 256-row "
          "tiles, the gather-sums in column slices, the logit norm, and down and dX~ over a reduction longer than 512 "
          "in 128-wide ping-pong pairs); the official layer's 7B rounds there ran slow, so that row's × is no "
          "kernel comparison. The next three: each compiled block one graph (`6dc2dbb`); the next three: the "
          "down and dx kernels in 2-CTA clusters that multicast A, 192-wide ping-pong tiles over a short reduction "
          "(`95f5f0d`); the last three: before (`79cabe9`).",
          rows=tuple(
              Row(f"{config}, cute+compile", "bench/results/2026-11-26-h100-moe_block-compiled-gram.json",
                  {"config": config, "backend": "cute+compile"}) for config in ("30B", "7B")) + tuple(
              Row(f"{config}, cute+compile", "bench/results/2026-11-25-h100-moe_block-compiled-pp128c2.json",
                  {"config": config, "backend": "cute+compile"}) for config in ("30B", "OLMoE", "7B")) + tuple(
              Row(f"{config}, cute+compile", f"bench/results/{file}.json", {"config": config, "backend": "cute+compile"})
              for file in ("2026-11-25-h100-moe_block-compiled-onegraph", "2026-11-25-h100-moe_block-compiled",
                           "2026-11-24-h100-moe_block-compiled") for config in ("7B", "30B", "OLMoE")),
          columns=BLOCK_COLUMNS),
    Table("official_7b", first="run", caption="The paper's 7B config (T 24576, d 1536, n 256, E 128, K 8), "
          "forward + backward of the bare expert layer (router logits, top-K, plan, experts: `bench.moe_layer`, "
          "the diagnostic), cute and the official sonic-moe 0.1.2.post1 layer in one "
          "process on the same inputs; one run each, the two not interleaved.", rows=(
              Row("7B alone", "bench/results/2026-11-22-h100-moe_layer-7b-final.json", LAYER_7B, "configs"),
              Row("7B alone, `--autotune`", "bench/results/2026-11-22-h200-moe_layer-7b-official.json", LAYER_7B,
                  "configs"),
              Row("every config, `--autotune`", "bench/results/2026-11-22-h200-moe_layer.json", LAYER_7B,
                  "configs")),
          columns=(Field("cute TFLOPS", "backends.cute.fwdbwd_tf", digits=0),
                   Field("official TFLOPS", "backends.official.fwdbwd_tf", digits=0),
                   Ratio("cute ÷ official", "backends.cute.fwdbwd_tf", "backends.official.fwdbwd_tf"),
                   Field("cute held MiB", "backends.cute.held_bytes", 2**-20, 0),
                   Field("official held MiB", "backends.official.held_bytes", 2**-20, 0))),
    Table("backends_7b", first="config", caption="Our three GPU backends on the same bare 7B expert layer in one "
          "process (the H100 run of the table above); `grouped_mm` is our own torch._grouped_mm backend, not a "
          "peer.", rows=(Row("7B", "bench/results/2026-11-22-h100-moe_layer-7b-final.json", LAYER_7B,
                                            "configs"),),
          columns=(*(Field(f"{b} TFLOPS", f"backends.{b}.fwdbwd_tf", digits=0)
                     for b in ("cute", "triton", "grouped_mm")),
                   Ratio("cute ÷ grouped_mm", "backends.cute.fwdbwd_tf", "backends.grouped_mm.fwdbwd_tf"),
                   *(Field(f"{b} held MiB", f"backends.{b}.held_bytes", 2**-20, 0) for b in ("cute", "grouped_mm")))),
    Table("levers", first="rung", caption="`sonic_7b` cut to 8 layers, 4 × 4096 tokens, one H100, one process "
          "(`bench.levers`): each rung adds one change to the rung above it.", rows=tuple(
              Row(lever, "bench/results/2026-11-23-h100-levers.json", {"lever": lever}, "rows")
              for lever in ("before", "+ bf16 router", "+ chunked loss", "+ compile")),
          columns=(Field("k tokens/s", "tokens_per_s", 1e-3),
                   Ratio("× the rung above", "tokens_per_s", "tokens_per_s", ABOVE),
                   Ratio("× before", "tokens_per_s", "tokens_per_s", {"lever": "before"}), CausalMfu("MFU"),
                   Field("MFU, full attention", "mfu", 100, suffix="%"), Field("peak GiB", "peak_mem_gib"))),
    Table("lever_swaps", first="swap", caption="Each swaps one piece of the `+ compile` rung and is measured in "
          "the same process as that rung; the document-masked rows also change the batch (packed documents "
          "that may not attend to each other).", rows=(
              *(Row(lever, "bench/results/2026-11-23-h100-levers.json", {"lever": lever}, "rows")
                for lever in ("liger loss", "cce loss", "flex causal", "doc flex", "doc sdpa dense mask")),
              Row("cudnn causal", "bench/results/2026-11-23-h100-levers-cudnn.json", {"lever": "cudnn causal"},
                  "rows")),
          columns=(Field("k tokens/s", "tokens_per_s", 1e-3),
                   Ratio("× `+ compile`, same process", "tokens_per_s", "tokens_per_s", {"lever": "+ compile"}),
                   Field("peak GiB", "peak_mem_gib"))),
    Table("profile_40l", first="step", caption="The trainer's own 40-layer `sonic_7b` step (cute, micro-batch 4 × "
          "4096, local BPE text) under torch.profiler, per profiled step (`bash bench/gpu.sh profile`, "
          "`bench.trainer_profile`): at `d48eabb`, fp32 AdamW moments and fp32 masters, the defaults then; at "
          "`c0ef921`, bf16 moments and no masters, the defaults since.",
          rows=(Row("profiled steps, `d48eabb`", PROFILE_40L), Row("profiled steps, `c0ef921`", PROFILE_40L_NOW)),
          columns=(Field("wall ms, unprofiled steps (median)", "step_wall_ms_after_profile_median"),
                   Field("span ms", "gaps_per_step.span_ms"), Field("GPU busy ms", "gaps_per_step.busy_ms"),
                   Field("GPU idle ms", "gaps_per_step.idle_ms"),
                   Field("idle, waiting for the host, ms", "gaps_per_step.idle_host_bound_ms"))),
    Table("profile_40l_ops", first="operator", caption="The `c0ef921` profile's largest GPU consumers, per step: the "
          "device time of each operator's kernels (operators nest: `aten::mm` includes the loss's GEMMs).",
          rows=tuple(Row(label, PROFILE_40L_NOW, {"0": op}, "top_ms_per_step") for label, op in (
              ("dense GEMMs (`aten::mm`: attention projections, shared expert, router, loss)", "aten::mm"),
              ("cuDNN attention, backward", "aten::_cudnn_attention_backward"),
              ("the experts' backward (`sonic::experts_backward`, cute)", "sonic::experts_backward"),
              ("AdamW (`_adamw_kernel`, bf16 moments, no masters)", "_adamw_kernel"),
              ("the experts' forward (`sonic::experts`, cute)", "sonic::experts"),
              ("the chunked linear + cross-entropy loss", "_ChunkedLinearCE"),
              ("cuDNN attention, forward", "aten::_cudnn_attention_forward"),
              ("the router's centring, backward", "sonic::centred_router_logits_backward"))),
          columns=(Field("ms per step", "1"), Field("calls per step", "2", digits=0))),
)


# --------------------------------------------------------------------------- git


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


@lru_cache(maxsize=None)
def in_history(root: Path, commit: str) -> bool:
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        return False
    return git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


@lru_cache(maxsize=None)
def added_in(root: Path, file: str) -> str | None:
    """The commit that first added `file`, or None if it is not committed."""
    out = git(root, "log", "--diff-filter=A", "--format=%h", "--", file).stdout.split()
    return out[-1] if out else None


def is_shallow(root: Path) -> bool:
    return git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"


def cited_commit(root: Path, file: str, recorded: str | None) -> tuple[str, str]:
    """(commit, why): the commit a result file's numbers are cited at: the one it records, if that is in
    the history; else the one that added the file, and why ('' for a recorded commit)."""
    if recorded and in_history(root, recorded):
        return recorded, ""
    added = added_in(root, file)
    if added is None:
        raise ClaimError(f"{file} is not committed: commit the result file, then render")
    why = f"its recorded commit {recorded} is not in the history" if recorded else "the file records no commit"
    return added, f"it added the file; {why}"


def provenance(root: Path, file: str, recorded: str | None) -> str:
    """The words citing that commit, e.g. "commit `05b39f4` (it added the file; the file records no commit)"."""
    commit, why = cited_commit(root, file, recorded)
    return f"commit `{commit}`" + (f" ({why})" if why else "")


# --------------------------------------------------------------------------- rendering


def gpu_label(rec: Record) -> str:
    """'2×H200', 'H100', 'CPU': the GPU count and kind of the record's run."""
    device = str(rec.get("gpu") or rec.get("device") or "")
    if not device:
        raise ClaimError(f"{rec.file} {rec.label()}: no gpu or device recorded")
    count = rec.get("num_gpus") or (int(m.group(1)) if (m := re.match(r"\s*(\d+)\s*x\s", device)) else 1)
    from sonic.train.metrics import PEAK_BF16_FLOPS  # noqa: PLC0415 - the GPU names MFU knows

    name = next((key for key, _ in PEAK_BF16_FLOPS if key in device), "CPU" if device.lower().startswith("cpu")
                else device)
    return f"{count}×{name}" if count > 1 else name


def date_of(rec: Record) -> str:
    date = rec.get("date") or (m.group(0) if (m := re.match(r"\d{4}-\d{2}-\d{2}", Path(rec.file).name)) else None)
    if not date:
        raise ClaimError(f"{rec.file}: no date recorded")
    return str(date)[:10]


def source(root: Path, rec: Record) -> tuple[str, str]:
    """(file, what else the note says: commit and command): rows with the same source share a note."""
    if rec.file == PAPER_SOURCE:
        return rec.file, "typed from the paper (arXiv 2512.14080), each value citing it"
    command = rec.get("command")
    if not command:
        raise ClaimError(f"{rec.file} {rec.label()}: no command recorded; a claim needs the command that produced "
                         f"it (re-run and commit the result, or drop the row)")
    return rec.file, f"{provenance(root, rec.file, rec.get('commit'))}; command: `{command}`"


def render_table(root: Path, table: Table) -> str:
    """The block body: caption, the table (label, cells, GPU, date, note number), the numbered notes."""
    header = [table.first, *(c.header for c in table.columns), "GPU", "date", "commit", "note"]
    lines = ([table.caption, ""] if table.caption else []) + [
        "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: dict[tuple[str, str], list[str]] = {}  # source -> the records cited from it
    above = None
    for row in table.rows:
        rec = select(root, row.file, row.records, row.where)
        cells = [c.cell(rec, Where(root, row, above)) for c in table.columns]
        above = rec
        cited = notes.setdefault(source(root, rec), [])
        if rec.label() not in cited:
            cited.append(rec.label())
        gpu = "64×H100" if rec.file == PAPER_SOURCE else gpu_label(rec)
        date = "2025 (arXiv 2512.14080)" if rec.file == PAPER_SOURCE else date_of(rec)
        commit = "–" if rec.file == PAPER_SOURCE else f"`{cited_commit(root, rec.file, rec.get('commit'))[0]}`"
        number = list(notes).index(source(root, rec)) + 1
        lines.append("| " + " | ".join([row.label, *cells, gpu, date, commit, str(number)]) + " |")
    lines.append("")
    lines += [f"{i}. `{file}` ({'; '.join(records)}); {rest}" for i, ((file, rest), records) in enumerate(notes.items(), 1)]
    return "\n".join(lines) + "\n"


def tables() -> dict[str, Table]:
    names = [t.name for t in TABLES]
    assert len(set(names)) == len(names), f"two tables share a name: {names}"
    return {t.name: t for t in TABLES}


def blocks(text: str) -> list[re.Match]:
    return list(BLOCK.finditer(text))


def render_docs(root: Path, specs: dict[str, Table], docs=DOCS) -> dict[str, str]:
    """{doc: its text with every claims block re-rendered}; a ClaimError if a block names no table."""
    out = {}
    for doc in docs:
        path = root / doc
        if not path.is_file():
            continue
        text = path.read_text()

        def fill(m: re.Match) -> str:
            if m["name"] not in specs:
                raise ClaimError(f"{doc}: block claims:{m['name']} names no table in scripts/claims.py TABLES")
            return f"<!-- claims:{m['name']} -->\n{render_table(root, specs[m['name']])}<!-- /claims:{m['name']} -->"

        out[doc] = BLOCK.sub(fill, text)
    return out


# --------------------------------------------------------------------------- checking


def _table_rows(body: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def compare_block(doc: str, name: str, have: str, want: str, table: Table) -> list[str]:
    """Cell by cell: what the doc says against what the cited file gives."""
    if have == want:
        return []
    problems = []
    have_rows, want_rows = _table_rows(have), _table_rows(want)
    if len(have_rows) != len(want_rows) or (have_rows and have_rows[0] != want_rows[0]):
        problems.append(f"{doc} claims:{name}: the table's rows or columns differ from TABLES[{name!r}]")
    else:
        header = want_rows[0]
        for row_have, row_want in zip(have_rows[1:], want_rows[1:]):
            for col, got, expected in zip(header, row_have, row_want):
                if got != expected:
                    problems.append(f"{doc} claims:{name}, row {row_want[0]!r}, column {col!r}: the doc says "
                                    f"{got!r}, its result file gives {expected!r}")
    other_have = [x for x in have.splitlines() if not x.startswith("|")]
    other_want = [x for x in want.splitlines() if not x.startswith("|")]
    for got, expected in zip(other_have, other_want):
        if got != expected:
            problems.append(f"{doc} claims:{name}: {got!r} should read {expected!r}")
    if len(other_have) != len(other_want):
        problems.append(f"{doc} claims:{name}: the caption or notes differ from what the result files give")
    return problems


def cited_commits(body: str) -> list[str]:
    """The commits a block cites: in its notes ("commit `abc1234`") and its rows' commit column."""
    return re.findall(r"(?:commit |\| )`([0-9a-f]{7,40})` ", body)


def cited_files(body: str) -> list[str]:
    return re.findall(r"^\d+\. `([^`]+)`", body, re.M)


def prose_figures(text: str, heading: str | None) -> list[str]:
    """Performance figures typed in prose: outside claims blocks, inside `heading`'s section (or anywhere)."""
    text = BLOCK.sub("", text)
    if heading is not None:
        start = text.find(heading + "\n")
        if start < 0:
            return [f"section {heading!r} is missing"]
        level = heading.split()[0]
        end = re.search(rf"^#{{1,{len(level)}}} ", text[start + len(heading):], re.M)
        text = text[start:start + len(heading) + (end.start() if end else len(text))]
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands, not claims
    return [m.group(0) for m in FIGURE.finditer(re.sub(r"`[^`]*`", "", text))]


def check(root: Path, specs: dict[str, Table], docs=DOCS, sections=CLAIM_SECTIONS) -> list[str]:
    """Every problem --check reports (an empty list when the docs hold only what the result files say)."""
    problems, placed = [], set()
    shallow = is_shallow(root)
    if shallow:
        problems.append("this is a shallow clone: cited commits cannot be checked; `git fetch --unshallow` first")
    try:
        rendered = render_docs(root, specs, docs)
    except ClaimError as err:
        return problems + [str(err)]
    for doc, new in rendered.items():
        old = (root / doc).read_text()
        have = {m["name"]: m["body"] for m in blocks(old)}
        want = {m["name"]: m["body"] for m in blocks(new)}
        for name, body in have.items():
            placed.add(name)
            problems += compare_block(doc, name, body, want[name], specs[name])
            for commit in cited_commits(body):
                if not shallow and not in_history(root, commit):
                    problems.append(f"{doc} claims:{name}: commit {commit} is not in the git history")
            for file in cited_files(body):
                if file != PAPER_SOURCE and not git(root, "ls-files", "--error-unmatch", file).returncode == 0:
                    problems.append(f"{doc} claims:{name}: {file} is not committed")
    problems += [f"TABLES[{name!r}] is placed in none of {', '.join(docs)}: add its markers or remove it"
                 for name in specs if name not in placed]
    for doc, heading in sections:
        if (root / doc).is_file():
            problems += [f"{doc}{' ' + heading if heading else ''}: prose types the figure {fig!r}; put it in a "
                         f"claims table and cite the row" for fig in prose_figures((root / doc).read_text(), heading)]
    return list(dict.fromkeys(problems))  # a commit cited in a row and its note is one problem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="report what differs from the result files; change nothing")
    args = ap.parse_args(argv)
    specs = tables()
    if args.check:
        problems = check(REPO, specs)
        for p in problems:
            print(p)
        if problems:
            print(f"\n{len(problems)} problem(s); `python -m scripts.claims` re-renders the tables", file=sys.stderr)
            return 1
        print(f"claims: {len(specs)} tables agree with their result files")
        return 0
    for doc, text in render_docs(REPO, specs).items():
        if (REPO / doc).read_text() != text:
            (REPO / doc).write_text(text)
            print(f"rendered {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
