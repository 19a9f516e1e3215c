"""Growing past one machine: the prefix directory on Redis, node servers and the router."""
