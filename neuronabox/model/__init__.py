"""Delay models: turn a collective, a byte count and a group into a duration and a schedule."""
