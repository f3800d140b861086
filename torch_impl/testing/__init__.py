"""Test support, apart from the library: tiny Megatron models that build and run on a
CPU, a one-call process-group set-up, and the examples.

- :mod:`torch_impl.testing.tiny`: ``build_tiny_gpt``, ``tiny_batch``, ``tiny_config``,
  ``cpu_layer_spec``, ``megatron_parallel``, ``free_port`` (the names of
  :mod:`torch_impl.tiny` and :mod:`torch_impl.process_state`, where the tools read them).
- :mod:`torch_impl.testing.tiny_hybrid`: a ``HybridModel`` without Transformer Engine
  (:mod:`torch_impl.tiny_hybrid`).
- :mod:`torch_impl.testing.tiny_moe`: a GPT whose layers (or last layer) are MoE layers.
- :mod:`torch_impl.testing.cp`: Megatron's context-parallel split of a batch (plain rows
  and packed THD sequences), written out.
- :mod:`torch_impl.testing.schedules`: ``cpu_schedule()``, which lets Megatron's
  pipeline schedules (``get_forward_backward_func``) run on a CPU over gloo.
- :mod:`torch_impl.testing.examples`: runnable examples (a GRPO toy, also through
  Megatron's schedule).

Nothing in the library imports this package (the doctor and ``hookcheck`` included); the
tests, the benchmarks and the notebooks do.
"""
