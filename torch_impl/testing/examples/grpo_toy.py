"""A GRPO-style run of a Megatron GPT on a toy task with a verifiable reward.

The task: a prompt is a counting sequence ``a, a+1, ..., a+P-1`` (mod ``V``); the
model continues it for ``C`` tokens; the reward of a completion is the fraction of
its tokens equal to the true continuation at their position (exact match)::

    answer[i] = (a + P + i) % V                                  # i = 0 .. C-1
    r         = mean_i(completion[i] == answer[i])               # in {0, 1/C, ..., 1}

A completion earns 1 exactly when it is the true continuation, and a policy cannot
game it with one fixed continuation: ``c_0, ..., c_{C-1}`` matches at position
``i`` only for the one start ``a = c_i - P - i`` (mod V), so over uniform starts
it scores ``1/V`` on average, chance. (A reward that only checked
``token = previous token + 1`` was gamed that way: ``6, 7, 8, 9`` earned 0.75 for
any prompt, and the policy settled there.)

One step of :func:`grpo_step`::

    prompts   = task.prompts(n)                                  # [n, P]
    seqs      = sample(policy, repeat(prompts, G))               # [n*G, P+C], G per prompt
    r         = task.reward(prompts, completions)                # [n*G] in [0, 1]
    A         = (r - mean_group(r)) / (std_group(r) + eps)       # broadcast to the tokens
    old, ref  = selected_logprobs through the hook, no grad      # [n*G, P+C-1]
    repeat updates_per_step times:
        loss  = policy_loss(PolicyLossConfig.grpo(kl_coef=...))  # inside the hook
        loss.backward(); optimizer.step()

Inputs are ``seqs[:, :-1]``, labels ``seqs[:, 1:]``, and the loss counts the
``C`` label positions of the completion. Sampling gathers the vocabulary shards
of the last position's logits over the tensor-parallel group, so every rank draws
the same tokens from the same generator. Works at any tensor-parallel size
(without sequence parallel); the tests run it at tp=2 over gloo.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state

from hookspec import ContractError
from torch_impl import unwrap_model
from torch_impl.processors import PolicyBatch, PolicyLossConfig, policy_loss, selected_logprobs

__all__ = [
    "CountingTask",
    "GRPOToyConfig",
    "Rollout",
    "StepStats",
    "group_advantages",
    "grpo_step",
    "rollout",
    "sample",
    "sequence_logprobs",
    "train",
]


@dataclasses.dataclass(frozen=True)
class CountingTask:
    """Continue a counting sequence mod ``vocab_size``: prompts of ``prompt_len``
    tokens, completions of ``completion_len`` tokens."""

    vocab_size: int = 16
    prompt_len: int = 4
    completion_len: int = 4

    def prompts(self, n: int, /, *, generator: torch.Generator) -> torch.Tensor:
        """``[n, prompt_len]``: ``start + arange(prompt_len)`` mod V, random starts."""
        start = torch.randint(0, self.vocab_size, (n, 1), generator=generator)
        return (start + torch.arange(self.prompt_len)) % self.vocab_size

    def answers(self, prompts: torch.Tensor, /) -> torch.Tensor:
        """``[n, completion_len]``: the true continuation of each prompt."""
        return (prompts[:, -1:] + 1 + torch.arange(self.completion_len)) % self.vocab_size

    def reward(self, prompts: torch.Tensor, completions: torch.Tensor, /) -> torch.Tensor:
        """``[n]`` float: the fraction of completion tokens equal to the true
        continuation at their position (``answers``), position-wise exact match."""
        return (completions == self.answers(prompts)).float().mean(-1)


@dataclasses.dataclass(frozen=True)
class GRPOToyConfig:
    """Sizes and settings of the run; ``kl_coef`` goes to ``PolicyLossConfig.grpo``.

    The defaults learn the counting task (V=16, P=C=4) on the tiny GPT of
    ``TinyGPTShape(vocab_size=16, max_sequence_length=16)``: the mean reward rises
    from chance (1/16) to 0.91-0.96 (the mean of the last 5 steps) in 200 steps, for
    each of seeds 0 to 4. 16 prompts per step (every start about once) and groups of
    16 give the sparse exact-match reward enough signal; ``kl_coef=0.1`` keeps the
    run stable (at 0.01 some seeds collapse late, at 0 some lock into wrong tokens)."""

    prompts_per_step: int = 16
    group_size: int = 16
    steps: int = 200
    updates_per_step: int = 2
    lr: float = 2e-3
    kl_coef: float = 0.1
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "steps", "updates_per_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ContractError(name, expected="an int >= 1", actual=repr(value))
        if (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 2
        ):
            raise ContractError(
                "group_size",
                expected="an int >= 2 (advantages are normalised within a group)",
                actual=repr(self.group_size),
            )
        if not self.temperature > 0:
            raise ContractError(
                "temperature", expected="a number > 0", actual=repr(self.temperature)
            )


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One sampled batch, every per-token field ``[b, s]`` with ``s = P + C - 1``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor  # 1.0 at the completion's label positions
    rewards: torch.Tensor  # [b]
    advantages: torch.Tensor  # [b, s], the sequence's advantage at every token


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step measured: the sampled batch's mean reward (before the update)
    and the last update's loss, KL to the reference and clip fraction."""

    reward: float
    loss: float
    kl: float
    clip_fraction: float


