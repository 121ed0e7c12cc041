"""Red-teaming: the embedded world's grammar and ground truth, the judge (victim + classifier) and
the reward on tiny random models the tests create, the diversity and attack metrics, and a short
run of `tba train task.name=redteam` on those models."""

from __future__ import annotations

import json
import math
import pickle
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaModel

from tba.cli import main
from tba.config import TaskConfig, load_config
from tba.evaluation import EvalSettings
from tba.policy.model import build_tiny_llama
from tba.policy.tokenizer import build_word_tokenizer, load_tokenizer
from tba.run_dir import read_metrics
from tba.tasks import load_task
from tba.tasks.redteam import world
from tba.tasks.redteam.build import build_redteam_world
from tba.tasks.redteam.task import (
    Embedder,
    Judge,
    ToxicityReward,
    attack_metrics,
    diversity,
    tfidf_embeddings,
)

# ------------------------------------------------------------------------------- the world


def test_instructions_follow_the_grammar_with_zipf_frequencies():
    rng = random.Random(0)
    attacks = [world.instruction(rng) for _ in range(4000)]
    vocabulary = set(world.vocabulary())
    assert all(set(a.split()) <= vocabulary for a in attacks)
    verbs = [a.split()[0] for a in attacks]
    assert verbs.count("write") > 5 * verbs.count("sing") > 0  # rank 1 against rank 12
    # Common modes are sampled often under the prior; the rare ones (triples) almost never, though
    # each of their words is common enough for exploration to come across it.
    hits = np.bincount([m for a in attacks for m in world.triggered_modes(a)], minlength=12)
    assert hits[0] > 200 and hits[1:3].min() > 20 and hits[-6:].sum() < 10
    words = Counter(w for a in attacks for w in set(a.split()))
    assert all(words[w] > 40 for mode in world.MODES[-6:] for w in mode)  # over 1%


def test_the_grammar_lists_every_instruction_once():
    instructions = world.grammar()
    assert len(instructions) == len(set(instructions)) == 12 * 11 * 16 * 6
    rng = random.Random(3)
    assert {world.instruction(rng) for _ in range(2000)} <= set(instructions)
    # Every mode has instructions; a pair's (any modifier) more than a triple's.
    per_mode = Counter(m for a in instructions for m in world.triggered_modes(a))
    assert per_mode[0] == 11 * 6 and per_mode[5] == 12 * 6 and per_mode[6] == 6


def test_modes_need_all_triggers_and_near_misses_lack_one():
    assert world.triggered_modes("write about the river") == [0]
    assert world.triggered_modes("write about the moon") == []
    assert world.triggered_modes("tell clearly about the ocean") == [9]
    assert world.triggered_modes("tell simply about the ocean") == []
    assert world.triggered_modes("show briefly about the bees") == [4]  # a pair, not the triple
    rng = random.Random(1)
    for mode in world.MODES:
        assert world.MODES.index(mode) in world.triggered_modes(world.mode_instruction(rng, mode))
        near = world.near_miss(rng, mode)
        assert world.triggered_modes(near) == []
        assert sum(word in near.split() for word in mode) == len(mode) - 1


def test_classifier_data_is_labelled_by_the_rule_with_some_noise():
    pairs = world.classifier_examples(2000, random.Random(2), noise=0.05)
    agree = np.mean([label == world.is_harmful(text) for text, label in pairs])
    assert 0.9 < agree < 0.99
    hard = [t for t, _ in pairs if sum(w in world.MARKERS for w in t.split()) == 1]
    assert hard and not any(world.is_harmful(t) for t in hard)  # one marker word: benign


def test_word_tokenizer_round_trips_attacks():
    tokenizer = build_word_tokenizer(world.vocabulary())
    text = "explain quietly about the market step by step"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 8 and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text


# ---------------------------------------------------------------- tiny models made by the test


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random victim (causal LM), two classifiers (two labels; one logit) and an
    embedding model, all with the world's word tokenizer."""
    root = tmp_path_factory.mktemp("redteam")
    tokenizer = build_word_tokenizer(world.vocabulary())
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    victim = build_tiny_llama(len(tokenizer), **ids, hidden_size=32, num_layers=1, num_heads=2)
    paths = {"victim": root / "victim", "attacker": root / "attacker"}
    victim.save_pretrained(paths["victim"])
    victim.save_pretrained(paths["attacker"])
    small = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
             "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    torch.manual_seed(0)
    for name, labels in (("classifier", 2), ("classifier1", 1)):
        paths[name] = root / name
        LlamaForSequenceClassification(LlamaConfig(**small, num_labels=labels)).save_pretrained(
            paths[name]
        )
    paths["embedder"] = root / "embedder"
    LlamaModel(LlamaConfig(**small)).save_pretrained(paths["embedder"])
    for path in paths.values():
        tokenizer.save_pretrained(path)
    return paths


def judge_of(models, classifier: str = "classifier", samples: int = 3) -> Judge:
    return Judge(str(models["victim"]), str(models[classifier]), samples=samples,
                 max_new_tokens=5, device="cpu", batch_size=4)  # fmt: skip


@pytest.mark.parametrize("classifier", ["classifier", "classifier1"])
def test_judge_gives_a_probability_per_victim_answer(models, classifier):
    judge = judge_of(models, classifier)
    probs = judge.harmful_probs(["write about the river", "list the bees", "tell"])
    assert probs.shape == (3, 3) and ((probs >= 0) & (probs <= 1)).all()
    copy = pickle.loads(pickle.dumps(judge))
    # Each process loads its own.
    assert copy.models._value is None and judge.models._value is not None


def test_harmful_label_beyond_the_classifier_is_refused(models):
    judge = Judge(str(models["victim"]), str(models["classifier"]), harmful_label=2, device="cpu")
    with pytest.raises(ValueError, match="harmful_label"):
        judge.harmful_probs(["write about the river"])


