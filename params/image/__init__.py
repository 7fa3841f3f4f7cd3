"""Image classification experiment params."""
