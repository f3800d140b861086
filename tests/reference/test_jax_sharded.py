"""The sharded reference under shard_map over virtual CPU devices.

Virtual devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before
JAX starts its backend, so each check runs in a fresh interpreter
(``python -c "import tests.reference.test_jax_sharded as t; t.<body>()"``) and the test
process's own JAX is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _in_subprocess(body: str, devices: int) -> None:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONWARNINGS="ignore",
    )
    code = f"import tests.reference.test_jax_sharded as t; t.{body}()"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _case(seed: int = 0):
    import jax.numpy as jnp
    import numpy as np

    from jax_ref.inputs import ReferenceInputs

    rng = np.random.default_rng(seed)
    s, b, h, v = 6, 3, 8, 24
    labels = rng.integers(0, v, size=(b, s))
    labels[0, 1] = labels[2, 5] = -100
    mask = np.ones((b, s))
    mask[2, 3:] = 0
    lp_guess = -np.log(v) + 0.1 * rng.normal(size=(b, s))
    batch = types.SimpleNamespace(
        old_logprobs=jnp.asarray(lp_guess + 0.2 * rng.normal(size=(b, s))),
        ref_logprobs=jnp.asarray(lp_guess + 0.2 * rng.normal(size=(b, s))),
        advantages=jnp.asarray(rng.normal(size=(b, s))),
        mask=None,
        temperature=None,
    )
    inputs = ReferenceInputs(
        labels=jnp.asarray(labels), loss_mask=jnp.asarray(mask), context=batch, vocab_size=v
    )
    hidden = jnp.asarray(rng.normal(size=(s, b, h)))
    weight = jnp.asarray(rng.normal(size=(v, h)) / np.sqrt(h) * 2)
    return hidden, weight, inputs


def _references():
    import numpy as np

    from jax_ref import processors as P

    ppo = types.SimpleNamespace(
        clip_low=0.2, clip_high=0.28, dual_clip=3.0, ratio="token", kl_coef=0.1, kl_estimator="k3",
        entropy_coef=0.01, aggregation="token-mean", log_ratio_clamp=20.0,
    )  # fmt: skip
    gspo = types.SimpleNamespace(
        **{**vars(ppo), "ratio": "sequence", "aggregation": "seq-mean-token-mean"}
    )
    return {
        "logprobs": P.selected_logprobs(temperature=0.7, entropy=True),
        "cross_entropy": P.cross_entropy_loss(),
        "ppo": P.policy_loss(ppo),
        "gspo": P.policy_loss(gspo),
        "cross_entropy_smoothed_capped": _capped(
            P.cross_entropy_loss(
                label_smoothing=0.1, class_weights=np.linspace(0.2, 2.0, 24), z_loss=0.01
            )
        ),
    }


def _capped(ref):
    """``ref`` under a final-logit softcap of 2.5 (the inputs' ``softcap``)."""
    return lambda hidden, weight, inputs: ref(hidden, weight, inputs.replace(softcap=2.5))


def sharded_equals_unsharded() -> None:
    import itertools

    import jax
    import numpy as np

    import jax_ref
    from jax_ref.sharded import shard_reference, vocab_mesh

    assert len(jax.devices()) == 4
    with jax_ref.float64():
        hidden, weight, inputs = _case()
        for (name, ref), n in itertools.product(_references().items(), (2, 4)):
            sharded = shard_reference(ref, vocab_mesh(n))
            out, vjp = jax.vjp(lambda h, w, r=ref: r(h, w, inputs), hidden, weight)
            out_s, vjp_s = jax.vjp(lambda h, w, f=sharded: f(h, w, inputs), hidden, weight)
            leaves, leaves_s = jax.tree.leaves(out), jax.tree.leaves(out_s)
            for a, b in zip(leaves, leaves_s):
                np.testing.assert_allclose(
                    np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-13, err_msg=f"{name} n={n}"
                )
            cot = jax.tree.map(lambda x: jax.numpy.ones_like(x) * 0.7, out)
            for a, b in zip(vjp(cot), vjp_s(cot)):
                np.testing.assert_allclose(
                    np.asarray(b), np.asarray(a), rtol=1e-11, atol=1e-13, err_msg=f"{name} n={n}"
                )
            assert float(np.abs(np.asarray(vjp_s(cot)[0])).max()) > 0, name


def collectives_follow_the_contract() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_ref
    from jax_ref import JaxCollectives
    from jax_ref.sharded import shard_map, vocab_mesh

    mesh = vocab_mesh(2)  # the first 2 of the 4 devices
    coll = JaxCollectives("tp")
    with jax_ref.float64():
        x = jnp.arange(8.0).reshape(2, 4)  # row r on rank r

        def total(x):  # the sum over ranks, replicated; its gradient passes through unchanged
            return jnp.sum(
                shard_map(
                    lambda v: coll.all_reduce_sum(v), mesh=mesh, in_specs=P("tp"), out_specs=P()
                )(x)
            )

        assert float(total(x)) == float(x.sum(0).sum())
        np.testing.assert_array_equal(np.asarray(jax.grad(total)(x)), np.ones((2, 4)))

        def top(x):  # elementwise max over ranks, no gradient
            return jnp.sum(
                shard_map(
                    lambda v: coll.all_reduce_max(v), mesh=mesh, in_specs=P("tp"), out_specs=P()
                )(x)
            )

        assert float(top(x)) == float(x.max(0).sum())
        assert float(jnp.abs(jax.grad(top)(x)).max()) == 0.0

        w = jnp.arange(1.0, 5.0).reshape(2, 2)  # each rank a row of the weight

        def used_by_every_shard(h):  # h replicated: its gradient sums every shard's part
            def body(h_, w_):
                return coll.all_reduce_sum(jnp.sum(coll.gather_hidden_states(h_) @ w_.T))

            return shard_map(body, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P())(h, w)

        h = jnp.ones((3, 2))
        np.testing.assert_allclose(
            np.asarray(jax.grad(used_by_every_shard)(h)), np.tile(w.sum(0), (3, 1))
        )

        sp = JaxCollectives("tp", sequence_parallel=True)

        def gathered(h):  # sequence parallel: all-gather forward, reduce-scatter backward
            def body(h_, w_):
                return sp.all_reduce_sum(jnp.sum((sp.gather_hidden_states(h_) @ w_.T) ** 2))

            return shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P())(h, w)

        h = jnp.arange(12.0).reshape(6, 2) / 10
        want = jax.grad(lambda h: jnp.sum((h @ w.T) ** 2))(h)
        np.testing.assert_allclose(np.asarray(jax.grad(gathered)(h)), np.asarray(want), rtol=1e-12)


