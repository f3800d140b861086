"""The conventions of the standard quantities, stated once as the code they equal.

Every implementation of the contract (``torch_impl``, ``jax_ref``, a user's
processor) computes these quantities with exactly these definitions. Shapes:
``z`` are the logits of one token, ``[V]`` (global vocabulary); ``y`` the
selected token id; ``T`` the temperature (a scalar or one value per token).

Selected-token logprob with temperature::

    logprob = z[y] / T - logsumexp(z / T)                  # <= 0

The logits of the output layer, hidden state ``h [H]``, weight ``W [V, H]``, an
optional bias ``b [V]`` (0 when absent; each vocabulary shard holds its part and
its gradient), and the scale ``logit_scale`` (1 unless a config sets one)::

    z = (h @ W.T + b) * logit_scale                        # d z / d b = logit_scale

Entropy of the tempered distribution, non-negative (NeMo RL's chunked entropy
returns the negative; we do not)::

    p = softmax(z / T)
    entropy = logsumexp(z / T) - sum(p * z / T)            # >= 0

Log-partition and z-loss, per token, over the whole vocabulary (every shard), at
temperature ``T``; the z-loss of a cross entropy weighted by ``z_loss >= 0``, 0 at an
ignored label, aggregated with the cross entropy's own token weights (token-mean:
divided by the same count; Liger-Kernel's ``lse_square_scale``, Cut Cross-Entropy's
``compute_z_loss`` times its weight)::

    lse = logsumexp(z / T)                                 # d lse / d(z / T) = softmax(z / T)
    loss = -logprob + z_loss * lse ** 2                    # the token's loss with a z-loss

Class weights ``cw [V]`` (finite, ``>= 0``) of a cross entropy, as
``torch.nn.functional.cross_entropy(weight=cw)`` and Liger-Kernel's ``ce_weight``
define them, under a mask ``M`` (0 at an ignored label); the z-loss is not weighted
by them (Liger-Kernel's)::

    token loss:  -cw[y] * logprob + z_loss * lse ** 2
    sum:         sum(M * cw[y] * -logprob) + z_loss * sum(M * lse ** 2)
    mean:        sum(M * cw[y] * -logprob) / sum(M * cw[y]) + z_loss * sum(M * lse ** 2) / sum(M)

Final-logit soft-capping (Gemma's ``final_logit_softcapping``, Liger-Kernel's and Cut
Cross-Entropy's ``softcap``) at a cap ``s > 0``, on the model's logits ``u`` (after any
output multiplier), before the temperature; every quantity above is then of ``z``::

    z = s * tanh(u / s)                                    # |z| < s
    d z / d u = 1 - tanh(u / s) ** 2 = 1 - (z / s) ** 2

Label smoothing ``eps`` in ``[0, 1]`` of a cross entropy, as
``torch.nn.functional.cross_entropy(label_smoothing=eps)`` and Liger-Kernel's
``label_smoothing`` define it: the target mixes the label with the uniform
distribution over the whole vocabulary (every shard), 0 at an ignored label,
aggregated with the cross entropy's token weights::

    mean_logit = mean(z / T)                               # d mean_logit / d(z / T)_j = 1 / V
    loss = (1 - eps) * -logprob + eps * (lse - mean_logit) + z_loss * lse ** 2

With class weights ``cw [V]`` (PyTorch's and Liger-Kernel's definition) the uniform
term is weighted per class, the z-loss is not, and the mean divides the cross entropy
by ``sum(M * cw[y])``::

    token loss:  (1 - eps) * cw[y] * -logprob + eps / V * sum_j cw[j] * (lse - z_j / T)
               = (1 - eps) * cw[y] * -logprob + eps * (mean(cw) * lse - sum_j cw[j] * z_j / T / V)
    mean:        sum(M * token loss) / sum(M * cw[y]) + z_loss * sum(M * lse ** 2) / sum(M)

A weighted mean whose weight is 0 (``sum(M * cw[y]) == 0``: every counted label has class
weight 0, where PyTorch's ``0 / 0`` gives NaN) has a cross-entropy term of ``0.0`` with a
zero gradient, its label smoothing included, as an empty mask aggregates (below); the
z-loss term keeps its mean over ``sum(M)``::

    mean:        where(sum(M * cw[y]) > 0, sum(M * token loss) / sum(M * cw[y]), 0)
                 + z_loss * sum(M * lse ** 2) / sum(M)

Ignore index: a label equal to ``IGNORE_INDEX`` (or the context's
``ignore_index``) selects no token: its logprob is defined as ``0.0``, its
gradient is zero, and it counts in no aggregation. Any other label outside
``[0, vocab_size)`` is an error, never a silent value.

KL estimators between the policy ``logp`` and the reference ``ref`` (both
selected-token logprobs ``[b, s]``), with ``log_ratio = ref - logp``::

    k1 = logp - ref
    k2 = (logp - ref) ** 2 / 2
    k3 = exp(log_ratio) - log_ratio - 1                    # >= 0, unbiased
    abs = |logp - ref|

Optionally the value is clamped (veRL clamps k3 to ``[-10, 10]``), and the
straight-through form (veRL's ``"k3+"``) keeps the value with k2's gradient::

    kl = k2 - stop_gradient(k2) + stop_gradient(kl)

PPO clipped objective with ``ratio = exp(logp - old)`` and advantages ``A``::

    loss = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    # dual clip, A < 0 only, with c > 1:
    loss = min(loss, -A * c)

Log ratios are clamped before ``exp`` (default ``C = 20``; ``None`` turns it
off), so that a masked or far off-policy token cannot produce inf or NaN::

    ratio = exp(clamp(logp - old, -C, C))
    log_ratio = clamp(ref - logp, -C, C)                   # in the KL estimators

GRPO is the PPO objective with group-relative advantages (the caller's
``A``). GSPO replaces the token ratio by the sequence ratio, the masked mean
of the token log-ratios of the token's sequence, differentiated through that
mean (not the "GSPO-token" stop-gradient form)::

    ratio_b = exp(clamp(sum_s((logp - old) * M) / sum_s(M), -C, C))   # [b], broadcast over s

The policy-loss modes (veRL's ``loss_mode`` names), ``d = clamp(logp - old, -C, C)``,
``r = exp(d)``, ``sg`` the stop-gradient, ``[lo, hi] = [1 - eps_low, 1 + eps_high]``::

    gspo:     s = exp(sg(sum_s(d * M) / sum_s(M)) + logp - sg(logp));  max(-A s, -A clip(s))
    dppo_tv:  -A * sg(min(r, c)) * logp * sg(valid)   # valid: p - p_old <= eps_high if A > 0
                                                      #        p - p_old >= -eps_low  else
    dppo_kl:  the same, valid: bkl <= eps_high or p <= p_old (A > 0); bkl <= eps_low or p >= p_old
              bkl = p_old * (old - logp) + (1 - p_old) * log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    sapo:     -A * sigmoid(tau * (r - 1)) * 4 / tau   # tau = tau_pos if A > 0 else tau_neg
    gpg:      -A * logp
    clip_cov: where(top, 0, max(-A r, -A clip(r)))    # top: max(1, int(ratio * sum(M))) unclipped
              # tokens with lb < cov < ub of largest cov = (A - mean_M(A)) * (logp - mean_M(logp))
    kl_cov:   -A r + where(top, coef * |d|, 0)        # top: max(1, int(ratio * n)), largest cov
    geo_mean: -mean_M(A)_b * exp(mean_M(sign(A) * min(sign(A) * d, sign(A) * clip(d, -eps_low,
              eps_high)))_b)                          # per sequence b, at each of its tokens
    dro:      -(A * logp - beta / 2 * (logp - old) ** 2)
    cispo:    -sg(clip(r, lo, hi)) * A * logp

Rollout correction, between the trainer's ``old`` logprobs and the rollout engine's
``rollout`` (``bypass``: the current ``logp`` against ``rollout``, which is then ``old``)::

    log_ratio = where(M > 0, old - rollout, 0)
    w = exp(clamp(log_ratio, -20, 20))                               # token
    w_b = exp(clamp(sum_s(log_ratio * M), -20, 20))                  # sequence, broadcast
    w_b = exp(clamp(sum_s(log_ratio * M) / sum_s(M), -20, 20))       # geometric, broadcast
    w = min(w, upper) * M              # truncated; with a lower bound: where(lo <= w <= up, w, 0)
    r = clamp(log_ratio, -20, 20);  k1 = -r;  k2 = r ** 2 / 2;  k3 = exp(r) - 1 - r
    keep = all(lower <= stat <= upper)   # per token, or a sequence's sum, mean or max of it
    M = M * keep;  pg = w * pg           # a rejected token leaves the loss and its normaliser

with k1's bounds ratios compared in log space. The weights are detached.

Aggregations of a per-token loss ``L [b, s]`` under a mask ``M [b, s]``::

    token-mean:          sum(L * M) / sum(M)
    seq-mean-token-sum:  mean_b( sum_s(L * M) )            # over sequences with sum_s M > 0
    seq-mean-token-mean: mean_b( sum_s(L * M) / sum_s(M) ) # over sequences with sum_s M > 0
    token-sum:           sum(L * M)
    seq-mean-token-sum-norm: seq-mean-token-sum / F        # Dr. GRPO; F: a constant, default s

An empty mask (``sum(M) == 0``) aggregates to ``0.0`` with a zero gradient.

Preference losses of pairs of sequences, ``c`` chosen and ``r`` rejected. A sequence's
logprob is ``S = sum_t(M * logprob)`` over its ``n = sum_t(M)`` counted tokens, the
reference's ``S_ref`` over the same tokens; length-normalised, both are divided by ``n``
(DPO: sums by default; IPO: means by default, as TRL, where the IPO paper writes sums;
SimPO: always means; ``lp = 0`` where ``n == 0``)::

    lp, ref = (S / n, S_ref / n) if length_normalized else (S, S_ref)
    m = (lp_c - ref_c) - (lp_r - ref_r)                    # SimPO: ref = 0
    dpo:    L = -(1 - eps) * logsigmoid(beta * m) - eps * logsigmoid(-beta * m)
    ipo:    L = (m - 1 / (2 * beta)) ** 2
    simpo:  L = -(1 - eps) * logsigmoid(beta * m - gamma) - eps * logsigmoid(gamma - beta * m)
    reward = beta * (lp - ref)                             # each side; accuracy: r_c > r_r
    loss = sum_i(w_i * L_i) / sum_i(w_i)                   # mean over the pairs, weights w >= 0

``beta > 0``; ``eps`` (label smoothing, conservative DPO) in ``[0, 0.5]``, 0 for IPO;
``gamma`` SimPO's target margin. A pair counts (``w_i > 0``) only with a counted token in
each of its sequences.

Top-k logprobs of one token: the ``k`` largest entries of ``lp = log_softmax(z /
T)``, ordered by value descending and, among equal values, by id ascending (the
smaller id first, deterministically)::

    order = argsort by (-lp, id);  ids = order[:k];  topk_logprobs = lp[ids]

"Equal" means equal as computed, at the implementation's precision: two logits
that differ in exact arithmetic but round to the same value are a tie, and the
smaller id wins; a reference checks an implementation's ids against its own
values, not against a higher-precision ranking.

Sampling support (sampling replay): a rollout engine that samples with top-k, top-p or
min-p draws from the tempered distribution renormalised over the tokens its sampler
kept, ``K``; the logprob and entropy of that distribution are::

    logprob = z[y] / T - logsumexp(z[K] / T)       # -inf where y is not in K; 0 where ignored
    q = softmax(z[K] / T);  entropy = -sum(q * log(q))          # 0 where K is empty

``K`` is given as ids, or by vLLM's sampler's rule on ``u = z / T``, in its order::

    K = {j : u_j >= max(u) + log(min_p)}                        # min-p (0: every token)
    K = {j in K : u_j >= kth_largest(u[K], top_k)}              # top-k: ties at the k-th kept
    above_j = sum(softmax(u[K])[i] for i in K if u_i > u_j)
    K = {j in K : above_j < top_p}                              # top-p: a tie group kept whole

The largest logit and its ties are always kept. vLLM removes each position of its
ascending sort whose cumulative mass is ``<= 1 - top_p``; the rule above keeps a tie group
wherever vLLM keeps any of its members (vLLM's unstable sort decides which it keeps).

Distillation, per token, teacher ``p`` and student ``q = softmax(z / T)``, both
at temperature ``T``; a divergence between distributions ``P`` and ``Q`` over
the same outcomes, where a term whose weight (``P``, ``Q``) is 0 is 0::

    forward-kl:  D = sum(P * (log P - log Q))                          # KL(teacher || student)
    reverse-kl:  D = sum(Q * (log Q - log P))                          # KL(student || teacher)
    jsd(beta):   log M = logaddexp(log(beta) + log P, log(1 - beta) + log Q)    # 0 < beta < 1
                 D = beta * sum(P * (log P - log M)) + (1 - beta) * sum(Q * (log Q - log M))

Dense teacher: ``P = p``, ``Q = q`` over the whole vocabulary. The teacher's
logits are ``z_t = h_t @ W_t.T * c_t / T`` from its hidden states, its output weight
(the same vocabulary rows as the student's) and its own logit scale ``c_t`` (MuP's
output multiplier of the teacher model; 1 without MuP); the student's are ``z = h @
W.T * c / T`` with its model's scale ``c``. Each is capped by its own model's softcap
where that has one (above; the teacher's ``s_t``: ``z_t = s_t * tanh(h_t @ W_t.T * c_t /
s_t) / T``), the teacher's independent of the student's. No gradient reaches the teacher. No
``T**2`` factor is applied: ``D`` is the divergence at temperature ``T``
(Hinton's ``T**2`` gradient scale is the caller's to multiply).

Sparse teacher: its top-k ``ids [k]`` and logprobs ``lp_t [k]``, the student's
``u = z[ids] / T`` and ``log q = u - logsumexp(z / T)``; the teacher's remaining
mass is treated one of two ways (``TeacherTail``)::

    renormalize:  log P = lp_t - logsumexp(lp_t)                       # [k]
                  log Q = u - logsumexp(u)                             # [k]: no full-vocabulary
                                                                       #   term
    bucket:       p_tail = -expm1(logsumexp(lp_t))                     # 1 - sum(exp(lp_t)), no
                                                                       #   cancellation
                  q_tail = -expm1(logsumexp(log q))
                  log P = concat(lp_t, log(max(p_tail, TAIL_FLOOR)))   # [k + 1]: the k ids and
                                                                       #   one tail
                  log Q = concat(log q, log(max(q_tail, TAIL_FLOOR)))  # both tails alike

``TAIL_FLOOR = 2**-126`` (float32's smallest normal number, whatever dtype the terms
are computed in): a tail that is empty on both sides contributes
``TAIL_FLOOR * (log TAIL_FLOOR - log TAIL_FLOOR) = 0``, and a tail empty on one side
only a finite term (``k = V``, or a teacher whose listed mass rounds to 1, gives a
finite reverse KL).

A sparse teacher is valid where it is read (the tokens that count), per token:
``ids`` distinct, each in ``[0, V)``; ``lp_t`` neither NaN nor ``+inf``, each ``<= eps``
and ``sum(exp(lp_t)) <= 1 + k * eps`` (``eps``: the machine epsilon of ``lp_t``'s dtype,
its rounding); ``lp_t[0]`` finite and ``lp_t[0] >= lp_t[j]`` for every ``j``
(``ids[0]`` is the teacher's top-1, which top-1 agreement reads). An invalid teacher
raises ``ContractError`` naming the rule it breaks rather than giving a loss.

``lp_t[j] = -inf`` is probability 0 (an id the teacher masks): ``P`` is 0 there, and
by the rule above its terms are 0. Forward KL and JSD stay finite, with finite
gradients; the reverse KL is ``+inf`` wherever the student gives that id mass (every
finite logit does), as ``KL(Q || P)`` is: use forward KL or JSD with such teachers.

Top-1 agreement: ``argmax(q) == argmax(p)`` (dense; ties: the smaller id), or
``argmax(q) == ids[0]`` (sparse).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = [
    "IGNORE_INDEX",
    "TAIL_FLOOR",
    "UPSTREAM_HOOK_KEYWORDS",
    "UPSTREAM_HOOK_SOURCES",
    "Aggregation",
    "DistillDivergence",
    "KLEstimator",
    "TeacherTail",
    "UpstreamHookSources",
]

IGNORE_INDEX: int = -100
"""The default ignore index, as in ``torch.nn.functional.cross_entropy``."""

TAIL_FLOOR: float = 2.0**-126
"""The floor of both tails of a sparse teacher's ``bucket`` form (float32's smallest
normal number, whatever dtype the terms are computed in; module docstring)."""

UPSTREAM_HOOK_KEYWORDS: tuple[str, ...] = (
    "hidden_states",
    "output_layer",
    "output_weight",
    "labels",
    "loss_mask",
    "input_ids",
    "position_ids",
    "attention_mask",
    "decoder_input",
    "inference_context",
    "packed_seq_params",
    "runtime_gather_output",
    "context",
    "compute_language_model_loss",
    "scale_logits",
    "config",
)
"""The 16 keywords Megatron Core's native ``output_processor`` hook passes (0.18+)."""


