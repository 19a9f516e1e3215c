"""Tools: command line, demo, built-in workload, trace replay."""
