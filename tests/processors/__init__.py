"""The processors and their engine: values and gradients against float64, both backends
(torch, Triton), precision, cost, launches, host reads, the policy family, distillation."""
