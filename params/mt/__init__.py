"""Encoder-decoder (translation) experiment params."""
