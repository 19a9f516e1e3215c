"""Metrics: declared specs, a thread-safe registry, latency histograms, exporters."""
