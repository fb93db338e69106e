"""``python -m lightning_megatron.planner --model ... --gpus ...``: the layout planner's command line
(:mod:`lightning_megatron.planner.cli`)."""
import sys

from lightning_megatron.planner.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
