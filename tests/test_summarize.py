"""Preference tuning: the summarisation world and its gold judge, the proxy reward model's
pipeline on a tiny world, the KL and perplexity metrics against a float64 computation, the
`summarize` task and a short run on the tiny world, and the `tldr` task's metrics on tiny
random models the tests create."""

from __future__ import annotations

import json
import math
import pickle
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from tba.cli import main
from tba.config import PretrainConfig, TaskConfig, load_config
from tba.evaluation import EvalSettings
from tba.policy.model import build_tiny_llama, load_model
from tba.policy.tokenizer import build_char_tokenizer, build_word_tokenizer, load_tokenizer
from tba.rewards.models import RewardModel
from tba.rewards.training import pairwise_accuracy, ranked_pairs, train_reward_model
from tba.run_dir import read_metrics
from tba.tasks import load_task
from tba.tasks.preference import closeness, decode, respond, win
from tba.tasks.summarize import world
from tba.tasks.summarize.build import build_summarize_world, world_dir

POST = "post : ana lost kite . it was windy . ben fixed lamp . cleo saw drum . park was busy . "
POST += "tl;dr : "

# ------------------------------------------------------------------------------ the gold judge


def test_gold_judge_counts_recall_invention_length_and_repetition():
    score = lambda summary: world.judge(POST, summary).score  # noqa: E731
    assert world.key_events(POST) == [("ana", "lost", "kite"), ("ben", "fixed", "lamp")]
    assert score("ana lost kite and ben fixed lamp") == 2.0  # 7 words, within the 8-word budget
    assert score("ana lost kite and ben fixed lamp so yeah") == 2.0 - 0.25  # one word over
    assert score("ana lost kite") == 1.0
    assert score("ana lost kite and ben fixed drum") == 1.0 - 1.0  # an altered event
    assert score("ana lost kite and cleo saw drum") == 1.0 - 1.0  # a minor event is not key
    assert score("ana lost kite and ana lost kite") == 1.0 - 0.5  # said twice
    assert score("ana lost kite and ben fixed lamp so that was all") == 2.0 - 0.25 * 3
    assert score("kite lamp") == 0.0 and score("") == 0.0
    verdict = world.judge(POST, "ana lost kite and ana lost kite and eli won boat")
    assert (verdict.recalled, verdict.invented, verdict.repeated, verdict.excess_words) == (
        1, 1, 1, 3,
    )  # fmt: skip


def test_a_win_is_a_higher_gold_score_and_a_tie_counts_half():
    summaries = ["ana lost kite and ben fixed lamp", "ana lost kite", "ben fixed lamp"]
    both, one, other = world.gold_scores([POST] * 3, summaries)
    assert (win(both, one), win(one, both)) == (1.0, 0.0)
    assert win(one, other) == 0.5


def test_posts_are_a_fixed_function_of_their_split():
    first = world.posts("test", 50)
    assert first == world.posts("test", 50) and first[:10] == world.posts("test", 10)
    assert first != world.posts("train", 50)
    vocabulary = set(world.vocabulary())
    for post in first:
        assert list(post.events) == world.key_events(post.prompt)
        assert set(post.prompt.split()) | set(post.reference.split()) <= vocabulary
        assert world.judge(post.prompt, world.ideal_summary(post)).score == len(post.events)


def test_references_keep_the_annotators_habits():
    posts = world.posts("sft", 2000)
    ideal = [world.judge(p.prompt, world.ideal_summary(p)).score for p in posts]
    careless = [world.judge(p.prompt, p.reference).score for p in posts]
    assert all(c <= i for c, i in zip(careless, ideal))
    dropped = sum(len(world.stated_events(p.reference)) < len(p.events) for p in posts)
    assert 0.6 < dropped / len(posts) < 0.8  # DROP_PROB = 0.7
    wins = sum(win(i, c) for i, c in zip(ideal, careless)) / len(posts)
    assert 0.8 < wins < 0.95  # the ideal summary beats most references, not all


# ------------------------------------------------------------------ the proxy and a tiny world


def test_ranked_pairs_put_the_judges_choice_first_and_leave_ties_out():
    summaries = ["ana lost kite", "ana lost kite and ben fixed lamp", "ben fixed lamp", "x"]
    pairs = ranked_pairs(POST, summaries, world.gold_scores)
    assert (POST, summaries[1], summaries[0]) in pairs and (POST, summaries[0], "x") in pairs
    assert len(pairs) == 5  # six pairs, one of them a tie


