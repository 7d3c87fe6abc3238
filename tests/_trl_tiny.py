"""A tiny, offline TRL GRPO setup for the tests and the overhead benchmark.

A randomly initialised 2-layer Qwen2 (hidden size 32) and a WordLevel tokenizer over 40 words,
saved with ``save_pretrained`` and loaded from that directory (TRL rebuilds models from their path).
Prompts are plain text; every prompt has an ``environment`` ("math" or "code").
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(40)]
PAD, EOS, UNK = 0, 1, 2
N_PROMPTS = 32


def build_tiny_model(directory: str | os.PathLike) -> str:
    """Save a tiny random causal LM and its tokenizer under ``directory``; return the path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = Path(directory) / "tiny-qwen2"
    if (path / "config.json").exists():
        return str(path)
    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=True)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    torch.random.set_rng_state(generator_state)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def prompt_env() -> dict[str, str]:
    """Prompt text -> environment label (prompts are distinct)."""
    return {" ".join(WORDS[i:i + 3]): ("math" if i % 2 == 0 else "code") for i in range(N_PROMPTS)}


def make_dataset():
    from datasets import Dataset

    pairs = list(prompt_env().items())
    return Dataset.from_dict({"prompt": [p for p, _ in pairs], "environment": [e for _, e in pairs]})


def reward_length(completions: list[str], **kwargs: Any) -> list[float]:
    """Number of words / 8."""
    return [len(c.split()) / 8 for c in completions]


def reward_has_w1(completions: list[str], environment: list[str], **kwargs: Any) -> list[float | None]:
    """1 if the completion contains the word w1; math prompts only (None elsewhere)."""
    return [(1.0 if "w1" in c.split() else 0.0) if env == "math" else None
            for c, env in zip(completions, environment)]


REWARD_FUNCS = [reward_length, reward_has_w1]


def make_rollout_func(max_len: int, seed: int = 0):
    """A ``rollout_func`` standing in for vLLM: random words, random lengths (some hit ``max_len``
    without EOS, i.e. truncated), and made-up sampler log-probs in [-6, -0.5] so that the
    sampler/trainer mismatch is large."""
    rng = random.Random(seed)

    def rollout(prompts: list, trainer: Any) -> dict[str, list]:
        tokenizer = trainer.processing_class
        prompt_ids, completion_ids, logprobs = [], [], []
        for prompt in prompts:
            prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            n = rng.randint(2, max_len)
            ids = [rng.randint(3, 3 + len(WORDS) - 1) for _ in range(n)]
            if n < max_len or rng.random() < 0.3:
                ids[-1] = EOS
            completion_ids.append(ids)
            logprobs.append([-rng.uniform(0.5, 6.0) for _ in ids])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout


def make_trainer(model_path: str, output_dir: str | os.PathLike, *, rollout: bool = False, callbacks=None,
                 reward_funcs: list | None = None, **config: Any):
    """A GRPOTrainer on CPU over the tiny model. ``rollout=True`` uses :func:`make_rollout_func` with
    the vLLM code path switched on (sync_weights stubbed) so that sampler log-probs flow."""
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    settings = dict(output_dir=str(output_dir), use_cpu=True, num_generations=4, max_completion_length=8,
                    per_device_train_batch_size=8, report_to="none", logging_steps=1, save_strategy="no",
                    seed=0, learning_rate=1e-2, beta=0.0, disable_tqdm=True, dataloader_num_workers=0)
    settings.update(config)
    args = GRPOConfig(**settings)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward_funcs or REWARD_FUNCS, args=args,
                          train_dataset=make_dataset(),
                          processing_class=tokenizer, callbacks=callbacks,
                          rollout_func=make_rollout_func(args.max_completion_length) if rollout else None)
    if rollout:
        # The sampler-log-prob path of TRL 1.16 without vLLM: these private attributes are what
        # `_generate` and `_generate_and_score_completions` read (pinned TRL range). A CPU stand-in:
        # TRL's own vLLM generation code never runs here, only its use of what `rollout_func` returns.
        trainer.use_vllm = True
        trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
        trainer._last_loaded_step = -1
    return trainer
