"""Tensor parallelism: one model split over several worker processes (chapter 9)."""
