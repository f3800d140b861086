"""The contract fuzzer's known findings: defects it found that are not fixed yet,
each named, with its minimal reproduction (a strict ``xfail`` in
``tests/test_contract_fuzz.py`` runs each one), and matched by entry point, draw and
message, so that the default run stays green while each stays visible: the run
counts and prints every case it matched. Remove an entry with its fix (its strict
``xfail`` then fails first, as a reminder).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

__all__ = ["KNOWN_FINDINGS", "KnownFinding", "known_finding"]

PROCESSORS = ("selected_logprobs", "cross_entropy_loss", "policy_loss", "topk_logprobs", "distillation_loss")


@dataclasses.dataclass(frozen=True)
class KnownFinding:
    """A defect the fuzzer finds: ``matches(result)`` says whether a finding is it."""

    name: str
    entries: tuple[str, ...]
    where: str  # the code that has it
    reproduction: str  # the minimal reproduction, as the xfail test runs it
    matches: Callable[[Any], bool]


def _message(pattern: str) -> Callable[[Any], bool]:
    return lambda r: re.search(pattern, r.message) is not None


KNOWN_FINDINGS: tuple[KnownFinding, ...] = (
    KnownFinding(
        name="vocab-none-named-vocab_weight",
        entries=PROCESSORS,
        where="torch_impl/processors/_inputs.py::hook_inputs",
        reproduction="selected_logprobs()(OutputContext(hidden_states=h, vocab_weight=w, labels=y, "
        "vocab=None)) raises ContractError('vocab_weight', expected the output weight shard, got "
        "None): the weight is "
        "there; the missing VocabShard is not named",
        matches=lambda r: "vocab_missing" in r.mutations and "names 'vocab_weight'" in r.message,
    ),
    KnownFinding(
        name="sparse-distillation-under-inference-mode",
        entries=("distillation_loss",),
        where="torch_impl/processors/_distill.py::_sparse_epilogue (torch.enable_grad + autograd.grad)",
        reproduction="with torch.inference_mode(): distillation_loss()(ctx with a SparseTeacher) raises "
        "RuntimeError: element 0 of tensors does not require grad (enable_grad does not lift "
        "inference mode; the dense form and every other processor run)",
        matches=lambda r: (
            r.notes.get("caller") == "inference"
            and r.notes.get("teacher") == "sparse"
            and "does not require grad" in r.message
        ),
    ),
    KnownFinding(
        name="distillation-unused-count-field",
        entries=("distillation_loss",),
        where="torch_impl/processors/_distill.py (aggregation_weights' check_unused_count without the "
        "'context.' prefix)",
        reproduction="distillation_loss(DistillConfig(aggregation='token-mean'))(ctx with "
        "SparseTeacher(..., global_sequences=5)) raises ContractError('global_sequences', ...); the "
        "teacher's field is context.global_sequences (policy_loss names it so)",
        matches=_message(r"names 'global_(tokens|sequences)', expected one of \[.*'context\.global_"),
    ),
    KnownFinding(
        name="bucket-tails-cancel",
        entries=("distillation_loss",),
        where="torch_impl/processors/_distill.py::sparse_divergence (both tails as -expm1(logsumexp(.)) "
        "in the accumulation dtype)",
        reproduction="V=3, k=2, a teacher of fp32 logprobs log(0.7), log(0.3), h=[[1.]], W=[[2.],[.5],[3.]], "
        "reverse-kl, bucket: loss 59.63 in fp32, 14.218 in float64 (the truth of the same inputs: "
        "the teacher's tail 1 - sum(exp(lp)) is 1.2e-8, the fp32 logsumexp rounds it to 0, floored to "
        "2**-126); h=[[1.]], W=[[10.],[-6.]], a teacher log(0.6) at id 0, forward-kl: kl 34.26 for "
        "5.727 (the student's tail 1.1e-7 as -expm1(logsumexp(u) - lse) cancels at |lse| * 6e-8 = 6e-7)",
        matches=lambda r: (
            r.notes.get("tail") == "bucket"
            and r.notes.get("teacher") == "sparse"
            and "off the float64 truth" in r.message
        ),
    ),
)


KNOWN_FINDINGS += (
    KnownFinding(
        name="topk-entropy-keeps-its-graph",
        entries=("topk_logprobs", "linear_topk_logprobs", "hookcheck.main"),
        where="torch_impl/processors/_topk.py::_TopkFunction.forward (ctx.stats holds stats.entropy, "
        "which forward also returns: output -> grad_fn -> ctx -> output, a cycle through autograd's "
        "nodes that Python's collector cannot see)",
        reproduction="h = randn(4, 1, 8, requires_grad=True); out = topk_logprobs(3, entropy=True)(ctx "
        "of h); "
        "backward; del everything; gc.collect(): h is still alive (so are the weight, the TileSetup "
        "and its TorchCollectives' process group: an in-process hookcheck run keeps 17 file "
        "descriptors and 7 native threads per run); entropy=False, selected_logprobs(entropy=True): freed",
        matches=lambda r: (
            "stay alive" in r.message or (r.entry == "hookcheck.main" and "after a second run" in r.message)
        ),
    ),
)


def known_finding(result: Any) -> str:
    """The name of the known finding ``result`` is, or ``""``."""
    for known in KNOWN_FINDINGS:
        if result.entry in known.entries and known.matches(result):
            return known.name
    return ""
