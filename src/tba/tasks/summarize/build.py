"""The embedded summarisation world's models (`builtin:summarize`, `tba pretrain
task.name=summarize`): the SFT summariser (the policy) and the proxy reward model trained on the
gold judge's preferences, built once into the cache directory. The world is the task, so it is
the same for every run seed."""

from __future__ import annotations

import json
import random
import time
from functools import partial
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from tba.config import PretrainConfig
from tba.policy.model import build_tiny_llama
from tba.policy.sampling import generate_texts
from tba.policy.sft import supervise
from tba.policy.sources import built_once
from tba.policy.tokenizer import build_word_tokenizer
from tba.rewards.training import pairwise_accuracy, ranked_pairs, train_reward_model
from tba.tasks.preference import win
from tba.tasks.summarize import world


def world_dir(pretrain: PretrainConfig, log=print) -> Path:
    """The embedded summarisation world (policy/, proxy/, world.json), built on first use."""
    target = Path(pretrain.cache_dir).expanduser() / f"summarize-v{world.VERSION}"
    build = partial(build_summarize_world, seed=0, log=log)
    return built_once(target, "world.json", "the summarisation world", build, log)


def build_summarize_world(out_dir: Path, *, seed: int, scale: float = 1.0, log=print) -> Path:
    """policy/ (the SFT summariser) and proxy/ (its reward model) in `out_dir`, each loadable
    with `from_pretrained` and holding the world's tokenizer, and world.json (what the build
    measured: the SFT policy's greedy win rate on the held-out posts, the proxy's pairwise
    accuracy). `scale` multiplies the data and the steps (tests build a smaller world).

    - The SFT policy imitates the careless reference summaries of `world.posts("sft")`:
      it learns to copy events from the post (the copying sets in after a few hundred steps)
      and keeps the annotator's habits (greedy, it mostly leaves out the last key event).
    - The proxy is a Bradley-Terry reward model trained on the gold judge's preferences between
      the SFT policy's sampled summaries of a post (as the paper's proxy was trained on a larger
      model's labels), ties left out. It is small (one layer) and sees only what one policy
      writes, so it learns the judge in part: it credits the events a summary states without
      checking them against the post, and a policy that adds or repeats events over-optimises
      it. Its pairwise accuracy on the pairs of held-out posts is logged and saved to world.json.
    """
    start = time.time()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(world.vocabulary())
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def n(count: int) -> int:
        return max(1, round(count * scale))

    posts = world.posts("sft", n(8000))
    policy = build_tiny_llama(
        len(tokenizer), pad_token_id=pad, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        hidden_size=64, num_layers=2, num_heads=4, max_positions=128, seed=seed,
    )  # fmt: skip
    prompts = [tokenizer(p.prompt)["input_ids"] for p in posts]
    responses = [tokenizer(p.reference, add_special_tokens=False)["input_ids"] + [eos]
                 for p in posts]  # fmt: skip
    supervise(policy, prompts, responses, pad, steps=n(1200), batch_size=32, lr=3e-3, rng=rng,
              log=log, name="summarizer")  # fmt: skip
    held_out_posts = world.posts("test", n(512))
    (greedy,) = zip(*sample_summaries(policy, tokenizer, [p.prompt for p in held_out_posts],
                                      samples=1, max_new_tokens=world.MAX_SUMMARY_WORDS,
                                      seed=seed, greedy=True))  # fmt: skip
    sft_win_rate = sum(
        win(world.judge(p.prompt, summary).score, world.judge(p.prompt, p.reference).score)
        for p, summary in zip(held_out_posts, greedy)
    ) / len(held_out_posts)
    log(f"SFT policy: greedy win rate {sft_win_rate:.3f} against the references")

    # The proxy learns from the policy's own summaries; a fifth of the posts are held out.
    labelled = [p.prompt for p in world.posts("preference", n(2000))]
    summaries = sample_summaries(policy, tokenizer, labelled, samples=4,
                                 max_new_tokens=world.MAX_SUMMARY_WORDS, seed=seed)  # fmt: skip
    pairs = [ranked_pairs(post, four, world.gold_scores) for post, four in zip(labelled, summaries)]
    cut = len(labelled) - max(1, len(labelled) // 5)
    train = [pair for per_post in pairs[:cut] for pair in per_post]
    held_out = [pair for per_post in pairs[cut:] for pair in per_post]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=pad, num_labels=1)  # fmt: skip
    proxy = LlamaForSequenceClassification(config)
    train_reward_model(proxy, tokenizer, train, steps=n(400), batch_size=64, lr=3e-3, rng=rng,
                       log=log)  # fmt: skip
    report = {
        "version": world.VERSION,
        "sft_greedy_win_rate": sft_win_rate,
        "proxy_train_pairs": len(train),
        "proxy_train_accuracy": pairwise_accuracy(proxy, tokenizer, train),
        "proxy_held_out_pairs": len(held_out),
        "proxy_held_out_accuracy": pairwise_accuracy(proxy, tokenizer, held_out),
        "build_seconds": round(time.time() - start, 1),
    }
    log(f"proxy reward model: pairwise accuracy {report['proxy_held_out_accuracy']:.3f} on "
        f"{len(held_out)} pairs of held-out posts ({report['proxy_train_accuracy']:.3f} on its "
        f"{len(train)} training pairs)")  # fmt: skip
    for name, model in (("policy", policy), ("proxy", proxy)):
        model.save_pretrained(out_dir / name)
        tokenizer.save_pretrained(out_dir / name)
    (out_dir / "world.json").write_text(json.dumps(report, indent=2))
    return out_dir


@torch.no_grad()
def sample_summaries(
    model, tokenizer, prompts: list[str], *, samples: int, max_new_tokens: int, seed: int,
    greedy: bool = False, batch_size: int = 512,
) -> list[list[str]]:  # fmt: skip
    """`samples` responses to each prompt at temperature 1 (or greedy), decoded."""
    ids = [tokenizer(p)["input_ids"] for p in prompts for _ in range(samples)]
    texts = generate_texts(
        model, tokenizer, ids, max_new_tokens=max_new_tokens, greedy=greedy,
        generator=torch.Generator().manual_seed(seed), batch_size=batch_size,
    )  # fmt: skip
    return [texts[i : i + samples] for i in range(0, len(texts), samples)]
