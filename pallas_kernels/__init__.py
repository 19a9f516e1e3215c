"""Device kernels over the kvjax page pool (paged attention, KV write, block copy)."""

__all__: list[str] = []
