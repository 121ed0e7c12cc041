"""Real Hugging Face architectures through `tba train policy.model=<dir>`: tiny random Llama, GPT-2
and Qwen2 models with a tokenizer trained here on the task's text, in fp32, bf16 and with LoRA;
the pieces underneath (tokenizer loading, bf16 weight transfer and master weights, the LoRA sync,
gradient accumulation and checkpointing) one by one; and a missing model's error message."""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from huggingface_hub import constants
from peft.tuners.lora import LoraLayer
from safetensors.numpy import load_file
from tiny_models import build_model, task_texts, teach_to_stop, train_tokenizer
from transformers import PreTrainedTokenizerFast

from tba.cli import main
from tba.config import ConfigError, LoraConfig, RunConfig, TrainConfig, load_config
from tba.core import Sample
from tba.policy.logprobs import sequence_logprobs, token_logprobs
from tba.policy.model import (
    add_lora,
    get_weights,
    load_model,
    load_policy,
    policy_state_dict,
    set_weights,
)
from tba.policy.tokenizer import encode_prompts, load_tokenizer
from tba.run_dir import read_metrics
from tba.searcher import Searcher
from tba.tasks.verifiers.last_number import last_number_reward
from tba.trainer import Trainer

ARCHS = ["llama", "gpt2", "qwen2"]

