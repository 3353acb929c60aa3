"""The project's own ``PreTrainedModel`` families, each a flat folder that can be pushed to the Hub.

Families (see DESIGN.md): ``asm`` (ASMForCausalLM), ``air`` (AIRSolver), ``arith``
(ArithTransformer). Each is registered here with the Auto classes once it lands.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .air import AIRConfig, AIRSolver
from .arith import ArithConfig, ArithTransformer
from .asm import ASMConfig, ASMForCausalLM, ASMModel

AutoConfig.register(AIRConfig.model_type, AIRConfig, exist_ok=True)
AutoModel.register(AIRConfig, AIRSolver, exist_ok=True)
AutoConfig.register(ArithConfig.model_type, ArithConfig, exist_ok=True)
AutoModel.register(ArithConfig, ArithTransformer, exist_ok=True)
AutoConfig.register(ASMConfig.model_type, ASMConfig, exist_ok=True)
AutoModel.register(ASMConfig, ASMModel, exist_ok=True)
AutoModelForCausalLM.register(ASMConfig, ASMForCausalLM, exist_ok=True)

__all__: list[str] = [
    "AIRConfig",
    "AIRSolver",
    "ASMConfig", "ASMForCausalLM", "ASMModel", "ArithConfig", "ArithTransformer"]
