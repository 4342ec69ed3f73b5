"""Replays a simulated run's allocation log on real memory through torch (see README)."""
