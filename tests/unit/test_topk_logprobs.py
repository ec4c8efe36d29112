"""The distillation helpers of token_logprobs.py against log_softmax written out: top-k next-token
logprobs and the logprobs of given ids are aligned with compute_token_logprobs (position t: token t given
the tokens before it), and their gradient is the composed one."""

import torch

from posttrain.workers.policy.token_logprobs import (
    compute_token_logprobs,
    next_token_logprobs_at,
    topk_next_token_logprobs,
)


def test_topk_and_gathered_logprobs_line_up_with_token_logprobs():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)  # [b, K, V]
    input_ids = torch.randint(0, 7, (2, 5), generator=generator)
    reference = torch.log_softmax(logits / 0.7, dim=-1)  # [b, K, V]: position t - 1 predicts token t
    values, ids = topk_next_token_logprobs(logits, 3, temperature=0.7)
    assert values.shape == ids.shape == (2, 5, 3)
    assert bool((values[:, 0] == 0).all()) and bool((ids[:, 0] == 0).all())
    expected_values, expected_ids = reference[:, :-1].topk(3, dim=-1)
    torch.testing.assert_close(values[:, 1:], expected_values)
    assert torch.equal(ids[:, 1:], expected_ids)
    # With every id a candidate, the candidate logprob at the next token is compute_token_logprobs'.
    every = torch.arange(7).expand(2, 5, 7)
    gathered = next_token_logprobs_at(logits, every, temperature=0.7)  # [b, K, V]
    tokens = compute_token_logprobs(logits, input_ids, temperature=0.7)  # [b, K]
    torch.testing.assert_close(gathered.gather(-1, input_ids.unsqueeze(-1)).squeeze(-1), tokens)


def test_gathered_logprobs_have_the_gradient_of_log_softmax():
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ids = torch.tensor([[[0, 1], [2, 3], [4, 5], [1, 1]]])
    weights = torch.randn(1, 4, 2, generator=torch.Generator().manual_seed(2))
    (next_token_logprobs_at(logits, ids) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    composed = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:])
    (composed * weights[:, 1:]).sum().backward()
    torch.testing.assert_close(ours, logits.grad)