FAST = [
    "train.mode=sync",
    "searchers.count=0",  # the searcher in this process: no Ray
    "task.num_train=16",
    "task.num_eval=4",
    "task.num_eval_pass_k=2",
    "eval.pass_k=2",
    "eval.every=1000",
    "train.num_prompts=2",
    "train.group_size=4",
    "train.max_steps=3",
    "train.learning_rate=1e-2",
    "policy.max_new_tokens=8",
    "policy.num_threads=1",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each architecture saved with `save_pretrained`, tokenizer included."""
    dirs = {}
    for arch in ARCHS:
        tokenizer = train_tokenizer(arch)
        model = build_model(arch, tokenizer)
        teach_to_stop(model, tokenizer)
        dirs[arch] = tmp_path_factory.mktemp(arch)
        model.save_pretrained(dirs[arch])
        tokenizer.save_pretrained(dirs[arch])
    return dirs


# Every completion of a call gets a reward of its own: the rewards of a group always differ.
DISTINCT_REWARD = """
def distinct(completions, **kwargs):
    return [i / len(completions) for i in range(len(completions))]
"""


@pytest.fixture(scope="module")
def distinct_rewards(tmp_path_factory) -> list[str]:
    """Overrides for runs whose steps must have a gradient whatever was sampled: the task's
    prompts, each completion rewarded by its place in the batch. (With the math task's reward,
    the tiny models answer wrong almost always: with equal rewards in every group, TB's gradient
    at the base policy is exactly zero, and whether a step has one depends on the draws.)"""
    root = tmp_path_factory.mktemp("distinct")
    (root / "rewards.py").write_text(DISTINCT_REWARD)
    prompts, _ = task_texts(16)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return ["task.name=custom", f"task.train_path={root / 'train.jsonl'}",
            f"task.reward_funcs=[{root / 'rewards.py'}:distinct]"]  # fmt: skip


def train_run(tmp_path: Path, model_dir: Path | str, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    args = ["train", f"policy.model={model_dir}", *FAST, *overrides, f"output_dir={run_dir}"]
    assert main(args) == 0
    return run_dir


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def assert_trained(run_dir: Path) -> None:
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert all(r["grad_norm"] > 0 for r in steps)  # `distinct_rewards`: whatever was sampled
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == 3 and "eval_reward" in summary["final"]


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    assert set(before) == set(after)
    return {name for name in before if not torch.equal(before[name], after[name])}


# ---------------------------------------------------------------------------- tba train


@pytest.mark.parametrize("arch", ARCHS)
def test_full_fine_tuning_in_fp32(tmp_path, model_dirs, distinct_rewards, arch):
    run_dir = train_run(tmp_path, model_dirs[arch], *distinct_rewards)
    assert_trained(run_dir)
    base = load_model(str(model_dirs[arch]), "cpu").state_dict()
    final = load_model(str(run_dir / "final"), "cpu").state_dict()
    assert len(changed(base, final)) > len(base) // 2  # most weights moved
    # The saved tokenizer still pads (GPT-2 with its EOS) and reloads as it was used.
    assert load_tokenizer(str(run_dir / "final")).pad_token_id is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_weights_train_through_fp32_master_weights(tmp_path, model_dirs, distinct_rewards,
                                                        arch):  # fmt: skip
    run_dir = train_run(tmp_path, model_dirs[arch], *distinct_rewards, "policy.dtype=bfloat16")
    assert_trained(run_dir)
    base = load_model(str(model_dirs[arch]), "cpu", torch.bfloat16).state_dict()
    final = load_model(str(run_dir / "final"), "cpu", torch.float32).state_dict()
    # final/ holds the bf16 policy the run evaluated: every value is a bf16 number...
    assert all(torch.equal(t, t.bfloat16().float()) for t in final.values())
    # ...and it moved away from the (rounded) base.
    base32 = {name: t.float() for name, t in base.items()}
    assert len(changed(base32, final)) > len(base) // 2


@pytest.mark.parametrize(
    "arch, extra",
    [("llama", []), ("gpt2", []), ("qwen2", []), ("qwen2", ["policy.dtype=bfloat16"])],
)
def test_lora_trains_adapters_and_leaves_the_rest_of_the_policy(
    tmp_path, model_dirs, distinct_rewards, arch, extra
):
    overrides = [*distinct_rewards, "lora.r=4", "lora.alpha=8", "eval.snapshot_minutes=0.0001",
                 *extra]  # fmt: skip
    run_dir = train_run(tmp_path, model_dirs[arch], *overrides)
    assert_trained(run_dir)
    dtype = torch.bfloat16 if extra else torch.float32
    base = load_model(str(model_dirs[arch]), "cpu", dtype).state_dict()
    base = {name: tensor.float() for name, tensor in base.items()}
    final = load_model(str(run_dir / "final"), "cpu").state_dict()  # adapters merged in
    moved = changed(base, final)
    # Only weights of linear layers inside the blocks carry adapters; embeddings, norms and
    # biases are the base's, bit for bit.
    assert moved and all(name.endswith(".weight") and (".h." in name or ".layers." in name)
                         for name in moved)  # fmt: skip
    assert not any("embed" in name or "wte" in name or "norm" in name or "ln_" in name
                   for name in moved)  # fmt: skip
    assert (run_dir / "final" / "adapter" / "adapter_config.json").exists()
    snapshots = [r for r in read_metrics(run_dir / "metrics.jsonl") if "snapshot" in r]
    last = load_file(run_dir / snapshots[-1]["snapshot"])
    assert set(last) <= set(final)
    assert all(np.array_equal(last[name], final[name].numpy()) for name in last)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # GPT-2's Conv1D stores weights transposed
def test_lora_adapter_in_final_reproduces_the_merged_policy(tmp_path, model_dirs, arch):
    run_dir = train_run(tmp_path, model_dirs[arch], "lora.r=4", "train.max_steps=1")
    merged = load_model(str(run_dir / "final"), "cpu").eval()
    adapted = peft.PeftModel.from_pretrained(
        load_model(str(model_dirs[arch]), "cpu"), str(run_dir / "final" / "adapter")
    ).eval()
    ids = torch.tensor([load_tokenizer(str(run_dir / "final"))("Ann has 3 pens.\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits)


def test_gradient_checkpointing_and_micro_batches_train(tmp_path, model_dirs, distinct_rewards):
    overrides = [*distinct_rewards, "train.gradient_checkpointing=true",
                 "train.micro_batch_groups=1"]  # fmt: skip
    run_dir = train_run(tmp_path, model_dirs["gpt2"], *overrides)
    assert_trained(run_dir)
    assert load_config(run_dir / "config.yaml").train.micro_batch_groups == 1


def test_chat_template_wraps_prompts(tmp_path, model_dirs, distinct_rewards):
    tokenizer = load_tokenizer(str(model_dirs["qwen2"]), chat_template=True)
    [ids] = encode_prompts(tokenizer, ["Q?\n"], chat_template=True)
    text = "<|im_start|>user\nQ?\n<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == text
    run_dir = train_run(tmp_path, model_dirs["qwen2"], *distinct_rewards,
                        "policy.chat_template=true")  # fmt: skip
    assert_trained(run_dir)


def test_chat_template_without_one_in_the_tokenizer_is_a_clear_error(tmp_path, model_dirs, capsys):
    args = ["train", f"policy.model={model_dirs['llama']}", *FAST, "policy.chat_template=true",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(args) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face Hub cache of this test's own, and no network (HF_HUB_OFFLINE=1)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_trains_from_the_cached_snapshot_offline(tmp_path, model_dirs, offline_hub_cache):
    """A model id resolves to its snapshot in the Hub cache (the layout huggingface_hub writes)."""
    repo = offline_hub_cache / "models--tba-tests--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dirs["llama"], repo / "snapshots" / commit)
    run_dir = train_run(tmp_path, "tba-tests/tiny-llama", "train.max_steps=1")
    assert len(step_records(run_dir)) == 1
    assert load_config(run_dir / "config.yaml").policy.model == "tba-tests/tiny-llama"


def test_missing_hub_model_offline_names_what_was_looked_for(tmp_path, offline_hub_cache, capsys):
    model_id = "tba-tests/no-such-model"
    args = ["train", f"policy.model={model_id}", *FAST, f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tba: error: policy.model: 'tba-tests/no-such-model'")
    assert f"Hub cache ({offline_hub_cache})" in err and "HF_HUB_OFFLINE=1" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_missing_local_directory_is_named(tmp_path, capsys):
    args = ["train", f"policy.model={tmp_path / 'nowhere'}", *FAST]
    assert main(args) == 2
    assert f"no model directory at {tmp_path / 'nowhere'}" in capsys.readouterr().err


@pytest.mark.slow
def test_async_run_on_ray_with_lora(tmp_path, model_dirs):
    """One searcher process receives adapter weights at every sync and trains the policy."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "tba.cli", "train", f"policy.model={model_dirs['llama']}",
        *[o for o in FAST if o not in ("train.mode=sync", "searchers.count=0")],
        "train.mode=async", "searchers.count=1", "searchers.num_cpus=1", "lora.r=4",
        "train.max_steps=4", f"output_dir={run_dir}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = step_records(run_dir)
    assert len(steps) == 4 and all(math.isfinite(r["loss"]) for r in steps)
    assert any("searcher0/version_lag" in r for r in steps)  # samples came from the searcher
    assert (run_dir / "final" / "adapter" / "adapter_config.json").exists()


# ---------------------------------------------------------------------------- the pieces


def test_tokenizer_without_a_pad_token_pads_with_eos_on_the_left(model_dirs):
    tokenizer = load_tokenizer(str(model_dirs["gpt2"]))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"


def test_tokenizer_without_eos_is_refused(tmp_path):
    tokenizer = train_tokenizer("llama")
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    bare.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="has no EOS token"):
        load_tokenizer(str(tmp_path))


