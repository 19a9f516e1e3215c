"""A pool sharded over KV heads on several devices (``--xla_force_host_platform_device_count``
gives a CPU several devices, but only before JAX starts, so the check runs in a subprocess):
float and quantized pools keep their sharding through writes, block copies and attention, and
compute what the unsharded reference computes."""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from kvjax.tiers.page_pool import PagePool, PoolConfig
    import pallas_kernels
    from pallas_kernels.kv_format import dequantize_pool

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("kv",))
    sharding = NamedSharding(mesh, P(None, None, None, "kv"))  # [blocks, layers, 2, KV heads, ...]
    rng = np.random.default_rng(0)
    for quant in (None, "int8", "fp8_e4m3"):
        cfg = PoolConfig(8, 2, 4, 8, 16, "float32", kv_quant=quant)
        pool = PagePool(cfg, sharding=sharding)
        k, v = (jnp.asarray(rng.standard_normal((11, 4, 16)), jnp.float32) for _ in range(2))
        pool.write(k, v, list(range(8, 19)), layer=1)  # blocks 1 and 2
        pool.scatter([5], pool.gather([2]))
        leaves = jax.tree.leaves(pool.kv_pages)
        assert all(leaf.sharding.spec == P(None, None, None, "kv") for leaf in leaves), quant
        q = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
        meta = (jnp.array([[1, 5]], jnp.int32), jnp.array([11], jnp.int32), jnp.array([0, 2], jnp.int32))
        out = pallas_kernels.paged_attention(q, pool.kv_pages, *meta, layer=1)
        ref = pallas_kernels.paged_attention_reference(q, pool.kv_pages, *meta, layer=1)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
        stored = np.asarray(dequantize_pool(pool.kv_pages))[1, 1, 0, :, :]  # K of block 1, [4, 8, 16]
        tol = 0 if quant is None else {"int8": 0.02, "fp8_e4m3": 0.07}[quant] * np.abs(k).max()
        np.testing.assert_allclose(stored.transpose(1, 0, 2), np.asarray(k[:8]), atol=tol + 1e-6)
    print("ok")
""")


def test_pool_sharded_over_kv_heads():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
