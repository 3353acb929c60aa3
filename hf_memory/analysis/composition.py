"""Section 5: how memories compose within a layer and how layers refine the prediction.

With ``top`` the logit-lens argmax, per layer and sampled prefix:

- zero agreement (5.1): ``top(y) != top(s_i · v_i)`` for every active memory i, where ``s_i`` is
  the sign of its coefficient (vacuously true when no memory is active);
- where the layer's prediction comes from (5.2), comparing ``top(r)``, ``top(y)``, ``top(o)``:
  ``residual`` top(o) = top(r) != top(y); ``ffn`` top(o) = top(y) != top(r);
  ``agreement`` top(o) = top(r) = top(y); ``composition`` top(o) differs from both;
  ``other`` top(r) = top(y) != top(o), impossible for RMSNorm (its lens is linear up to a
  positive scale) and reported so that it is seen if it happens;
- refinement: share of prefixes with ``top(r^l)`` equal to the model's final prediction.
"""

from __future__ import annotations

import torch

__all__ = ["CASES", "classify", "zero_agreement"]

CASES = ("residual", "ffn", "agreement", "composition", "other")


def classify(top_r: torch.Tensor, top_y: torch.Tensor, top_o: torch.Tensor) -> torch.Tensor:
    """Case index into ``CASES`` for each element of the (same-shaped) top-token tensors."""
    o_r, o_y, r_y = top_o == top_r, top_o == top_y, top_r == top_y
    case = torch.full_like(top_o, CASES.index("composition"))
    case[o_r & ~o_y] = CASES.index("residual")
    case[o_y & ~o_r] = CASES.index("ffn")
    case[o_r & o_y] = CASES.index("agreement")
    case[r_y & ~o_r] = CASES.index("other")
    return case


def zero_agreement(top_y: torch.Tensor, active_sign: torch.Tensor, top_plus: torch.Tensor,
                   top_minus: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: no active memory's top token equals the layer's top token.

    top_y: ``[n]``; active_sign: ``[n, M]`` int8 (+1, -1, 0 inactive); top_plus / top_minus:
    ``[M]`` top token of ``+v_i`` / ``-v_i``.
    """
    memory_top = torch.where(active_sign > 0, top_plus[None, :], top_minus[None, :])
    hits = (memory_top == top_y[:, None]) & (active_sign != 0)
    return ~hits.any(dim=1)
