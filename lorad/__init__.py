"""lorad: serve thousands of LoRA adapters on one base model, with CPU-assisted cold starts."""

__version__ = "0.1.0"
