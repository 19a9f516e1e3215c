"""The eviction queue's lanes: ``reuse`` ranks every evictable node with the offsets of the pop."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policies_reuse import FakeNode, _bound

from kvjax.cache.eviction import EvictionPolicy, EvictionQueue
from kvjax.cache.policies import ReusePolicy, ReuseStatistics

ROOT_FRESH, DEEP_HIT_MORE = 0, 7


def test_a_node_pushed_before_the_offsets_changed_is_ranked_with_the_offsets_of_the_pop():
    """Both pushed with no evidence (trust 0: plain LRU, the one-off root node is the newer);
    then peers' evidence says one-off root nodes are rarely used again: at the pop the one-off
    root goes first, as it would have had it been pushed now (stamped at push, it would not)."""
    policy = _bound(ReusePolicy())
    queue = EvictionQueue(policy)
    one_off = FakeNode(b"one-off", last_access=10.0)
    hot = FakeNode(b"hot", first_page=3, hits=2, last_access=5.0)
    queue.push(one_off, 10.0)
    queue.push(hot, 10.0)
    assert policy.offsets() == [0.0] * 8
    trials = (1000.0,) * 8
    reused = tuple(10.0 if kind == ROOT_FRESH else 990.0 for kind in range(8))
    policy.merge_peer_statistics([ReuseStatistics(trials, reused, 10**6, 10.0, 100)])
    offsets = policy.offsets()
    assert one_off.last_access + offsets[ROOT_FRESH] < hot.last_access + offsets[DEEP_HIT_MORE]
    assert queue.pop(lambda node: True) is one_off
    assert queue.pop(lambda node: True) is hot
    assert queue.pop(lambda node: True) is None and len(queue) == 0


class _Node:
    def __init__(self, name):
        self.name, self.lane, self.last_access, self.heap_version, self.evictable = name, 0, 0.0, -1, True


class _LanePolicy(EvictionPolicy):
    """Priority ``last_access + offsets[node.lane]``, offsets set by the test."""

    name = "lanes under test"
    num_lanes = 3

    def __init__(self):
        self.offsets = [0.0] * self.num_lanes

    def lane(self, node, now):
        return node.lane

    def lane_offsets(self):
        return self.offsets


_times = st.integers(0, 40).map(float)
_ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 7), st.integers(0, 2), _times),
    st.tuples(st.just("offsets"), st.lists(st.integers(-50, 0).map(float), min_size=3, max_size=3)),
    st.tuples(st.just("block"), st.integers(0, 7)),
    st.tuples(st.just("pop")),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_lanes_pop_what_one_heap_ranked_at_the_pop_would(ops):
    """Pushes (a node pushed again replaces its entry), offset changes, nodes that stop being
    evictable, pops, in any order: each pop returns the live entry lowest by
    ``(last_access + offset now, last_access, push order)`` that is evictable, dropping the
    unevictable ones ranked before it, exactly as a heap re-ranked at every pop would."""
    policy = _LanePolicy()
    queue = EvictionQueue(policy)
    nodes = [_Node(i) for i in range(8)]
    live, order = {}, 0  # node -> (last_access, push order): the model's entries
    for op in ops:
        if op[0] == "push":
            node = nodes[op[1]]
            node.lane, node.last_access, node.evictable = op[2], op[3], True
            queue.push(node, 0.0)
            live[node.name], order = (node.last_access, order), order + 1
        elif op[0] == "offsets":
            policy.offsets[:] = op[1]
        elif op[0] == "block":
            nodes[op[1]].evictable = False
        else:
            expected = None
            while live and expected is None:
                name = min(live, key=lambda n: (live[n][0] + policy.offsets[nodes[n].lane], *live[n]))
                del live[name]
                expected = name if nodes[name].evictable else None
            popped = queue.pop(lambda node: node.evictable)
            assert (popped.name if popped is not None else None) == expected
    assert len(queue) >= len(live)  # stale entries count until a pop drops them


def test_a_lane_out_of_range_is_refused_naming_it():
    policy = _LanePolicy()
    node = _Node(0)
    node.lane = 3
    with pytest.raises(ValueError, match=r"lane 3; expected 0 to 2"):
        EvictionQueue(policy).push(node, 0.0)
    with pytest.raises(ValueError, match=r"lane 3; expected 0 to 2"):
        EvictionQueue(policy).rebuild([node], 0.0)


def test_rebuild_keeps_the_lanes_order():
    policy = _LanePolicy()
    queue = EvictionQueue(policy)
    nodes = [_Node(i) for i in range(4)]
    for node, lane, last_access in zip(nodes, (0, 1, 2, 0), (4.0, 1.0, 2.0, 3.0)):
        node.lane, node.last_access = lane, last_access
        queue.push(node, 0.0)
    policy.offsets[:] = [-10.0, 0.0, -1.5]
    queue.rebuild(nodes, 0.0)
    assert len(queue) == 4
    assert [queue.pop(lambda node: True).name for _ in range(4)] == [3, 0, 2, 1]
