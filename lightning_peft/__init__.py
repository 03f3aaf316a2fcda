"""lightning-peft: parameter-efficient fine-tuning and efficient-training plugins for PyTorch Lightning."""

__version__ = "0.1.0"
