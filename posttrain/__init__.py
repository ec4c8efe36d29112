"""posttrain: post-training for language models (SFT, GRPO, DPO, RM) on Ray, from a laptop CPU to a GPU
cluster."""

__version__ = "0.1.0"
