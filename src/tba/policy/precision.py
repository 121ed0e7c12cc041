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

`train.master_weights=none` keeps no fp32 copy (`CompensatedWeights`): each 16-bit weight w gets
a compensation buffer c of its own dtype, and the weight is w + c, about 16 significant bits
instead of 8 (Kahan-compensated summation). At the step, one weight at a time, the optimizer
(whichever: torch's AdamW or bitsandbytes' 8-bit one) updates an fp32 view w + c of it, its
gradient upcast; then w becomes the view rounded and c what the rounding lost
(`compensated_assign`), so an update far below w's resolution accumulates in c until it moves w.
Deterministic: a checkpoint keeps c, and a resumed run continues bit for bit. Memory: a 2-byte
c a weight instead of a 4-byte master and its 4-byte fp32 gradient, plus one weight's fp32 view
and gradient at a time; gradients stay in the model's dtype (accumulated over micro-batches in
it). Weights of fp32 or more need no compensation: with an fp32 policy the setting changes
nothing.
"""

from __future__ import annotations

import torch

from tba.config.train import MASTER_WEIGHTS

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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step on the masters, then the model's weights from them."""
        optimizer.step()
        self.masters_to_model()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps beside the model: the fp32 masters of 16-bit weights (rounding
        would lose them), as `master.<index>`."""
        return {f"master.{index}": master.detach()
                for index, (master, param) in enumerate(zip(self.params, self.model_params))
                if master is not param}  # fmt: skip

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, value in tensors.items():
            self.params[int(key.split(".", 1)[1])].copy_(value)


def compensated_value(weight: torch.Tensor, compensation: torch.Tensor) -> torch.Tensor:
    """The weight that `weight` + `compensation` (both 16-bit) hold, in fp32."""
    return weight.float() + compensation.float()


@torch.no_grad()
def compensated_assign(weight: torch.Tensor, compensation: torch.Tensor,
                       value: torch.Tensor) -> None:  # fmt: skip
    """Hold the fp32 `value` as `weight` (its rounding to the weight's dtype) + `compensation`
    (what the rounding lost, rounded in turn), in place."""
    weight.copy_(value)
    compensation.copy_(value - weight.float())


def compensated_add(weight: torch.Tensor, compensation: torch.Tensor,
                    update: torch.Tensor | float) -> None:  # fmt: skip
    """weight += update, with Kahan compensation: an update below the weight's resolution is
    kept in `compensation` until the sum of them moves the weight."""
    compensated_assign(weight, compensation, compensated_value(weight, compensation) + update)


class CompensatedWeights:
    """`train.master_weights=none`: the optimizer updates the model's own weights, each 16-bit
    one through an fp32 view of weight + compensation, one at a time (`step`). The same interface
    as `MasterWeights`: `params` (what the optimizer holds and the clip bounds: here the model's
    parameters themselves, with their gradients), `step`, and the checkpoint's tensors."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.model_params = list(params)
        self.params = self.model_params
        self.compensation = [torch.zeros_like(p, requires_grad=False)
                             if p.dtype in LOW_PRECISION else None
                             for p in self.model_params]  # fmt: skip

    def grads_to_masters(self) -> None:
        """Nothing to move: the gradients accumulate on the model's weights, in their dtype."""

    def masters_to_model(self) -> None:
        """Nothing to copy: `step` updates the model's weights."""

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step: first on everything it holds but the 16-bit weights (fp32
        weights, heads), then on each 16-bit weight alone, as an fp32 view with an fp32 gradient
        (both optimizers skip parameters without a gradient), kept as weight + compensation.
        Adam's state of a weight is created at its first step, on the fp32 view: fp32 (or 8-bit)
        moments for a bf16 weight."""
        low = [(p, c) for p, c in zip(self.model_params, self.compensation)
               if c is not None and p.grad is not None]  # fmt: skip
        grads = [p.grad for p, _ in low]
        for p, _ in low:
            p.grad = None
        optimizer.step()
        others = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]  # fmt: skip
        held = [p.grad for p in others]
        for p in others:
            p.grad = None
        for (p, compensation), grad in zip(low, grads):
            weight = p.data
            p.data = compensated_value(weight, compensation)
            p.grad = grad.float()
            optimizer.step()
            p.grad = None
            compensated_assign(weight, compensation, p.data)  # bitsandbytes may replace p.data
            p.data = weight
        for p, grad in zip(others, held):
            p.grad = grad

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps beside the model: each compensation, as `kahan.<index>`."""
        return {f"kahan.{index}": c for index, c in enumerate(self.compensation) if c is not None}

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, value in tensors.items():
            compensation = self.compensation[int(key.split(".", 1)[1])]
            if compensation is None:
                raise ValueError(f"a checkpoint's {key} has no 16-bit weight here")
            compensation.copy_(value)



def trainable_weights(
    params: list[torch.nn.Parameter], master_weights: str = "fp32"
) -> MasterWeights | CompensatedWeights:
    """What the optimizer updates for the trainable `params`, as `train.master_weights` says:
    `fp32` master copies of 16-bit weights, or `none` (the weights themselves, compensated)."""
    if master_weights == "fp32":
        return MasterWeights(params)
    if master_weights == "none":
        return CompensatedWeights(params)
    raise ValueError(f"train.master_weights is one of {', '.join(MASTER_WEIGHTS)}, "
                     f"not {master_weights!r}")  # fmt: skip
