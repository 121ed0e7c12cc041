"""fp32 master weights for a model trained in bfloat16.

bf16 keeps 8 bits of mantissa: next to a weight of 0.5 the closest other values are 2^-9 ≈ 0.002
away, while one Adam step moves a weight by about the learning rate (~1e-5). Applied to bf16
weights directly, most updates round away to nothing. So the model runs forward and backward in
bf16 (half the memory for weights, activations and gradients), while the optimizer holds an fp32
copy of every low-precision trainable weight:

    grad32 = float(grad16);  clip and step on the fp32 masters;  weight16 = round(master32)

Weights of fp32 or more (all of them in an fp32 run; LoRA adapters on a bf16 base) are their own
masters, so the same code serves every case. The loss itself is always computed in fp32 (the
log-probs upcast the logits).
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.model_params = list(params)
        # What the optimizer updates: fp32 masters of 16-bit parameters, the others themselves.
        self.params = [
            torch.nn.Parameter(p.detach().float().clone()) if p.dtype in LOW_PRECISION else p
            for p in self.model_params
        ]

    def grads_to_masters(self) -> None:
        """Move the model's low-precision gradients onto the masters' fp32 ones (added: called
        after every micro-batch, so that accumulation happens in fp32)."""
        for master, param in zip(self.params, self.model_params):
            if master is not param and param.grad is not None:
                grad = param.grad.float()
                master.grad = grad if master.grad is None else master.grad + grad
                param.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """The model's weights become the updated masters, rounded to the model's dtype."""
        for master, param in zip(self.params, self.model_params):
            if master is not param:
                param.copy_(master)