def _full_vocab(local: torch.Tensor) -> torch.Tensor:
    """Concatenate the tensor-parallel vocabulary shards along the last dim."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(
        parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    new_tokens: int,
    /,
    *,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[b, P + new_tokens]``: ancestral sampling from ``softmax(z / temperature)``
    of the last position, one token at a time (no KV cache: the sequences are short)."""
    seqs = prompts
    for _ in range(new_tokens):
        b, s = seqs.shape
        positions = torch.arange(s).expand(b, s)
        logits = _full_vocab(model(seqs, positions, None)[:, -1, :].float())
        probs = torch.softmax(logits / temperature, dim=-1)
        seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return seqs


def group_advantages(rewards: torch.Tensor, /, *, eps: float = 1e-6) -> torch.Tensor:
    """``[n, G] -> [n, G]``: ``(r - mean(r)) / (std(r) + eps)`` within each group
    (population std), 0 for a group whose rewards are all equal."""
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)
    return (rewards - mean) / (std + eps)


def rollout(
    model: torch.nn.Module,
    task: CountingTask,
    config: GRPOToyConfig,
    /,
    *,
    generator: torch.Generator,
) -> Rollout:
    """Sample ``group_size`` completions for each of ``prompts_per_step`` prompts and
    score them."""
    n, g = config.prompts_per_step, config.group_size
    prompts = task.prompts(n, generator=generator).repeat_interleave(g, dim=0)
    seqs = sample(
        model, prompts, task.completion_len, generator=generator, temperature=config.temperature
    )
    rewards = task.reward(prompts, seqs[:, task.prompt_len :])
    adv = group_advantages(rewards.view(n, g)).reshape(-1)
    s = seqs.shape[1] - 1
    mask = torch.zeros(n * g, s)
    mask[:, task.prompt_len - 1 :] = 1.0
    return Rollout(
        input_ids=seqs[:, :-1].contiguous(),
        position_ids=torch.arange(s).expand(n * g, s).contiguous(),
        labels=seqs[:, 1:].contiguous(),
        mask=mask,
        rewards=rewards,
        advantages=adv[:, None].expand(n * g, s).contiguous(),
    )


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, batch: Rollout, /, *, temperature: float = 1.0
) -> torch.Tensor:
    """``[b, s]``: the labels' logprobs under ``model``, through the hook
    (``selected_logprobs``), without a graph."""
    out = model(
        batch.input_ids,
        batch.position_ids,
        None,
        labels=batch.labels,
        output_processor=selected_logprobs(temperature=temperature),
    )
    return out["logprobs"]


def grpo_step(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    task: CountingTask,
    config: GRPOToyConfig,
    /,
    *,
    generator: torch.Generator,
) -> StepStats:
    """One rollout and ``updates_per_step`` optimizer steps on it. ``model`` and
    ``reference`` are enabled (``torch_impl.enable_output_processor``) GPTs whose
    vocabulary is ``task.vocab_size``."""
    vocab = getattr(unwrap_model(model), "vocab_size", None)
    if vocab != task.vocab_size:
        raise ContractError(
            "task.vocab_size",
            expected=f"the model's vocabulary size {vocab}",
            actual=task.vocab_size,
        )
    batch = rollout(model, task, config, generator=generator)
    old = sequence_logprobs(model, batch, temperature=config.temperature)
    ref = sequence_logprobs(reference, batch, temperature=config.temperature)
    loss_fn = policy_loss(PolicyLossConfig.grpo(kl_coef=config.kl_coef))
    context = PolicyBatch(
        old_logprobs=old,
        advantages=batch.advantages,
        mask=batch.mask,
        ref_logprobs=ref,
        temperature=None if config.temperature == 1.0 else config.temperature,
    )
    out: Any = None
    for _ in range(config.updates_per_step):
        optimizer.zero_grad(set_to_none=True)
        out = model(
            batch.input_ids,
            batch.position_ids,
            None,
            labels=batch.labels,
            output_processor=loss_fn,
            output_processor_context=context,
        )
        out["loss"].backward()
        optimizer.step()
    return StepStats(
        reward=float(batch.rewards.mean()),
        loss=float(out["loss"].detach()),
        kl=float(out["kl"]),
        clip_fraction=float(out["clip_fraction"]),
    )


def train(
    model: torch.nn.Module, reference: torch.nn.Module, task: CountingTask, config: GRPOToyConfig, /
) -> list[StepStats]:
    """``config.steps`` GRPO steps with Adam (``lr``), sampling from a generator
    seeded with ``config.seed`` (the same draws on every tensor-parallel rank)."""
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    return [
        grpo_step(model, reference, optimizer, task, config, generator=generator)
        for _ in range(config.steps)
    ]
