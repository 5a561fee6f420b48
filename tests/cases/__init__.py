"""Helpers shared by the test tiers (imported as `cases.<module>`)."""
