"""Training: GRPO's loss and advantages, rewards, datasets and prompts, the trainer loop with atomic
checkpoints that resume exactly, the drafter's online and offline training, data-parallel ranks and
sharding, and `assemble`, the one place that composes a rollout (policy copy, CPU kernels, drafter,
budget, SPARK) from a configuration."""
