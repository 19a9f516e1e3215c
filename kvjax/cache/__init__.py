"""Host bookkeeping of cached KV on the device: block keys, allocator, prefix trie, eviction."""