def test_pad_equal_to_eos_keeps_log_probs_exact(model_dirs):
    """Masks come from lengths: a response ending in EOS (= pad) next to a longer one scores as
    it does alone."""
    model = load_model(str(model_dirs["gpt2"]), "cpu").eval()
    tokenizer = load_tokenizer(str(model_dirs["gpt2"]))
    eos = tokenizer.eos_token_id
    prompts = encode_prompts(tokenizer, ["Ann has 3 pens.\n", "Bob?\n"])
    responses = [[eos], tokenizer("#### 12", add_special_tokens=False)["input_ids"] + [eos]]
    with torch.no_grad():
        batched = sequence_logprobs(model, prompts, responses, pad_id=eos)
        alone = [sequence_logprobs(model, [p], [r], pad_id=eos).item()
                 for p, r in zip(prompts, responses)]  # fmt: skip
    np.testing.assert_allclose(batched.numpy(), alone, rtol=0, atol=1e-5)


def test_bf16_weights_cross_as_int16_bits_without_loss(model_dirs):
    source = load_model(str(model_dirs["llama"]), "cpu", torch.bfloat16)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    weights = get_weights(source)
    assert all(a.dtype == np.int16 for a in weights.values())
    target = load_model(str(model_dirs["llama"]), "cpu", torch.bfloat16)
    set_weights(target, weights)
    for name, tensor in target.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, source.state_dict()[name])


