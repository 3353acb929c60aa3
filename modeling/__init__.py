"""The project's own ``PreTrainedModel`` families, each a flat folder that can be pushed to the Hub.

Families (see DESIGN.md): ``asm`` (ASMForCausalLM), ``air`` (AIRSolver), ``arith``
(ArithTransformer). Each is registered here with the Auto classes once it lands.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel

from .arith import ArithConfig, ArithTransformer

AutoConfig.register(ArithConfig.model_type, ArithConfig, exist_ok=True)
AutoModel.register(ArithConfig, ArithTransformer, exist_ok=True)

__all__: list[str] = ["ArithConfig", "ArithTransformer"]
