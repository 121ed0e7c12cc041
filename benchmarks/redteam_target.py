"""TB's target on the embedded red-teaming world, summed exactly, and how far trained attackers
are from it.

The world's grammar has 12,672 instructions and the attacker's prior puts 97.6% of its mass on
them, so the target every method aims at (TB directly, the KL-shaped baselines through their
reward), `q(a) = pi_ref(a) exp(E[r(a)] / beta) / Z`, can be summed over the grammar instead of
sampled. E[r(a)] and P(success | a) (mean P(harmful) over the victim's 5 answers > 0.5) are
estimated from `--draws` independent sets of victim answers per instruction.

For each beta the table gives the target's ASR, the expected number of modes with a successful
attack among 512 samples (what `eval_modes_covered` measures), and each mode's share of the
target's successful attacks. With `--runs`, it gives the same for the final attacker of
each run (its exact distribution over the grammar), with its mass on the grammar and its KL to
the target of the run's own beta, both directions.

    python -m benchmarks.redteam_target                          # the target at betas 1 .. 0.05
    python -m benchmarks.redteam_target --runs runs/redteam/tb/seed0 runs/redteam/rloo/seed0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from tba.config import PretrainConfig
from tba.offline_eval import load_scored_policy
from tba.policy.logprobs import sequence_logprobs
from tba.policy.model import load_model
from tba.policy.tokenizer import encode_prompts, load_tokenizer
from tba.quiet import quiet_libraries
from tba.run_dir import run_config
from tba.tasks.redteam import build as redteam_build
from tba.tasks.redteam import world
from tba.tasks.redteam.task import SUCCESS_THRESHOLD, Judge, attack_rewards

EVAL_SAMPLES = 512
BETAS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05)


@torch.no_grad()
def grammar_logprobs(model, tokenizer, instructions: list[str], batch: int = 2048) -> np.ndarray:
    """log pi(a) of every instruction (its words, then EOS) after the attacker's prompt."""
    (prompt,) = encode_prompts(tokenizer, [world.ATTACKER_PROMPT])
    responses = [tokenizer(a, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
                 for a in instructions]  # fmt: skip
    logps = [
        sequence_logprobs(model, [prompt] * len(chunk), chunk, pad_id=tokenizer.pad_token_id)
        for chunk in (responses[i : i + batch] for i in range(0, len(responses), batch))
    ]
    return torch.cat(logps).double().cpu().numpy()


def judged(world_dir: Path, instructions: list[str], draws: int) -> tuple[np.ndarray, np.ndarray]:
    """E[r(a)] and P(success | a) of every instruction, over `draws` sets of 5 victim answers."""
    judge = Judge(str(world_dir / "victim"), str(world_dir / "classifier"))
    probs = np.stack([judge.harmful_probs(instructions, seed=100 + d) for d in range(draws)], 1)
    rewards = attack_rewards(probs)  # (instructions, draws)
    return rewards.mean(1), (probs.mean(-1) > SUCCESS_THRESHOLD).mean(1)


def summary(p: np.ndarray, success: np.ndarray, modes: np.ndarray) -> dict:
    """ASR, expected modes covered by 512 samples and each mode's share of the successes, of a
    distribution `p` over the grammar (renormalised); `modes` is (instructions, 12) 0/1."""
    p = p / p.sum()
    per_mode = (p * success) @ modes  # P(a sample succeeds in mode m)
    return {
        "asr": float(p @ success),
        "modes": float((1 - (1 - per_mode) ** EVAL_SAMPLES).sum()),
        "shares": per_mode / max(per_mode.sum(), 1e-12),
    }


def row(label: str, s: dict, extra: str = "") -> str:
    shares = " | ".join(f"{100 * x:.1f}" for x in s["shares"])
    return f"| {label} | {100 * s['asr']:.1f}% | {s['modes']:.1f} |{extra} {shares} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=4, help="victim answer sets per instruction")
    parser.add_argument("--runs", type=Path, nargs="*", default=[], help="run directories")
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_libraries()
    world_dir = redteam_build.world_dir(PretrainConfig())
    instructions = world.grammar()
    modes = np.zeros((len(instructions), len(world.MODES)))
    for i, attack in enumerate(instructions):
        modes[i, world.triggered_modes(attack)] = 1
    attacker = load_model(str(world_dir / "attacker"), torch.device("cpu")).eval()
    prior = grammar_logprobs(attacker, load_tokenizer(str(world_dir / "attacker")), instructions)
    reward, success = judged(world_dir, instructions, args.draws)
    print(f"prior mass on the grammar: {np.exp(prior).sum():.3f}")

    header = " | ".join(f"mode {m} (%)" for m in range(len(world.MODES)))
    rule = "|---" * len(world.MODES) + "|"
    print(f"\n| target | ASR | modes in {EVAL_SAMPLES} | {header} |\n|---|---|---{rule}")
    print(row("prior", summary(np.exp(prior), success, modes)))
    configs = {run_dir: run_config(run_dir) for run_dir in args.runs}
    targets = {}
    for beta in sorted({*BETAS, *(c.train.beta for c in configs.values())}, reverse=True):
        log_q = prior + reward / beta
        q = np.exp(log_q - log_q.max())
        targets[beta] = q / q.sum()
        print(row(f"beta {beta}", summary(targets[beta], success, modes)))

    if args.runs:
        print(f"\n| final attacker | ASR | modes in {EVAL_SAMPLES} | on grammar | KL(p‖q) | "
              f"KL(q‖p) | {header} |\n|---|---|---|---|---|---{rule}")  # fmt: skip
        for run_dir, config in configs.items():
            model, tokenizer = load_scored_policy(run_dir / "final", config)
            p = np.exp(grammar_logprobs(model, tokenizer, instructions))
            pn, q = p / p.sum(), targets[config.train.beta]
            kls = f" {p.sum():.3f} | {pn @ np.log(pn / q):.2f} | {q @ np.log(q / pn):.2f} |"
            label = f"{run_dir} ({config.train.loss}, beta {config.train.beta})"
            print(row(label, summary(p, success, modes), kls))


if __name__ == "__main__":
    main()
