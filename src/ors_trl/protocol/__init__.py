"""protocol: see ARCHITECTURE.md."""