def group_of(tokenizer, prompt_id: int, text: str, rewards: list[float]) -> list[Sample]:
    prompt = tokenizer(text)["input_ids"]
    answers = ["#### 1", "#### 22", "#### 3", "#### 45"]
    responses = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
    return [
        Sample(prompt_id, prompt, response, reward=r, ref_logp=-4.0 - i, behaviour_logp=-4.0,
               behaviour_token_logps=[-4.0 / len(response)] * len(response), version=0)
        for i, (response, r) in enumerate(zip(responses, rewards))
    ]  # fmt: skip


def test_bf16_trainer_updates_fp32_masters_and_rounds_them_into_the_model(model_dirs):
    tokenizer = load_tokenizer(str(model_dirs["llama"]))
    model = load_policy(str(model_dirs["llama"]), "cpu", dtype="bfloat16")
    trainer = Trainer(model, TrainConfig(learning_rate=1e-5, max_grad_norm=1.0),
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert all(p.dtype == torch.float32 for p in optimized)
    initial = [p.detach().clone() for p in optimized]
    groups = [group_of(tokenizer, 0, "Ann has 3 pens.\n", [1.0, 0.0, 0.5, 0.0])]
    for _ in range(3):
        trainer.step(groups, beta=0.1)
    for master, param in zip(trainer.masters.params, model.parameters()):
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, master.to(torch.bfloat16))
    # Steps of ~1e-5 are mostly below bf16's resolution: the masters keep them, bf16 would not.
    masters = torch.cat([m.detach().flatten() for m in trainer.masters.params])
    moves = (masters - torch.cat([s.flatten() for s in initial])).abs()
    assert 0 < moves.max() < 1e-4
    assert not torch.equal(masters, masters.bfloat16().float())


