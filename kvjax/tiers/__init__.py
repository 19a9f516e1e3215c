"""The tiered KV cache: device page pool, host and disk tiers, codecs, transfers, KVCache."""