def a_reference_that_does_not_reduce_is_refused() -> None:
    import jax.numpy as jnp

    import jax_ref
    from hookspec import ContractError
    from jax_ref.sharded import shard_reference, vocab_mesh

    def local_only(hidden, weight, inputs):  # forgets the all-reduce: differs by shard
        return jnp.sum(hidden @ weight.T, axis=-1).T

    with jax_ref.float64():
        hidden, weight, inputs = _case()
        try:
            shard_reference(local_only, vocab_mesh(2))(hidden, weight, inputs)
        except ContractError as exc:
            assert "vary by shard" in str(exc) and "inputs.collectives" in str(exc), str(exc)
        else:
            raise AssertionError("expected a ContractError")


def too_few_devices_is_a_clear_error() -> None:
    from hookspec import ContractError
    from jax_ref.sharded import vocab_mesh

    try:
        vocab_mesh(8)
    except ContractError as exc:
        assert "xla_force_host_platform_device_count=8" in str(exc), str(exc)
    else:
        raise AssertionError("expected a ContractError")


def collectives_and_errors() -> None:
    collectives_follow_the_contract()
    a_reference_that_does_not_reduce_is_refused()
    too_few_devices_is_a_clear_error()


def test_sharded_reference_equals_the_unsharded_one_on_2_and_4_devices():
    _in_subprocess("sharded_equals_unsharded", 4)


def test_jax_collectives_follow_the_contract_and_errors_are_clear():
    _in_subprocess("collectives_and_errors", 4)