class UpstreamHookSources(NamedTuple):
    """Where each of the sixteen upstream keywords comes from, in
    ``GPTModel._postprocess`` (0.19.2) where the native hook is called.

    ``decoder``: the decoder's (or MTP block's main) output. ``call``: the
    arguments the model's own ``forward``/``_postprocess`` received, passed on
    as they are. ``model``: read off the model (output layer and its tied
    weight, Megatron's loss, the logit scaling, the config). ``caller``: the
    caller's ``output_processor_context``.
    """

    decoder: tuple[str, ...]
    call: tuple[str, ...]
    model: tuple[str, ...]
    caller: tuple[str, ...]


UPSTREAM_HOOK_SOURCES = UpstreamHookSources(
    decoder=("hidden_states",),
    call=(
        "labels",
        "loss_mask",
        "input_ids",
        "position_ids",
        "attention_mask",
        "decoder_input",
        "inference_context",
        "packed_seq_params",
        "runtime_gather_output",
    ),
    model=(
        "output_layer",
        "output_weight",
        "compute_language_model_loss",
        "scale_logits",
        "config",
    ),
    caller=("context",),
)
""":class:`UpstreamHookSources` of :data:`UPSTREAM_HOOK_KEYWORDS`: every keyword in exactly
one group."""


class KLEstimator(enum.StrEnum):
    """The KL estimators ``k1``, ``k2``, ``k3`` of the module docstring."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    ABS = "abs"


class Aggregation(enum.StrEnum):
    """How a per-token loss ``[b, s]`` becomes a scalar (module docstring)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    TOKEN_SUM = "token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class DistillDivergence(enum.StrEnum):
    """The distillation divergences of the module docstring."""

    FORWARD_KL = "forward-kl"
    REVERSE_KL = "reverse-kl"
    JSD = "jsd"


class TeacherTail(enum.StrEnum):
    """How a sparse (top-k) teacher's mass outside its ``k`` ids is treated (module docstring)."""

    RENORMALIZE = "renormalize"
    BUCKET = "bucket"
