"""The learner: packing, the torch (HF + FSDP2) trainer, checkpoints, the supervised warm-up."""
