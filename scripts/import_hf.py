"""Import a local Hugging Face OLMoE / Qwen3-MoE directory as a single-file Sonic checkpoint.

  python scripts/import_hf.py path/to/OLMoE-1B-7B-0924 olmoe.safetensors

The file holds the weights and the Sonic model config (with data.tokenizer = the HF directory
when it has tokenizer files), so `python -m eval checkpoint=olmoe.safetensors` evaluates it.
`python -m eval checkpoint=path/to/hf_dir` also works directly, without this step.
"""
import argparse
from pathlib import Path

from sonic.models.loading import load_model, save_model_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="a local directory with config.json and *.safetensors")
    parser.add_argument("out_file", help="where to write: *.safetensors or *.pt")
    parser.add_argument("--tokenizer", default=None,
                        help="data.tokenizer to record (default: the HF directory, if it holds a tokenizer)")
    args = parser.parse_args()
    if not (Path(args.hf_dir) / "config.json").is_file():
        raise SystemExit(f"{args.hf_dir} has no config.json; give a Hugging Face model directory")
    loaded = load_model(args.hf_dir, kernel_backend="reference")
    tokenizer = args.tokenizer or (str(Path(loaded.tokenizer).resolve()) if loaded.tokenizer else None)
    out = save_model_file(args.out_file, loaded.model, tokenizer=tokenizer)
    print(f"wrote {out}: {loaded.config.name}, {loaded.config.num_layers} layers, "
          f"{loaded.config.moe.num_experts} experts (tokenizer: {tokenizer})")


if __name__ == "__main__":
    main()
