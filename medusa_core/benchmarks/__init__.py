"""Benchmarks that time the decoding step and loop, and the references they are held against."""
