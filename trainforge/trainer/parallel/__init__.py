"""The parallelism engine: mesh, DDP, FSDP2, TP, PP, EP, activation checkpointing, DeepSpeed (docs/parallelism.md)."""
