"""Shared core: requests, sequences, snapshots, decisions and the Policy protocol."""
