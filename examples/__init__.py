"""Examples: a user model factory for ``verify-traffic --model`` and an own training script."""
