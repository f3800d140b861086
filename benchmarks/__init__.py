"""Benchmarks of the production processors (run as modules, never collected by pytest):

- ``python -m benchmarks.logprobs``: logprobs + entropy and the PPO loss, forward +
  backward, time and peak extra memory against the naive path and veRL.
- ``python -m benchmarks.hook_overhead``: an enabled model with a pass-through
  processor against the stock model.

``bash scripts/bench.sh`` runs both (``--quick`` for a smoke run). Results go
to ``benchmarks/results/`` (git-ignored).
"""
