"""A CPU-sized OpenRLHF run for the integration tests: OpenRLHF's real classes, two stand-ins.

Real OpenRLHF code: the argument parser and its checks (``cli/train_ppo_ray.py``, run as
``__main__`` up to the point where it would build the DeepSpeed strategy), ``DeepspeedStrategy``,
``prepare_datasets`` / ``PromptDataset`` / its dataloader, ``SamplesGenerator`` (prompt dispatch,
``_process_response_into_experience``), ``SingleTurnAgentExecutor`` / ``MultiTurnAgentExecutor``
(the code that runs inside vLLM's engine actor), ``BasePPOTrainer`` (``train_step``, ``ppo_train``,
``broadcast_to_vllm``, ``save_logs_and_checkpoints``), ``RemoteExperienceMaker``, the ``Actor``
model wrapper (log-probs), ``PolicyLoss``.

Stand-ins, because they need GPUs: ``CpuEngine`` replaces vLLM's ``RolloutRayActor`` (a Ray actor
whose ``CpuSampler`` samples with a tiny bf16 Qwen2 and answers ``generate``, as vLLM's engine does,
to OpenRLHF's own agent executors) and ``CpuActorGroup`` replaces the ``RayActorGroup`` of DeepSpeed policy
actors (forward = OpenRLHF's ``Actor`` on CPU in fp32; fit = OpenRLHF's ``PolicyLoss`` and SGD;
broadcast = copy the weights into the engine). Everything runs in one local Ray instance.
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

VOCAB = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(45)]
EOS = 1


class _StopAfterParsing(Exception):
    pass


def parse_args(argv: list[str]) -> Any:
    """OpenRLHF's own hierarchical arguments for ``argv`` (its CLI's parser, defaults and checks),
    captured where its ``train()`` would build the DeepSpeed strategy."""
    import ray

    import openrlhf.utils

    captured: dict[str, Any] = {}

    def capture(args: Any) -> Any:
        captured["args"] = args
        raise _StopAfterParsing

    real_get_strategy, real_is_initialized = openrlhf.utils.get_strategy, ray.is_initialized
    saved_argv = sys.argv
    openrlhf.utils.get_strategy = capture          # bound by `from openrlhf.utils import get_strategy`
    ray.is_initialized = lambda: True               # train() then skips its own ray.init
    sys.argv = ["train_ppo_ray", *argv]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except _StopAfterParsing:
        pass
    finally:
        openrlhf.utils.get_strategy, ray.is_initialized = real_get_strategy, real_is_initialized
        sys.argv = saved_argv
    return captured["args"]


def make_tokenizer(directory: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return fast


def make_model_dir(directory: Path, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    make_tokenizer(directory)
    return directory


def write_prompts(path: Path, n: int = 8) -> Path:
    sources = ["gsm8k", "math"]
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{(i * 7 + j) % 40 + 3}" for j in range(3 + i % 3))
            f.write(json.dumps({"input": words, "label": f"w{i % 5 + 3}", "datasource": sources[i % 2]}) + "\n")
    return path


REWARD_PY = '''
def reward_func(queries, prompts, labels):
    """1 when the label word occurs in the generated text, plus an extra log."""
    text = queries[0][len(prompts[0]):]
    hit = float(labels[0] in text.split())
    return {"rewards": hit, "scores": hit, "extra_logs": {"hit": hit, "words": float(len(text.split()))}}
'''

AGENT_PY = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
import torch


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turns = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turns += 1
        done = self.turns >= 2
        return {"rewards": torch.tensor(float(states["label"] in states["action_text"].split())),
                "scores": torch.tensor(0.0), "environment_feedback": "" if done else " w3 w4",
                "done": done, "extra_logs": {"turns": float(self.turns)}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


class CpuSampler:
    """What OpenRLHF's agent executors call as ``llm_engine``: ``generate`` samples with a tiny bf16
    model and returns what vLLM's ``RequestOutput`` carries (token ids, text, finish reason,
    processed log-probs)."""

    def __init__(self, model: Any, tokenizer: Any, seed: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        ids = list(prompt_token_ids)
        out, logprobs = [], []
        temperature = float(sampling_params.temperature or 1.0)
        finish = "length"
        for _ in range(int(sampling_params.max_tokens)):
            logits = self.model(torch.tensor([ids + out])).logits[0, -1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
            out.append(token)
            logprobs.append({token: SimpleNamespace(logprob=float(logp[token]))})
            if token == EOS and len(out) >= int(sampling_params.min_tokens or 0):
                finish = "stop"
                break
        output = SimpleNamespace(token_ids=out, text=" " + self.tokenizer.decode(out, skip_special_tokens=True),
                                 finish_reason=finish,
                                 logprobs=logprobs if sampling_params.logprobs is not None else None)
        return SimpleNamespace(outputs=[output])


class CpuEngine:
    """Stand-in for OpenRLHF's vLLM ``RolloutRayActor`` (a Ray actor; see the module docstring):
    ``generate_responses`` is OpenRLHF's own (it runs the real agent executor n times against a
    :class:`CpuSampler`). A synchronous actor, so that Ray runs its calls one at a time in the order
    they were sent (Ray may start an async actor's calls out of order): OpenRLHF collects requests in
    the order they finish, and two runs that must agree number for number (with and without the
    hook) need the same order and the same draws from the one sampling generator."""

    def __init__(self, model_dir: str, tokenizer_dir: str, reward_py: str | None = None,
                 agent_py: str | None = None, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
        self.sampler = CpuSampler(model, AutoTokenizer.from_pretrained(tokenizer_dir), seed)
        self.loop = asyncio.new_event_loop()        # one loop for the executors' lifetime
        self.weight_updates = 0
        if agent_py:
            from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

            self.executor = _load_agent_executor(agent_py)
        else:
            from openrlhf.utils.agent import SingleTurnAgentExecutor

            self.executor = SingleTurnAgentExecutor(reward_py)

    def get_num_unfinished_requests(self) -> int:
        return 0

    def update_weights(self, state_dict: dict) -> int:
        self.sampler.model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state_dict.items()})
        self.weight_updates += 1
        return self.weight_updates

    def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1,
                           images=None):
        # OpenRLHF's RolloutRayActor.generate_responses (vllm_engine.py), run to completion here.
        async def responses():
            tasks = [self.executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                                           max_length=max_length, hf_tokenizer=hf_tokenizer,
                                           llm_engine=self.sampler, images=images) for _ in range(num_samples)]
            return await asyncio.gather(*tasks)

        return self.loop.run_until_complete(responses())


class CpuActorGroup:
    """Stand-in for the ``RayActorGroup`` of DeepSpeed policy actors (``PolicyModelActor``), with
    the methods ``RemoteExperienceMaker`` and ``BasePPOTrainer`` call on it. Results go through the
    Ray object store, as the real group's do."""

    def __init__(self, args: Any, model_dir: str, engines: list, lr: float = 0.5) -> None:
        from openrlhf.models import Actor, PolicyLoss

        self.args = args
        self.actor = Actor(model_dir, attn_implementation="eager", temperature=args.rollout.temperature)
        self.actor.model.float()
        self.actor.packing_samples = False
        self.engines = engines
        self.buffer: list = []
        self.optimizer = torch.optim.SGD(self.actor.parameters(), lr=lr)
        adv = args.algo.advantage
        if hasattr(adv, "is_correction_level"):                           # 0.11.1+
            kwargs = dict(is_correction_level=adv.is_correction_level, is_correction_mode=adv.is_correction_mode,
                          is_correction_gating=adv.is_correction_gating,
                          is_correction_threshold=adv.is_correction_threshold)
        else:                                                             # 0.11.0
            kwargs = dict(enable_vllm_is_correction=adv.is_correction_enable,
                          vllm_is_truncated_threshold=adv.is_correction_threshold if adv.is_correction_enable
                          else None, vllm_is_correction_type=adv.is_correction_type)
        self.loss_fn = PolicyLoss(clip_eps_low=args.actor.eps_clip_low_high[0],
                                  clip_eps_high=args.actor.eps_clip_low_high[1], **kwargs)
        self.loss_outputs: list[tuple] = []
        self.saved: list[str] = []

    def _refs(self, values: list) -> list:
        import ray

        return [ray.put(v) for v in values]

    def async_run_method_batch(self, method_name: str, **kwargs: Any) -> list:
        if method_name == "forward":
            with torch.no_grad():
                out = [self.actor(seq, am, att).float() for seq, am, att in
                       zip(kwargs["sequences"], kwargs["action_mask"], kwargs["attention_mask"])]
            return self._refs([out])
        if method_name == "append":
            self.buffer.extend(kwargs["experience"])
            return self._refs([None])
        raise NotImplementedError(method_name)

    def async_run_method(self, method_name: str, **kwargs: Any) -> list:
        import ray

        if method_name == "fit":
            return self._refs([self.fit()])
        if method_name == "broadcast_to_vllm":
            state = {k: v.detach().clone() for k, v in self.actor.model.state_dict().items()}
            ray.get([engine.update_weights.remote(state) for engine in self.engines])
            return self._refs([None])
        if method_name == "save_checkpoint":
            path = os.path.join(self.args.ckpt.path, "_actor", kwargs["tag"])
            os.makedirs(path, exist_ok=True)
            self.saved.append(path)
            return self._refs([None])
        if method_name == "empty_cache":
            return self._refs([None])
        raise NotImplementedError(method_name)

    def fit(self) -> dict:
        """One PPO epoch over the buffer with OpenRLHF's PolicyLoss (as ActorPPOTrainer.training_step)."""
        status = {"policy_loss": 0.0, "clip_ratio": 0.0, "ppo_kl": 0.0}
        for experience in self.buffer:
            log_probs = self.actor(experience.sequences, experience.action_mask, experience.attention_mask)
            outputs = self.loss_fn(log_probs, experience.action_log_probs, experience.advantages,
                                   action_mask=experience.action_mask, rollout_log_probs=experience.rollout_log_probs)
            self.loss_outputs.append(tuple(o.detach().clone() if isinstance(o, torch.Tensor) else o for o in outputs))
            self.optimizer.zero_grad()
            outputs[0].backward()
            self.optimizer.step()
            status["policy_loss"] += float(outputs[0]) / len(self.buffer)
            status["clip_ratio"] += float(outputs[1]) / len(self.buffer)
            status["ppo_kl"] += float(outputs[2]) / len(self.buffer)
            if outputs[3] is not None:
                status["vllm_kl"] = status.get("vllm_kl", 0.0) + float(outputs[3]) / len(self.buffer)
        self.buffer = []
        return status


def build(tmp: Path, argv: list[str], agent: bool = False, engine_seed: int = 0,
          reward_py: str = REWARD_PY) -> SimpleNamespace:
    """A BasePPOTrainer, SamplesGenerator and their stand-ins for ``argv`` (OpenRLHF arguments);
    ``reward_py`` is the source of the ``reward_func`` file (without ``agent``)."""
    import ray

    from openrlhf.trainer.ppo_trainer import BasePPOTrainer, prepare_datasets
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.utils import get_strategy

    model_dir = make_model_dir(tmp / "model")
    prompts = write_prompts(tmp / "prompts.jsonl")
    (tmp / "reward.py").write_text(reward_py)
    (tmp / "agent.py").write_text(AGENT_PY)
    base = ["--actor.model_name_or_path", str(model_dir), "--data.prompt_dataset", str(prompts),
            "--data.input_key", "input", "--data.label_key", "label", "--actor.num_gpus_per_node", "1",
            "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--ckpt.path", str(tmp / "ckpt"),
            "--algo.kl.init_coef", "0"]
    base += (["--train.agent_func_path", str(tmp / "agent.py")] if agent
             else ["--reward.remote_url", str(tmp / "reward.py")])
    args = parse_args(base + argv)
    strategy = get_strategy(args)
    tokenizer = make_tokenizer(tmp / "tokenizer")
    tokenizer.padding_side = "left"
    dataloader, _, _ = prepare_datasets(strategy, tokenizer)
    engine_cls = ray.remote(num_cpus=0)(CpuEngine)
    engine = engine_cls.remote(str(model_dir), str(tmp / "tokenizer"),
                               reward_py=None if agent else str(tmp / "reward.py"),
                               agent_py=str(tmp / "agent.py") if agent else None, seed=engine_seed)
    group = CpuActorGroup(args, str(model_dir), [engine])
    generator = SamplesGenerator(strategy=strategy, prompts_dataloader=dataloader, eval_dataloader=None,
                                 tokenizer=tokenizer, vllm_engines=[engine])
    trainer = BasePPOTrainer(strategy, group, None, None, None, [engine], tokenizer)
    generate_kwargs = dict(do_sample=True, max_len=args.data.max_len, max_new_tokens=args.rollout.max_new_tokens,
                           temperature=args.rollout.temperature, top_p=args.rollout.top_p)
    return SimpleNamespace(args=args, strategy=strategy, tokenizer=tokenizer, generator=generator, trainer=trainer,
                           group=group, engine=engine, generate_kwargs=generate_kwargs, global_step=0)


def run_step(run: SimpleNamespace) -> tuple[dict, list]:
    """One iteration of ``PPOTrainer.fit``: generate, train_step, save_logs_and_checkpoints. Returns
    OpenRLHF's status and the Experiences ``make_experience_batch`` produced (spied on the instance)."""
    captured: list = []
    maker = run.trainer.experience_maker
    method = type(maker).make_experience_batch

    def spy(rollout_samples):
        result = method(maker, rollout_samples)
        captured.append((list(rollout_samples), result))
        return result

    maker.make_experience_batch = spy
    try:
        samples, _, _, _ = run.generator.generate_samples(**run.generate_kwargs)
        status, run.global_step = run.trainer.train_step(samples, run.global_step)
        run.trainer.save_logs_and_checkpoints(run.global_step, status, {"global_step": run.global_step})
    finally:
        del maker.make_experience_batch
    return status, captured[-1]
