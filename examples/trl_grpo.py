"""rlwatch on a TRL GRPOTrainer: one line, ``rlwatch.integrations.trl.watch(trainer)``.

Runs fully offline on CPU: a tiny randomly initialised Qwen2 and a word-level tokenizer are built
and saved locally (swap in your own model and dataset). The dataset has an ``environment`` column,
so rewards, truncation and zero-variance groups are also reported per environment. With
``--num-iterations 2`` every generation batch is trained on twice, so the version lag is 1 on the
second pass.

The sampler/trainer signals (k3, |dlogp|, ESS, TIS fractions) need the sampler's log-probs, which
TRL has only from vLLM or a ``rollout_func``; without a GPU this example samples in a
``rollout_func`` (the policy itself generates and reports its log-probs, as vLLM would), from
weights synced every ``--stale-sampler`` updates (0 = in sync: a tiny mismatch; try 4 for a
sampler that misses weight syncs: its weights are 0-3 updates old). The ``rollout_func`` returns
``policy_version``, the step whose weights sampled, so that rlwatch's version lag is the sampler's
own staleness (plus TRL's reuse of a generation batch with ``--num-iterations`` above 1).
``--trl-generate`` uses TRL's own generation instead, and says which signals that leaves out.

Open http://127.0.0.1:9400/metrics while it trains (or ``rlwatch up`` first: each step is paced to
``--pace`` seconds, 0.5 by default, so that 5 s scrapes see it). The headline signals also appear
in TRL's own logs under ``rlwatch/`` (console, W&B, TensorBoard). Afterwards every step is in the
run store next to the checkpoints, <output-dir>/out/rlwatch.db (``rlwatch postmortem <output-dir>/out``):

    python examples/trl_grpo.py --steps 60 --num-iterations 2
    python examples/trl_grpo.py --stale-sampler 4 --pace 0

The guard line makes a critical alert (e.g. a sampler/trainer KL spike) save a checkpoint and
stop training cleanly.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
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


def make_rollout_func(stale_steps: int):
    """A TRL ``rollout_func`` that samples with the policy's weights of up to ``stale_steps - 1``
    optimizer steps ago (a weight sync every ``stale_steps`` steps; 0: the current weights) and returns
    each sampled token's log-prob under the sampling distribution, as vLLM reports them (what rlwatch
    compares with TRL's recomputed log-probs), and ``policy_version``: the step whose weights sampled
    each completion (what rlwatch's version lag counts from)."""
    sampler: dict = {"weights": None, "step": None}

    @torch.no_grad()
    def rollout(prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
        policy = trainer.accelerator.unwrap_model(trainer.model)
        step = trainer.state.global_step
        current = None
        if stale_steps > 0:
            if sampler["weights"] is None or step - sampler["step"] >= stale_steps:       # a weight sync
                sampler["weights"] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
                sampler["step"] = step
            # The policy module itself samples, with the old weights loaded for the call: the same code and
            # precision as the trainer's forward (TRL trains under bf16 autocast by default, even on CPU). A
            # deep copy of the module sampled apart from it even with equal weights (k3 0.002 at lag 0);
            # this way k3 is round-off at lag 0 and measures the staleness alone.
            current = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            policy.load_state_dict(sampler["weights"])
        try:
            out = _sample(policy, prompts, trainer)
        finally:
            if current is not None:
                policy.load_state_dict(current)
        return {**out, rlwatch.integrations.trl.POLICY_VERSION_KEY: [sampler["step"] if current is not None else step]
                * len(out["completion_ids"])}

    return rollout


def _sample(model, prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
    """Sample one completion per prompt with ``model``; token ids and the sampling distribution's log-probs."""
    tokenizer, args = trainer.processing_class, trainer.args
    was_training = model.training
    model.eval()
    prompt_ids, completion_ids, logprobs = [], [], []
    for prompt in prompts:                     # the prompts arrive repeated num_generations times
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out = model.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=args.max_completion_length,
                             temperature=args.temperature, top_p=1.0, top_k=0, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        new = out.sequences[0, len(ids):].tolist()
        logps = [torch.log_softmax(scores[0].float(), -1)[token].item() for scores, token in zip(out.scores, new)]
        prompt_ids.append(ids)
        completion_ids.append(new)
        logprobs.append(logps)
    model.train(was_training)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


class Pace(TrainerCallback):
    """Makes each optimizer step last at least ``seconds`` (so that scrapes every few seconds see the run)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.monotonic()

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self.started)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--num-iterations", type=int, default=2, help="passes over each generation batch (default 2)")
    parser.add_argument("--pace", type=float, default=0.5,
                        help="minimum seconds per step, so that scrapes see the run (default 0.5; 0: no pacing)")
    parser.add_argument("--stale-sampler", type=int, default=0,
                        help="the rollout_func's sampler syncs its weights every this many steps (default 0: in sync)")
    parser.add_argument("--trl-generate", action="store_true",
                        help="TRL's own generation instead of the rollout_func (no sampler log-probs on CPU)")
    parser.add_argument("--port", type=int, default=9400,
                        help="metrics port, the next free one if taken (default 9400)")
    parser.add_argument("--output-dir", default=None, help="where the model, checkpoints and run store go "
                                                           "(default: a new temporary directory)")
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
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")          # rollout_func is marked experimental
    trainer = GRPOTrainer(model=model_path, reward_funcs=[reward_short, reward_keyword], args=args,
                          train_dataset=dataset, processing_class=PreTrainedTokenizerFast.from_pretrained(model_path),
                          rollout_func=None if opts.trl_generate else make_rollout_func(opts.stale_sampler),
                          callbacks=[Pace(opts.pace)] if opts.pace > 0 else None)

    # The one line. Everything else is optional: run name, port, store path, guard actions.
    watch = rlwatch.integrations.trl.watch(
        trainer, run="trl-grpo-example", port=opts.port, port_fallback=True,
        guard=(rlwatch.integrations.trl.save_on_critical, rlwatch.integrations.trl.stop_on_critical))

    print(f"rlwatch: metrics at {watch.url}, run store {watch.store_path}")
    if opts.trl_generate:
        print("rlwatch: TRL's own generation reports no sampler log-probs (only vLLM or a rollout_func does), so "
              "k3, |dlogp| p99, ESS and the TIS fraction are not computed; lag, zero-variance groups, rewards and "
              "truncation are. Run without --trl-generate for all of them.")
    else:
        print("rlwatch: sampling in a rollout_func " + (
              f"whose weights sync every {opts.stale_sampler} steps (0-{opts.stale_sampler - 1} updates old)"
              if opts.stale_sampler > 1 else "with the current weights") + f"; {opts.steps} steps, at least "
              f"{opts.pace:g} s each")
    trainer.train()
    last = next((h for h in reversed(trainer.state.log_history) if "rlwatch/version_lag_max" in h), {})
    print("rlwatch: headline signals of the last logged step (in TRL's logs under rlwatch/): "
          + ", ".join(f"{k[len('rlwatch/'):]}={v:.4g}" for k, v in last.items() if k.startswith("rlwatch/")))
    lags = [h["rlwatch/version_lag_max"] for h in trainer.state.log_history if "rlwatch/version_lag_max" in h]
    print("rlwatch: max version lag per step (updates between the sampler's weights and the update): "
          + " ".join(f"{lag:.0f}" for lag in lags))
    rlwatch.integrations.trl.unwatch(trainer)      # restores the trainer and closes the Watch


if __name__ == "__main__":
    main()
