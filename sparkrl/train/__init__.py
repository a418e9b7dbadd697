"""Training: GRPO's loss and advantages, rewards, datasets and prompts, the trainer loop with atomic
checkpoints that resume exactly, the drafter's online and offline training, data-parallel ranks and
sharding, and `generation`, the one place that builds what makes rollouts (the policy's inference copy on the
CPU kernels, the drafting from `drafting`: drafter, SPARK, budget; the engine, sparkrl's or vLLM's) from a
configuration."""