def test_reward_model_learns_the_judges_preferences(tmp_path):
    tokenizer = build_word_tokenizer(world.vocabulary())
    posts = world.posts("preference", 60)
    pairs = [pair for p in posts for pair in ranked_pairs(
        p.prompt, [world.ideal_summary(p), p.reference, ""], world.gold_scores)]  # fmt: skip
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         pad_token_id=tokenizer.pad_token_id, num_labels=1)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    train_reward_model(model, tokenizer, pairs, steps=40, batch_size=32, lr=1e-2,
                       rng=random.Random(0), log=lambda _: None)  # fmt: skip
    assert pairwise_accuracy(model, tokenizer, pairs) > 0.8
    # Saved, it scores through the same class as the real task's reward models.
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward = RewardModel(str(tmp_path / "rm"), device="cpu")
    p = posts[0]
    good, bad = reward([p.prompt] * 2, [world.ideal_summary(p), ""])
    assert good > bad


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A cache holding a tiny-scale world where `builtin:summarize` looks for it."""
    cache = tmp_path_factory.mktemp("cache")
    build_summarize_world(cache / f"summarize-v{world.VERSION}", seed=0, scale=0.03,
                          log=lambda _: None)  # fmt: skip
    return cache


def test_tiny_world_builds_policy_proxy_and_report(cache_dir):
    root = world_dir(PretrainConfig(cache_dir=str(cache_dir)))
    report = json.loads((root / "world.json").read_text())
    assert report["version"] == world.VERSION
    assert report["proxy_train_pairs"] > 0 and 0 <= report["proxy_held_out_accuracy"] <= 1
    assert 0 <= report["sft_greedy_win_rate"] <= 1
    policy = load_model(str(root / "policy"), "cpu")
    assert len(load_tokenizer(str(root / "policy"))) == policy.config.vocab_size
    scores = RewardModel(str(root / "proxy"), device="cpu")([POST], ["ana lost kite"])
    assert len(scores) == 1 and math.isfinite(scores[0])


# ------------------------------------------------------------------------ KL and perplexity


@torch.no_grad()
def reference_closeness(policy, reference, prompts, responses, temperature):
    """The metrics one sequence and one position at a time, in float64, without padding."""
    kl = logq_sum = 0.0
    tokens = 0
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(policy(input_ids=ids).logits[0].double() / temperature, -1)
        logq = torch.log_softmax(reference(input_ids=ids).logits[0].double() / temperature, -1)
        for t, token in enumerate(response):
            row = len(prompt) - 1 + t  # the position that predicts this token
            kl += float((logp[row].exp() * (logp[row] - logq[row])).sum())
            logq_sum += float(logq[row, token])
            tokens += 1
    return kl / tokens, math.exp(-logq_sum / tokens)


def tiny_pair(vocab: int = 20):
    def build(seed: int):
        return build_tiny_llama(vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                hidden_size=16, num_layers=1, num_heads=2, seed=seed).double()

    return build(0).eval(), build(1).eval()


def test_kl_and_perplexity_match_a_float64_computation():
    policy, reference = tiny_pair()
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 20) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    responses = [[rng.randrange(3, 20) for _ in range(rng.randint(1, 4))] + [2] for _ in range(5)]
    for temperature in (1.0, 0.7):
        got = closeness(policy, reference, prompts, responses, pad_id=0,
                        temperature=temperature, batch_size=2)  # fmt: skip
        want = reference_closeness(policy, reference, prompts, responses, temperature)
        assert got == pytest.approx(want, rel=1e-9)
        assert got[0] > 0
    kl, perplexity = closeness(policy, policy, prompts, responses, pad_id=0)
    assert kl == pytest.approx(0.0, abs=1e-12)
    assert perplexity == pytest.approx(reference_closeness(policy, policy, prompts, responses,
                                                           1.0)[1])  # fmt: skip


# ------------------------------------------------------------------------------- the task


def test_summarize_task_evaluates_win_rate_rewards_and_closeness(cache_dir):
    config = TaskConfig(name="summarize", num_train=20, num_eval=12, reward_device="cpu")
    task = load_task(config, seed=0, cache_dir=str(cache_dir))
    assert task.train_rows[0].keys() == {"prompt", "reference"}
    assert [r["prompt"] for r in task.eval_rows] == [p.prompt for p in world.posts("test", 12)]
    policy_dir = world_dir(PretrainConfig(cache_dir=str(cache_dir))) / "policy"
    model, tokenizer = load_model(str(policy_dir), "cpu"), load_tokenizer(str(policy_dir))
    settings = EvalSettings(max_new_tokens=world.MAX_SUMMARY_WORDS, batch_size=8, seed=1)
    metrics = task.evaluate(model, tokenizer, settings)
    assert set(metrics) == {"eval_win_rate", "eval_gold", "eval_proxy_reward", "eval_kl",
                            "eval_ref_perplexity"}  # fmt: skip
    assert 0 <= metrics["eval_win_rate"] <= 1 and metrics["eval_ref_perplexity"] >= 1
    assert metrics["eval_kl"] == pytest.approx(0.0, abs=1e-9)  # the policy is its reference
    assert metrics == task.evaluate(model, tokenizer, settings)  # seeded: repeatable
    with torch.no_grad():  # a policy that moved is measured away from its reference
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    assert task.evaluate(model, tokenizer, settings)["eval_kl"] > 1e-4
    copy = pickle.loads(pickle.dumps(task.evaluate))
    assert copy.reference._value is None and task.evaluate.reference._value is not None


def test_summarize_presets_apply_unless_set():
    config = load_config(None, ["task.name=summarize", "train.beta=0.3"])
    assert config.policy.model == "builtin:summarize" and config.train.beta == 0.3
    assert config.train.sync_every == 10 and config.buffer.recent_prob == 0.5
    assert config.buffer.reward_weight == 1.0 and config.train.truncated == "penalize"
    assert config.policy.max_new_tokens == world.MAX_SUMMARY_WORDS


def test_a_short_summarize_run_on_the_tiny_world(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    overrides = [
        "task.name=summarize", f"pretrain.cache_dir={cache_dir}", "task.num_train=16",
        "task.num_eval=8", "train.num_prompts=2", "train.group_size=4", "train.max_steps=3",
        "train.mode=sync", "searchers.count=0", "eval.every=2", f"output_dir={run_dir}",
        "task.reward_device=cpu", "policy.num_threads=1",
    ]  # fmt: skip
    assert main(["train", *overrides]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    evaluated = [r for r in records if "eval_win_rate" in r]
    assert len(evaluated) >= 3  # the base policy, step 2 and the final policy
    assert evaluated[0]["eval_kl"] == pytest.approx(0.0, abs=1e-9)
    summary = json.loads((run_dir / "eval.json").read_text())
    for name in ("eval_win_rate", "eval_proxy_reward", "eval_kl", "eval_ref_perplexity"):
        assert name in summary["base"] and name in summary["final"]


# ---------------------------------------------------------------------------- TL;DR (tldr)


@pytest.fixture(scope="module")
def tldr_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random policy, reward model and gold judge with the character tokenizer, and a
    JSONL file of rows in the TL;DR dataset's format."""
    root = tmp_path_factory.mktemp("tldr")
    tokenizer = build_char_tokenizer()
    paths = {"policy": root / "policy", "rm": root / "rm", "gold": root / "gold"}
    build_tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     hidden_size=16, num_layers=1, num_heads=2).save_pretrained(paths["policy"])
    for seed, name in ((0, "rm"), (1, "gold")):
        torch.manual_seed(seed)
        LlamaForSequenceClassification(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )).save_pretrained(paths[name])  # fmt: skip
    for path in paths.values():
        tokenizer.save_pretrained(path)
    rows = [{"query": f"POST: I {verb} my keys.\n\nTL;DR:", "reference_response": f" {verb} keys"}
            for verb in ("lost", "found", "moved", "hid")]  # fmt: skip
    paths["data"] = root / "tldr.jsonl"
    paths["data"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def test_tldr_task_reports_win_rate_against_the_gold_judge_and_closeness(tldr_models):
    data = str(tldr_models["data"])
    config = TaskConfig(
        name="tldr", train_path=data, eval_path=data, reward_model=str(tldr_models["rm"]),
        eval_reward_model=str(tldr_models["gold"]), reward_device="cpu",
    )  # fmt: skip
    task = load_task(config, seed=0, policy_model=str(tldr_models["policy"]))
    assert task.metrics == ("eval_win_rate", "eval_kl")
    model = load_model(str(tldr_models["policy"]), "cpu")
    tokenizer = load_tokenizer(str(tldr_models["policy"]))
    settings = EvalSettings(max_new_tokens=6, batch_size=4, seed=0)
    metrics = task.evaluate(model, tokenizer, settings)
    prompts = [row["prompt"] for row in task.eval_rows]
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    greedy = decode(tokenizer, respond(model, tokenizer, prompt_ids, settings, greedy=True))
    gold = RewardModel(str(tldr_models["gold"]), device="cpu")
    ours, theirs = gold(prompts, greedy), gold(prompts, [r["reference"] for r in task.eval_rows])
    assert metrics["eval_win_rate"] == pytest.approx(
        sum(win(a, b) for a, b in zip(ours, theirs)) / len(ours))
    assert metrics["eval_gold"] == pytest.approx(sum(ours) / len(ours), rel=1e-5)
    proxy = RewardModel(str(tldr_models["rm"]), device="cpu")(prompts, greedy)
    assert metrics["eval_proxy_reward"] == pytest.approx(sum(proxy) / len(proxy), rel=1e-5)
    assert metrics["eval_kl"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["eval_ref_perplexity"] > 1
    # Without a reference policy there is no KL to report.
    assert "eval_kl" not in load_task(config, seed=0).evaluate(model, tokenizer, settings)


def test_pythia_tldr_config_still_loads():
    config = load_config(Path(__file__).parent.parent / "configs" / "pythia_tldr.yaml")
    assert config.task.name == "tldr" and config.task.eval_reward_model is not None
