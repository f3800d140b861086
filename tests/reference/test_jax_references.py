"""The float64 references against numpy float64, and their gradients with check_grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from scipy.special import logsumexp

import jax_ref
from hookspec import ContractError
from jax_ref import references as R


@pytest.fixture(autouse=True)
def _x64():
    with jax_ref.float64():
        yield


def _np_logprobs(z, y, t, ignore=-100):
    zt = z / t[..., None]
    lp = zt - logsumexp(zt, axis=-1, keepdims=True)
    safe = np.where(y == ignore, 0, y)
    out = np.take_along_axis(lp, safe[..., None], -1)[..., 0]
    return np.where(y == ignore, 0.0, out)


def _np_entropy(z, t):
    zt = z / t[..., None]
    lse = logsumexp(zt, axis=-1)
    p = np.exp(zt - lse[..., None])
    return lse - (p * zt).sum(-1)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    b, s, h, v = 3, 7, 13, 67  # awkward sizes
    hidden = rng.normal(size=(b, s, h))
    weight = rng.normal(size=(v, h)) / np.sqrt(h) * 3
    labels = rng.integers(0, v, size=(b, s))
    labels[0, 2] = labels[2, 6] = -100
    temp = rng.uniform(0.5, 2.0, size=(b, s))
    return hidden, weight, labels, temp


@pytest.mark.parametrize("per_token", [False, True])
def test_token_logprobs_and_entropy_match_numpy(data, per_token):
    hidden, weight, labels, temp = data
    t = temp if per_token else np.full(labels.shape, 0.7)
    z = hidden @ weight.T
    got = R.token_logprobs(jnp.asarray(z), jnp.asarray(labels), temperature=t if per_token else 0.7)
    want = _np_logprobs(z, labels, t)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-13)
    assert got.dtype == jnp.float64
    assert np.all(np.asarray(got) <= 0) and np.all(np.asarray(got)[labels == -100] == 0)
    ent = R.token_entropy(jnp.asarray(z), temperature=t if per_token else 0.7)
    np.testing.assert_allclose(np.asarray(ent), _np_entropy(z, t), rtol=1e-12, atol=1e-13)
    assert np.all(np.asarray(ent) >= 0)


def test_linear_logprobs_equals_plain_path(data):
    hidden, weight, labels, temp = data
    res = R.linear_logprobs(
        jnp.asarray(hidden),
        jnp.asarray(weight),
        jnp.asarray(labels),
        temperature=temp,
        with_entropy=True,
    )
    z = hidden @ weight.T
    want = _np_logprobs(z, labels, temp)
    np.testing.assert_allclose(np.asarray(res.logprobs), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        np.asarray(res.entropy), _np_entropy(z, temp), rtol=1e-12, atol=1e-12
    )
    assert (
        R.linear_logprobs(jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels)).entropy
        is None
    )


def test_linear_logprobs_gradients(data):
    hidden, weight, labels, temp = data
    y = jnp.asarray(labels)

    def f(h, w):
        r = R.linear_logprobs(h, w, y, temperature=temp, with_entropy=True)
        return r.logprobs, r.entropy

    check_grads(
        jax.jit(f), (jnp.asarray(hidden), jnp.asarray(weight)), order=1, modes=("rev", "fwd")
    )
    # ignored labels get a zero gradient from the logprob
    _, vjp = jax.vjp(lambda h: f(h, jnp.asarray(weight))[0], jnp.asarray(hidden))
    ct = np.zeros(labels.shape)
    ct[0, 2] = 1.0
    (dh,) = vjp(jnp.asarray(ct))
    assert float(jnp.abs(dh).max()) == 0.0


def test_lse_and_the_z_loss_reference_match_numpy(data):
    """``lse`` at every token (ignored labels too), its gradient, and the cross-entropy
    reference with a z-loss: ``-logprob + z_loss * lse ** 2``, 0 at ignored labels."""
    from jax_ref import processors as P

    hidden, weight, labels, temp = data
    res = R.linear_logprobs(
        jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels), temperature=temp
    )
    z = hidden @ weight.T
    lse = logsumexp(z / temp[..., None], axis=-1)
    np.testing.assert_allclose(np.asarray(res.lse), lse, rtol=1e-13, atol=1e-13)

    def f(h, w):
        return R.linear_logprobs(h, w, jnp.asarray(labels), temperature=temp).lse

    check_grads(jax.jit(f), (jnp.asarray(hidden), jnp.asarray(weight)), order=1, modes=("rev",))
    inputs = jax_ref.ReferenceInputs(labels=jnp.asarray(labels), vocab_size=weight.shape[0])
    hs = jnp.asarray(hidden.transpose(1, 0, 2))  # [s, b, h]
    got = P.cross_entropy_loss(z_loss=0.03, temperature=0.8)(hs, jnp.asarray(weight), inputs)
    lse8 = logsumexp(z / 0.8, axis=-1)
    want = np.where(
        labels == -100, 0.0, -_np_logprobs(z, labels, np.full(labels.shape, 0.8)) + 0.03 * lse8**2
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
    cw = np.linspace(0.0, 2.0, weight.shape[0])
    weighted = P.cross_entropy_loss(z_loss=0.03, temperature=0.8, class_weights=cw)(
        hs, jnp.asarray(weight), inputs
    )
    cwy = np.where(labels == -100, 0.0, cw[np.where(labels == -100, 0, labels)])
    want_w = np.where(
        labels == -100,
        0.0,
        -cwy * _np_logprobs(z, labels, np.full(labels.shape, 0.8)) + 0.03 * lse8**2,
    )
    np.testing.assert_allclose(np.asarray(weighted), want_w, rtol=1e-12, atol=1e-12)
    plain = P.cross_entropy_loss()(hs, jnp.asarray(weight), inputs)
    np.testing.assert_allclose(
        np.asarray(plain), -_np_logprobs(z, labels, np.ones(labels.shape)), rtol=1e-12
    )


def test_strongly_negative_logits_are_finite():
    z = jnp.full((2, 5, 11), -1e4) + jnp.linspace(0, 1, 11)
    y = jnp.zeros((2, 5), jnp.int64)
    lp = R.token_logprobs(z, y)
    assert bool(jnp.isfinite(lp).all()) and float(lp.max()) <= 0
    assert bool(jnp.isfinite(R.token_entropy(z)).all())


def test_kl_estimators():
    rng = np.random.default_rng(1)
    logp, ref = -rng.uniform(0, 3, (4, 5)), -rng.uniform(0, 3, (4, 5))
    lr = ref - logp
    np.testing.assert_allclose(
        np.asarray(R.kl_penalty(logp, ref, estimator="k1")), logp - ref, rtol=1e-15
    )
    np.testing.assert_allclose(
        np.asarray(R.kl_penalty(logp, ref, estimator="k2")), (logp - ref) ** 2 / 2
    )
    k3 = np.asarray(R.kl_penalty(logp, ref, estimator="k3"))
    np.testing.assert_allclose(k3, np.exp(lr) - lr - 1, rtol=1e-13)
    assert np.all(k3 >= 0)
    for est in ("k1", "k2", "k3"):
        check_grads(
            jax.jit(lambda a, b, e=est: R.kl_penalty(a, b, estimator=e)), (logp, ref), order=2
        )
    with pytest.raises(ContractError, match="estimator"):
        R.kl_penalty(logp, ref, estimator="k4")


def _np_ppo(logp, old, a, eps_low, eps_high, c):
    out = np.empty_like(logp)
    for i in np.ndindex(logp.shape):
        r = np.exp(logp[i] - old[i])
        loss = max(-a[i] * r, -a[i] * min(max(r, 1 - eps_low), 1 + eps_high))
        if c is not None and a[i] < 0:
            loss = min(loss, -a[i] * c)
        out[i] = loss
    return out


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_loss_asymmetric_and_dual_clip(dual_clip):
    rng = np.random.default_rng(2)
    old = -rng.uniform(0.1, 3, (4, 6))
    logp = old + rng.normal(0, 0.6, (4, 6))
    logp[0, 0] = old[0, 0] + 2.0  # ratio e^2 > dual clip 3 with A < 0
    a = rng.normal(size=(4, 6))
    a[0, 0] = -1.0
    got = np.asarray(R.ppo_loss(logp, old, a, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip))
    np.testing.assert_allclose(got, _np_ppo(logp, old, a, 0.2, 0.28, dual_clip), rtol=1e-14)
    if dual_clip is not None:
        assert got[0, 0] == pytest.approx(3.0)
    # gradients away from the clip boundaries
    check_grads(
        jax.jit(lambda lp: R.ppo_loss(lp, old, a, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip)),
        (logp,),
        order=1,
        eps=1e-6,
    )


def test_gspo_matches_the_sequence_objective():
    rng = np.random.default_rng(3)
    b, s = 3, 5
    old = -rng.uniform(0.1, 3, (b, s))
    logp = old + rng.normal(0, 0.05, (b, s))
    mask = np.ones((b, s))
    mask[1, 3:] = 0
    adv = rng.normal(size=b)
    eps = 0.02

    def token_form(lp):
        loss = R.gspo_loss(lp, old, adv, mask, eps_low=eps, eps_high=eps)
        return R.aggregate(loss, mask, mode="seq-mean-token-mean")

    def sequence_form(lp):  # GSPO as written in the paper: one ratio per sequence
        sr = jnp.exp(jnp.sum(mask * (lp - old), -1) / mask.sum(-1))
        per_seq = jnp.maximum(-adv * sr, -adv * jnp.clip(sr, 1 - eps, 1 + eps))
        return jnp.mean(per_seq)

    np.testing.assert_allclose(float(token_form(logp)), float(sequence_form(logp)), rtol=1e-14)
    np.testing.assert_allclose(
        np.asarray(jax.grad(token_form)(jnp.asarray(logp))),
        np.asarray(jax.grad(sequence_form)(jnp.asarray(logp))),
        rtol=1e-12,
        atol=1e-15,
    )
    # per-token advantages: the ratio is differentiated through the sequence mean
    adv_t = rng.normal(size=(b, s))

    def through_the_mean(lp):
        loss = R.gspo_loss(lp, old, adv_t, mask, eps_low=eps, eps_high=eps)
        return R.aggregate(loss, mask, mode="token-mean")

    def by_hand(lp):
        sr = jnp.exp(jnp.sum(mask * (lp - old), -1) / mask.sum(-1))[:, None]
        pg = jnp.maximum(-adv_t * sr, -adv_t * jnp.clip(sr, 1 - eps, 1 + eps))
        return jnp.sum(pg * mask) / mask.sum()

    np.testing.assert_allclose(
        np.asarray(jax.grad(through_the_mean)(jnp.asarray(logp))),
        np.asarray(jax.grad(by_hand)(jnp.asarray(logp))),
        rtol=1e-12,
        atol=1e-15,
    )
    ratio_value = np.exp((mask * (logp - old)).sum(-1) / mask.sum(-1))
    per_token = np.asarray(R.gspo_loss(logp, old, adv, mask, eps_low=10.0, eps_high=10.0))
    np.testing.assert_allclose(
        per_token, -adv[:, None] * ratio_value[:, None] * np.ones((b, s)), rtol=1e-13
    )


def test_aggregations_match_numpy_and_skip_empty_sequences():
    rng = np.random.default_rng(4)
    loss = rng.normal(size=(3, 5))
    mask = (rng.uniform(size=(3, 5)) > 0.3).astype(float)
    mask[2] = 0  # an empty sequence counts in no mean
    mask[0, 0] = 1
    lm = loss * mask
    want = {
        "token-mean": lm.sum() / mask.sum(),
        "seq-mean-token-sum": lm[:2].sum(-1).mean(),
        "seq-mean-token-mean": (lm[:2].sum(-1) / mask[:2].sum(-1)).mean(),
    }
    empty = np.zeros_like(mask)
    for mode, value in want.items():
        assert float(R.aggregate(loss, mask, mode=mode)) == pytest.approx(value, rel=1e-14)
        check_grads(jax.jit(lambda x, m=mode: R.aggregate(x, mask, mode=m)), (loss,), order=1)
        assert float(R.aggregate(loss, empty, mode=mode)) == 0.0
        g = jax.grad(lambda x, m=mode, e=empty: R.aggregate(x, e, mode=m))(jnp.asarray(loss))
        assert float(jnp.abs(g).max()) == 0.0
    with pytest.raises(ContractError, match="mode"):
        R.aggregate(loss, mask, mode="sum")


def test_references_refuse_to_run_without_float64():
    with jax.enable_x64(False), pytest.raises(ContractError, match=r"jax_ref\.float64"):
        R.token_entropy(jnp.zeros((2, 3)))


def test_references_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, jax_ref, jax_ref.references, jax_ref.collectives; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_reference_side_imports_no_torch():
    """References, JAX processors, sharded reference, collectives, float64 scope,
    inputs and the flax head (until it loads from torch) import no torch; a
    reference actually runs so that lazily loaded names load too."""
    import json
    import subprocess
    import sys

    code = (
        "import sys, json, jax.numpy as jnp, jax_ref\n"
        "from jax_ref import collectives, head, inputs, processors, references, sharded\n"
        "with jax_ref.float64():\n"
        "    h, w = jnp.ones((3, 2, 4)), jnp.ones((5, 4))\n"
        "    x = jax_ref.ReferenceInputs(labels=jnp.zeros((2, 3), int), vocab_size=5)\n"
        "    processors.token_logprobs_of(h, w, x)\n"
        "    jax_ref.JaxCollectives('tp')\n"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('torch', 'torch_impl', 'megatron')"
        " or m.startswith('jax_ref.check'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [], out.stderr


def _np_capped(hidden, weight, *, bias=None, scale=1.0, cap=None):
    u = (hidden @ weight.T + (0.0 if bias is None else bias)) * scale
    return u if cap is None else cap * np.tanh(u / cap)


@pytest.mark.parametrize("cap", [0.5, 3.0, 30.0])
def test_softcap_linear_logprobs_match_numpy_and_their_gradients_check(data, cap):
    """``z = s * tanh((h @ W.T + b) * scale / s) / T`` at several caps (0.5: every
    logit deep in the tanh's saturation; 30: nearly the identity), logprobs, entropy,
    lse and the mean logit against numpy, and every gradient by check_grads."""
    hidden, weight, labels, temp = data
    rng = np.random.default_rng(1)
    bias = rng.normal(size=weight.shape[0])
    z = _np_capped(hidden, weight, bias=bias, scale=1.3, cap=cap)
    assert np.abs(z).max() <= cap  # tanh rounds to 1 in float64 where saturated
    got_z = R.linear_logits(
        jnp.asarray(hidden), jnp.asarray(weight), bias=jnp.asarray(bias), scale=1.3, softcap=cap
    )
    np.testing.assert_allclose(np.asarray(got_z), z, rtol=1e-13, atol=1e-13)
    res = R.linear_logprobs(
        jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels), temperature=temp,
        with_entropy=True, bias=jnp.asarray(bias), logit_scale=1.3, softcap=cap,
        with_mean_logit=True,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(res.logprobs), _np_logprobs(z, labels, temp), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        np.asarray(res.entropy), _np_entropy(z, temp), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(np.asarray(res.lse), logsumexp(z / temp[..., None], -1), rtol=1e-13)
    np.testing.assert_allclose(
        np.asarray(res.mean_logit), (z / temp[..., None]).mean(-1), rtol=1e-12, atol=1e-14
    )
    # the cap binds: uncapped logits differ
    plain = R.linear_logprobs(
        jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels), temperature=temp
    )
    assert float(jnp.abs(plain.logprobs - res.logprobs).max()) > 1e-3
    y, b = jnp.asarray(labels), jnp.asarray(bias)
    cw = jnp.asarray(rng.uniform(0.0, 2.0, size=weight.shape[0]))

    def f(h, w):
        r = R.linear_logprobs(
            h, w, y, temperature=temp, with_entropy=True, bias=b, logit_scale=1.3, softcap=cap,
            mean_logit_weights=cw,
        )  # fmt: skip
        return r.logprobs, r.entropy, r.lse, r.mean_logit

    check_grads(
        jax.jit(f), (jnp.asarray(hidden), jnp.asarray(weight)), order=1, modes=("rev", "fwd")
    )


def test_mean_logit_and_its_column_weights(data):
    """``mean_logit = sum_j c_j z_j / V`` (``c`` = 1 without weights), its gradient
    ``c_j / V`` on ``z_j`` (none to the weights), a wrong weight shape named."""
    hidden, weight, labels, temp = data
    v = weight.shape[0]
    z = hidden @ weight.T / temp[..., None]
    h, w, y = jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels)
    cw = np.linspace(0.0, 3.0, v)
    res = R.linear_logprobs(h, w, y, temperature=temp, mean_logit_weights=jnp.asarray(cw))
    np.testing.assert_allclose(
        np.asarray(res.mean_logit), (z * cw).sum(-1) / v, rtol=1e-12, atol=1e-14
    )
    assert R.linear_logprobs(h, w, y).mean_logit is None

    def f(w_, c):
        return R.linear_logprobs(h, w_, y, temperature=temp, mean_logit_weights=c).mean_logit.sum()

    dw, dc = jax.grad(f, argnums=(0, 1))(w, jnp.asarray(cw))
    want = (
        cw[:, None] * (hidden / temp[..., None]).reshape(-1, hidden.shape[-1]).sum(0)[None, :] / v
    )
    np.testing.assert_allclose(np.asarray(dw), want, rtol=1e-12, atol=1e-13)
    assert float(jnp.abs(dc).max()) == 0.0
    with pytest.raises(ContractError, match=r"mean_logit_weights.*V_local=67"):
        R.linear_logprobs(h, w, y, mean_logit_weights=jnp.ones(v - 1))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ContractError, match="softcap"):
            R.linear_logits(h, w, softcap=bad)


@pytest.mark.parametrize("class_weights", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
def test_label_smoothing_matches_torch_cross_entropy_in_float64(data, eps, class_weights):
    """``cross_entropy_loss(label_smoothing=eps, class_weights=cw)`` is PyTorch's
    ``F.cross_entropy(z / T, y, weight=cw, label_smoothing=eps, ignore_index=-100)``
    in float64, per token ("none") and, summed and divided by ``sum(cw[y])`` over
    counted tokens, as its "mean"; under a softcap (the inputs') the logits capped
    first. Gradients by check_grads."""
    import torch
    import torch.nn.functional as F

    from jax_ref import processors as P

    hidden, weight, labels, _ = data
    v = weight.shape[0]
    cw = np.random.default_rng(2).uniform(0.1, 2.0, size=v) if class_weights else None
    hs = jnp.asarray(hidden.transpose(1, 0, 2))  # [s, b, h]
    for cap in (None, 2.0):
        inputs = jax_ref.ReferenceInputs(labels=jnp.asarray(labels), vocab_size=v, softcap=cap)
        ref = P.cross_entropy_loss(temperature=0.8, label_smoothing=eps, class_weights=cw)
        got = np.asarray(ref(hs, jnp.asarray(weight), inputs))
        z = torch.from_numpy(_np_capped(hidden, weight, cap=cap) / 0.8).reshape(-1, v)
        y = torch.from_numpy(labels).reshape(-1)
        tw = None if cw is None else torch.from_numpy(cw)
        want = F.cross_entropy(z, y, weight=tw, label_smoothing=eps, reduction="none").reshape(
            labels.shape
        )
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)
        assert np.all(got[labels == -100] == 0.0)
        mean = F.cross_entropy(z, y, weight=tw, label_smoothing=eps, reduction="mean")
        counted = labels != -100
        denom = counted.sum() if cw is None else cw[np.where(counted, labels, 0)][counted].sum()
        np.testing.assert_allclose(got.sum() / denom, mean.item(), rtol=1e-12)

        def f(h, w, inputs=inputs, ref=ref):
            return ref(h, w, inputs)

        check_grads(jax.jit(f), (hs, jnp.asarray(weight)), order=1, modes=("rev",))
    with pytest.raises(ContractError, match="label_smoothing"):
        P.cross_entropy_loss(label_smoothing=1.5)
