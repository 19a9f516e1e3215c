"""Serving: requests, scheduler, model and model runner, the engine and its observer."""
