"""sparkrl: fast GRPO with exact speculative rollouts and SPARK in-rollout draft adaptation."""

__version__ = "0.1.0"
