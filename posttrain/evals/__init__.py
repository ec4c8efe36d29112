"""Evaluation: pass@k and cons@k metrics over n samples per prompt (and the `posttrain eval` run)."""

from posttrain.evals.metrics import eval_cons_k, eval_pass_k, pass_at_k

__all__ = ["eval_cons_k", "eval_pass_k", "pass_at_k"]
