"""What a run measures besides its traffic: step time, compute spans, memory, numerics, the
checkpoint step, QK-clip, the blocks' execution order, and the figures the report adds."""