def test_accumulated_micro_batches_equal_the_full_batch_gradient_in_float64(model_dirs):
    tokenizer = load_tokenizer(str(model_dirs["qwen2"]))
    groups = [
        group_of(tokenizer, 0, "Ann has 3 pens.\n", [1.0, 0.0, 0.5, 0.0]),
        group_of(tokenizer, 1, "Bob?\n", [0.0, 0.0, 1.0, -1.0]),
        group_of(tokenizer, 2, "Cy has 12 bags of 4 eggs.\n", [-1.0, 1.0, 1.0, 0.0]),
    ]
    base = load_model(str(model_dirs["qwen2"]), "cpu", torch.float64)
    grads = []
    for micro in (None, 1, 2):
        # A learning rate of 0 (the gradient without an update) is past the config's validation.
        settings = TrainConfig(max_grad_norm=1e9, micro_batch_groups=micro).model_copy(
            update={"learning_rate": 0.0})  # fmt: skip
        trainer = Trainer(copy.deepcopy(base), settings, pad_id=tokenizer.pad_token_id,
                          temperature=1.0)  # fmt: skip
        trainer.step(groups, beta=0.1)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    assert grads[0].abs().max() > 0
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradient_checkpointing_gives_the_same_log_probs_and_gradients(model_dirs, arch):
    """Checkpointed, each response runs with its own copy of its prompt; otherwise the prompt
    runs once and its KV cache is shared. Same log-probs, same gradients (up to fp32 rounding:
    Llama's RMSNorm computes in fp32 even in a float64 model)."""
    path = str(model_dirs[arch])
    tokenizer = load_tokenizer(path)
    prompts = encode_prompts(tokenizer, ["Ann has 3 pens.\n", "Bob?\n", "Bob?\n"])
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                 for t in ["#### 3", "#### 12", "7"]]  # fmt: skip
    results = []
    for checkpointing in (False, True):
        model = load_policy(path, "cpu", gradient_checkpointing=checkpointing).double().train()
        logps, mask = token_logprobs(model, prompts, responses, pad_id=tokenizer.pad_token_id)
        (logps.sum(-1) * torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)).sum().backward()
        results.append((logps.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-12)
    (logps, grad), (logps_ckpt, grad_ckpt) = results
    assert grad.norm() > 0 and (grad_ckpt - grad).norm() / grad.norm() < 1e-6


def lora_pair(model_dirs):
    """A trainer on a LoRA policy that took one step, and a searcher on its own base copy."""
    path = str(model_dirs["llama"])
    tokenizer = load_tokenizer(path)
    lora = LoraConfig(r=4)
    trainer = Trainer(load_policy(path, "cpu", lora=lora),
                      TrainConfig(learning_rate=1e-2, max_grad_norm=1.0),
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    base_before = {n: t.clone() for n, t in trainer.model.state_dict().items() if "lora_" not in n}
    trainer.step([group_of(tokenizer, 0, "Ann has 3 pens.\n", [1.0, 0.0, 0.5, 0.0])], beta=0.1)
    rows = [{"prompt": "Ann has 3 pens.\n", "answer": "3"}]
    config = RunConfig(policy={"max_new_tokens": 6},
                       train={"group_size": 4, "truncated": "penalize"})  # fmt: skip
    searcher = Searcher(load_policy(path, "cpu", lora=lora), tokenizer, rows,
                        [last_number_reward], config)  # fmt: skip
    return trainer, searcher, base_before, tokenizer


def test_lora_sync_sends_only_adapter_tensors(model_dirs):
    trainer, searcher, base_before, tokenizer = lora_pair(model_dirs)
    # Training moved the adapters only: every base weight is bit for bit what it was.
    after = {n: t for n, t in trainer.model.state_dict().items() if "lora_" not in n}
    assert not changed(base_before, after)
    version, step = trainer.publish()
    weights = trainer.weights()
    adapted = [m for m in trainer.model.modules() if isinstance(m, LoraLayer)]
    assert len(adapted) == 2 * 7  # 2 blocks x (q, k, v, o, gate, up, down)
    assert len(weights) == 2 * len(adapted)
    assert all(".lora_A." in name or ".lora_B." in name for name in weights)
    payload = sum(a.size for a in weights.values())
    full = sum(t.numel() for t in policy_state_dict(trainer.model).values())
    assert payload < full / 4

    searcher.set_weights(weights, version, step)
    assert searcher.reference is None  # the base model with adapters off: no second copy
    prompt = searcher.prompt_ids[0]
    responses = [tokenizer("#### 3", add_special_tokens=False)["input_ids"]]
    pad = tokenizer.pad_token_id
    trainer.model.eval()
    with torch.no_grad():
        policy_logp = sequence_logprobs(trainer.model, [prompt], responses, pad_id=pad)
        torch.testing.assert_close(
            sequence_logprobs(searcher.policy, [prompt], responses, pad_id=pad), policy_logp
        )
        base = load_model(str(model_dirs["llama"]), "cpu").eval()
        base_logp = sequence_logprobs(base, [prompt], responses, pad_id=pad)
    assert searcher._reference_logps([prompt], responses)[0] == pytest.approx(base_logp.tolist())
    assert abs(policy_logp.item() - base_logp.item()) > 1e-4  # the adapters do something


def test_lora_searcher_samples_carry_base_model_reference_log_probs(model_dirs):
    trainer, searcher, _, tokenizer = lora_pair(model_dirs)
    version, step = trainer.publish()
    searcher.set_weights(trainer.weights(), version, step)
    samples, _ = searcher.generate(num_prompts=1)
    base = load_model(str(model_dirs["llama"]), "cpu").eval()
    with torch.no_grad():
        expected = sequence_logprobs(
            base, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
            pad_id=tokenizer.pad_token_id,
        )  # fmt: skip
    np.testing.assert_allclose([s.ref_logp for s in samples], expected.numpy(), atol=1e-5)
    assert any(abs(s.ref_logp - s.behaviour_logp) > 1e-4 for s in samples)


def test_add_lora_wraps_without_copying_the_base(model_dirs):
    model = load_model(str(model_dirs["llama"]), "cpu")
    embed = model.get_input_embeddings().weight
    wrapped = add_lora(model, LoraConfig(r=2))
    assert wrapped.get_input_embeddings().weight.data_ptr() == embed.data_ptr()
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
