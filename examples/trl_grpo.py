"""rlwatch on a TRL GRPOTrainer: one line, ``rlwatch.integrations.trl.watch(trainer)``.

Runs fully offline on CPU: a tiny randomly initialised Qwen2 and a word-level tokenizer are built
and saved locally (swap in your own model and dataset). The dataset has an ``environment`` column,
so rewards, truncation and zero-variance groups are also reported per environment. With
``--num-iterations 2`` every generation batch is trained on twice, so the version lag is 1 on the
second pass. Open http://127.0.0.1:9400/metrics while it trains (or ``rlwatch up`` for Prometheus
and Grafana); afterwards every step is in the run store next to the checkpoints,
<output-dir>/out/rlwatch.db (``rlwatch.store.StoreReader``; ``rlwatch postmortem <output-dir>/out``):

    python examples/trl_grpo.py --steps 20 --num-iterations 2

The guard line makes a critical alert (e.g. a sampler/trainer KL spike) save a checkpoint and
stop training cleanly.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

import rlwatch.integrations.trl

WORDS = [f"w{i}" for i in range(40)]


def build_tiny_model(directory: str) -> str:
    """A 2-layer Qwen2 (hidden size 32) and its tokenizer, saved under ``directory``.

    TRL reloads models from their path (e.g. for the reference model when beta > 0), so the model
    is saved with save_pretrained and loaded from there rather than passed as an object."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = os.path.join(directory, "tiny-qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def reward_short(completions: list[str], **kwargs) -> list[float]:
    """Prefer short answers: 1 - words / 8."""
    return [1.0 - len(c.split()) / 8 for c in completions]


def reward_keyword(completions: list[str], environment: list[str], **kwargs) -> list[float | None]:
    """Math prompts only: 1 if the answer says w7 (None elsewhere: the function does not apply)."""
    return [(1.0 if "w7" in c.split() else 0.0) if env == "math" else None
            for c, env in zip(completions, environment)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-iterations", type=int, default=2)
    parser.add_argument("--port", type=int, default=9400)
    parser.add_argument("--output-dir", default=None)
    opts = parser.parse_args()

    workdir = opts.output_dir or tempfile.mkdtemp(prefix="rlwatch-trl-")
    model_path = build_tiny_model(workdir)
    prompts = [" ".join(WORDS[i:i + 3]) for i in range(32)]
    dataset = Dataset.from_dict({"prompt": prompts,
                                 "environment": ["math" if i % 2 == 0 else "code" for i in range(32)]})
    args = GRPOConfig(output_dir=os.path.join(workdir, "out"), use_cpu=True, max_steps=opts.steps,
                      num_generations=4, max_completion_length=8, per_device_train_batch_size=8,
                      num_iterations=opts.num_iterations, learning_rate=1e-2, beta=0.0, logging_steps=1,
                      save_steps=10, report_to="none")
    trainer = GRPOTrainer(model=model_path, reward_funcs=[reward_short, reward_keyword], args=args,
                          train_dataset=dataset, processing_class=PreTrainedTokenizerFast.from_pretrained(model_path))

    # The one line. Everything else is optional: run name, port, store path, guard actions.
    watch = rlwatch.integrations.trl.watch(
        trainer, run="trl-grpo-example", port=opts.port, port_fallback=True,
        guard=(rlwatch.integrations.trl.save_on_critical, rlwatch.integrations.trl.stop_on_critical))

    print(f"rlwatch: metrics at {watch.url}, run store {watch.store_path}")
    trainer.train()
    rlwatch.integrations.trl.unwatch(trainer)      # restores the trainer and closes the Watch


if __name__ == "__main__":
    main()