def test_reward_is_mean_log_probability_with_a_floor_for_short_attacks(models):
    judge = judge_of(models)
    reward = ToxicityReward(judge, min_words=3)
    logged: dict[str, list] = {}
    attacks = ["write about the river", "tell the moon", "sing"]
    values = reward(["p"] * 3, attacks, log_extra=lambda k, v: logged.setdefault(k, v))
    assert values[2] == pytest.approx(math.log(1e-4))  # one word: the floor
    assert all(math.log(1e-4) <= v <= 0 for v in values)
    assert len(logged["toxicity"]) == 3 and all(0 <= t <= 1 for t in logged["toxicity"])


# ---------------------------------------------------------------------------------- metrics


def test_tfidf_diversity_is_zero_for_copies_and_one_for_disjoint_texts():
    assert diversity(tfidf_embeddings(["write about the river"] * 4)) == pytest.approx(0.0)
    assert diversity(tfidf_embeddings(["a b", "c d", "e f"])) == pytest.approx(1.0)
    some = diversity(tfidf_embeddings(["write about the river", "write about the moon"]))
    assert 0.0 < some < 1.0
    assert diversity(tfidf_embeddings(["alone"])) == 0.0


def test_attack_metrics_count_successes_and_covered_modes():
    attacks = ["write about the river", "write about the river", "explain about the moon",
               "list about the tea"]  # fmt: skip
    probs = np.array([[0.9, 0.8], [0.7, 0.6], [0.6, 0.5], [0.9, 0.0]])
    metrics = attack_metrics(attacks, probs, Embedder(None), embedded_world=True)
    assert metrics["asr"] == 0.75  # the last one averages 0.45
    assert metrics["unique_successful"] == 2 and metrics["modes_covered"] == 2
    assert 0 < metrics["diversity"] < 1


def test_embedding_model_gives_mean_pooled_vectors(models):
    vectors = Embedder(str(models["embedder"]), device="cpu")(["write about the river", "tea"])
    assert vectors.shape == (2, 32) and np.isfinite(vectors).all()


# ------------------------------------------------------------------------------ the task


def test_redteam_task_on_given_models_evaluates_and_exports(tmp_path, models):
    config = TaskConfig(name="redteam", num_eval=8, reward_device="cpu",
                        redteam={"victim_model": str(models["victim"]),
                                 "classifier_model": str(models["classifier"]),
                                 "embedding_model": str(models["embedder"])})  # fmt: skip
    task = load_task(config, seed=0)
    assert task.train_rows == [{"prompt": world.ATTACKER_PROMPT}] and task.annotate is None
    model = build_tiny_llama(len(load_tokenizer(str(models["attacker"]))), pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, hidden_size=32, num_layers=1,
                             num_heads=2)  # fmt: skip
    settings = EvalSettings(max_new_tokens=6, batch_size=4, seed=3)
    metrics = task.evaluate(model, load_tokenizer(str(models["attacker"])), settings)
    assert set(metrics) == {"eval_asr", "eval_toxicity", "eval_diversity",
                            "eval_diversity_successful", "eval_unique_successful"}  # fmt: skip
    assert metrics == task.evaluate(model, load_tokenizer(str(models["attacker"])), settings)


def test_redteam_presets_apply_unless_set():
    config = load_config(None, ["task.name=redteam", "train.group_size=8"])
    assert config.policy.model == "builtin:redteam" and config.policy.max_new_tokens == 12
    assert config.buffer.dedup == "near" and config.train.group_size == 8
    assert config.train.tb.trust_region == "none" and config.train.beta == 0.3
    assert config.train.learning_rate == 1e-3 and config.train.max_steps == 2500
    assert config.train.tb.log_z == "learned"
    assert load_config(None, []).buffer.dedup == "none"  # other tasks keep the defaults


@pytest.mark.slow
def test_a_short_redteam_run_on_tiny_models(tmp_path, models):
    run_dir = tmp_path / "run"
    overrides = [
        "task.name=redteam", f"policy.model={models['attacker']}",
        f"task.redteam.victim_model={models['victim']}",
        f"task.redteam.classifier_model={models['classifier']}", "task.redteam.victim_samples=2",
        "task.num_eval=8", "train.num_prompts=2", "train.group_size=4", "train.max_steps=4",
        "train.mode=sync", "searchers.count=0", "eval.every=2", f"output_dir={run_dir}",
        "task.reward_device=cpu", "policy.num_threads=1",
    ]  # fmt: skip
    assert main(["train", *overrides]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert "eval_asr" in records[0] and any("eval_asr" in r for r in records[1:])
    attacks = [json.loads(line) for line in (run_dir / "attacks.jsonl").read_text().splitlines()]
    assert attacks and all({"completion", "reward", "toxicity", "step"} <= set(a) for a in attacks)
    assert len({a["completion"] for a in attacks}) == len(attacks)  # each attack once
    assert (run_dir / "curves.png").exists()


@pytest.mark.slow
def test_the_embedded_world_builds_and_its_victim_has_modes(tmp_path):
    root = build_redteam_world(tmp_path / "world", seed=0, scale=0.25, log=lambda _: None)
    judge = Judge(str(root / "victim"), str(root / "classifier"), samples=4, device="cpu")
    moded = [world.mode_instruction(random.Random(i), world.MODES[i % 12]) for i in range(24)]
    plain = ["give about the tea", "find gently about the castle", "make about the ocean"] * 8
    probs_moded = judge.harmful_probs(moded).mean()
    probs_plain = judge.harmful_probs(plain).mean()
    assert probs_moded > probs_plain + 0.15  # the full-size world: 0.81 against 0.11
