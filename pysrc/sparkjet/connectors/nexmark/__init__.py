"""nexmark."""
