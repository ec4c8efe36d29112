"""Workers: the Ray actors that do the heavy work, each role in its own package with the actor and, apart, its
driver-side handle: `policy/` (training: a base worker with DTensor/FSDP2 and Megatron Core siblings, and the
`Policy` handle), `generation/` (Hugging Face and vLLM), and `refit.py` (weights from one to the other)."""
