"""LoRA adapters served beside the base model (docs/lora.md)."""
