"""What `train.max_grad_norm` means for each objective, and how fast samples go off-policy.

Part 1, gradient scale: from the embedded base policy, generate a few batches (B prompts x K
responses, on-policy) and compute, on exactly the same batches, the gradient of every objective.
The table gives each one's norm (median, min and max over the batches) and its cosine with the TB
gradient: a norm far above `max_grad_norm` means every step of that objective is clipped to the
same length, whatever the batch says.

Part 2, drift: train TB on fresh batches for up to `--max-stale` steps while keeping the first
batch aside; after s steps, the share of that batch's sequences (and tokens) whose importance
ratio pi_theta / pi_behaviour lies outside [1 - eps, 1 + eps]: what a trust region would clip.

    python -m benchmarks.grad_scale                  # 4 batches, drift up to 12 steps
    python -m benchmarks.grad_scale --batches 8 train.learning_rate=1e-4
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from tba.config import load_config
from tba.objectives import OBJECTIVES
from tba.policy.logprobs import token_logprobs
from tba.policy.model import load_policy
from tba.policy.tokenizer import load_tokenizer
from tba.quiet import quiet_libraries
from tba.searcher import Searcher
from tba.tasks import load_task, resolve_policy
from tba.trainer import Trainer, trainer_settings

LOSSES = tuple(OBJECTIVES)


def build_trainer(config, policy_dir, tokenizer) -> Trainer:
    """A trainer of `config`'s objective on a fresh copy of the base policy, on the CPU."""
    model = load_policy(str(policy_dir), "cpu", dtype=config.policy.dtype)
    return Trainer(model, **trainer_settings(config, tokenizer.pad_token_id, None))


def flat_grad(trainer, groups, beta: float) -> torch.Tensor:
    """The gradient of the trainer's objective on `groups`, flattened (no step taken)."""
    trainer.model.zero_grad(set_to_none=True)
    flat = [s for group in groups for s in group]
    loss, _ = trainer._loss(flat, beta, [])
    loss.backward()
    grads = [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
    trainer.model.zero_grad(set_to_none=True)
    return torch.cat(grads)


def gradient_table(config, policy_dir, tokenizer, batches) -> None:
    beta = config.train.beta
    grads: dict[str, list[torch.Tensor]] = {}
    for loss in LOSSES:
        config.train.loss = loss
        trainer = build_trainer(config, policy_dir, tokenizer)
        grads[loss] = [flat_grad(trainer, groups, beta) for groups in batches]
    print(f"\ngradient of each objective on the same {len(batches)} on-policy batches "
          f"(beta {beta:g}, max_grad_norm {config.train.max_grad_norm:g})")  # fmt: skip
    print("| objective | norm median | norm min | norm max | cosine with tb | norm / tb |")
    print("|---|---|---|---|---|---|")
    for loss, gs in grads.items():
        norms = np.array([float(g.norm()) for g in gs])
        cosines = [float(torch.nn.functional.cosine_similarity(g, t, dim=0))
                   for g, t in zip(gs, grads["tb"])]  # fmt: skip
        ratios = [float(g.norm() / t.norm()) for g, t in zip(gs, grads["tb"])]
        print(f"| {loss} | {np.median(norms):.3g} | {norms.min():.3g} | {norms.max():.3g} | "
              f"{np.mean(cosines):.3f} | {np.mean(ratios):.3g} |")  # fmt: skip


@torch.no_grad()
def ratio_drift(trainer, groups, eps: float) -> tuple[float, float]:
    """Shares of sequences and of tokens of `groups` whose ratio to their behaviour policy lies
    outside [1 - eps, 1 + eps] under the trainer's current policy."""
    flat = [s for group in groups for s in group]
    token_logp, mask = token_logprobs(
        trainer.model, [s.prompt_ids for s in flat], [s.response_ids for s in flat],
        pad_id=trainer.pad_id, temperature=trainer.temperature,
    )  # fmt: skip
    behaviour = torch.zeros_like(token_logp)
    for row, s in enumerate(flat):
        behaviour[row, : len(s.behaviour_token_logps)] = torch.tensor(s.behaviour_token_logps)
    log_ratio = (token_logp - behaviour) * mask
    lo, hi = np.log(1 - eps), np.log(1 + eps)
    seq = log_ratio.sum(1)
    seq_out = float(((seq < lo) | (seq > hi)).float().mean())
    tok_out = float((((log_ratio < lo) | (log_ratio > hi)) & mask.bool()).sum() / mask.sum())
    return seq_out, tok_out


def drift_table(config, policy_dir, tokenizer, searcher, max_stale: int, eps: float) -> None:
    config.train.loss = "tb"
    trainer = build_trainer(config, policy_dir, tokenizer)
    tc = config.train
    kept = to_groups(searcher.generate(tc.num_prompts)[0])
    print(f"\nsamples s steps stale (TB, lr {tc.learning_rate:g}, fresh batch every step): share "
          f"outside [{1 - eps:g}, {1 + eps:g}]")  # fmt: skip
    print("| steps stale | sequences | tokens | grad norm before clipping |")
    print("|---|---|---|---|")
    for step in range(1, max_stale + 1):
        groups = to_groups(searcher.generate(tc.num_prompts)[0])
        record = trainer.step(groups, tc.beta)
        searcher.set_weights(trainer.weights(), step, step)
        if step in (1, 2, 3, 4, 6, 8, 10, 12) or step == max_stale:
            seq_out, tok_out = ratio_drift(trainer, kept, eps)
            print(f"| {step} | {seq_out:.1%} | {tok_out:.1%} | {record['grad_norm']:.3g} |")


def to_groups(samples) -> list[list]:
    by_prompt: dict[int, list] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_id, []).append(s)
    return list(by_prompt.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4, help="batches for the gradient table")
    parser.add_argument("--max-stale", type=int, default=12, help="steps of drift to follow")
    parser.add_argument("--eps", type=float, default=0.2, help="ratio band [1 - eps, 1 + eps]")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    quiet_libraries()
    torch.set_num_threads(2)
    config = load_config(None, args.overrides)
    torch.manual_seed(config.seed)
    policy_dir = resolve_policy(config.policy.model, config.pretrain, config.seed)
    tokenizer = load_tokenizer(str(policy_dir))
    task = load_task(config.task, seed=config.seed)
    searcher = Searcher(
        load_policy(str(policy_dir), "cpu"), tokenizer, task.train_rows, task.reward_fns,
        config, seed=config.seed,
    )  # fmt: skip
    batches = [to_groups(searcher.generate(config.train.num_prompts)[0])
               for _ in range(args.batches)]  # fmt: skip
    gradient_table(config, policy_dir, tokenizer, batches)
    drift_table(config, policy_dir, tokenizer, searcher, args.max_stale, args.eps)


if __name__ == "__main__":
    main()
