"""zerojax.rewrite.jaxpr_eval: reading a scan equation's operands in both of JAX's spellings."""
import jax
import jax.numpy as jnp

from zerojax.rewrite.jaxpr_eval import scan_counts


def _scan_eqn():
    w, c = jnp.ones(3), jnp.ones(3)

    def f(w, c, xs):
        def body(carry, x):
            return (carry[0] * w + x, carry[1] + x), carry[0]
        return jax.lax.scan(body, (c, c), xs)

    jaxpr = jax.make_jaxpr(f)(w, c, jnp.ones((4, 3)))
    return next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")


def test_scan_counts_reads_the_installed_jax_scan():
    eqn = _scan_eqn()
    nc, ncarry = scan_counts(eqn.params)
    assert (nc, ncarry) == (1, 2)  # w closed over; two carries; then the scanned input
    assert len(eqn.invars) == nc + ncarry + 1


def test_scan_counts_reads_a_flat_tree_of_operands():
    """JAX 0.11 passes `ft_in` (constants, carries, scanned inputs) instead of the two counts."""
    class Flat:  # the part of jax._src.flattree.FlatTree the rewriters read
        def __init__(self, *groups):
            self.groups = groups

        def unpack(self):
            return self.groups

    assert scan_counts({"ft_in": Flat([None] * 2, [None] * 3, [None])}) == (2, 3)
