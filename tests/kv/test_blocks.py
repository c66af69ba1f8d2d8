"""The paged cache's bookkeeping (hybrid/kv/blocks.py) and its storage (hybrid/model/kv_cache.py)."""
from __future__ import annotations

import pytest
import torch

from hybrid.kv.blocks import BlockPool, keys
from hybrid.model.kv_cache import ZERO_BLOCK, KVCache


def test_keys_name_the_whole_prefix():
    a, b = list(range(12)), list(range(12))
    b[1] = 99  # the first block differs: so does every later key
    ka, kb = keys(a, 4, 3), keys(b, 4, 3)
    assert ka[0] != kb[0] and ka[2] != kb[2]
    assert keys(a, 4, 3, first=1, parent=ka[0]) == ka[1:]


def test_published_blocks_are_shared_cached_and_evicted_tail_first():
    pool = BlockPool(blocks=5, block_tokens=2)  # blocks 1..4
    tokens = [1, 2, 3, 4, 5]
    new, evicted = pool.grow(0, 3)
    assert ZERO_BLOCK not in new and not evicted
    pool.publish(0, tokens, 2)  # two full blocks
    k = keys(tokens, 2, 2)
    assert pool.find(k[0], (1, 2)) == new[0] and pool.find(k[1], (3, 4)) == new[1]
    assert pool.find(k[0], (9, 9)) is None  # a key whose tokens differ is no hit
    pool.share(1, new[0], k[0])
    assert pool.refs[new[0]] == 2
    pool.release(0)
    assert pool.cached() == 1 and pool.in_use() == 1  # block 1 idle, block 0 still held by slot 1
    assert new[2] in pool.free  # never published: free again
    pool.release(1)
    assert pool.cached() == 2
    got, evicted = pool.grow(2, 3)  # 2 free ones, then the room of the least recent cached: the prefix's tail
    assert [b for b, _, _ in evicted] == [new[1]] and pool.evictions == 1
    assert pool.find(k[1], (3, 4)) is None and pool.find(k[0], (1, 2)) == new[0]
    with pytest.raises(MemoryError, match="1 available"):
        pool.grow(2, 2)


def test_a_prefix_published_twice_keeps_the_first_block():
    pool = BlockPool(blocks=5, block_tokens=2)
    a, _ = pool.grow(0, 1)
    b, _ = pool.grow(1, 1)
    pool.publish(0, [7, 8], 1)
    pool.publish(1, [7, 8], 1)
    assert pool.find(keys([7, 8], 2, 1)[0], (7, 8)) == a[0]
    pool.release(1)
    assert b[0] in pool.free


def test_the_unpaged_table_and_paged_reads_agree():
    """As made, every slot owns its blocks; a block table that scatters a slot's positions reads them back the same."""
    cache = KVCache(n_layers=1, slots=2, max_context=8, latent=4, rope=2, dtype=torch.float32, block_tokens=4,
                    extra_blocks=2)
    assert cache.blocks == 1 + 2 * 2 + 2 and cache.table.tolist() == [[1, 2], [3, 4]]
    layer = cache.layers[0]
    kv, pe = torch.randn(1, 7, 4), torch.randn(1, 7, 2)
    layer.write(torch.tensor([1]), torch.arange(7)[None], kv, pe)
    assert torch.equal(layer.rows(1, 7)[0], kv[0]) and torch.equal(layer.rows(1, 7)[1], pe[0])
    cache.table[0] = torch.tensor([6, 5])  # scattered, in reverse
    layer.write(torch.tensor([0]), torch.arange(7)[None], kv, pe)
    assert torch.equal(layer.kv[6, :4], kv[0, :4]) and torch.equal(layer.kv[5, :3], kv[0, 4:])
    got_kv, _ = layer.read(torch.tensor([0, 1]), 7)
    assert torch.equal(got_kv[0], got_kv[1])
    cache.zero(torch.tensor([6]))
    assert float(layer.kv[6].abs().sum()) == 0 and float(layer.kv[5].abs().sum()) > 0
