"""Export a Sonic checkpoint to a Hugging Face directory (config.json + model.safetensors + tokenizer).

  python scripts/export_hf.py runs/tiny/checkpoints/step_00000300 hf/tiny [--dtype bfloat16]

qk_norm=full exports as OlmoeForCausalLM, qk_norm=head as Qwen3MoeForCausalLM; anything HF
cannot represent (expert biases, shared experts, ...) stops with a ValueError naming the field.
"""
import argparse

import torch

from sonic.data import DataConfig, build_tokenizer
from sonic.models.hf import ARCHITECTURES, export_hf, hf_model_type
from sonic.models.loading import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="step dir, run dir, or a .safetensors/.pt file")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    parser.add_argument("--tokenizer", default=None, help="default: the run's data.tokenizer")
    args = parser.parse_args()
    loaded = load_model(args.checkpoint, kernel_backend="reference")
    name = args.tokenizer or loaded.tokenizer
    tokenizer = build_tokenizer(DataConfig(tokenizer=name)) if name else None
    out = export_hf(loaded.model, loaded.config, args.out_dir, tokenizer=tokenizer,
                    dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"wrote {ARCHITECTURES[hf_model_type(loaded.config)]} to {out} (from {loaded.path})")


if __name__ == "__main__":
    main()
