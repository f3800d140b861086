"""The float64 JAX references (jax_ref) and the hookcheck tool built on them."""
