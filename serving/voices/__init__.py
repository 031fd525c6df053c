"""Stored voices: the named and anonymous voice store and its file format."""
