"""Fixtures shared by every test tier."""
