"""kvjax: computed KV as a reusable asset for JAX/Flax serving loops."""

__all__: list[str] = []
