"""Worked examples on the tiny CPU model: importable by tests and notebooks.

- :mod:`torch_impl.testing.examples.grpo_toy`: a GRPO-style run on a counting task with a
  verifiable reward, the policy loss computed inside the output-processor hook.
- :mod:`torch_impl.testing.examples.grpo_schedule`: the same run through Megatron's
  ``get_forward_backward_func``: a DDP-wrapped policy and packed (THD) micro-batches.
- :mod:`torch_impl.testing.examples.critic`: a PPO critic, per-token values from a value
  head of the user's own and PPO's clipped value loss, inside the hook.
"""

__all__: list[str] = []
