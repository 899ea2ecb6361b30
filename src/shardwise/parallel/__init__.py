"""Parallelism: mesh axes (dims), data-parallel family, precision, activation checkpointing."""
