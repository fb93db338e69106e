"""``python -m lightning_megatron fit --config examples/configs/tiny_cpu.yaml``: LightningCLI with the strategy,
model, data and Trainer in YAML (:class:`lightning_megatron.cli.MegatronCLI`, docs/cli.md)."""
from lightning_megatron.cli.lightning_cli import main

if __name__ == "__main__":
    main()
