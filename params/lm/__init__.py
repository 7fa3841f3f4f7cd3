"""Language-model experiment params."""
