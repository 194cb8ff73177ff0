"""Grouped top-k routing of mixture-of-experts layers, as DeepSeek-V2 and DeepSeek-V3 route.

The experts are split into ``num_groups`` groups (DeepSeek places a group on a device); a
token first keeps its ``topk_groups`` best groups, then its ``top_k`` best experts among
them (DeepSeek-V2, arXiv:2405.04434, "device-limited routing"). DeepSeek-V3
(arXiv:2412.19437, section 2.1.2) scores experts with a sigmoid and chooses them by score
plus a per-expert bias (``e_score_correction_bias``, its auxiliary-loss-free load
balancing), ranking a group by the sum of its two best biased scores; the weights are the
unbiased scores of the chosen experts, renormalised, times ``routed_scaling_factor``.
DeepSeek-V2 scores with a softmax and ranks a group by its best expert.
"""

from __future__ import annotations

from typing import Literal

import torch

Scoring = Literal["softmax", "sigmoid"]


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int = 1,
    topk_groups: int = 1,
    scoring: Scoring = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights (see the module docstring), in float32.

    Args:
        router_logits: ``[T, E]``, any float dtype.
        top_k: experts per token.
        num_groups: expert groups (``E`` must be a multiple); 1 disables group selection.
        topk_groups: groups a token keeps.
        scoring: ``"softmax"`` over all experts or an independent ``"sigmoid"`` per expert.
        renormalize: divide the chosen weights by their sum.
        correction_bias: ``[E]`` added to the scores for choosing only (DeepSeek-V3).
        routed_scaling_factor: multiplies the weights.

    Returns:
        ``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)``.

    Raises:
        ValueError: an unknown scoring, or ``E`` not a multiple of ``num_groups``.
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown expert scoring {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        tokens, experts = choice.shape
        if experts % num_groups:
            raise ValueError(f"{experts} experts do not split into {num_groups} groups")
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        if correction_bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(experts // num_groups, 1), -torch.inf)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
