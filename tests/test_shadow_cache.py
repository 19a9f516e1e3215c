"""ShadowCache: the flat cache of the tiers' total blocks whose evictions the host follows."""

import numpy as np

from kvjax.cache.block_keys import as_namespace, chained_block_keys
from kvjax.tiers.shadow_cache import ShadowCache


def _prompt(*tokens):
    return np.array(tokens, np.int32).tobytes()


def test_the_shadow_lists_what_it_evicted_until_it_stores_it_again():
    ns = as_namespace(None)
    now = [0.0]
    shadow = ShadowCache(3, 1, "lru", lambda: now[0])
    k1, k12 = chained_block_keys([1, 2], 1, ns)
    k3, k34 = chained_block_keys([3, 4], 1, ns)
    # The last token's page is left to compute (as DeviceIndex.admit matches): pages 1, 2 enter.
    assert shadow.observe(ns, _prompt(1, 2, 9)) == 0
    assert not shadow.evicted(k1) and shadow.take_evicted() == []
    now[0] = 1.0
    # 3 blocks for [3, 4, 9]: both cached pages go (one node, listed in page order).
    assert shadow.observe(ns, _prompt(3, 4, 9)) == 0
    assert shadow.take_evicted() == [k1, k12] and shadow.take_evicted() == []
    assert shadow.evicted(k1) and shadow.evicted(k12) and not shadow.evicted(k3)
    now[0] = 2.0
    # [1, 9] stores page 1 again (evicting page 4, the LRU leaf): it is no longer evicted.
    assert shadow.observe(ns, _prompt(1, 9)) == 0
    assert not shadow.evicted(k1) and shadow.evicted(k12) and shadow.evicted(k34)
    assert shadow.take_evicted() == [k34]
    now[0] = 3.0
    assert shadow.observe(ns, _prompt(1, 9)) == 1  # a hit: the page a later prompt can use


def test_the_shadow_remembers_its_latest_evictions_only():
    ns = as_namespace(None)
    shadow = ShadowCache(2, 1, "lru", lambda: 0.0)
    keys = []
    for token in range(1, 8):
        shadow.observe(ns, _prompt(token, 99))
        keys += chained_block_keys([token], 1, ns)
    # 7 pages through a 2-block cache: 1 held, 6 evicted, the latest 2 remembered
    assert [shadow.evicted(key) for key in keys] == [False] * 4 + [True, True, False]
    assert shadow.take_evicted() == keys[4:6]
