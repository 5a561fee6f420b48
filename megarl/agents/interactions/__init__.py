"""Interactions: simulated users or environments that answer the model between its turns."""
