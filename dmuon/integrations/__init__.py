"""Adapters to training frameworks; each imports its framework only when used
(``dmuon.integrations.torchtitan``)."""
