"""Train a Sonic MoE. `python train.py` runs the embedded default (tiny model, CPU-friendly).

Examples:
  python train.py model=olmoe_1b_7b data=fineweb_edu train.seq_len=4096
  python train.py routing=token_rounding model.moe.kernel_backend=triton
  torchrun --nproc-per-node 8 train.py experiment=sonic_7b
"""
import hydra
from omegaconf import DictConfig

from eval import run_lm_eval
from sonic.train.config import register_schema, to_config
from sonic.train.trainer import train

register_schema()


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(raw: DictConfig) -> None:
    train(to_config(raw), lm_eval=run_lm_eval)


if __name__ == "__main__":
    main()
