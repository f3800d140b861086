"""Worked examples on the tiny CPU model: importable by tests and notebooks.

- :mod:`torch_impl.testing.examples.grpo_toy`: a GRPO-style run on a counting task with a
  verifiable reward, the policy loss computed inside the output-processor hook.
"""

__all__: list[str] = []
