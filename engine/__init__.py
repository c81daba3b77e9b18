"""ZeRO training engine on torch.distributed (filled in by the engine issue)."""
